"""Rollout/training mismatch: metrics and importance-sampling corrections (TIS / MIS).

The rollout engine (SGLang, or the embedded inference copy) and the trainer compute the same policy with different
kernels, batch shapes and — for a MoE like GPT-OSS — possibly different expert routing. The tokens were sampled from
the engine's distribution `p_rollout`, but the gradient is taken through the trainer's `p_train`. With
`w = p_train / p_rollout = exp(logp_train - logp_rollout)` per token:

- truncated importance sampling (TIS, token level): weight `min(w, C)`;
- masked importance sampling (MIS): weight 1 inside `[low, high]`, 0 outside, per token or per sequence (the sequence
  ratio is the geometric mean of its token ratios, so it does not explode with length).

All functions take `[B, T]` tensors aligned on completion tokens and a `[B, T]` mask that is 1 exactly on the tokens
the policy sampled (tool output and padding are 0). Rollout log-probs that the engine could not provide are NaN and
are treated as "no evidence": weight 1, left out of the metrics.
"""

from __future__ import annotations

import torch

__all__ = ["importance_weights", "mismatch_metrics"]


def _valid_mask(rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return mask.bool() & ~torch.isnan(rollout_logps)


@torch.no_grad()
def importance_weights(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    tis_cap: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
) -> torch.Tensor:
    """Per-token correction weights `[B, T]` (detached) for `mode` in `token_tis | token_mask | sequence_mask`.

    Positions outside `mask` get weight 1 (they carry no loss anyway).
    """
    if train_logps.shape != rollout_logps.shape or train_logps.shape != mask.shape:
        raise ValueError(
            f"shapes differ: train {tuple(train_logps.shape)}, rollout {tuple(rollout_logps.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    valid = _valid_mask(rollout_logps, mask)
    log_w = torch.where(valid, train_logps.float() - rollout_logps.float(), torch.zeros_like(train_logps.float()))
    if mode == "token_tis":
        weights = torch.exp(log_w).clamp(max=tis_cap)
    elif mode == "token_mask":
        w = torch.exp(log_w)
        weights = ((w >= mask_low) & (w <= mask_high)).float()
    elif mode == "sequence_mask":
        n = valid.sum(-1, keepdim=True).clamp(min=1)
        seq_w = torch.exp(log_w.sum(-1, keepdim=True) / n)  # geometric mean of the token ratios
        weights = ((seq_w >= mask_low) & (seq_w <= mask_high)).float().expand_as(log_w)
    else:
        raise ValueError(f"unknown mismatch correction mode {mode!r} (token_tis | token_mask | sequence_mask)")
    return torch.where(mask.bool(), weights, torch.ones_like(weights))


@torch.no_grad()
def mismatch_metrics(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float = 0.1,
) -> dict[str, torch.Tensor]:
    """Scalar tensors describing how far the trainer's distribution is from the sampler's on the sampled tokens.

    - `prob_diff_mean` / `prob_diff_max`: mean / max of `|p_rollout - p_train|` per token;
    - `k3_kl`: `E[w - 1 - log w]` with `w = p_train / p_rollout`, an unbiased, non-negative estimate of
      KL(rollout ‖ train) from samples of the rollout policy;
    - `log_ppl_diff`: mean over sequences of `log PPL_train - log PPL_rollout` (per-sequence mean negative log-prob);
    - `frac_tokens_over_threshold`: share of tokens with `|p_rollout - p_train| > threshold`;
    - `num_tokens`: how many tokens entered the statistics.
    """
    valid = _valid_mask(rollout_logps, mask)
    lt = train_logps.detach().float()
    lr = torch.nan_to_num(rollout_logps.float(), nan=0.0)
    zero = lt.new_zeros(())
    n = valid.sum()
    if n == 0:
        return {
            "prob_diff_mean": zero,
            "prob_diff_max": zero,
            "k3_kl": zero,
            "log_ppl_diff": zero,
            "frac_tokens_over_threshold": zero,
            "num_tokens": zero,
        }
    prob_diff = (lt.exp() - lr.exp()).abs()[valid]
    log_w = (lt - lr)[valid]
    k3 = torch.expm1(log_w) - log_w
    seq_n = valid.sum(-1)
    has_tokens = seq_n > 0
    seq_log_w = torch.where(valid, lt - lr, torch.zeros_like(lt)).sum(-1)
    # log PPL = -mean log p, so log PPL_train - log PPL_rollout = -mean(log p_train - log p_rollout)
    log_ppl_diff = (-seq_log_w[has_tokens] / seq_n[has_tokens]).mean()
    return {
        "prob_diff_mean": prob_diff.mean(),
        "prob_diff_max": prob_diff.max(),
        "k3_kl": k3.mean(),
        "log_ppl_diff": log_ppl_diff,
        "frac_tokens_over_threshold": (prob_diff > threshold).float().mean(),
        "num_tokens": n.float(),
    }
