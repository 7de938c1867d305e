"""One full GRPO training step of a gpt-oss-20b-shaped model at long context, by stack.

Model: `hf_gptoss_rl.model_builders.gptoss_20b_config()` with random bf16 weights created on the GPU
(`hf_gptoss_rl.model_builders.build_random_gptoss`), LoRA r=16 on q/k/v/o (peft), gradient checkpointing (non-reentrant),
one sequence of S random token ids: the first S/8 are the "prompt", the rest the completion that the loss covers.

Variants (only attention, experts and the log-prob computation differ; the loss is the same):

- `project`: the project's sink kernel + `experts_implementation="memory_efficient"` + chunked log-probs, called
  as `AgenticGRPOTrainer` calls them with `padding_free` (`hf_gptoss_rl.packing.packed_completion_logprobs`: the
  chunked head of `add_chunked_logprob_head`, no `[T, vocab]` logits; the varlen attention arguments passed with
  the forward);
- `project_sac` / `project_sac_experts` (optional, `--variants`): the project's stack with selective activation
  checkpointing (`hf_gptoss_rl.checkpointing`): the recompute skips the sink kernel's forward (and the experts op),
  whose outputs are kept instead (~0.26 GiB and ~1.6 GiB per layer at 32k tokens);
- `project_sac_experts_liger` / `project_sac_liger` (optional): the same (attention + experts kept / attention
  kept) plus Liger-Kernel's Triton RMSNorm with GPT-OSS's own rounding
  (`hf_gptoss_rl.fused_layers.apply_liger_gptoss_rms_norm`); needs `liger-kernel` and CUDA;
  `project_sac_experts_liger_rope` / `project_sac_liger_rope` add the fused rotary embedding
  (`hf_gptoss_rl.fused_layers.apply_fused_gptoss_rope`);
  `project_sac_experts_liger_torchlp` is the first of these with the log-prob chunks in PyTorch ops
  (`set_backends(logprobs="torch")`) instead of the fused Triton kernels, the CUDA default;
- `project_default` (optional): `AgenticGRPOConfig()`'s stack: `project_sac_experts_liger_rope` that also keeps the
  projections (`checkpoint_saves=["attention", "experts", "projections"]`), the experts and the projections kept
  only up to the memory-derived token bounds of `checkpoint_experts_max_tokens` / `checkpoint_projections_max_tokens`
  (`hf_gptoss_rl.checkpointing.experts_max_tokens_for_model` / `projections_max_tokens_for_model`; for gpt-oss-20b on
  a 140 GiB GPU ~33k and ~140k tokens: both kept at 32k, the projections only at 64k);
- `flex_grouped_mm`: `flex_attention` (sinks by LSE renormalisation) + `grouped_mm` experts (transformers'
  default) + full-vocabulary logits (`model(..., logits_to_keep=T+1).logits`, fp32 log-softmax), as a stock
  trainer without a fused LM head computes them;
- `fa4_grouped_mm`: `flash_attention_4` (FlashAttention-4 CuTe, `learnable_sink`) + `grouped_mm` + full logits,
  when transformers can import it (skipped otherwise, with the reason);
- `flex_grouped_mm_chunked` (optional, `--variants`): flex + grouped_mm with the chunked log-probs, to separate
  what the log-prob path buys from what attention + experts buy;
- `eager_grouped_mm` (not in the default GPU set: O(S²) memory: its [heads, S, S] scores
  alone are 32 GiB per layer at 16k) for CPU smoke runs.

`--ragged`: instead of one sequence, a batch of agentic trajectories of very different lengths (default: 16
lengths drawn from a log-normal with median 4,096 and sigma 1.0, clipped to [256, 32,768], torch generator seed 0;
the first 1/8 of each is the prompt), in micro-batches of `--micro-batch` rows (default 4) with gradient
accumulation, TRL's loss normalised by the batch's completion tokens. The project's variants run each micro-batch
packed into one row (`hf_gptoss_rl.packing.packed_completion_logprobs`, what `AgenticGRPOTrainer` does with
`padding_free`); the stock variants run it as TRL 1.16 does: padded to its longest trajectory (prompts left,
completions right, an attention mask), scored through a fused LM head (TRL 1.16's `fused_lm_head=True`; here the
chunked head, the same call contract). Useful tokens/s = real tokens of the batch / step seconds. Writes
`full_step_ragged.{md,json,png}`, with the loss and the sum of the completion log-probs of every variant (packed and
padded must agree).

Per (variant, S), in its own subprocess (an OOM or crash is reported and does not poison the other runs):

1. GRPO step: per-token log-probs of the completion (with grad) and the router aux loss, TRL 1.16's default
   loss (`grpo_loss`: `loss_type="dapo"`, beta 0, token-level ratio clipped to [1-0.2, 1+0.2], plus
   `router_aux_loss_coef * aux_loss`; on-policy, old log-probs = the detached new ones, as in
   `AgenticGRPOTrainer`), `backward()`. Warm-up step(s) first (compiles Triton / flex), then timed.
2. Log-prob pass: the same log-probs under `torch.no_grad()` (the old/reference log-prob pass).
3. Plain step: `model(input_ids, labels=input_ids).loss.backward()`, what a stock user runs.

tokens/s = S / step seconds; peak = `torch.cuda.max_memory_allocated()` during the measurement, weights included.
`--autocast` runs every forward under bf16 autocast, as `accelerate` does with TRL's default `bf16=True` (outputs
cast to fp32), and the project's variants skip PEFT's LoRA input casts that autocast undoes (`hf_gptoss_rl.lora`, as
`AgenticGRPOTrainer` does); without it the bf16 model runs as it is and PEFT computes the float32 adapters in
float32.
`--max-seconds` bounds the whole sweep: a run that would not start in time is reported as skipped, a run still
going at the deadline is killed and reported as timed out.

    python benchmarks/full_step.py                                   # one H200: S = 16k, 32k, 64k (~6-8 min)
    python -m benchmarks.full_step --model tiny --device cpu --seq-lens 64 --out /tmp/x   # smoke test
    python benchmarks/full_step.py --ragged --variants project_default,fa4_grouped_mm  # ragged batch

On a GPU machine, `pip install -e ".[dev]"` gives every variant but FA4; for `fa4_grouped_mm` (Hopper or newer,
CUDA 12.8+): `pip install flash-attn-4==4.0.0b36`.

Writes `full_step.md`, `full_step.png`, `full_step.json` into `--out` (default `docs/benchmarks/`, only while no
report is there: name the folder to replace one); `--report-from docs/benchmarks/full_step.json` (or
`full_step_ragged.json`) re-renders the report of a saved run (no GPU). The ragged case writes
`full_step_ragged.{md,json,png}`. The exit status is non-zero when a run crashed, timed out or failed a check (an
OOM is a result, not a failure).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import OUT_HELP, RATIO_RULE, exit_if_failed, output_dir, ratio, without_local_paths

# `hf_gptoss_rl` is imported where it is used: the sweep's parent process stays light (torch only); every
# (variant, S) run is its own worker process.
REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "project": {
        "label": "project: sink kernel + memory_efficient experts + chunked log-probs",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
    },
    "project_sac": {
        "label": "project + selective checkpointing (keeps attention outputs)",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "checkpoint_saves": ("attention",),
    },
    "project_sac_experts": {
        "label": "project + selective checkpointing (keeps attention + experts outputs)",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "checkpoint_saves": ("attention", "experts"),
    },
    "project_sac_experts_liger": {
        "label": "project + selective checkpointing (attention + experts) + Liger RMSNorm",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "checkpoint_saves": ("attention", "experts"),
        "liger": True,
    },
    "project_sac_experts_liger_rope": {
        "label": "project + SAC (attention + experts) + Liger RMSNorm + fused RoPE",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "checkpoint_saves": ("attention", "experts"),
        "liger": True,
        "rope": True,
    },
    "project_sac_liger_rope": {
        "label": "project + SAC (attention) + Liger RMSNorm + fused RoPE",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "checkpoint_saves": ("attention",),
        "liger": True,
        "rope": True,
    },
    "project_default": {  # AgenticGRPOConfig()'s stack; experts / projections kept up to the memory-derived bounds
        "label": "project, default configuration: SAC (attention + experts + projections where memory allows) + "
        "Liger + fused RoPE",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "checkpoint_saves": ("attention", "experts", "projections"),
        "max_tokens": "auto",
        "liger": True,
        "rope": True,
        "fuse_lora_update": True,
    },
    "project_sac_experts_liger_torchlp": {  # the previous log-prob chunk math, to time the fused kernels' share
        "label": "project + SAC (attention + experts) + Liger RMSNorm, log-prob chunks in PyTorch ops",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "logprobs_backend": "torch",
        "checkpoint_saves": ("attention", "experts"),
        "liger": True,
    },
    "project_sac_liger": {
        "label": "project + selective checkpointing (attention) + Liger RMSNorm",
        "attn": "project",
        "experts": "memory_efficient",
        "logprobs": "chunked",
        "checkpoint_saves": ("attention",),
        "liger": True,
    },
    "flex_grouped_mm": {
        "label": "flex_attention + grouped_mm + full logits",
        "attn": "flex_attention",
        "experts": "grouped_mm",
        "logprobs": "full",
    },
    "fa4_grouped_mm": {
        "label": "FA4 (flash_attention_4) + grouped_mm + full logits",
        "attn": "flash_attention_4",
        "experts": "grouped_mm",
        "logprobs": "full",
    },
    "flex_grouped_mm_chunked": {  # optional: separates the log-prob path's share from attention + experts
        "label": "flex_attention + grouped_mm + chunked log-probs",
        "attn": "flex_attention",
        "experts": "grouped_mm",
        "logprobs": "chunked",
    },
    "eager_grouped_mm": {
        "label": "eager + grouped_mm + full logits",
        "attn": "eager",
        "experts": "grouped_mm",
        "logprobs": "full",
    },
}
DEFAULT_VARIANTS = ("project", "flex_grouped_mm", "fa4_grouped_mm")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RESULT_PREFIX = "FULL_STEP_RESULT "
# Rough H200 costs for the plan's time estimate, on the slow side of this script's own rows in
# docs/benchmarks/full_step.md (train steps run at 7-13k tokens/s, the project's log-prob pass at ~30k tokens/s;
# a subprocess spends ~30 s on imports, model build, LoRA and kernel/flex compilation).
EST_OVERHEAD_S = 30.0
EST_TRAIN_TOKENS_PER_S = 8000.0
EST_LOGPROB_TOKENS_PER_S = 28000.0


# ---------------------------------------------------------------------------------------------------------- the loss


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    aux_loss: torch.Tensor | None = None,
    router_aux_loss_coef: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> torch.Tensor:
    """TRL 1.16 `GRPOTrainer._compute_loss` with its defaults, for one accumulation step.

    `loss_type="dapo"`, beta 0, token-level ratio `r = exp(logp - old)`, per-token `-min(r A, clip(r, 1-el, 1+eh) A)`
    summed over the mask and divided by the batch's completion-token count (`num_items_in_batch`), plus TRL's MoE
    load-balancing term `router_aux_loss_coef * aux_loss` (TRL enables it for GPT-OSS, whose config declares
    `output_router_logits`). `AgenticGRPOTrainer` uses this loss unchanged (it only reweights advantages when a
    mismatch correction is on, which this benchmark leaves off). `tests/test_benchmark_scripts.py` checks it
    against TRL's own `_compute_loss`.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if aux_loss is not None:
        loss = loss + router_aux_loss_coef * aux_loss
    return loss


def completion_logps(model, input_ids: torch.Tensor, keep: int, how: str, with_aux: bool, packed: bool = False):
    """Per-token log-probs `[B, keep]` of the last `keep` tokens (and the router aux loss if `with_aux`).

    - `how="chunked"`: the trainer's memory-efficient path: the model was patched by
      `hf_gptoss_rl.logprobs.add_chunked_logprob_head`, and is called exactly as TRL calls its fused LM head
      (`model(input_ids, labels=..., fused_lm_head=True)`, labels -100 on the prompt): no `[T, vocab]` logits.
      With `packed`, through `hf_gptoss_rl.packing.packed_completion_logprobs`, as `AgenticGRPOTrainer` runs it
      with `padding_free` (the default where the attention honours packing, the sink kernel's included): the
      same head, the varlen attention arguments passed with the forward.
    - `how="full"`: stock: `model(..., logits_to_keep=keep + 1).logits`, fp32 log-softmax, gathered at the targets.
    """
    extra = {"output_router_logits": True} if with_aux else {}
    if how == "chunked" and packed:
        from hf_gptoss_rl.packing import packed_completion_logprobs

        mask = torch.ones_like(input_ids)
        logps, _, aux = packed_completion_logprobs(model, input_ids, mask, keep, compute_aux_loss=with_aux)
        return logps, aux
    if how == "chunked":
        labels = input_ids.clone()
        labels[:, :-keep] = -100
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True, use_cache=False, **extra)
        return out.log_probs[:, -keep:], (out.aux_loss if with_aux else None)
    if how == "full":
        out = model(input_ids=input_ids, logits_to_keep=keep + 1, use_cache=False, **extra)
        logits = out.logits[:, :-1].float()
        targets = input_ids[:, -keep:]
        logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        return logps, (out.aux_loss if with_aux else None)
    raise ValueError(f"unknown log-prob path {how!r} (chunked | full)")


# ---------------------------------------------------------------------------------------------------------- worker


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(fn, device, warmup: int, repeats: int) -> dict:
    """Median seconds of `fn()` over `repeats` after `warmup` calls, and the peak memory of the timed calls."""
    try:
        for _ in range(warmup):
            fn()
        _sync(device)
        _cleanup(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        return {"seconds": statistics.median(times), "all_seconds": times, "peak_gib": peak}
    except Exception as e:  # an OOM (or a failure) of one measurement does not stop the others
        msg = (str(e).splitlines() or [""])[0][:240]
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return {"oom": True, "error": msg}
        return {"error": f"{type(e).__name__}: {msg}"}
    finally:
        _cleanup(device)


def worker(spec: dict) -> dict:
    """Build the model for one (variant, S) and run the three measurements."""
    device = torch.device(spec["device"])
    variant = VARIANTS[spec["variant"]]
    seq_len = int(spec["seq_len"])
    result = {"variant": spec["variant"], "seq_len": seq_len}
    from peft import LoraConfig, get_peft_model

    import hf_gptoss_rl  # noqa: F401  (registers memory_efficient experts and the hub kernel id)
    from hf_gptoss_rl import set_backends
    from hf_gptoss_rl.attention_variants import set_project_attention
    from hf_gptoss_rl.checkpointing import (
        experts_max_tokens_for_model,
        projections_max_tokens_for_model,
        selective_checkpointing_kwargs,
    )
    from hf_gptoss_rl.logprobs import add_chunked_logprob_head
    from hf_gptoss_rl.model_builders import build_random_gptoss, gptoss_20b_config, tiny_gptoss_config

    if spec["model"] == "20b":
        config = gptoss_20b_config(num_hidden_layers=int(spec["layers"]))
    else:
        config = tiny_gptoss_config(vocab_size=1024, num_hidden_layers=int(spec["layers"]))
    t0 = time.perf_counter()
    model = build_random_gptoss(config, device=device, dtype=getattr(torch, spec["dtype"]), seed=0)
    attn = variant["attn"]
    if attn == "project":
        attn, result["attention_how"] = set_project_attention(model, spec["project_attn"])
    else:
        model.set_attn_implementation(attn)
    result["attn_implementation"] = attn
    model.set_experts_implementation(variant["experts"])
    if variant.get("logprobs_backend"):  # this worker process only
        set_backends(logprobs=variant["logprobs_backend"])
    if variant["logprobs"] == "chunked" or spec.get("ragged"):  # ragged: every variant has a fused head, as TRL
        add_chunked_logprob_head(model)  # what AgenticGRPOTrainer installs for its chunked log-probs
    if variant.get("liger"):  # Liger's RMSNorm kernel with GPT-OSS's rounding (hf_gptoss_rl.fused_layers)
        from hf_gptoss_rl.fused_layers import apply_liger_gptoss_rms_norm

        apply_liger_gptoss_rms_norm(model)
    if variant.get("rope"):  # one Triton kernel each way instead of seven bf16 passes (hf_gptoss_rl.fused_layers)
        from hf_gptoss_rl.fused_layers import apply_fused_gptoss_rope

        apply_fused_gptoss_rope(model)
    saves = variant.get("checkpoint_saves", ())
    result["checkpoint_saves"] = list(saves)
    result["autocast"] = bool(spec.get("autocast"))
    bounds = {}
    if variant.get("max_tokens") == "auto":  # the trainer's default bounds (checkpoint_*_max_tokens)
        if "experts" in saves:
            bounds["experts_max_tokens"] = experts_max_tokens_for_model(
                model, device, with_projections="projections" in saves
            )
        if "projections" in saves:
            bounds["projections_max_tokens"] = projections_max_tokens_for_model(model, device)
        result.update(bounds)
    # selective checkpointing keeps the named ops' outputs instead of recomputing them (hf_gptoss_rl.checkpointing)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=selective_checkpointing_kwargs(saves, **bounds)
        if saves
        else {"use_reentrant": False}
    )
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    model.train()
    if spec.get("autocast"):
        # what `accelerate` does to the model with mixed_precision="bf16" (TRL's default bf16=True): the forward
        # under bf16 autocast, floating outputs cast to fp32
        from accelerate.utils import convert_outputs_to_fp32

        model.forward = convert_outputs_to_fp32(torch.autocast(device.type, dtype=torch.bfloat16)(model.forward))
        if variant["attn"] == "project":  # as AgenticGRPOTrainer does to a PEFT policy
            from hf_gptoss_rl.lora import skip_autocast_undone_lora_casts

            skip_autocast_undone_lora_casts(model)
    if variant.get("fuse_lora_update"):  # AgenticGRPOConfig.fuse_lora_update (on by default)
        from hf_gptoss_rl.lora import fuse_lora_update

        fuse_lora_update(model)
    _sync(device)
    result["build_s"] = time.perf_counter() - t0
    result["resident_gib"] = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result["params"] = sum(p.numel() for p in model.parameters())
    if spec.get("ragged"):
        return ragged_measure(spec, result, model, config, device, packed=variant["attn"] == "project")

    gen = torch.Generator(device=device).manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (1, seq_len), device=device, generator=gen)
    keep = seq_len - seq_len // 8  # completion tokens (the loss covers them)
    mask = torch.ones(1, keep, device=device)
    advantages = torch.ones(1, device=device)
    how = variant["logprobs"]
    packed = variant["attn"] == "project"  # the trainer's padding-free path (AgenticGRPOTrainer's default here)
    aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    result["router_aux_loss_coef"] = aux_coef

    def grpo_step():
        model.zero_grad(set_to_none=True)
        logps, aux = completion_logps(model, input_ids, keep, how, with_aux=aux_coef != 0.0, packed=packed)
        # on-policy, as AgenticGRPOTrainer: old log-probs = the detached new ones (ratio 1)
        loss = grpo_loss(logps, logps.detach(), advantages, mask, aux, aux_coef)
        loss.backward()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite GRPO loss {loss.item()}")

    def logprob_pass():  # TRL's old/reference log-prob pass: no grad, no aux loss
        with torch.no_grad():
            completion_logps(model, input_ids, keep, how, with_aux=False, packed=packed)

    def plain_step():
        model.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()

    warmup, repeats = int(spec["warmup"]), int(spec["repeats"])
    result["grpo_step"] = _measure(grpo_step, device, warmup, repeats)
    # the GRPO step's own LoRA gradients, before the other measurements replace or (OOM) half-write them
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]
    result["lora_grads_finite"] = bool(lora_grads) and all(bool(torch.isfinite(g).all()) for g in lora_grads)
    # the GRPO warm-up already compiled the forward kernels; compile here only if that step did not run
    result["logprob_pass"] = _measure(logprob_pass, device, 0 if "seconds" in result["grpo_step"] else 1, repeats)
    if spec["run_plain_step"]:
        result["plain_step"] = _measure(plain_step, device, 0 if "seconds" in result["grpo_step"] else 1, repeats)
    if spec.get("profile") and "seconds" in result["grpo_step"]:
        result["step_profile"] = profile_step(grpo_step, device)
    return result


def ragged_lengths(n: int, median: int, sigma: float, low: int, high: int, seed: int) -> list[int]:
    """`n` trajectory lengths: `median * exp(sigma * z)`, z ~ N(0, 1) from a torch generator seeded `seed`, rounded
    and clipped to [low, high]."""
    z = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return [int(min(max(round(median * math.exp(sigma * v)), low), high)) for v in z.tolist()]


def ragged_micro_batches(lengths: list[int], micro_batch: int, vocab: int, device) -> list[dict]:
    """TRL's padded layout per micro-batch: prompt (first 1/8) left-padded, completion right-padded."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for start in range(0, len(lengths), micro_batch):
        rows = lengths[start : start + micro_batch]
        prompts = [max(1, n // 8) for n in rows]
        width_p, width_c = max(prompts), max(n - p for n, p in zip(rows, prompts))
        ids = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
        mask = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
        for b, (n, p) in enumerate(zip(rows, prompts)):
            ids[b, width_p - p : width_p + n - p] = torch.randint(1, vocab, (n,), generator=gen)
            mask[b, width_p - p : width_p + n - p] = 1
        batches.append({"input_ids": ids.to(device), "attention_mask": mask.to(device), "keep": width_c})
    return batches


def ragged_measure(spec: dict, result: dict, model, config, device, packed: bool) -> dict:
    """One GRPO step over the ragged batch: micro-batches packed (project) or padded (stock), gradients accumulated."""
    from hf_gptoss_rl.packing import packed_completion_logprobs

    lengths = spec["ragged"]["lengths"]
    batches = ragged_micro_batches(lengths, int(spec["ragged"]["micro_batch"]), config.vocab_size, device)
    aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    completion_tokens = sum(int(b["attention_mask"][:, -b["keep"] :].sum()) for b in batches)
    result.update(
        path="packed" if packed else "padded",
        useful_tokens=sum(lengths),
        processed_tokens=sum(lengths) if packed else sum(b["input_ids"].numel() for b in batches),
    )
    losses = []

    def grpo_step():
        model.zero_grad(set_to_none=True)
        losses.clear()
        for b in batches:
            ids, mask, keep = b["input_ids"], b["attention_mask"], b["keep"]
            if packed:
                logps, _, aux = packed_completion_logprobs(model, ids, mask, keep, compute_aux_loss=aux_coef != 0.0)
            else:
                labels = ids.masked_fill(mask == 0, -100)
                labels[:, :-keep] = -100
                extra = {"output_router_logits": True} if aux_coef != 0.0 else {}
                out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False,
                            **extra)  # fmt: skip
                logps, aux = out.log_probs[:, -keep:], out.aux_loss
            cmask = mask[:, -keep:].float()
            advantages = torch.linspace(-1.0, 1.0, ids.shape[0], device=device)
            # TRL's dapo normalisation: the batch's completion-token count; the aux term once per micro-batch
            loss = grpo_loss(logps, logps.detach(), advantages, cmask) * (cmask.sum() / completion_tokens)
            if aux is not None:
                loss = loss + aux_coef * aux / len(batches)
            loss.backward()
            losses.append((float(loss), float((logps.detach() * cmask).sum())))
        if not all(math.isfinite(v) for v, _ in losses):
            raise FloatingPointError(f"non-finite GRPO loss {losses}")

    result["grpo_step"] = _measure(grpo_step, device, int(spec["warmup"]), int(spec["repeats"]))
    result["loss"] = sum(v for v, _ in losses) if losses else None
    result["completion_logp_sum"] = sum(v for _, v in losses) if losses else None  # packed vs padded check
    return result


def _env_text(env: dict) -> str:
    return (
        f"{env['device']} (torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}, triton "
        f"{env['triton']}, kernels {env['kernels']}{', commit ' + env['commit'] if env.get('commit') else ''})"
    )


def write_ragged_report(out: Path, results: list[dict], meta: dict) -> None:
    results, meta = without_local_paths(results), without_local_paths(meta)  # a report names no local folder
    out.mkdir(parents=True, exist_ok=True)
    (out / "full_step_ragged.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    r0 = meta["ragged"]
    lines = [
        "# Full GRPO step on a ragged agentic batch (`benchmarks/full_step.py --ragged`)",
        "",
        f"Measured on {_env_text(meta['env'])}. Command: `{meta['command']}`.",
        f"Model: {meta['model']} ({meta['layers']} layers), {meta['dtype']}, random weights, LoRA r=16 on q/k/v/o, "
        "gradient checkpointing; on-policy GRPO loss (dapo) with gradient accumulation; "
        f"{meta.get('warmup', 1)} warm-up + {meta.get('repeats', 1)} timed step(s) (median).",
        _autocast_text(results),
        f"Batch: {len(r0['lengths'])} trajectories, lengths ~ log-normal(median {r0['median']}, sigma {r0['sigma']}), "
        f"clipped to [{r0['min']}, {r0['max']}], seed {r0['seed']}: {r0['lengths']} ({sum(r0['lengths']):,} tokens); "
        f"micro-batches of {r0['micro_batch']} rows; prompt = first 1/8 of each.",
        "",
        "| variant | path | useful tokens | tokens processed | step s | useful tokens/s | peak GiB | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        g = r.get("grpo_step")
        note = r.get("skip") or r.get("error") or (g or {}).get("error") or ""
        lines.append(
            f"| {VARIANTS[r['variant']]['label'].replace('full logits', 'fused LM head')} | {r.get('path', '—')} | {r.get('useful_tokens', 0):,} | "
            f"{r.get('processed_tokens', 0):,} | {cell_time(g)} | {cell_tps(g, r.get('useful_tokens', 0))} | "
            f"{cell_peak(g)} | {note} |"
        )
    timed = {r["variant"]: r["grpo_step"]["seconds"] for r in results if "seconds" in (r.get("grpo_step") or {})}
    lines.append("")
    for ours in (n for n in timed if VARIANTS[n]["attn"] == "project"):
        for other in (n for n in timed if VARIANTS[n]["attn"] != "project"):
            lines.append(f"- {ours}: {ratio(timed[ours], timed[other])} the step time of {other} ({RATIO_RULE})")
    # packed and padded compute the same loss: the timed step's loss and the sum of the completion log-probs
    same = [r for r in results if r.get("loss") is not None and r.get("completion_logp_sum") is not None]
    if len(same) > 1:
        ref = same[0]
        for r in same[1:]:
            lines.append(
                f"- same batch, same loss: {r['variant']} ({r['path']}) vs {ref['variant']} ({ref['path']}): loss "
                f"{r['loss']:.8g} vs {ref['loss']:.8g} (relative difference "
                f"{abs(r['loss'] - ref['loss']) / max(abs(ref['loss']), 1e-30):.1e}); sum of completion log-probs "
                f"{r['completion_logp_sum']:.8g} vs {ref['completion_logp_sum']:.8g} (relative difference "
                f"{abs(r['completion_logp_sum'] - ref['completion_logp_sum']) / max(abs(ref['completion_logp_sum']), 1e-30):.1e})"
            )
    lines += ["", "![ragged batch](full_step_ragged.png)"]
    if meta.get("notes"):
        lines += ["", "## Notes", "", *[f"- {note}" for note in meta["notes"]]]
    (out / "full_step_ragged.md").write_text("\n".join(lines) + "\n")
    plot_ragged(out / "full_step_ragged.png", results)


def plot_ragged(path: Path, results: list[dict]) -> None:
    """Useful tokens/s and peak GiB of the GRPO step per variant on the ragged batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "seconds" in (r.get("grpo_step") or {})]
    names = [f"{r['variant']}\n({r.get('path', '?')})" for r in ok]
    fig, (ax_tps, ax_mem) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax_tps.barh(names, [r["useful_tokens"] / r["grpo_step"]["seconds"] for r in ok])
    ax_tps.set_xlabel("useful tokens/s (real tokens / step seconds)")
    ax_mem.barh(names, [r["grpo_step"].get("peak_gib") or 0.0 for r in ok])
    ax_mem.set_xlabel("peak GiB (weights included)")
    for ax in (ax_tps, ax_mem):
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("GRPO step on a ragged agentic batch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_ragged(args, device, layers: int, names: list[str], start: float) -> list[dict]:
    tiny = args.model == "tiny"
    ragged = {
        "median": args.ragged_median or (48 if tiny else 4096),
        "sigma": args.ragged_sigma,
        "min": args.ragged_min or (8 if tiny else 256),
        "max": args.ragged_max or (256 if tiny else 32768),
        "seed": args.ragged_seed,
        "micro_batch": args.micro_batch,
    }
    ragged["lengths"] = ragged_lengths(
        args.ragged_n, ragged["median"], ragged["sigma"], ragged["min"], ragged["max"], ragged["seed"]
    )
    print(f"[full_step] ragged batch {ragged['lengths']} ({sum(ragged['lengths']):,} tokens)", flush=True)
    results = []
    for name in names:
        spec = {"variant": name, "seq_len": max(ragged["lengths"]), "device": str(device), "model": args.model,
                "layers": layers, "dtype": args.dtype, "warmup": args.warmup, "repeats": args.repeats,
                "project_attn": args.project_attn, "ragged": ragged, "autocast": args.autocast}  # fmt: skip
        reason = availability(name, device)
        remaining = args.max_seconds - (time.perf_counter() - start)
        if reason or remaining < 1.0:
            results.append({**spec, "skip": reason or "skipped: --max-seconds budget"})
            continue
        r = run_one(spec, timeout=min(remaining, args.run_timeout))
        results.append(r)
        g = r.get("grpo_step") or {}
        print(f"[full_step] ragged {name}: {g.get('seconds', r.get('error', g))}", flush=True)
    from benchmarks._cli import environment

    meta = {"env": environment(), "command": "python benchmarks/full_step.py " + " ".join(args.argv), "model": args.model,
            "layers": layers, "dtype": args.dtype, "warmup": args.warmup, "repeats": args.repeats,
            "ragged": ragged, "autocast": args.autocast}  # fmt: skip
    write_ragged_report(args.out, results, meta)
    print((args.out / "full_step_ragged.md").read_text())
    exit_if_failed("benchmarks/full_step.py --ragged", run_failures(results), args.out)
    return results


def profile_step(fn, device, top: int = 25) -> dict:
    """Where one (already warmed-up) GRPO step spends its time: `torch.profiler` over one call, operator level
    (aten ops, the kernel's custom ops, autograd nodes' ops), ranked by self GPU time (CPU time on a CPU run).
    Self time counts each kernel once, under the op that launched it, so the rows add up to the busy time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=True) as prof:
        fn()
        _sync(device)
    wall = time.perf_counter() - t0
    by_shape = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.device_type == DeviceType.CPU
        and (getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total) > 0
    ]

    def self_us(e):
        return getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total

    ops = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and self_us(e) > 0]
    busy_us = sum(self_us(e) for e in ops)
    ops.sort(key=self_us, reverse=True)
    return {
        "clock": "GPU" if cuda else "CPU",
        "profiled_wall_s": wall,
        "busy_ms": busy_us / 1e3,
        "top": [
            {"op": e.key, "calls": e.count, "self_ms": self_us(e) / 1e3, "share": self_us(e) / busy_us}
            for e in ops[:top]
        ],
        # the same ops split by input shapes (which layer part a `mul` or `copy_` belongs to), for the json only
        "top_by_shape": [
            {"op": e.key, "shapes": str(e.input_shapes)[:200], "calls": e.count, "self_ms": self_us(e) / 1e3}
            for e in sorted(by_shape, key=self_us, reverse=True)[: 2 * top]
        ],
    }


# ---------------------------------------------------------------------------------------------------------- driver


def availability(name: str, device: torch.device) -> str | None:
    """None when the variant can run here, else why not."""
    attn = VARIANTS[name]["attn"]
    if attn == "flex_attention" and device.type != "cuda":
        return "skipped: flex_attention refuses sinks on CPU"
    from hf_gptoss_rl.attention_variants import flash_attention_4_available

    if attn == "flash_attention_4" and not flash_attention_4_available():
        return "skipped: flash_attention_4 not importable here (flash-attn CuTe / nvidia-cutlass-dsl missing)"
    if VARIANTS[name].get("liger"):
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            return "skipped: liger-kernel not installed"
        if device.type != "cuda":
            return "skipped: Liger's Triton kernels need CUDA"
    return None


def estimate_s(seq_len: int, args) -> float:
    if args.device_type != "cuda":
        return 15.0
    train = seq_len / EST_TRAIN_TOKENS_PER_S
    lp = seq_len / EST_LOGPROB_TOKENS_PER_S
    plain = train if args.plain_step else 0.0
    return EST_OVERHEAD_S + (args.warmup + args.repeats) * train + args.repeats * (lp + plain)


def run_one(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return {**spec, **json.loads(line[len(RESULT_PREFIX) :]), "wall_s": wall}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
    oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
    return {
        **spec,
        "error": ("OOM (model build or setup)" if oom else f"worker exited with {proc.returncode}"),
        "stderr_tail": tail,
        "wall_s": wall,
    }


def report_files(ragged: bool, png_name: str = "full_step.png") -> list[str]:
    """The files `write_report` (or, ``ragged``, `write_ragged_report`) writes."""
    if ragged:
        return ["full_step_ragged.json", "full_step_ragged.md", "full_step_ragged.png"]
    return ["full_step.json", "full_step.md", png_name]


def run_failures(results: list[dict]) -> list[str]:
    """The (variant, S) runs that failed: a worker that crashed or timed out, a measurement that raised (an OOM is a
    result: the variant does not fit), GRPO-step LoRA gradients that are not finite."""
    failures = []
    for r in results:
        name = f"{r['variant']} S={r.get('seq_len')}"
        if r.get("error") and not r["error"].startswith("OOM"):
            failures.append(f"{name}: {r['error']}")
        for key in ("grpo_step", "logprob_pass", "plain_step"):
            m = r.get(key) or {}
            if m.get("error") and not m.get("oom"):
                failures.append(f"{name}, {key}: {m['error']}")
        if "seconds" in (r.get("grpo_step") or {}) and r.get("lora_grads_finite") is False:
            failures.append(f"{name}: LoRA gradients of the GRPO step are not finite")
    return failures


def cell_time(m: dict | None) -> str:
    if m is None:
        return "—"
    if m.get("oom"):
        return "OOM"
    if "error" in m:
        return "error"
    return f"{m['seconds']:.2f}"


def cell_tps(m: dict | None, seq_len: int) -> str:
    if m is None or "seconds" not in m:
        return "—"
    return f"{seq_len / m['seconds']:,.0f}"


def cell_peak(m: dict | None) -> str:
    if m is None or m.get("peak_gib") is None:
        return "OOM" if (m or {}).get("oom") else "—"
    return f"{m['peak_gib']:.1f}"


_CLOCKS = {"device": "GPU", "cpu": "CPU"}  # the names older reports stored


# Dense bf16 Tensor Core peak, TFLOP/s, by the GPU name the run recorded (`torch.cuda.get_device_name`), most specific
# first. NVIDIA's H100 and H200 datasheets give bf16 "with sparsity" (SXM: 1,979; NVL: 1,671; H100 PCIe: 1,513);
# dense is half of that.
DENSE_BF16_PEAK_TFLOPS = {"H100 PCIe": 756.5, "H100 NVL": 835.5, "H200 NVL": 835.5, "H100": 989.5, "H200": 989.5}


def dense_bf16_peak(device_name: str | None) -> tuple[str, float] | None:
    """(the table's name, its dense bf16 peak in TFLOP/s) of the GPU named ``device_name``; None for a device not in
    `DENSE_BF16_PEAK_TFLOPS` (a CPU, another GPU) or a report that recorded none."""
    for name, peak in DENSE_BF16_PEAK_TFLOPS.items():
        if device_name and name in device_name:
            return name, peak
    return None


def grpo_step_flops(config, seq_len: int, prompt_len: int) -> dict:
    """Model FLOPs of one LoRA GRPO step on one sequence (the MFU convention: forward + backward, recomputation not
    counted, so every variant is held to the same work). Matmuls only, 2 FLOPs per multiply-add:

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
    total = linear + attention + head
    return {"linear": linear, "attention": attention, "lm_head": head, "total": total}


def row_label(r: dict) -> str:
    """The variant's label, marked when the row ran the forward under bf16 autocast (`--autocast`)."""
    return VARIANTS[r["variant"]]["label"] + (" (bf16 autocast)" if r.get("autocast") else "")


def _row_order(r: dict) -> tuple:
    return r["seq_len"], bool(r.get("autocast")), list(VARIANTS).index(r["variant"])


def flop_limit_lines(results: list[dict], layers: int, device_name: str | None) -> list[str]:
    """What is left to the FLOP limit: each measured GRPO step against the model FLOPs at the dense bf16 peak of the
    GPU the run recorded (``device_name``); no section where that peak is unknown (a CPU run, a report without it)."""
    from hf_gptoss_rl.model_builders import gptoss_20b_config

    config = gptoss_20b_config(num_hidden_layers=layers)
    rows = [r for r in results if "seconds" in (r.get("grpo_step") or {})]
    found = dense_bf16_peak(device_name)
    if not rows or found is None:
        return []
    gpu, peak = found
    lines = [
        "## What is left to the FLOP limit",
        "",
        f"Model FLOPs of one GRPO step (`grpo_step_flops`: forward + backward of the {layers}-layer model with "
        f"frozen base weights, recomputation not counted, the same work for every variant) against the {gpu}'s dense "
        f"bf16 peak of {peak:g} TFLOP/s (NVIDIA's datasheet: {2 * peak:,.0f} with sparsity). "
        "The limit is the step time at that peak; MFU = limit / measured.",
        "",
        "| S | linear TFLOP | attention TFLOP | LM head TFLOP | total TFLOP | limit s | limit tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    per_len = {}
    for s in sorted({r["seq_len"] for r in rows}):
        f = per_len[s] = grpo_step_flops(config, s, s // 8)
        limit = f["total"] / (peak * 1e12)
        lines.append(
            f"| {s:,} | {f['linear'] / 1e12:.0f} | {f['attention'] / 1e12:.0f} | {f['lm_head'] / 1e12:.0f} | "
            f"{f['total'] / 1e12:.0f} | {limit:.3f} | {s / limit:,.0f} |"
        )
    lines += ["", "| variant | S | GRPO step s | MFU |", "|---|---|---|---|"]
    for r in sorted(rows, key=_row_order):
        limit = per_len[r["seq_len"]]["total"] / (peak * 1e12)
        sec = r["grpo_step"]["seconds"]
        lines.append(f"| {row_label(r)} | {r['seq_len']:,} | {sec:.2f} | {limit / sec:.0%} |")
    return lines + [""]


def _autocast_text(results: list[dict]) -> str:
    with_autocast = {bool(r.get("autocast")) for r in results}
    if with_autocast == {True}:
        return "The forward runs under bf16 autocast, as `accelerate` runs it with `bf16=True` (`--autocast`)."
    without = "without autocast (bf16 weights; PEFT computes the float32 LoRA adapters in float32)"
    if with_autocast == {False}:
        return f"Every row ran {without}."
    return (
        "Rows marked (bf16 autocast) ran the forward under bf16 autocast, as `accelerate` runs it with `bf16=True` "
        f"(`--autocast`, what training does); the others ran {without}."
    )


def write_report(out: Path, results: list[dict], meta: dict) -> None:
    results, meta = without_local_paths(results), without_local_paths(meta)  # a report names no local folder
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Full GRPO step, gpt-oss-20b-shaped model (`benchmarks/full_step.py`)",
        "",
        f"Measured on {_env_text(meta['env'])}. Command: `{meta['command']}`.",
        f"Model: {meta['model']} ({meta['layers']} layers), {meta['dtype']}, random weights, LoRA r=16 on q/k/v/o, "
        f"gradient checkpointing; one sequence, loss over the last 7/8 of it; {meta['warmup']} warm-up + "
        f"{meta['repeats']} timed repeat(s) (median); PYTORCH_CUDA_ALLOC_CONF={meta['alloc_conf']!r}.",
        _autocast_text(results),
        "Peak = max allocated during the measurement, weights included. tokens/s = S / step time.",
        "",
        "| variant | S | GRPO step s | tokens/s | peak GiB | log-prob pass s | peak GiB "
        "| plain `labels=` step s | tokens/s | peak GiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=_row_order):
        g, lp, pl = r.get("grpo_step"), r.get("logprob_pass"), r.get("plain_step")
        note = r.get("skip") or r.get("error") or ""
        for key, m in (("GRPO", g), ("log-prob", lp), ("plain", pl)):
            if m and "error" in m:
                note += f" {key} {'OOM' if m.get('oom') else 'error'}: {m['error'][:100]}"
        if g and "seconds" in g and r.get("lora_grads_finite") is False:
            note += " GRPO step: some LoRA gradients not finite"
        lines.append(
            f"| {row_label(r)} | {r['seq_len']:,} | {cell_time(g)} | {cell_tps(g, r['seq_len'])} | "
            f"{cell_peak(g)} | {cell_time(lp)} | {cell_peak(lp)} | {cell_time(pl)} | {cell_tps(pl, r['seq_len'])} | "
            f"{cell_peak(pl)} | {note.strip()} |"
        )
    lines += [
        "",
        "Time of the project's GRPO step ÷ each stock variant's at the same S, both with or both without autocast "
        f"({RATIO_RULE}):",
        "",
    ]
    by_key = {(r["variant"], r["seq_len"], bool(r.get("autocast"))): r for r in results}
    ratio_lines = []
    ours_names = [n for n, v in VARIANTS.items() if v["attn"] == "project"]
    for s, autocast in sorted({(r["seq_len"], bool(r.get("autocast"))) for r in results}):
        mark = " (bf16 autocast)" if autocast else ""
        for ours_name in ours_names:
            ours = (by_key.get((ours_name, s, autocast)) or {}).get("grpo_step") or {}
            for name in VARIANTS:
                theirs = (by_key.get((name, s, autocast)) or {}).get("grpo_step") or {}
                if name not in ours_names and "seconds" in ours and "seconds" in theirs:
                    ratio_lines.append(
                        f"- S={s:,}{mark}: {ours_name}: {ratio(ours['seconds'], theirs['seconds'])} of "
                        f"{VARIANTS[name]['label']}"
                    )
    lines += ratio_lines or ["- (no pair measured)"]
    lines += ["", f"![full step]({meta['png_name']})", ""]
    if meta.get("model") == "20b":
        lines += flop_limit_lines(results, meta["layers"], (meta.get("env") or {}).get("device"))
    profiled = [r for r in results if r.get("step_profile")]
    for r in sorted(profiled, key=_row_order):
        prof = r["step_profile"]
        lines += [
            f"### Where the GRPO step's time goes: {row_label(r)}, S={r['seq_len']:,}",
            "",
            f"One profiled step (`--profile`; {prof['profiled_wall_s']:.2f} s wall under the profiler), "
            f"{_CLOCKS.get(prof['clock'], prof['clock'])} busy time {prof['busy_ms']:.0f} ms; ops by self "
            f"{_CLOCKS.get(prof['clock'], prof['clock'])} time:",
            "",
            "| op | calls | self ms | share |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{t['op'][:90]}` | {t['calls']} | {t['self_ms']:.1f} | {t['share']:.1%} |" for t in prof["top"]]
        lines.append("")
    if meta.get("notes"):
        lines += ["## Notes", "", *[f"- {note}" for note in meta["notes"]], ""]
    (out / "full_step.md").write_text("\n".join(lines) + "\n")
    (out / "full_step.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    plot(out / meta["png_name"], results)


def plot(path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, autocast in ((n, a) for a in (False, True) for n in VARIANTS):
        rows = sorted(
            (r for r in results if r["variant"] == name and bool(r.get("autocast")) == autocast),
            key=lambda r: r["seq_len"],
        )
        ok = [r for r in rows if "seconds" in (r.get("grpo_step") or {})]
        if not rows:
            continue
        label = row_label(rows[0])
        if ok:
            xs = [r["seq_len"] for r in ok]
            ax_tps.plot(xs, [r["seq_len"] / r["grpo_step"]["seconds"] for r in ok], marker="o", label=label)
            peaks = [(r["seq_len"], r["grpo_step"]["peak_gib"]) for r in ok if r["grpo_step"].get("peak_gib")]
            if peaks:
                ax_mem.plot(*zip(*peaks), marker="o", label=label)
        for r in rows:
            if (r.get("grpo_step") or {}).get("oom") or "OOM" in str(r.get("error", "")):
                ax_mem.scatter([r["seq_len"]], [0], marker="x", color="red")
                ax_mem.annotate(f"{name} OOM", (r["seq_len"], 0), fontsize=7, rotation=30)
    if torch.cuda.is_available():
        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
        ax_mem.axhline(capacity, color="gray", linestyle="--", label=f"GPU memory ({capacity:.0f} GiB)")
    for ax, title in ((ax_tps, "GRPO train step tokens/s"), (ax_mem, "GRPO train step peak GiB (x = OOM)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("20b", "tiny"), default="20b")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--layers", type=int, default=None, help="default 24 for 20b (full depth), 2 for tiny")
    p.add_argument("--seq-lens", default=None, help="comma-separated; default 16384,32768,65536 (tiny: 64,128)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated of {list(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-plain-step", dest="plain_step", action="store_false", help="skip the labels= step")
    p.add_argument("--max-seconds", type=float, default=480.0, help="budget for the whole sweep")
    p.add_argument("--run-timeout", type=float, default=240.0, help="limit of one (variant, S) subprocess")
    p.add_argument("--project-attn", choices=("auto", "hub", "direct"), default="auto")
    p.add_argument("--alloc-conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF of the workers")
    p.add_argument(
        "--autocast",
        action="store_true",
        help="run the forward under bf16 autocast, as accelerate does with TRL's default bf16=True",
    )
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--profile", action="store_true", help="also profile one GRPO step per run: top ops by self time")
    p.add_argument(
        "--from-json", "--report-from", dest="report_from", type=Path, default=None,
        help="no run: re-render the report of a saved full_step.json / full_step_ragged.json",
    )  # fmt: skip
    p.add_argument("--ragged", action="store_true", help="the ragged-batch case instead of the S sweep")
    p.add_argument("--ragged-n", type=int, default=16, help="trajectories in the ragged batch")
    p.add_argument("--ragged-median", type=int, default=None, help="log-normal median (default 4096; tiny: 48)")
    p.add_argument("--ragged-sigma", type=float, default=1.0, help="log-normal sigma of the lengths")
    p.add_argument("--ragged-min", type=int, default=None, help="shortest trajectory (default 256; tiny: 8)")
    p.add_argument("--ragged-max", type=int, default=None, help="longest trajectory (default 32768; tiny: 256)")
    p.add_argument("--ragged-seed", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per forward in the ragged case")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.worker is not None:
        print(RESULT_PREFIX + json.dumps(worker(json.loads(args.worker))), flush=True)
        return []
    if args.report_from is not None:
        saved = json.loads(args.report_from.read_text())
        ragged = "ragged" in saved["meta"]
        args.out = output_dir(args.out, *report_files(ragged, saved["meta"].get("png_name", "full_step.png")))
        (write_ragged_report if ragged else write_report)(args.out, saved["results"], saved["meta"])
        return saved["results"]
    args.out = output_dir(args.out, *report_files(args.ragged))
    start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device_type = device.type
    layers = args.layers or (24 if args.model == "20b" else 2)
    default_lens = "16384,32768,65536" if args.model == "20b" else "64,128"
    seq_lens = sorted(int(s) for s in (args.seq_lens or default_lens).split(","))
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.alloc_conf:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.alloc_conf)
    if args.ragged:
        args.argv = sys.argv[1:] if argv is None else list(argv)
        return run_ragged(args, device, layers, names, start)

    plan, skipped = [], []
    for s in seq_lens:
        for name in names:
            spec = {
                "variant": name,
                "seq_len": s,
                "device": str(device),
                "model": args.model,
                "layers": layers,
                "dtype": args.dtype,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "run_plain_step": args.plain_step,
                "project_attn": args.project_attn,
                "profile": args.profile,
                "autocast": args.autocast,
            }
            reason = availability(name, device)
            (skipped if reason else plan).append({**spec, "skip": reason} if reason else spec)
    total_est = sum(estimate_s(spec["seq_len"], args) for spec in plan)
    print(f"[full_step] {args.model} ({layers} layers) on {device}; budget --max-seconds {args.max_seconds:.0f}")
    for spec in plan:
        print(f"  run  {spec['variant']:<18} S={spec['seq_len']:>6}  ~{estimate_s(spec['seq_len'], args):.0f} s")
    for spec in skipped:
        print(f"  skip {spec['variant']:<18} S={spec['seq_len']:>6}  {spec['skip']}")
    print(f"[full_step] estimated {total_est:.0f} s ({total_est / 60:.1f} min) for {len(plan)} runs", flush=True)

    results = list(skipped)
    for spec in plan:
        remaining = args.max_seconds - (time.perf_counter() - start)
        need = min(estimate_s(spec["seq_len"], args), EST_OVERHEAD_S + 10) if device.type == "cuda" else 1.0
        if remaining < need:
            results.append({**spec, "skip": f"skipped: --max-seconds budget ({remaining:.0f} s left)"})
            print(f"[full_step] {spec['variant']} S={spec['seq_len']}: skipped (budget)", flush=True)
            continue
        r = run_one(spec, timeout=min(remaining, args.run_timeout))
        results.append(r)
        g = r.get("grpo_step") or {}
        status = f"{g['seconds']:.2f} s" if "seconds" in g else ("OOM" if g.get("oom") else r.get("error", "?"))
        print(
            f"[full_step] {spec['variant']} S={spec['seq_len']}: GRPO step {status} (wall {r['wall_s']:.0f} s)",
            flush=True,
        )

    from benchmarks._cli import environment

    meta = {
        "env": environment(),
        "command": "python benchmarks/full_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "layers": layers,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "autocast": args.autocast,
        "estimated_s": total_est,
        "wall_s": time.perf_counter() - start,
        "png_name": "full_step.png",
    }
    write_report(args.out, results, meta)
    print((args.out / "full_step.md").read_text())
    exit_if_failed("benchmarks/full_step.py", run_failures(results), args.out)
    return results


if __name__ == "__main__":
    main()
