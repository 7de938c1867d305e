"""trl_ext.mismatch: metrics and importance-sampling ratios against hand computations and TRL's formulas; an engine's
rollouts scored by the policy in their layout; the sink control against engines that honour or ignore the sinks and
the sync."""

import math

import pytest
import torch

from trl_ext.mismatch import (
    IMPORTANCE_SAMPLING_MODES,
    completion_logprobs,
    exact_completion_logprobs,
    importance_sampling_ratio,
    mismatch_metrics,
    rollout_scoring_batch,
    sink_control,
)


def _case():
    train = torch.tensor([[-0.1, -2.0, -0.7, -5.0], [-1.0, -0.2, -3.0, -0.5]])
    rollout = torch.tensor([[-0.3, -1.0, -0.7, 0.0], [-1.5, -0.2, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])  # last column: tool tokens / padding
    return train, rollout, mask


def test_metrics_match_hand_computation():
    train, rollout, mask = _case()
    m = mismatch_metrics(train, rollout, mask, threshold=0.1)
    pairs = [(-0.1, -0.3), (-2.0, -1.0), (-0.7, -0.7), (-1.0, -1.5), (-0.2, -0.2)]  # NaN rollout token excluded
    diffs = [abs(math.exp(t) - math.exp(r)) for t, r in pairs]
    k3 = [math.expm1(t - r) - (t - r) for t, r in pairs]
    seq = [[(-0.1, -0.3), (-2.0, -1.0), (-0.7, -0.7)], [(-1.0, -1.5), (-0.2, -0.2)]]
    log_ppl = [-sum(t - r for t, r in s) / len(s) for s in seq]
    assert m["prob_diff_mean"].item() == pytest.approx(sum(diffs) / 5, rel=1e-6)
    assert m["prob_diff_max"].item() == pytest.approx(max(diffs), rel=1e-6)
    assert m["logp_diff_mean"].item() == pytest.approx(sum(abs(t - r) for t, r in pairs) / 5, rel=1e-6)
    assert m["logp_diff_max"].item() == pytest.approx(1.0, rel=1e-6)
    assert m["k3_kl"].item() == pytest.approx(sum(k3) / 5, rel=1e-6)
    assert m["log_ppl_diff"].item() == pytest.approx(sum(log_ppl) / 2, rel=1e-6)
    assert m["frac_tokens_over_threshold"].item() == pytest.approx(sum(d > 0.1 for d in diffs) / 5)
    weights = [math.exp(t - r) for t, r in pairs]
    mean_w = sum(weights) / 5
    assert m["is_weight_std"].item() == pytest.approx(math.sqrt(sum((w - mean_w) ** 2 for w in weights) / 5), rel=1e-6)
    assert m["num_tokens"].item() == 5


def test_identical_distributions_give_zero():
    train = torch.randn(3, 7).clamp(max=0)
    m = mismatch_metrics(train, train.clone(), torch.ones(3, 7))
    for key in ("prob_diff_mean", "prob_diff_max", "logp_diff_mean", "k3_kl", "log_ppl_diff", "is_weight_std"):
        assert m[key].item() == 0.0


def test_empty_mask_is_zero_not_nan():
    m = mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in m.values())


def test_token_modes_by_hand():
    train, rollout, mask = _case()
    # token ratios: e^0.2, e^-1, 1 | e^0.5, 1, NaN -> 1; outside the mask -> 1
    w = importance_sampling_ratio(train, rollout, mask, "token_truncate", clip_max=1.5)
    expected = torch.tensor([[math.exp(0.2), math.exp(-1.0), 1.0, 1.0], [1.5, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(w, expected)
    w = importance_sampling_ratio(train, rollout, mask, "token_truncate", clip_min=0.5, clip_max=None)
    torch.testing.assert_close(w[0, 1], torch.tensor(0.5))
    w = importance_sampling_ratio(train, rollout, mask, "token_mask", clip_min=0.5, clip_max=1.5)
    # TRL's token_mask keeps the ratio itself inside the bounds (it is not a 0/1 mask)
    expected = torch.tensor([[math.exp(0.2), 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(w, expected)


def test_sequence_modes_by_hand():
    train, rollout, mask = _case()
    # products: exp(0.2 - 1.0 + 0) = 0.449; exp(0.5 + 0 + 0) = 1.649
    w = importance_sampling_ratio(train, rollout, mask, "sequence_truncate", clip_max=1.2)
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.8)], [1.2]]))
    w = importance_sampling_ratio(train, rollout, mask, "sequence_mask", clip_min=0.4, clip_max=1.5)
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.8)], [0.0]]))
    # the geometric means exp(-0.8 / 3) = 0.766 and exp(0.5 / 2) = 1.284 (the NaN token does not count)
    w = importance_sampling_ratio(train, rollout, mask, "sequence_geometric_mask", clip_min=0.7, clip_max=1.5)
    torch.testing.assert_close(w, torch.ones(2, 1))
    w = importance_sampling_ratio(train, rollout, mask, "sequence_geometric_mask", clip_min=0.8, clip_max=1.2)
    torch.testing.assert_close(w, torch.zeros(2, 1))


def _trl_reference(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's ratio, transcribed from `GRPOTrainer._generate_and_score_completions` (use_vllm branch)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_trl_modes_equal_trl(mode, bounds):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 9, generator=gen) * 3
    sampling = old + 0.4 * torch.randn(4, 9, generator=gen)
    sampling[1, 2] = float("nan")
    mask = (torch.rand(4, 9, generator=gen) > 0.3).long()
    clip_min, clip_max = bounds
    ours = importance_sampling_ratio(old, sampling, mask, mode, clip_min=clip_min, clip_max=clip_max)
    torch.testing.assert_close(ours, _trl_reference(old, sampling, mask, mode, clip_min, clip_max))


def test_bad_mode_bounds_and_shapes_raise():
    t = torch.zeros(2, 3)
    assert "sequence_geometric_mask" in IMPORTANCE_SAMPLING_MODES
    with pytest.raises(ValueError, match="unknown importance sampling mode 'token_tis'"):
        importance_sampling_ratio(t, t, t, "token_tis")
    with pytest.raises(ValueError, match="needs clip_min or clip_max"):
        importance_sampling_ratio(t, t, t, "token_truncate", clip_max=None)
    with pytest.raises(ValueError, match="shapes differ"):
        importance_sampling_ratio(t, torch.zeros(2, 4), t, "token_truncate")


def test_rollouts_of_unequal_length_are_scored_as_each_alone():
    """`rollout_scoring_batch` right-pads prompt + completion rows of unequal length; `completion_logprobs` scores them
    in one forward and puts each completion token's log-prob where the engine's is: the values one row alone gets."""
    from hf_gptoss_rl.logprobs import causal_lm_token_logprobs
    from hf_gptoss_rl.model_builders import build_random_gptoss, tiny_gptoss_config
    from trl_ext.rollout import GenerationOutput

    model = build_random_gptoss(tiny_gptoss_config(vocab_size=128), device="cpu", dtype=torch.float32)
    model.set_attn_implementation("eager")
    prompts = [[1, 2, 3], [4, 5]]
    outputs = [GenerationOutput([9, 10, 11, 12], [-1.0, -2.0, -3.0, -4.0], "length"),
               GenerationOutput([13, 14], [-0.5, -0.25], "stop")]  # fmt: skip
    ids, mask, rollout, completion_mask = rollout_scoring_batch(prompts, outputs, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 9, 10, 11, 12], [4, 5, 13, 14, 0, 0, 0]]
    assert mask.tolist() == [[1] * 7, [1] * 4 + [0] * 3]
    assert rollout.tolist() == [[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, 0.0, 0.0]]
    assert completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    logps = completion_logprobs(model, ids, mask, [len(p) for p in prompts], width=4, temperature=0.7)
    for row, prompt, out in zip(logps, prompts, outputs):
        n = len(out.output_ids)
        alone, _ = causal_lm_token_logprobs(
            model, torch.tensor([prompt + out.output_ids]), logits_to_keep=n, temperature=0.7
        )
        torch.testing.assert_close(row[:n], alone[0], rtol=1e-5, atol=1e-5)
        assert (row[n:] == 0).all()


def test_sink_control_passes_an_engine_with_sinks_and_fails_one_without_them_or_without_the_sync():
    """An embedded engine serving eager attention with sinks passes; one serving sink-dropping attention fails, and
    so does one that is never sent the shifted weights. Afterwards the engine serves the policy's own weights again
    and the policy is unchanged."""
    from hf_gptoss_rl.attention_variants import register_sink_dropping_attention
    from hf_gptoss_rl.model_builders import build_random_gptoss, tiny_gptoss_config
    from trl_ext.rollout import EmbeddedEngine

    model = build_random_gptoss(tiny_gptoss_config(vocab_size=128), device="cpu", dtype=torch.float32)
    model.set_attn_implementation("eager")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (8,), generator=generator).tolist() for _ in range(4)]

    def check(attention, **kwargs):
        engine = EmbeddedEngine.from_policy(model, attn_implementation=attention, seed=0)
        try:
            result = sink_control(engine, model, prompts, max_new_tokens=16, **kwargs)
            for name, tensor in engine.model.state_dict().items():  # the shifted sinks were taken back
                torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
        finally:
            engine.shutdown()
        return result

    honest = check("eager")
    assert honest["passed"] and honest["tokens"] == 64 and honest["prompts"] == 4
    assert honest["mean_abs_logp_diff_with_sinks"] < 1e-4 < honest["mean_abs_logp_diff_without_sinks"]
    assert (honest["sink_shift"], honest["margin"]) == (6.0, 3.0)
    dropping = check(register_sink_dropping_attention())
    assert not dropping["passed"] and dropping["mean_abs_logp_diff_without_sinks"] < 1e-4
    unsynced = check("eager", push=lambda m: None)  # the engine keeps serving the unshifted sinks
    assert not unsynced["passed"]
    assert unsynced["mean_abs_logp_diff_with_sinks"] > unsynced["mean_abs_logp_diff_without_sinks"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match="no parameter named"):
        sink_control(None, torch.nn.Linear(2, 2), prompts)


def test_exact_completion_logprobs_scores_in_float32_eager_without_tf32():
    """`exact_completion_logprobs` scores a bf16 policy on another attention as `completion_logprobs` scores its fp32
    eager copy, with the float32 matmul precision at "highest" (no TF32) during the forward and put back after; the
    policy stays in float32 with eager attention."""
    import copy

    from hf_gptoss_rl.attention_variants import register_sink_dropping_attention
    from hf_gptoss_rl.model_builders import build_random_gptoss, tiny_gptoss_config
    from trl_ext.rollout import GenerationOutput

    model = build_random_gptoss(tiny_gptoss_config(vocab_size=128), device="cpu", dtype=torch.bfloat16)
    model.set_attn_implementation(register_sink_dropping_attention())
    exact_copy = copy.deepcopy(model).float()
    exact_copy.set_attn_implementation("eager")
    prompts = [[1, 2, 3], [4, 5]]
    outputs = [GenerationOutput([9, 10, 11], [-1.0] * 3, "length"), GenerationOutput([13], [-0.5], "stop")]
    ids, mask, _, _ = rollout_scoring_batch(prompts, outputs, pad_id=0)
    seen = []
    model.base_model.register_forward_pre_hook(  # the backbone: the scoring never calls the full head
        lambda *_: seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
    )
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        exact = exact_completion_logprobs(model, ids, mask, [3, 2], width=3, temperature=0.7)
        assert torch.get_float32_matmul_precision() == "high"  # put back
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen == [("highest", False)]
    assert next(model.parameters()).dtype == torch.float32 and model.config._attn_implementation == "eager"
    assert torch.equal(exact, completion_logprobs(exact_copy, ids, mask, [3, 2], width=3, temperature=0.7))
