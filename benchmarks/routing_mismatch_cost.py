"""What `routing_mismatch_every` costs on the steps that pay for it: the extra no-grad forward against the step (CPU).

What runs: `AgenticGRPOTrainer` on a small random GPT-OSS (harmony rollouts on the embedded engine, which records
routing, so routing replay is on), `routing_mismatch_every=1` so every step pays. Per optimizer step it times

- `extra_s`: the diagnostic's pass (the loss batch scored again under the other routing, without gradient),
- `training_step_s`: TRL's `training_step` less its `_prepare_inputs` (generation and scoring): the loss forward
  with gradient, the backward and the extra pass,
- `step_s`: the whole step before its weight sync (`timing/step_s`: generation, scoring, `training_step`, optimizer),

and reports the medians over the steps after the first (warm-up): `extra_s / (training_step_s - extra_s)`, the
diagnostic against the forward and backward it rides on, and `extra_s / step_s`, against the whole step. The ratios
depend on the device, the model and the lengths; rerun this on yours.

Usage: python benchmarks/routing_mismatch_cost.py [--out DIR] [--steps 6]   (or python -m benchmarks.routing_mismatch_cost)
Writes DIR/routing_mismatch_cost.json (default DIR = docs/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import OUT_HELP, command_line, exit_if_failed, machine, output_dir, without_local_paths

REPORT = "routing_mismatch_cost.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (the first is left out as warm-up)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="hidden and intermediate size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=128, help="max_completion_length")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (4 generations per prompt)")
    return p.parse_args(argv)


def measure(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer

    class TimedTrainer(AgenticGRPOTrainer):
        """Times the diagnostic's pass (`flip_replay=True`) and each `training_step` without its `_prepare_inputs`."""

        extra: list[float]
        training_steps: list[float]

        def _dispatch_logps(self, *a, **kw):
            start = time.perf_counter()
            try:
                return super()._dispatch_logps(*a, **kw)
            finally:
                if kw.get("flip_replay"):
                    self.extra[-1] += time.perf_counter() - start

        def _prepare_inputs(self, *a, **kw):  # generation and scoring, inside TRL's `training_step`
            start = time.perf_counter()
            try:
                return super()._prepare_inputs(*a, **kw)
            finally:
                self.training_steps[-1] -= time.perf_counter() - start

        def training_step(self, *a, **kw):
            self.extra.append(0.0)
            self.training_steps.append(0.0)
            start = time.perf_counter()
            try:
                return super().training_step(*a, **kw)
            finally:
                self.training_steps[-1] += time.perf_counter() - start

    torch.manual_seed(0)
    config = tiny_gptoss_config(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden,
        num_local_experts=args.experts, num_experts_per_tok=min(4, args.experts), head_dim=64,
        num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128),
        sliding_window=128,
    )  # fmt: skip
    config._attn_implementation = "eager"
    rows = [{"prompt": [{"role": "user", "content": f"Write a long story about the number {i}."}]} for i in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TimedTrainer(
            model=GptOssForCausalLM(config),
            reward_funcs=lambda completion_ids, **k: [float(len(c) % 7) for c in completion_ids],
            args=AgenticGRPOConfig(
                output_dir=tmp,
                max_steps=args.steps,
                per_device_train_batch_size=args.batch,
                num_generations=4,
                max_completion_length=args.completion_length,
                max_turns=1,
                beta=0.0,
                loss_type="dapo",
                learning_rate=1e-4,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                use_cpu=True,
                bf16=False,
                seed=0,
                disable_tqdm=True,
                routing_mismatch_every=1,
            ),
            train_dataset=Dataset.from_list(rows),
            processing_class=load_gptoss_tokenizer(),
        )
        trainer.extra, trainer.training_steps = [], []
        trainer.train()
    logged = [h for h in trainer.state.log_history if "timing/step_s" in h]
    steps = [
        {"step": i + 1, "extra_s": extra, "training_step_s": training, "step_s": h["timing/step_s"],
         "completion_tokens_mean": h.get("completions/mean_length"), "routing_agreement": h.get("routing/agreement")}
        for i, (extra, training, h) in enumerate(zip(trainer.extra, trainer.training_steps, logged))
    ]  # fmt: skip
    return {"config": {k: getattr(args, k) for k in ("steps", "layers", "hidden", "experts", "batch")}
            | {"completion_length": args.completion_length}, "steps": steps}  # fmt: skip


def summarize(steps: list[dict]) -> dict:
    measured = steps[1:]  # the first step warms up
    return {
        "extra_over_forward_backward": statistics.median(
            s["extra_s"] / (s["training_step_s"] - s["extra_s"]) for s in measured
        ),
        "extra_over_step": statistics.median(s["extra_s"] / s["step_s"] for s in measured),
        "extra_s": statistics.median(s["extra_s"] for s in measured),
        "step_s": statistics.median(s["step_s"] for s in measured),
        "steps_measured": len(measured),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    out = output_dir(args.out, REPORT)
    failures: list[str] = []
    report = {"command": command_line("routing_mismatch_cost", argv), "machine": machine(), **measure(args)}
    if len(report["steps"]) < 2:
        failures.append(f"{len(report['steps'])} step(s) timed: need at least 2 (one warm-up)")
    elif any(s["extra_s"] <= 0 for s in report["steps"]):
        failures.append("a step without the diagnostic's pass: routing_mismatch_every=1 should pay on every step")
    else:
        report["summary"] = summarize(report["steps"])
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT).write_text(json.dumps(without_local_paths(report), indent=1) + "\n")
    print(json.dumps(report.get("summary", {}), indent=1))
    exit_if_failed("routing_mismatch_cost", failures, out)


if __name__ == "__main__":
    main()
