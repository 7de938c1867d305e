# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Single-turn GRPO for GPT-OSS on GSM8K: the model reasons (analysis channel) and answers in \\boxed{} (final).

The same trainer as `grpo_retool.py`, with no tools and one assistant turn (`max_turns=1`). Every
`AgenticGRPOConfig` field is a flag (TRL's `TrlParser`); the defaults are a CPU demo: a tiny GPT-OSS built locally,
a short cold start (`SFTTrainer` on answer-only demonstrations), the shipped GSM8K rows, the embedded engine.

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
from trl import SFTConfig, TrlParser

from hf_gptoss_rl.harmony import load_gptoss_tokenizer
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_ext.cold_start import cold_start
from trl_ext.recipes import StepSummaryCallback, boxed_format_reward_func, correctness_reward_func, load_math_dataset

DEFAULT_DATASET = str(Path(__file__).resolve().parents[1] / "data" / "gsm8k_train_mini.jsonl")


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(
        default="tiny", metadata={"help": "'tiny' (a small GPT-OSS built locally, for CPUs) or a model id/path."}
    )
    dtype: str = field(default="auto", metadata={"help": "dtype the checkpoint is loaded in; 'auto': its own."})
    dataset_name: str = field(default=DEFAULT_DATASET, metadata={"help": "A .jsonl file or a Hub dataset."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config, e.g. 'main' for gsm8k."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name to train on."})
    num_prompts: int | None = field(default=None, metadata={"help": "Use only the first N rows of the dataset."})
    cold_start_steps: int | None = field(
        default=None, metadata={"help": "SFT steps on answer demonstrations; default: 30 for 'tiny', 0 otherwise."}
    )
    cold_start_learning_rate: float = field(default=2e-2, metadata={"help": "Learning rate of the cold start."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter (merged for the weight sync)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})

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


def main(script_args: ScriptArguments, training_args: AgenticGRPOConfig):
    start = time.perf_counter()
    tiny = script_args.model_name_or_path == "tiny"
    tokenizer = load_gptoss_tokenizer()
    train_dataset = load_math_dataset(
        script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split, script_args.num_prompts
    )
    if tiny:
        from transformers import GptOssForCausalLM

        from hf_gptoss_rl.testing import tiny_gptoss_config

        torch.manual_seed(training_args.seed)
        config = tiny_gptoss_config()
        config._attn_implementation = training_args.attn_implementation or "eager"
        model = GptOssForCausalLM(config)
        if script_args.dtype != "auto":
            model = model.to(getattr(torch, script_args.dtype))
    else:
        model = script_args.model_name_or_path
        training_args.model_init_kwargs = {"dtype": script_args.dtype, **(training_args.model_init_kwargs or {})}

    steps = script_args.cold_start_steps if script_args.cold_start_steps is not None else (30 if tiny else 0)
    if steps and training_args.resume_from_checkpoint is None:
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

    peft_config = None
    if script_args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha, target_modules="all-linear")
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=[correctness_reward_func, boxed_format_reward_func],
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
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
    parser = TrlParser((ScriptArguments, AgenticGRPOConfig))
    parser.set_defaults_with_config(**DEMO_DEFAULTS)
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args).accelerator.end_training()
