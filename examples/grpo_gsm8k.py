# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Single-turn GRPO for GPT-OSS on GSM8K: the model reasons (analysis channel) and answers in \\boxed{} (final).

The same trainer as `grpo_retool.py`, with no tools and one assistant turn (`max_turns=1`). Every
`AgenticGRPOConfig` and `trl.ModelConfig` field is a flag (TRL's `TrlParser`, as in TRL's scripts); the defaults are a
CPU demo: a tiny GPT-OSS built locally, a short cold start (`SFTTrainer` on answer-only demonstrations), the shipped
GSM8K rows, the embedded engine.

    python examples/grpo_gsm8k.py
    accelerate launch examples/grpo_gsm8k.py --model_name_or_path openai/gpt-oss-20b --bf16 --learning_rate 1e-6 \\
        --dataset_name openai/gsm8k --dataset_config main --rollout_backend sglang \\
        --sglang_urls http://localhost:30000 --max_completion_length 2048
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig, SFTConfig, TrlParser

from hf_gptoss_rl.harmony import load_gptoss_tokenizer
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_ext.cold_start import cold_start
from trl_ext.recipes import (
    DEMO_MODEL_DEFAULTS,
    StepSummaryCallback,
    boxed_format_reward_func,
    correctness_reward_func,
    load_math_dataset,
    policy_from_model_config,
)

DEFAULT_DATASET = str(Path(__file__).resolve().parents[1] / "data" / "gsm8k_train_mini.jsonl")


@dataclass
class ScriptArguments:
    dataset_name: str = field(default=DEFAULT_DATASET, metadata={"help": "A .jsonl file or a Hub dataset."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config, e.g. 'main' for gsm8k."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name to train on."})
    num_prompts: int | None = field(default=None, metadata={"help": "Use only the first N rows of the dataset."})
    cold_start_steps: int | None = field(
        default=None, metadata={"help": "SFT steps on answer demonstrations; default: 30 for 'tiny', 0 otherwise."}
    )
    cold_start_learning_rate: float = field(default=2e-2, metadata={"help": "Learning rate of the cold start."})

    def __post_init__(self):
        if self.cold_start_steps is not None and self.cold_start_steps < 0:
            raise ValueError(f"--cold_start_steps must be >= 0, got {self.cold_start_steps}")


DEMO_DEFAULTS = dict(
    output_dir="outputs/grpo_gsm8k",
    max_steps=3,
    learning_rate=1e-4,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=96,
    max_turns=1,  # single turn: no tools
    reasoning_effort="low",
    beta=0.0,
    reward_weights=[1.0, 0.1],  # correctness, and a small shaping term for answering in \boxed{} at all
    logging_steps=1,
    save_strategy="no",
    bf16=False,
    # CPU machines: accelerate's gloo processes (without it, `torchrun` on CPU starts unconnected copies)
    use_cpu=not torch.cuda.is_available(),
)


def make_parser() -> TrlParser:
    """TRL's parser over the script's arguments, `AgenticGRPOConfig` and `ModelConfig`, with the CPU demo's defaults."""
    parser = TrlParser((ScriptArguments, AgenticGRPOConfig, ModelConfig))
    parser.set_defaults_with_config(**DEMO_DEFAULTS, **DEMO_MODEL_DEFAULTS)
    return parser


def main(script_args: ScriptArguments, training_args: AgenticGRPOConfig, model_args: ModelConfig):
    start = time.perf_counter()
    tiny = model_args.model_name_or_path == "tiny"
    tokenizer = load_gptoss_tokenizer()
    train_dataset = load_math_dataset(
        script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split, script_args.num_prompts
    )
    model, peft_config, quantization_config = policy_from_model_config(model_args, training_args)

    steps = script_args.cold_start_steps if script_args.cold_start_steps is not None else (30 if tiny else 0)
    if steps and training_args.resume_from_checkpoint is None:
        if quantization_config is not None:
            raise ValueError("the cold start trains every weight, which a quantized model cannot: --cold_start_steps 0")
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, **training_args.model_init_kwargs)
        sft_args = SFTConfig(
            output_dir=str(Path(training_args.output_dir) / "cold_start"), max_steps=steps,
            use_cpu=training_args.use_cpu,  # the first trainer fixes accelerate's process state for the run
            per_device_train_batch_size=4, learning_rate=script_args.cold_start_learning_rate,
            lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20), logging_steps=10, save_strategy="no",
            gradient_checkpointing=False, bf16=training_args.bf16, report_to=training_args.report_to,
            seed=training_args.seed, max_length=None, router_aux_loss_coef=0.0,
            disable_tqdm=training_args.disable_tqdm,
        )  # fmt: skip
        cold_start(model, tokenizer, train_dataset, tool=None, args=sft_args,
                   reasoning_effort=training_args.reasoning_effort)  # fmt: skip

    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=[correctness_reward_func, boxed_format_reward_func],
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        quantization_config=quantization_config,
        callbacks=[StepSummaryCallback()],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: every logged metric (log_history)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if trainer.accelerator.is_main_process:
        print(f"done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s", flush=True)
    return trainer


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args).accelerator.end_training()
