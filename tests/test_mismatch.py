"""trl_ext.mismatch: metrics and TIS/MIS weights against hand computations."""

import math

import pytest
import torch

from trl_ext.mismatch import importance_weights, mismatch_metrics


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
    assert m["k3_kl"].item() == pytest.approx(sum(k3) / 5, rel=1e-6)
    assert m["log_ppl_diff"].item() == pytest.approx(sum(log_ppl) / 2, rel=1e-6)
    assert m["frac_tokens_over_threshold"].item() == pytest.approx(sum(d > 0.1 for d in diffs) / 5)
    assert m["num_tokens"].item() == 5


def test_identical_distributions_give_zero():
    train = torch.randn(3, 7).clamp(max=0)
    m = mismatch_metrics(train, train.clone(), torch.ones(3, 7))
    for key in ("prob_diff_mean", "prob_diff_max", "k3_kl", "log_ppl_diff", "frac_tokens_over_threshold"):
        assert m[key].item() == 0.0


def test_empty_mask_is_zero_not_nan():
    m = mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in m.values())


def test_token_tis_weights():
    train, rollout, mask = _case()
    w = importance_weights(train, rollout, mask, "token_tis", tis_cap=2.0)
    expected = torch.tensor(
        [[math.exp(0.2), math.exp(-1.0), 1.0, 1.0], [min(math.exp(0.5), 2.0), 1.0, 1.0, 1.0]]
    )
    torch.testing.assert_close(w, expected)


def test_token_and_sequence_mask_weights():
    train, rollout, mask = _case()
    w = importance_weights(train, rollout, mask, "token_mask", mask_low=0.5, mask_high=1.5)
    # ratios: e^0.2=1.22 keep, e^-1=0.37 drop, 1 keep | e^0.5=1.65 drop, 1 keep, NaN -> keep
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]]))
    w = importance_weights(train, rollout, mask, "sequence_mask", mask_low=0.7, mask_high=1.5)
    # geometric means: exp((0.2 - 1.0 + 0) / 3) = 0.766 keep; exp((0.5 + 0) / 2) = 1.28 keep
    torch.testing.assert_close(w, torch.ones(2, 4))
    w = importance_weights(train, rollout, mask, "sequence_mask", mask_low=0.8, mask_high=1.2)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]))


def test_bad_mode_and_shapes_raise():
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown mismatch correction"):
        importance_weights(t, t, t, "tis")
    with pytest.raises(ValueError, match="shapes differ"):
        importance_weights(t, torch.zeros(2, 4), t, "token_tis")
