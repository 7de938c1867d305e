"""Rollout/training mismatch: metrics and importance-sampling (IS) correction, with TRL's modes and semantics.

The rollout engine (SGLang, or the embedded inference copy) and the trainer compute the same policy with different
kernels, batch shapes and — for a MoE like GPT-OSS — possibly different expert routing. The tokens were sampled from
the engine's distribution `p_rollout`, but the gradient is taken through the trainer's `p_train`. With the per-token
log-ratio `d = logp_train - logp_rollout` on the policy tokens, the IS ratio follows TRL 1.16's
`vllm_importance_sampling_mode` (`GRPOTrainer._generate_and_score_completions`), with bounds `[C_min, C_max]`
(`vllm_importance_sampling_clip_min` / `_clip_max`, `None` = unbounded on that side):

- `token_truncate`: `clamp(exp(d), C_min, C_max)` per token (truncated IS, TIS);
- `token_mask`: `exp(d)` per token, 0 where it is outside `[C_min, C_max]` (masked IS, MIS);
- `sequence_truncate`: one ratio per sequence, the *product* of its token ratios `exp(sum d)`, clamped;
- `sequence_mask`: the same product, 0 (the whole sequence dropped) where outside `[C_min, C_max]`.

Beyond TRL, `sequence_geometric_mask` uses the *geometric mean* of the token ratios `exp(mean d)`: 1 inside
`[C_min, C_max]`, 0 outside. Unlike the product it does not drift with the sequence length, which matters for long
multi-turn trajectories.

All functions take `[B, T]` tensors aligned on completion tokens and a `[B, T]` mask that is 1 exactly on the tokens
the policy sampled (tool output and padding are 0). Rollout log-probs that the engine could not provide are NaN and
count as "no evidence": a zero log-ratio (ratio 1, as in TRL), and they are left out of the metrics.

To measure an engine against a policy outside the trainer, `rollout_scoring_batch` lays out an engine's
`GenerationOutput`s as such tensors and `completion_logprobs` scores the same tokens with the policy, the trainer's
way (`hf_gptoss_rl.logprobs.causal_lm_token_logprobs`: one forward of the right-padded batch); `rollout_routing_plan`
lays out the engine's MoE routing records for that forward, to replay them (`hf_gptoss_rl.routing.RoutingReplay`).
`exact_completion_logprobs` scores them exactly (float32, eager attention, no TF32): the reference both the engine's
and the trainer's log-probs can be measured against. `sink_control` checks, before training, that an engine honours
GPT-OSS's attention sinks and the weight sync at all.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "SEQUENCE_LEVEL_MODES",
    "TRL_IMPORTANCE_SAMPLING_MODES",
    "completion_logprobs",
    "exact_completion_logprobs",
    "importance_sampling_ratio",
    "mismatch_metrics",
    "rollout_routing_plan",
    "rollout_scoring_batch",
    "sink_control",
]

TRL_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IMPORTANCE_SAMPLING_MODES = (*TRL_IMPORTANCE_SAMPLING_MODES, "sequence_geometric_mask")
SEQUENCE_LEVEL_MODES = ("sequence_truncate", "sequence_mask", "sequence_geometric_mask")


def _valid_mask(rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return mask.bool() & ~torch.isnan(rollout_logps)


@torch.no_grad()
def importance_sampling_ratio(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """The IS ratio of `mode` (detached, float32): `[B, T]` for token modes, `[B, 1]` for sequence modes.

    Token modes give ratio 1 outside `mask` (those positions carry no loss). This is the tensor TRL's
    `GRPOTrainer` multiplies the per-token loss by (`importance_sampling_ratio`), for the same inputs.
    """
    if train_logps.shape != rollout_logps.shape or train_logps.shape != mask.shape:
        raise ValueError(
            f"shapes differ: train {tuple(train_logps.shape)}, rollout {tuple(rollout_logps.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; expected one of {IMPORTANCE_SAMPLING_MODES}")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"{mode} needs clip_min or clip_max")
    valid = _valid_mask(rollout_logps, mask)
    zero = torch.zeros_like(train_logps, dtype=torch.float32)
    d = torch.where(valid, train_logps.float() - rollout_logps.float(), zero)
    if mode == "sequence_geometric_mask":
        n = valid.sum(-1, keepdim=True).clamp(min=1)
        ratio = torch.exp(d.sum(-1, keepdim=True) / n)
    elif mode in SEQUENCE_LEVEL_MODES:
        ratio = torch.exp(d.sum(-1, keepdim=True))
    else:
        ratio = torch.exp(d)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    if mode == "sequence_geometric_mask":
        return (~outside).float()
    return ratio.masked_fill(outside, 0.0)


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
    - `logp_diff_mean` / `logp_diff_max`: mean / max of `|logp_train - logp_rollout|` per token (TRL's
      `sampling/sampling_logp_difference/*`);
    - `k3_kl`: `E[w - 1 - log w]` with `w = p_train / p_rollout`, an unbiased, non-negative estimate of
      KL(rollout ‖ train) from samples of the rollout policy;
    - `log_ppl_diff`: mean over sequences of `log PPL_train - log PPL_rollout` (per-sequence mean negative log-prob);
    - `frac_tokens_over_threshold`: share of tokens with `|p_rollout - p_train| > threshold`;
    - `is_weight_std`: standard deviation of the token-level importance weights `w = p_train / p_rollout` (0 when
      the trainer reproduces the sampler; the spread an importance-sampling correction has to absorb);
    - `num_tokens`: how many tokens entered the statistics.
    """
    valid = _valid_mask(rollout_logps, mask)
    lt = train_logps.detach().float()
    lr = torch.nan_to_num(rollout_logps.float(), nan=0.0)
    zero = lt.new_zeros(())
    n = valid.sum()
    if n == 0:
        return {
            key: zero
            for key in (
                "prob_diff_mean",
                "prob_diff_max",
                "logp_diff_mean",
                "logp_diff_max",
                "k3_kl",
                "log_ppl_diff",
                "frac_tokens_over_threshold",
                "is_weight_std",
                "num_tokens",
            )
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
        "logp_diff_mean": log_w.abs().mean(),
        "logp_diff_max": log_w.abs().max(),
        "k3_kl": k3.mean(),
        "log_ppl_diff": log_ppl_diff,
        "frac_tokens_over_threshold": (prob_diff > threshold).float().mean(),
        "is_weight_std": log_w.exp().std(correction=0),
        "num_tokens": n.float(),
    }


def rollout_scoring_batch(prompts: list[list[int]], outputs: list, pad_id: int, device=None):
    """`(input_ids, attention_mask, rollout_logps, completion_mask)` of the prompts and an engine's `GenerationOutput`s
    for them: right-padded `[B, S]` `prompt + completion` ids and their mask (on `device`), and the engine's log-probs
    `[B, T]` with the mask of the completion tokens (T = the longest completion; on the CPU)."""
    seqs = [list(p) + list(o.output_ids) for p, o in zip(prompts, outputs, strict=True)]
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(ids)
    t_max = max(len(o.output_ids) for o in outputs)
    rollout_logps = torch.zeros(len(seqs), t_max, dtype=torch.float32)
    completion_mask = torch.zeros(len(seqs), t_max, dtype=torch.long)
    for b, (seq, o) in enumerate(zip(seqs, outputs)):
        ids[b, : len(seq)] = torch.tensor(seq)
        attention_mask[b, : len(seq)] = 1
        rollout_logps[b, : len(o.logprobs)] = torch.tensor(o.logprobs, dtype=torch.float32)
        completion_mask[b, : len(o.output_ids)] = 1
    return ids.to(device), attention_mask.to(device), rollout_logps, completion_mask


def rollout_routing_plan(outputs: list, width: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """The engine's routing records (`GenerationOutput.routed_experts`, one row per token it read) in the layout of
    `rollout_scoring_batch`'s `input_ids` (`width`: their `shape[1]`): `[B, width, layers, top_k]`, each row from
    position 0, `no_route` where there is no record. `shape` is `hf_gptoss_rl.routing.routing_shape(policy)`; hand the
    plan to `RoutingReplay.set_plan` before `completion_logprobs` scores the batch."""
    from hf_gptoss_rl.routing import no_route, routing_dtype

    layers, top_k, experts = shape
    dtype = routing_dtype(experts)
    plan = torch.full((len(outputs), width, layers, top_k), no_route(dtype), dtype=dtype)
    for b, out in enumerate(outputs):
        if out.routed_experts is None:
            raise ValueError(f"output {b} has no routing record: the engine must record routing (record_routing)")
        plan[b, : out.routed_experts.shape[0]] = out.routed_experts.to(dtype)
    return plan


@torch.no_grad()
def completion_logprobs(model, input_ids, attention_mask, prompt_lens: list[int], width: int, temperature: float = 1.0):
    """The policy's log-probs of every completion token of `rollout_scoring_batch`'s right-padded rows, `[B, width]`
    float32 on the CPU, aligned with the engine's (`prompt_lens`: each row's prompt length; 0 past a completion)."""
    from hf_gptoss_rl.logprobs import causal_lm_token_logprobs

    logps, _ = causal_lm_token_logprobs(
        model, input_ids, attention_mask, logits_to_keep=input_ids.shape[1] - 1, temperature=temperature
    )  # position j scores token j + 1
    logps = logps.float().cpu()
    out = torch.zeros(input_ids.shape[0], width, dtype=torch.float32)
    for b, (p, length) in enumerate(zip(prompt_lens, attention_mask.sum(-1).tolist())):
        n = min(width, length - p)
        out[b, :n] = logps[b, p - 1 : p - 1 + n]
    return out


def sink_control(
    engine,
    model,
    prompts: list[list[int]],
    *,
    sink_shift: float = 6.0,
    margin: float = 3.0,
    max_new_tokens: int = 32,
    version: int = 0,
    push=None,
) -> dict:
    """Does ``engine`` honour the attention sinks and the weight sync? A check to run against a rollout engine before
    training on it.

    ``model``'s weights with every sink logit (the parameters named ``*sinks``) shifted by ``sink_shift`` are pushed
    to the engine, which samples up to ``max_new_tokens`` tokens per prompt at temperature 1; ``model``'s own weights
    are pushed back once it has. The shifted policy then scores the sampled tokens in float32 with eager attention,
    with its sinks and without them (`hf_gptoss_rl.attention_variants.register_sink_dropping_attention`). An engine
    that serves the pushed weights with their sinks sits ``margin`` times closer (mean |Δ log p| over the sampled
    tokens) to the policy with sinks than without; one that drops the sinks, or still serves the weights it held (the
    shift moves the log-probs far more than the engine's numerics do), does not.

    Args:
        engine: a `trl_ext.rollout.RolloutEngine` serving ``model`` (e.g. ``EmbeddedEngine.from_policy(model)``, or an
            `SGLangEngine` whose weight sync is configured).
        model: the policy, a GPT-OSS; it is not modified (a float32 copy gets the shifted sinks).
        prompts: prompt token ids, one list per prompt.
        version: the weight version both pushes carry.
        push: ``push(model)`` sends a model's weights to ``engine``; by default
            ``trl_ext.weight_sync.push_policy_weights(engine, model, version=version)``, checked as the engine's weight
            sync is configured (a server that keeps its weights fails the push back).

    Returns ``{"sink_shift", "margin", "prompts", "tokens", "mean_abs_logp_diff_with_sinks",
    "mean_abs_logp_diff_without_sinks", "passed"}``. Raises `RuntimeError` when the engine samples no token at all.
    """
    import copy

    from hf_gptoss_rl.attention_variants import register_sink_dropping_attention
    from trl_ext.rollout import SamplingParams, run_sync
    from trl_ext.weight_sync import push_policy_weights
    from trl_ext.weight_sync.verify import reference_logprobs

    if push is None:
        push = lambda m: push_policy_weights(engine, m, version=version)  # noqa: E731
    control = copy.deepcopy(model).float()
    sinks = [param for name, param in control.named_parameters() if name.endswith("sinks")]
    if not sinks:
        raise ValueError(f"sink_control: {type(model).__name__} has no parameter named '*sinks'")
    with torch.no_grad():
        for param in sinks:
            param.add_(sink_shift)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    push(control)
    try:
        outputs = run_sync(engine.generate_batch(prompts, sampling))
    finally:  # the engine serves the policy again, whatever happened
        push(model)
    if not any(o.output_ids for o in outputs):
        raise RuntimeError("sink control: the engine returned no tokens for any prompt")
    distances = {}
    for label, attention in (("with_sinks", "eager"), ("without_sinks", register_sink_dropping_attention())):
        control.set_attn_implementation(attention)
        diffs = [  # the policy's log-probs of the sampled tokens against the engine's
            torch.tensor(reference_logprobs(control, ids + list(out.output_ids))[len(ids) - 1 :])
            - torch.tensor(out.logprobs)
            for ids, out in zip(prompts, outputs)
            if out.output_ids
        ]
        distances[label] = torch.cat(diffs).abs().mean().item()
    return {
        "sink_shift": sink_shift,
        "margin": margin,
        "prompts": len(prompts),
        "tokens": sum(len(o.output_ids) for o in outputs),
        "mean_abs_logp_diff_with_sinks": distances["with_sinks"],
        "mean_abs_logp_diff_without_sinks": distances["without_sinks"],
        "passed": distances["without_sinks"] > margin * distances["with_sinks"],
    }


@torch.no_grad()
def exact_completion_logprobs(
    model, input_ids, attention_mask, prompt_lens: list[int], width: int, temperature: float = 1.0
) -> torch.Tensor:
    """`completion_logprobs` of the policy computed exactly: in float32, with eager attention (exact sinks) and TF32
    off (a 10-bit mantissa in every float32 product). `model` is upcast and switched in place and stays so: no second
    copy, so a 20b policy needs about twice its bf16 weights, not three times."""
    model.float()
    model.set_attn_implementation("eager")
    precision = torch.get_float32_matmul_precision()
    tf32_cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        return completion_logprobs(model, input_ids, attention_mask, prompt_lens, width, temperature)
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = tf32_cudnn
