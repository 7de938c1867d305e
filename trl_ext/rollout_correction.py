"""Rollout/training mismatch on the loss forward: the metrics (`mismatch/*`, TRL's `sampling/*`, `routing/*`) and
TRL's importance-sampling correction applied to any rollout engine (the math: `trl_ext.mismatch`).

The IS ratio `w` is folded into the advantages (`A -> A * w`, a detached `[B, T]` tensor, which TRL's loss supports):
for the clipped objective `min(r A w, clip(r) A w) = w min(r A, clip(r) A)` as `w >= 0`, exactly TRL's "per-token
loss x IS ratio"; VESPO gets it as TRL passes it (`importance_sampling_ratio`).
"""

from __future__ import annotations

from typing import Any

import torch

from .mismatch import SEQUENCE_LEVEL_MODES, importance_sampling_ratio, mismatch_metrics


def apply_rollout_correction(trainer, per_token_logps: torch.Tensor, inputs: dict[str, Any]) -> None:
    """Log the mismatch of `per_token_logps` (the loss forward's) with the rollout log-probs and, with
    `vllm_importance_sampling_correction`, weight `inputs` (this loss call's copy) by the IS ratio."""
    mode = "train" if trainer.model.training else "eval"
    args = trainer.args
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    rollout_logps = inputs["sampling_per_token_logps"]
    # On-policy, the training log-probs of the sampled tokens are this very forward's; off-policy, TRL's old
    # log-probs (recomputed right after generation) are the trainer's view of the sampling policy.
    old = inputs.get("old_per_token_logps")
    train_logps = (per_token_logps if old is None else old).detach()

    stats = mismatch_metrics(train_logps, rollout_logps, mask, threshold=args.mismatch_token_threshold)
    gather = trainer.accelerator.gather
    metrics = trainer._metrics[mode]
    metrics["mismatch/prob_diff_max"].append(gather(stats["prob_diff_max"]).max().item())
    for key in ("prob_diff_mean", "k3_kl", "log_ppl_diff", "frac_tokens_over_threshold", "is_weight_std"):
        metrics[f"mismatch/{key}"].append(gather(stats[key]).mean().item())
    # TRL's names (its vLLM path logs them with the correction on; here they are always logged)
    metrics["sampling/sampling_logp_difference/mean"].append(gather(stats["logp_diff_mean"]).mean().item())
    metrics["sampling/sampling_logp_difference/max"].append(gather(stats["logp_diff_max"]).max().item())

    if not args.vllm_importance_sampling_correction:
        return
    is_mode = args.vllm_importance_sampling_mode
    bounds = {
        "clip_min": args.vllm_importance_sampling_clip_min,
        "clip_max": args.vllm_importance_sampling_clip_max,
    }
    ratio = importance_sampling_ratio(train_logps, rollout_logps, mask, is_mode, **bounds)  # [B, T] or [B, 1]
    weights = ratio.expand_as(train_logps)
    trainer.last_importance_weights = weights
    if trainer.loss_type == "vespo":  # TRL's VESPO folds the ratio into its own sequence weights
        inputs["importance_sampling_ratio"] = ratio
    else:
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        inputs["advantages"] = advantages * weights  # [B, T], see the module docstring

    # TRL's metrics: over the sequences (sequence modes) or the policy tokens (token modes); 0 when empty
    sequence_level = is_mode in SEQUENCE_LEVEL_MODES
    flat = ratio.flatten() if sequence_level else ratio[mask.bool()]
    nonempty = flat.numel() > 0
    zero = ratio.new_zeros(())
    for stat, reduce in (("min", "min"), ("mean", "mean"), ("max", "max")):
        local = getattr(flat, stat)() if nonempty else zero
        metrics[f"sampling/importance_sampling_ratio/{stat}"].append(getattr(gather(local), reduce)().item())
    # beyond TRL: the share of ratios the mode changed (truncated, or masked to 0)
    if is_mode.endswith("truncate"):
        raw = importance_sampling_ratio(train_logps, rollout_logps, mask, is_mode.replace("truncate", "mask"),
                                        clip_min=None, clip_max=None)  # fmt: skip
        raw = raw.flatten() if sequence_level else raw[mask.bool()]
        changed = (raw != flat).float().mean() if nonempty else zero
        metrics["mismatch/frac_is_truncated"].append(gather(changed).mean().item())
    else:
        changed = (flat == 0).float().mean() if nonempty else zero
        metrics["mismatch/frac_is_masked"].append(gather(changed).mean().item())


def log_mismatch_by_routing(trainer, logps, other_logps, inputs) -> None:
    """`routing/k3_kl_{replayed,own}` and `routing/prob_diff_max_{replayed,own}`: the mismatch against the
    rollout with the engine's routing replayed and with the trainer's own, on the same tokens (one of the two
    is the loss forward, the other the extra pass of `routing_mismatch_every`)."""
    replayed = trainer.args.routing_replay is not False
    by_name = {"replayed": logps, "own": other_logps} if replayed else {"replayed": other_logps, "own": logps}
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    gather = trainer.accelerator.gather
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for name, train_logps in by_name.items():
        stats = mismatch_metrics(
            train_logps.detach(), inputs["sampling_per_token_logps"], mask,
            threshold=trainer.args.mismatch_token_threshold,
        )  # fmt: skip
        metrics[f"routing/k3_kl_{name}"].append(gather(stats["k3_kl"]).mean().item())
        metrics[f"routing/prob_diff_max_{name}"].append(gather(stats["prob_diff_max"]).max().item())
