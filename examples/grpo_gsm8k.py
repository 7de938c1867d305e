# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Single-turn GRPO for GPT-OSS on GSM8K: the model reasons (analysis channel) and answers in \\boxed{} (final).

The same trainer as `grpo_retool.py`, with no tools and one assistant turn. Defaults: a tiny GPT-OSS built locally,
the shipped GSM8K rows, the embedded engine, CPU:

    python examples/grpo_gsm8k.py
    python examples/grpo_gsm8k.py --model openai/gpt-oss-20b --dataset openai/gsm8k --dataset-config main \
        --rollout-backend sglang --sglang-urls http://localhost:30000 --bf16 --max-completion-length 2048
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # reuse the ReTool example's data/model helpers
from grpo_retool import PrintMetrics, build_model, cold_start, load_math_dataset, parse_args  # noqa: E402

from hf_gptoss_rl.harmony import load_gptoss_tokenizer  # noqa: E402
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer  # noqa: E402
from trl_ext.rewards import extract_boxed, math_reward  # noqa: E402


def correctness_reward(completions, final_text, answer, **kwargs) -> list[float]:
    """1 when the final channel's \\boxed{} answer is equivalent to the ground truth (math-verify), else 0."""
    return [math_reward(f, a) for f, a in zip(final_text, answer)]


def format_reward(completions, final_text, **kwargs) -> list[float]:
    """0.1 for answering in the final channel with a \\boxed{} at all (a small shaping term)."""
    return [0.1 * float(extract_boxed(f) is not None) for f in final_text]


def main(argv=None):
    args = parse_args(argv)
    if args.output_dir == "outputs/grpo_retool":
        args.output_dir = "outputs/grpo_gsm8k"
    start = time.perf_counter()
    tiny = args.model == "tiny"
    tokenizer = load_gptoss_tokenizer()
    train_dataset = load_math_dataset(args.dataset, args.dataset_config, limit=args.num_prompts)
    model, model_init_kwargs = build_model(args)
    steps = args.cold_start_steps if args.cold_start_steps is not None else (30 if tiny else 0)
    if tiny and args.resume_from_checkpoint is None:
        cold_start(model, tokenizer, train_dataset, tool=None, steps=steps)

    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear")
    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate or (1e-4 if tiny else 1e-6),
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        beta=0.0,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        seed=args.seed,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        model_init_kwargs=model_init_kwargs,
        rollout_backend=args.rollout_backend,
        sglang_urls=args.sglang_urls,
        weight_sync_mode=args.weight_sync_mode,
        max_turns=1,  # single turn: no tools
        reasoning_effort=args.reasoning_effort,
        mismatch_correction=args.mismatch_correction,
        attn_implementation=args.attn_implementation,
        experts_implementation=args.experts_implementation,
    )
    os.makedirs(args.output_dir, exist_ok=True)
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=[correctness_reward, format_reward],
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[PrintMetrics(os.path.join(args.output_dir, "metrics.jsonl"))],
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.accelerator.is_main_process:
        print(f"done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s")
    return trainer


if __name__ == "__main__":
    main()
