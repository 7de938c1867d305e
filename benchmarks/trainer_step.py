"""The optimizer step a user runs: `AgenticGRPOTrainer`'s own training step, by stack, on a gpt-oss-20b-shaped policy.

What runs is `AgenticGRPOTrainer.train()` itself, with TRL's defaults where this script names nothing: LoRA r=16 on
q/k/v/o (`peft_config`), gradient checkpointing, bf16 autocast (`bf16=True`), `loss_type="dapo"`, AdamW. Per
optimizer step the trainer makes whatever log-prob passes its configuration asks for, the loss forward and
backward of every micro-batch, the gradient clip and the optimizer update: all of it is timed.

Not timed, and stated in the report: the rollout (`_generate`: the agent loop, the engine and the harmony parsing)
and the weight sync after the step. The rollouts come from `ReplayEngine`, an in-process `RolloutEngine` that
returns random token ids at once (no model behind it), so each step trains on trajectories of exactly the lengths
asked for, the same ones for every stack (the trainer seeds every request: `sampling_seed`).

Stacks (each a configuration of the same trainer; `--variants`):

- `project_default`: `AgenticGRPOConfig()`'s defaults on CUDA: the sink kernel
  (`attn_implementation="hf-gptoss-rl/sink-flash-attn3"`), `experts_implementation="memory_efficient"`, chunked
  log-probs, selective checkpointing (attention, experts, projections within the memory-derived bounds), Liger
  RMSNorm (when `liger-kernel` is installed), fused RoPE, the fused LoRA update, padding-free micro-batches;
- `project_plain_checkpointing`: the same with `checkpoint_saves=[]`, to show what selective checkpointing buys;
- `stock_fa4`: the same trainer as stock TRL + transformers run it: `flash_attention_4` (FlashAttention-4,
  `learnable_sink`), transformers' `grouped_mm` experts, TRL's fused LM head (`logprobs_implementation="trl"`:
  TRL 1.16 scores log-probs with `model(..., fused_lm_head=True)` in `GRPOTrainer._get_per_token_logps_and_entropies`),
  plain checkpointing, transformers' RMSNorm and RoPE, PEFT's LoRA forward, padded micro-batches;
- `stock_flex`: `stock_fa4` with `flex_attention` (where FlashAttention-4 is not installed);
- `stock_eager`: `stock_fa4` with `eager` attention (CPU smoke runs only: O(S^2) memory).

Stock TRL with vLLM and its importance-sampling correction also scores every batch once more without gradient
(`old_per_token_logps` in `GRPOTrainer._generate_and_score_completions`); the stock rows here do not pay that pass,
so they are faster than stock TRL is.

Trajectories: `--seq-len S` gives `--trajectories` of exactly S tokens each (prompt + completion), one per
micro-batch; `--ragged` draws each trajectory's length from a log-normal (median `--ragged-median`, sigma
`--ragged-sigma`, clipped to [256, S]) from its request's seed, in micro-batches of `--micro-batch` rows.
tokens/s = the real tokens of the step's trajectories / step seconds. MFU = the model FLOPs of the step
(`grpo_step_flops` per trajectory: forward + backward, recomputation not counted, the same work for every stack) /
step seconds / the device's dense bf16 peak.

Every (variant) runs in its own process (an OOM is a result and does not poison the others); the first
`--warmup` steps compile kernels and are left out; the report gives the median of the `--repeats` timed steps.

    python benchmarks/trainer_step.py --out docs/benchmarks                    # one GPU: 2 x 32k tokens per step
    python benchmarks/trainer_step.py --ragged --out docs/benchmarks           # the ragged agentic batch
    python -m benchmarks.trainer_step --model tiny --device cpu --seq-len 256 --variants project_default,stock_eager --out /tmp/x

Writes `trainer_step.{json,md,png}` (`trainer_step_ragged.*` with `--ragged`) into `--out` (default
`docs/benchmarks/`, only while no report is there: name the folder to replace one); `--from-json FILE.json`
re-renders a saved run. The exit status is non-zero when a run crashed, timed out or failed a check (the step's
LoRA weights must move and its loss be finite; the default stack must make exactly one policy forward per
micro-batch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import (
    OUT_HELP,
    RATIO_RULE,
    command_line,
    environment,
    exit_if_failed,
    figure,
    output_dir,
    ratio,
    without_local_paths,
)
from hf_gptoss_rl.attention import KERNEL_REPO_ID as KERNEL

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "TRAINER_STEP_RESULT "
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
STOCK = {  # the trainer configured as stock TRL + transformers run it
    "experts": "grouped_mm",
    "config": {
        "logprobs_implementation": "trl",
        "checkpoint_saves": [],
        "liger_rms_norm": False,
        "fused_rope": False,
        "fuse_lora_update": False,
        "padding_free": False,
    },
}
VARIANTS = {
    "project_default": {"label": "project, default configuration", "attn": KERNEL, "experts": "memory_efficient"},
    "project_plain_checkpointing": {
        "label": "project, plain checkpointing (checkpoint_saves=[])",
        "attn": KERNEL,
        "experts": "memory_efficient",
        "config": {"checkpoint_saves": []},
    },
    "stock_fa4": {"label": "stock: FA4 + grouped_mm + TRL's fused LM head", "attn": "flash_attention_4", **STOCK},
    "stock_flex": {
        "label": "stock: flex_attention + grouped_mm + TRL's fused LM head",
        "attn": "flex_attention",
        **STOCK,
    },
    "stock_eager": {"label": "stock: eager + grouped_mm + TRL's fused LM head", "attn": "eager", **STOCK},
}
DEFAULT_VARIANTS = ("project_default", "stock_fa4")
TARGET_RATIO, TARGET_MFU = 0.40, 0.50  # the default stack's step time ÷ the stock stack's, and its MFU
# Dense bf16 Tensor Core peak, TFLOP/s, by the GPU name (`torch.cuda.get_device_name`), most specific first. NVIDIA's
# H100 and H200 datasheets give bf16 "with sparsity" (SXM: 1,979; NVL: 1,671; H100 PCIe: 1,513); dense is half.
DENSE_BF16_PEAK_TFLOPS = {"H100 PCIe": 756.5, "H100 NVL": 835.5, "H200 NVL": 835.5, "H100": 989.5, "H200": 989.5}


def dense_bf16_peak(device_name: str | None) -> tuple[str, float] | None:
    """(the table's name, its dense bf16 peak in TFLOP/s) of the GPU named ``device_name``, or None."""
    for name, peak in DENSE_BF16_PEAK_TFLOPS.items():
        if device_name and name in device_name:
            return name, peak
    return None


def grpo_step_flops(config, seq_len: int, prompt_len: int) -> dict:
    """Model FLOPs of one LoRA GRPO step on one sequence (the MFU convention: forward + backward, recomputation not
    counted, so every stack is held to the same work). Matmuls only, 2 FLOPs per multiply-add:

    - linear layers per token and layer: q/k/v/o projections, the router, and ``num_experts_per_tok`` experts
      (gate_up ``h x 2i``, down ``i x h``); backward = the input gradients only, as many FLOPs as the forward (the
      base weights are frozen, so no weight gradients; LoRA's own rank-16 products are under 1% and left out);
    - attention: QK^T and PV over the (query, key) pairs each layer sees (causal: S(S+1)/2; sliding window W: the
      last W keys); backward recomputes QK^T and computes dV, dP, dQ, dK: 2.5x forward;
    - LM head: the completion positions only (``S - prompt_len``), forward + input gradient.
    """
    h, d, hq = config.hidden_size, config.head_dim, config.num_attention_heads
    hkv, inter, k = config.num_key_value_heads, config.intermediate_size, config.num_experts_per_tok
    per_token_layer = 2 * (h * (hq + 2 * hkv) * d + hq * d * h + h * config.num_local_experts + k * 3 * h * inter)
    linear = 2 * config.num_hidden_layers * per_token_layer * seq_len  # forward + input gradients
    attention = 0
    for kind in config.layer_types:
        if kind == "sliding_attention":
            w = config.sliding_window
            pairs = seq_len * w - w * (w - 1) // 2 if seq_len >= w else seq_len * (seq_len + 1) // 2
        else:
            pairs = seq_len * (seq_len + 1) // 2
        attention += 3.5 * (2 * 2 * pairs * d * hq)
    head = 2 * 2 * h * config.vocab_size * (seq_len - prompt_len)
    return {"linear": linear, "attention": attention, "lm_head": head, "total": linear + attention + head}


# ---------------------------------------------------------------------------------------------------- the worker


def trajectory_length(seed: int, spec: dict) -> int:
    """The total length (prompt + completion) of the trajectory whose request carries ``seed``."""
    if not spec["ragged"]:
        return spec["seq_len"]
    z = random.Random(seed).gauss(0.0, 1.0)
    length = round(spec["ragged_median"] * math.exp(spec["ragged_sigma"] * z))
    return max(256, min(spec["seq_len"], length))


def replay_engine(spec: dict, vocab_ids: int):
    """A `RolloutEngine` that answers every request at once with random ids (below the harmony special tokens), so
    that its trajectory totals `trajectory_length` tokens; log-probs -1.0 each, every answer cut at its length."""
    from trl_ext.rollout import RolloutEngine
    from trl_ext.rollout.types import GenerationOutput

    class ReplayEngine(RolloutEngine):
        def __init__(self):
            self.version = None
            self.answers: list[tuple[int, int]] = []  # (prompt, completion) tokens handed out, in answer order

        async def generate(self, input_ids, sampling):
            total = trajectory_length(sampling.sampling_seed, spec)
            n = max(1, min(sampling.max_new_tokens, total - len(input_ids)))
            self.answers.append((len(input_ids), n))
            rng = random.Random(sampling.sampling_seed)
            ids = [rng.randrange(vocab_ids) for _ in range(n)]
            return GenerationOutput(ids, [-1.0] * n, "length", weight_version=self.version)

        async def update_weights(self, named_tensors, *, version):
            self.version = version  # nothing is loaded: there is no model behind the replay

        async def health(self):
            return True

        @property
        def weight_version(self):
            return self.version

    return ReplayEngine()


def worker(spec: dict) -> dict:
    """Build the policy and the trainer of one variant, train `warmup + repeats` steps, time each optimizer step."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    import hf_gptoss_rl  # noqa: F401  (registers the kernel id and the memory_efficient experts)
    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from hf_gptoss_rl.model_builders import build_random_gptoss, gptoss_20b_config, tiny_gptoss_config
    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer

    variant = VARIANTS[spec["variant"]]
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if spec["model"] == "20b":
        config = gptoss_20b_config(num_hidden_layers=spec["layers"])
    else:
        config = tiny_gptoss_config(num_hidden_layers=spec["layers"])
    model = build_random_gptoss(config, device=device, dtype=torch.bfloat16 if cuda else torch.float32, seed=0)
    model.set_attn_implementation(variant["attn"])
    model.set_experts_implementation(variant["experts"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps: list[dict] = []
    forwards = {"grad": 0, "no_grad": 0}

    class Timed(AgenticGRPOTrainer):
        def _generate(self, *args, **kwargs):  # the rollout: left out of the step's time
            sync()
            start = time.perf_counter()
            try:
                return super()._generate(*args, **kwargs)
            finally:
                sync()
                steps[-1]["rollout_s"] += time.perf_counter() - start

    timed_steps = spec["warmup"] + spec["repeats"]
    profiler = None

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            nonlocal profiler
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if len(steps) == timed_steps:  # one more step, profiled (left out of the timings)
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                profiler = profile(activities=activities)
                profiler.__enter__()
            steps.append({"rollout_s": 0.0, "forwards": dict.fromkeys(forwards, 0), "start": time.perf_counter()})
            forwards.update(dict.fromkeys(forwards, 0))

        def on_optimizer_step(self, args, state, control, **kwargs):
            sync()
            if profiler is not None and len(steps) > timed_steps:
                profiler.__exit__(None, None, None)
            step = steps[-1]
            step["wall_s"] = time.perf_counter() - step.pop("start")
            step["seconds"] = step["wall_s"] - step["rollout_s"]
            step["forwards"] = dict(forwards)
            step["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    def count_forward(module, args, kwargs):
        forwards["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    model.register_forward_pre_hook(count_forward, with_kwargs=True)
    engine = replay_engine(spec, vocab_ids=199_998 if spec["model"] == "20b" else config.vocab_size - 16)
    rows = [{"prompt": [{"role": "user", "content": f"Solve problem {i} step by step."}]} for i in range(64)]
    rewards = random.Random(1)
    overrides = dict(variant.get("config", {}))
    training_args = {
        "output_dir": spec["tmp"],
        "max_steps": timed_steps + (1 if spec["profile"] else 0),
        "per_device_train_batch_size": spec["micro_batch"],
        "gradient_accumulation_steps": spec["trajectories"] // spec["micro_batch"],
        "num_generations": spec["trajectories"],
        "max_completion_length": spec["seq_len"],
        "max_turns": 1,
        "learning_rate": 1e-4,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": not cuda,
        "bf16": cuda,
        "seed": 0,
        "disable_tqdm": True,
        # random tokens score far from the replay's log-probs: truncated (not masked) weights keep every
        # trajectory's gradient, at the cost of the default sequence mask
        "vllm_importance_sampling_mode": "token_truncate",
    } | overrides
    trainer = Timed(
        model=model,
        reward_funcs=lambda completions, **kw: [rewards.gauss(0.0, 1.0) for _ in completions],
        args=AgenticGRPOConfig(**training_args),
        train_dataset=Dataset.from_list(rows),
        processing_class=load_gptoss_tokenizer(),
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS),
        callbacks=[StepTimer()],
        rollout_engine=engine,
    )
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    result = {
        "variant": spec["variant"],
        "attn_implementation": variant["attn"],
        "experts_implementation": variant["experts"],
        "config_overrides": overrides,
        "padding_free": bool(trainer.resolved.padding_free),
        "liger_rms_norm": bool(trainer.resolved.liger_rms_norm),
        "fused_rope": bool(trainer.resolved.fused_rope),
        "resident_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
    }
    trainer.train()
    result["checkpoint_experts_max_tokens"] = getattr(trainer, "checkpoint_experts_max_tokens", None)
    result["checkpoint_projections_max_tokens"] = getattr(trainer, "checkpoint_projections_max_tokens", None)
    moved = [n for n, p in trainer.model.named_parameters() if n in lora and not torch.equal(p.detach(), lora[n])]
    result["lora_tensors_moved"] = f"{len(moved)}/{len(lora)}"
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if profiler is not None:
        result["profile"] = step_profile(profiler, cuda)
        result["profile"]["step_s"] = steps.pop()["wall_s"]
    n = spec["trajectories"]  # the (prompt, completion) tokens each step trained on, in answer order
    for i, step in enumerate(steps):
        step["trajectories"] = [list(a) for a in engine.answers[i * n : (i + 1) * n]]
    result["steps"] = steps
    return result


def step_profile(prof, cuda: bool, top: int = 20) -> dict:
    """Where the profiled step's time goes: operators (aten ops, the project's custom ops, Triton launches) ranked
    by self GPU time (CPU time on a CPU run). Self time counts each kernel once, under the op that launched it, so
    the rows add up to the busy time; the rollout inside the step is in it too (a few host milliseconds here)."""
    from torch.autograd import DeviceType

    def self_us(e):
        return getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total

    ops = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and self_us(e) > 0]
    busy_us = sum(self_us(e) for e in ops)
    ops.sort(key=self_us, reverse=True)
    return {
        "clock": "GPU" if cuda else "CPU",
        "busy_s": busy_us / 1e6,
        "top": [
            {"op": e.key, "calls": e.count, "self_ms": self_us(e) / 1e3, "share": self_us(e) / busy_us}
            for e in ops[:top]
        ],
    }


# ---------------------------------------------------------------------------------------------------- the driver


def run_variant(spec: dict, timeout: float) -> dict:
    """`worker(spec)` in its own process; a crash, an OOM or a timeout becomes the row's error."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps({**spec, "tmp": tmp})]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
        except subprocess.TimeoutExpired:
            return {"variant": spec["variant"], "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return {**json.loads(line[len(RESULT_PREFIX) :]), "wall_s": wall}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
    return {"variant": spec["variant"], "error": "OOM" if oom else f"exited with {proc.returncode}", "tail": tail}


def summarize(result: dict, config, warmup: int, device_name: str | None) -> dict:
    """Medians over the timed steps: seconds, tokens/s, peak GiB, MFU, policy forwards per micro-batch."""
    timed = [s for s in result.get("steps", [])[warmup:] if "seconds" in s]
    if not timed:
        return {}
    tokens = [sum(p + c for p, c in s["trajectories"]) for s in timed]
    flops = [sum(grpo_step_flops(config, p + c, p)["total"] for p, c in s["trajectories"]) for s in timed]
    seconds = statistics.median(s["seconds"] for s in timed)
    micro_batches = result["micro_batches_per_step"]
    out = {
        "seconds": seconds,
        "all_seconds": [s["seconds"] for s in timed],
        "rollout_s": statistics.median(s["rollout_s"] for s in timed),
        "tokens": statistics.median(tokens),
        "tokens_per_s": statistics.median(t / s["seconds"] for t, s in zip(tokens, timed)),
        "peak_gib": max((s["peak_gib"] for s in timed if s["peak_gib"] is not None), default=None),
        "grad_forwards_per_micro_batch": max(s["forwards"]["grad"] for s in timed) / micro_batches,
        "no_grad_forwards_per_micro_batch": max(s["forwards"]["no_grad"] for s in timed) / micro_batches,
        "model_tflop": statistics.median(flops) / 1e12,
    }
    peak = dense_bf16_peak(device_name)
    if peak is not None:
        out["mfu"] = statistics.median(f / s["seconds"] for f, s in zip(flops, timed)) / (peak[1] * 1e12)
    return out


def failures_of(results: list[dict]) -> list[str]:
    """A crash or timeout (an OOM is a result), a non-finite loss, LoRA weights that did not move, and a default
    stack that makes more than one policy forward per micro-batch (TRL's on-policy rule) or none with gradient."""
    failures = []
    for r in results:
        name = r["variant"]
        if r.get("error") and r["error"] not in ("OOM", "skipped"):
            failures.append(f"{name}: {r['error']}")
            continue
        if "summary" not in r:
            continue
        if not all(math.isfinite(x) for x in r.get("losses", [])):
            failures.append(f"{name}: non-finite loss {r['losses']}")
        moved, total = (int(x) for x in r["lora_tensors_moved"].split("/"))
        if moved < total:
            failures.append(f"{name}: only {moved} of {total} LoRA tensors moved")
        s = r["summary"]
        if name.startswith("project") and (
            s["grad_forwards_per_micro_batch"],
            s["no_grad_forwards_per_micro_batch"],
        ) != (1, 0):
            failures.append(
                f"{name}: {s['grad_forwards_per_micro_batch']:g} forward(s) with grad and "
                f"{s['no_grad_forwards_per_micro_batch']:g} without per micro-batch (expected 1 and 0)"
            )
    return failures


# ---------------------------------------------------------------------------------------------------- the report


def write_report(out: Path, report: dict) -> None:
    meta, results = report["meta"], report["results"]
    env = meta["environment"]
    stem = meta["stem"]
    lines = [
        "# The trainer's own optimizer step, by stack (`benchmarks/trainer_step.py`)",
        "",
        f"Measured on {env['device']} (torch {env['torch']}, transformers {env['transformers']}, trl {env.get('trl')}, "
        f"peft {env['peft']}, triton {env['triton']}, flash-attn-4 {env.get('flash_attn_4') or 'not installed'}, "
        f"liger-kernel {env.get('liger_kernel') or 'not installed'}, commit {env['commit']}).",
        f"Command: `{meta['command']}`.",
        "",
        f"`AgenticGRPOTrainer.train()` on a {meta['model']} policy ({meta['layers']} layers, random weights, "
        f"{meta['dtype']}), LoRA r=16 on q/k/v/o, gradient checkpointing, AdamW, lr 1e-4; {meta['trajectories']} "
        f"trajectories per optimizer step in micro-batches of {meta['micro_batch']} "
        + (
            f"(lengths log-normal, median {meta['ragged_median']:,}, sigma {meta['ragged_sigma']}, clipped to "
            f"[256, {meta['seq_len']:,}])"
            if meta["ragged"]
            else f"of {meta['seq_len']:,} tokens each (a {meta.get('prompt_tokens', '?')}-token prompt and its completion)"
        )
        + f"; {meta['warmup']} warm-up step(s), then the median of {meta['repeats']}.",
        "Timed: from the step's start to the end of the optimizer update (log-prob passes, every micro-batch's "
        "forward and backward, clipping, AdamW). Not timed: the rollout (`_generate`, replayed random tokens) and "
        "the weight sync after the step. Peak = max allocated during the step, weights included. MFU = model FLOPs "
        "of the step (forward + backward, recomputation not counted) / time / dense bf16 peak "
        f"({meta.get('peak_name') or 'no peak known for this device'}"
        + (f": {meta['peak_tflops']} TFLOP/s" if meta.get("peak_tflops") else "")
        + ").",
        "",
        "| stack | step s | tokens / step | tokens/s | peak GiB | MFU | forwards / micro-batch (grad + no grad) | "
        "packed | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.get("summary") or {}
        label = VARIANTS[r["variant"]]["label"]
        if not s:
            lines.append(
                f"| {label} | {r.get('error', '—')} | — | — | — | — | — | — | {'; '.join(r.get('notes', []))} |"
            )
            continue
        mfu = f"{100 * s['mfu']:.0f}%" if "mfu" in s else "—"
        peak = f"{s['peak_gib']:.1f}" if s.get("peak_gib") is not None else "—"
        fwd = f"{s['grad_forwards_per_micro_batch']:g} + {s['no_grad_forwards_per_micro_batch']:g}"
        lines.append(
            f"| {label} | {s['seconds']:.2f} | {s['tokens']:,.0f} | {s['tokens_per_s']:,.0f} | {peak} | {mfu} | "
            f"{fwd} | {'yes' if r.get('padding_free') else 'no'} | {'; '.join(r.get('notes', []))} |"
        )
    measured = [r for r in results if r.get("summary")]
    if meta["ragged"] and measured:  # each step trains on other lengths: the stacks side by side, step by step
        warmup = meta["warmup"]
        steps = [r["steps"][warmup:] for r in measured]
        lines += [
            "",
            "Each timed step trains on other trajectories (the trainer seeds each step's requests anew), the same ones "
            "for every stack:",
            "",
            "| step | tokens | longest | " + " | ".join(f"{r['variant']} s" for r in measured) + " |",
            "|---" * (3 + len(measured)) + "|",
        ]
        for i, step in enumerate(steps[0]):
            lengths = [p + c for p, c in step["trajectories"]]
            cells = " | ".join(f"{s[i]['seconds']:.2f}" if i < len(s) else "—" for s in steps)
            lines.append(f"| {warmup + i + 1} | {sum(lengths):,} | {max(lengths):,} | {cells} |")
    lines += ["", f"Ratios ({RATIO_RULE}):", ""]
    ours = [r for r in results if r["variant"].startswith("project") and r.get("summary")]
    peers = [r for r in results if r["variant"].startswith("stock") and r.get("summary")]
    for o in ours:
        for p in peers:
            o_s, p_s = o["summary"], p["summary"]
            mem = (
                f", peak memory {ratio(o_s['peak_gib'], p_s['peak_gib'])}"
                if o_s.get("peak_gib") and p_s.get("peak_gib")
                else ""
            )
            lines.append(
                f"- {VARIANTS[o['variant']]['label']}: step time {ratio(o_s['seconds'], p_s['seconds'])} of "
                f"{VARIANTS[p['variant']]['label']}{mem}"
            )
    if not (ours and peers):
        lines.append("- no pair of a project and a stock row measured")
    default = next((r for r in ours if r["variant"] == "project_default"), None)
    if default and peers and not meta["ragged"]:
        s, peer = default["summary"], peers[0]["summary"]
        need = TARGET_RATIO * peer["seconds"]
        lines += ["", "Targets of the default configuration:", ""]
        verdict = "met" if s["seconds"] <= need else f"missed: {s['seconds'] - need:.2f} s too slow"
        lines.append(
            f"- step time at most {TARGET_RATIO:.2f}x the stock stack's ({need:.2f} s): "
            f"{ratio(s['seconds'], peer['seconds'])}, {verdict}"
        )
        if "mfu" in s:
            mfu_need = s["mfu"] * s["seconds"] / TARGET_MFU  # the step time at which the MFU would reach the target
            verdict = "met" if s["mfu"] >= TARGET_MFU else f"missed: it needs a {mfu_need:.2f} s step"
            lines.append(f"- MFU at least {TARGET_MFU:.0%}: {100 * s['mfu']:.0f}%, {verdict}")
    for r in (r for r in results if r.get("profile")):
        prof = r["profile"]
        lines += [
            "",
            f"Where the time of one more step of *{VARIANTS[r['variant']]['label']}* goes (`--profile`: "
            f"`torch.profiler`, self {prof['clock']} time per operator; busy {prof['busy_s']:.2f} s of a "
            f"{prof['step_s']:.2f} s profiled step, the difference being time the {prof['clock']} waited):",
            "",
            "| operator | calls | self ms | share of busy |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{t['op'][:90]}` | {t['calls']} | {t['self_ms']:.1f} | {100 * t['share']:.1f}% |" for t in prof["top"]
        ]
    lines += ["", f"![trainer step]({stem}.png)", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))


def plot(path: Path, results: list[dict]) -> None:
    rows = [r for r in results if r.get("summary")]
    labels = [r["variant"] for r in rows]
    with figure(path, 1, 2, figsize=(10, 3.2)) as (_, axes):
        axes[0].barh(labels, [r["summary"]["tokens_per_s"] for r in rows], color="tab:blue")
        axes[0].set_xlabel("tokens/s (trainer step, median)")
        axes[1].barh(labels, [r["summary"]["peak_gib"] or 0 for r in rows], color="tab:orange")
        axes[1].set_xlabel("peak GiB")
        for ax in axes:
            ax.invert_yaxis()


def render(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem, report = report["meta"]["stem"], without_local_paths(report)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    write_report(out, report)
    plot(out / f"{stem}.png", report["results"])


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated of {list(VARIANTS)}")
    p.add_argument("--model", choices=("20b", "tiny"), default="20b")
    p.add_argument("--layers", type=int, default=None, help="default: 24 (20b), 2 (tiny)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--seq-len", type=int, default=32768, help="tokens per trajectory (--ragged: the longest)")
    p.add_argument("--trajectories", type=int, default=None, help="per optimizer step (default 2; --ragged 16)")
    p.add_argument("--micro-batch", type=int, default=None, help="trajectories per micro-batch (default 1; --ragged 4)")
    p.add_argument("--ragged", action="store_true", help="log-normal trajectory lengths (see the docstring)")
    p.add_argument("--ragged-median", type=int, default=4096)
    p.add_argument("--ragged-sigma", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per variant")
    p.add_argument("--profile", action="store_true", help="one more step per stack under torch.profiler (not timed)")
    p.add_argument("--from-json", default=None, help="re-render a saved trainer_step JSON (no measurement)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        print(RESULT_PREFIX + json.dumps(worker(json.loads(args.worker))), flush=True)
        return {}
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        stem = report["meta"]["stem"]
        out = output_dir(args.out, f"{stem}.json", f"{stem}.md", f"{stem}.png")
        render(out, report)
        return report
    import torch

    from hf_gptoss_rl.model_builders import gptoss_20b_config, tiny_gptoss_config

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layers = args.layers or (24 if args.model == "20b" else 2)
    trajectories = args.trajectories or (16 if args.ragged else 2)
    micro_batch = args.micro_batch or (4 if args.ragged else 1)
    if trajectories % micro_batch:
        raise SystemExit(f"--trajectories {trajectories} is not a multiple of --micro-batch {micro_batch}")
    stem = "trainer_step_ragged" if args.ragged else "trainer_step"
    out = output_dir(args.out, f"{stem}.json", f"{stem}.md", f"{stem}.png")
    config = gptoss_20b_config(layers) if args.model == "20b" else tiny_gptoss_config(num_hidden_layers=layers)
    env = environment("trl", "flash-attn-4", "liger-kernel")
    peak = dense_bf16_peak(env["device"] if device.startswith("cuda") else None)
    spec = {
        "model": args.model, "layers": layers, "device": device, "seq_len": args.seq_len,
        "trajectories": trajectories, "micro_batch": micro_batch, "ragged": args.ragged,
        "ragged_median": args.ragged_median, "ragged_sigma": args.ragged_sigma,
        "warmup": args.warmup, "repeats": args.repeats, "profile": args.profile,
    }  # fmt: skip
    results = []
    for name in names:
        if name == "stock_fa4":
            from hf_gptoss_rl.attention_variants import flash_attention_4_available

            if not flash_attention_4_available():
                results.append({"variant": name, "error": "skipped", "notes": ["flash_attention_4 is not importable"]})
                continue
        result = run_variant({**spec, "variant": name}, args.timeout)
        result["micro_batches_per_step"] = trajectories // micro_batch
        if result.get("steps"):
            result["summary"] = summarize(result, config, args.warmup, env["device"] if peak else None)
            spec.setdefault("prompt_tokens", result["steps"][0]["trajectories"][0][0])
        bound = result.get("checkpoint_experts_max_tokens")
        result["notes"] = [f"experts kept up to {bound:,} tokens"] if bound is not None else []
        results.append(result)
        print(json.dumps({k: result.get(k) for k in ("variant", "summary", "error")}), flush=True)
    meta = {
        **spec, "stem": stem, "command": command_line("trainer_step", argv), "environment": env, "dtype": "bfloat16" if device.startswith("cuda") else "float32",
        "peak_name": peak[0] if peak else None, "peak_tflops": peak[1] if peak else None,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }  # fmt: skip
    report = {"meta": meta, "results": results}
    render(out, report)
    exit_if_failed("trainer_step", failures_of(results), out)
    return report


if __name__ == "__main__":
    main()
