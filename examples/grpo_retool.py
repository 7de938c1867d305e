# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""ReTool-style agentic GRPO for GPT-OSS: the model thinks, runs Python in a sandbox, reads the output, answers.

As in TRL's example scripts, TRL's `TrlParser` (`--config recipe.yaml` works too) parses the script's own
`ScriptArguments` below, every field of `AgenticGRPOConfig` (TRL's `GRPOConfig` plus the agentic fields) and TRL's
`ModelConfig` (`--model_name_or_path`, `--dtype`, `--attn_implementation`, `--use_peft` and the `--lora_*` flags,
`--load_in_4bit` / `--load_in_8bit`). The defaults are a demo that needs nothing but a CPU and runs in a few minutes:

* a tiny GPT-OSS (2 layers, 4 experts, every GPT-OSS feature, the real 201,088-token vocabulary) built locally with
  the offline o200k_harmony tokenizer;
* a cold start: TRL's `SFTTrainer` on harmony demonstrations that call the `code_interpreter` tool with code that
  computes the answers of a few GSM8K problems (`trl_ext.cold_start`), so that the policy's tool calls parse and
  run, as ReTool's recipe fine-tunes on code-interpreter trajectories before RL;
* agentic GRPO on those problems with the local sandbox and the embedded rollout engine (an in-process inference
  copy of the policy, re-synced after every optimizer step);
* greedy accuracy and tool-call success on the practised problems, before and after GRPO.

    accelerate launch examples/grpo_retool.py                 # or: python examples/grpo_retool.py

The same script trains the real thing on GPUs (the full recipe, SGLang servers included, is in docs/quickstart.md):

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/grpo_retool.py \\
        --model_name_or_path /checkpoints/gpt-oss-20b-bf16 --bf16 --learning_rate 1e-6 --cold_start_steps 0 \\
        --rollout_backend sglang --sglang_urls http://localhost:30000 \\
        --dataset_name BytedTsinghua-SIA/DAPO-Math-17k --eval_dataset_name yentinglin/aime_2025 \\
        --attn_implementation hf-gptoss-rl/sink-flash-attn3 --experts_implementation memory_efficient \\
        --max_completion_length 16384 --max_turns 16 --output_dir /checkpoints/retool-20b

(`--use_peft` trains a LoRA adapter instead, `--lora_r`, `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`
(all linear layers by default), `--use_dora` shape it; `--model_name_or_path openai/gpt-oss-20b` loads the MXFP4
release dequantized to bf16; a checkpoint loads in its own dtype unless `--dtype` says otherwise.)
`python examples/grpo_retool.py --help` lists every flag.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig, SFTConfig, TrlParser

from hf_gptoss_rl.harmony import load_gptoss_tokenizer
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_ext.checkpoints import resolve_resume_checkpoint
from trl_ext.cold_start import StopAtLoss, cold_start
from trl_ext.recipes import (
    DEMO_MODEL_DEFAULTS,
    StepSummaryCallback,
    boxed_format_reward_func,
    evaluate_tool_use,
    load_math_dataset,
    policy_from_model_config,
    retool_reward_func,
)
from trl_ext.tools import CodeInterpreterTool

DEFAULT_DATASET = str(Path(__file__).resolve().parents[1] / "data" / "gsm8k_train_mini.jsonl")


# %% Arguments: the script's own, next to every AgenticGRPOConfig and ModelConfig field ---------------------------------------
@dataclass
class ScriptArguments:
    dataset_name: str = field(
        default=DEFAULT_DATASET, metadata={"help": "A .jsonl file or a Hub dataset (openai/gsm8k, DAPO-Math-17k, ...)."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config, e.g. 'main' for gsm8k."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name to train on."})
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Optional eval set (e.g. yentinglin/aime_2025); needs --eval_strategy steps."}
    )
    eval_dataset_split: str = field(default="train", metadata={"help": "Split of eval_dataset_name."})
    num_prompts: int | None = field(default=None, metadata={"help": "Use only the first N rows of the dataset."})
    sandbox_url: str | None = field(
        default=None, metadata={"help": "SandboxFusion URL for the code tool; default: the local sandbox."}
    )
    cold_start_steps: int | None = field(
        default=None,
        metadata={
            "help": "Most SFT steps on tool-calling demonstrations before GRPO (it stops earlier once they are learnt: "
            "--cold_start_target_nll); default: 120 for 'tiny', 0 otherwise."
        },
    )
    cold_start_target_nll: float = field(
        default=0.05,
        metadata={
            "help": "Stop the cold start once the mean loss (nll per assistant token) of 5 steps is below this; 0: run "
            "every step."
        },
    )
    cold_start_problems: int = field(default=4, metadata={"help": "Distinct problems in the cold start."})
    cold_start_learning_rate: float = field(
        default=1e-2, metadata={"help": "Learning rate of the cold start (1e-2 suits the tiny model; ~1e-5 for 20B)."}
    )
    cold_start_batch_size: int = field(default=4, metadata={"help": "Demonstrations per cold-start step."})
    rl_problems: str = field(
        default="practised",
        metadata={"help": "GRPO prompts after a cold start: 'practised' (its problems) or 'all' (every row)."},
    )
    eval_problems: int = field(
        default=4,
        metadata={"help": "Practised problems scored greedily before and after GRPO (0: skip)."},
    )

    def __post_init__(self):
        if self.rl_problems not in ("practised", "all"):
            raise ValueError(f"--rl_problems must be 'practised' or 'all', got {self.rl_problems!r}")
        for name in ("cold_start_problems", "cold_start_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_problems < 0 or (self.cold_start_steps is not None and self.cold_start_steps < 0):
            raise ValueError("--eval_problems and --cold_start_steps must be >= 0")
        if not self.cold_start_target_nll >= 0:
            raise ValueError(f"--cold_start_target_nll must be >= 0, got {self.cold_start_target_nll}")


# the CPU demo's values of AgenticGRPOConfig fields (a --config file or a flag overrides them)
DEMO_DEFAULTS = dict(
    output_dir="outputs/grpo_retool",
    max_steps=4,
    learning_rate=1e-4,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=96,
    max_turns=3,
    temperature=1.0,
    reasoning_effort="low",
    beta=0.0,
    loss_type="dapo",
    reward_weights=[1.0, 0.0],  # the ReTool reward; the boxed-format share is only logged
    logging_steps=1,
    save_strategy="no",
    bf16=False,
    # CPU machines: accelerate's gloo processes (without it, `torchrun` on CPU starts unconnected copies)
    use_cpu=not torch.cuda.is_available(),
    rollout_backend="embedded",
)


def make_parser() -> TrlParser:
    """TRL's parser over the script's arguments, `AgenticGRPOConfig` and `ModelConfig`, with the CPU demo's defaults."""
    parser = TrlParser((ScriptArguments, AgenticGRPOConfig, ModelConfig))
    parser.set_defaults_with_config(**DEMO_DEFAULTS, **DEMO_MODEL_DEFAULTS)
    return parser


def load_practised_rows(path: Path, dataset_name: str, num_rows: int) -> list[int]:
    """The rows the interrupted run's cold start practised (written when it finished), checked against the data."""
    if not path.is_file():
        raise FileNotFoundError(
            f"resuming after a cold start needs the rows it practised, in {path}; it is missing (was the run started "
            "with another --output_dir, or without a cold start? then pass --cold_start_steps 0)"
        )
    saved = json.loads(path.read_text())
    if (saved["dataset"], saved["num_rows"]) != (dataset_name, num_rows):
        raise ValueError(
            f"{path} was written for {saved['dataset']} ({saved['num_rows']} rows), not for --dataset_name "
            f"{dataset_name} ({num_rows} rows): resume with the interrupted run's data"
        )
    return [int(i) for i in saved["rows"]]


def _report(title, scores, what="practised problems"):
    success = scores["tool_call_success_rate"]
    print(
        f"[{title}] {what}: accuracy {scores['correct']}/{scores['n']} | "
        f"tool-call rate {scores['tool_call_rate']:.2f} | tool calls that ran "
        f"{'n/a' if success is None else f'{success:.2f}'} | final answers {scores['final_answer_rate']:.2f}",
        flush=True,
    )


# %% Train ---------------------------------------------------------------------------------------------------------------
def main(script_args: ScriptArguments, training_args: AgenticGRPOConfig, model_args: ModelConfig):
    start = time.perf_counter()
    tiny = model_args.model_name_or_path == "tiny"
    if training_args.eval_strategy != "no" and script_args.eval_dataset_name is None:
        raise ValueError(f"--eval_strategy {training_args.eval_strategy} needs --eval_dataset_name")
    if script_args.eval_dataset_name is not None and training_args.eval_strategy == "no":
        raise ValueError("--eval_dataset_name is set but --eval_strategy is 'no': pass --eval_strategy steps")

    # Data: math problems with a ground-truth answer, as {"prompt": [user message], "answer", "solution"}
    tokenizer = load_gptoss_tokenizer()
    train_dataset = load_math_dataset(
        script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split, script_args.num_prompts
    )
    eval_dataset = None
    if script_args.eval_dataset_name is not None:
        eval_dataset = load_math_dataset(script_args.eval_dataset_name, split=script_args.eval_dataset_split)
    if script_args.sandbox_url is None:
        tool = CodeInterpreterTool()  # local sandbox: own process group, time/memory limits, no network
    else:
        from trl_ext.tools import SandboxFusionBackend

        tool = CodeInterpreterTool(backend=SandboxFusionBackend(script_args.sandbox_url))

    # Model (TRL's ModelConfig: the policy, its LoRA and quantization configs), and a cold start: SFT on
    # demonstrations whose code_interpreter calls compute the answers
    model, peft_config, quantization_config = policy_from_model_config(model_args, training_args)
    cold_start_steps = (
        script_args.cold_start_steps if script_args.cold_start_steps is not None else (120 if tiny else 0)
    )
    # a resumed run skips the cold start (its weights are in the checkpoint) and trains on the rows it chose, saved
    # next to the checkpoints
    resume = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    practised_file = Path(training_args.output_dir) / "cold_start" / "practised_rows.json"
    practised = []
    if cold_start_steps and resume is not None:
        practised = load_practised_rows(practised_file, script_args.dataset_name, len(train_dataset))
    if cold_start_steps and resume is None and script_args.eval_problems and tiny:
        # the randomly initialised policy, for comparison: it never writes a tool call
        from trl_ext.rollout import EmbeddedEngine

        engine = EmbeddedEngine.from_policy(model, pad_token_id=tokenizer.pad_token_id, seed=training_args.seed)
        rows = [train_dataset[i] for i in range(min(script_args.eval_problems, len(train_dataset)))]
        _report("before the cold start", evaluate_tool_use(
            engine, [tool], rows, max_completion_length=training_args.max_completion_length,
            max_turns=training_args.max_turns, reasoning_effort=training_args.reasoning_effort,
        ), what="problems")  # fmt: skip
        engine.shutdown()
    if cold_start_steps and resume is None:
        if quantization_config is not None:
            raise ValueError("the cold start trains every weight, which a quantized model cannot: --cold_start_steps 0")
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, **training_args.model_init_kwargs)
        sft_args = SFTConfig(
            output_dir=str(Path(training_args.output_dir) / "cold_start"),
            use_cpu=training_args.use_cpu,  # the first trainer fixes accelerate's process state for the run
            max_steps=cold_start_steps,
            per_device_train_batch_size=script_args.cold_start_batch_size,
            learning_rate=script_args.cold_start_learning_rate,
            # a constant rate until the demonstrations are learnt: a decaying one left the tiny model unable to write a
            # tool call on some seeds (its loss plateaued at 0.5-1.0 nats per token)
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=max(1, cold_start_steps // 20),
            logging_steps=5,  # the logged loss is the mean of the 5 steps since the last log: what StopAtLoss reads
            save_strategy="no",
            gradient_checkpointing=training_args.gradient_checkpointing,
            bf16=training_args.bf16,
            report_to=training_args.report_to,
            seed=training_args.seed,
            max_length=None,
            router_aux_loss_coef=0.0,  # the loss is the demonstrations' negative log-likelihood alone
            disable_tqdm=training_args.disable_tqdm,
        )
        target = script_args.cold_start_target_nll
        practised = cold_start(
            model, tokenizer, train_dataset, tool, args=sft_args, max_rows=script_args.cold_start_problems,
            reasoning_effort=training_args.reasoning_effort, callbacks=[StopAtLoss(target, window=1)] if target else None,
        )  # fmt: skip
        print(f"[cold start] {len(practised)} problems practised in {time.perf_counter() - start:.0f} s", flush=True)
        if training_args.process_index == 0:
            practised_file.parent.mkdir(parents=True, exist_ok=True)
            practised_file.write_text(json.dumps(
                {"dataset": script_args.dataset_name, "num_rows": len(train_dataset), "rows": practised}
            ))  # fmt: skip
    eval_rows = [train_dataset[i] for i in (practised or range(len(train_dataset)))[: script_args.eval_problems]]
    if practised and script_args.rl_problems == "practised":
        train_dataset = train_dataset.select(practised)

    # Agentic GRPO: multi-turn rollouts with the code tool, scored by the ReTool reward
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=[retool_reward_func, boxed_format_reward_func],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        quantization_config=quantization_config,
        callbacks=[StepSummaryCallback()],
        tools=[tool],
    )

    def score(title):
        if eval_rows and trainer.accelerator.is_main_process:
            scores = evaluate_tool_use(
                trainer.rollout_engine, [tool], eval_rows, max_completion_length=training_args.max_completion_length,
                max_turns=training_args.max_turns, reasoning_effort=training_args.reasoning_effort,
            )  # fmt: skip
            _report(title, scores)

    score("before GRPO")
    trainer.train(resume_from_checkpoint=resume)
    score("after GRPO")  # the engine holds the trained weights (synced after every step)

    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: every logged metric (log_history)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if trainer.accelerator.is_main_process:
        print(
            f"done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s "
            f"(world size {trainer.accelerator.num_processes}); model and trainer_state.json in {training_args.output_dir}",
            flush=True,
        )
    return trainer


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    trainer = main(script_args, training_args, model_args)
    trainer.accelerator.end_training()  # destroys the process group before interpreter exit, as torch.distributed asks
