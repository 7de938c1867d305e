"""hf_gptoss_rl.packing: which attention implementations may run packed rows."""

from __future__ import annotations

import hf_gptoss_rl  # noqa: F401  (registers the kernel id)
from hf_gptoss_rl.packing import attention_honours_packing


def test_flash_path_and_masked_implementations_honour_packing():
    for name in ("hf-gptoss-rl/sink-flash-attn3", "flash_attention_2", "eager", "flex_attention"):
        assert attention_honours_packing(name), name


def test_a_custom_function_with_the_flash_mask_does_not_count():
    """It may read the attention mask instead of position_ids and attend across the packed trajectories."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    def custom_attention(module, query, key, value, attention_mask, **kwargs):  # pragma: no cover - never run
        raise AssertionError

    AttentionInterface.register("test_custom_span_attention", custom_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(
        "test_custom_span_attention", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    )
    assert not attention_honours_packing("test_custom_span_attention")
    assert not attention_honours_packing("no_such_attention")
    assert not attention_honours_packing(None)


def test_packed_masks_raise_no_deprecation_warning():
    """The packed forward's masks (eager/flex path) are built through transformers' mask functions with their current
    argument names: a deprecated keyword would warn on every training step (`FutureWarning`, here made an error). The
    masks keep the packed sequences apart, causal within each, sliding-window on sliding layers."""
    import warnings

    import torch

    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from hf_gptoss_rl.packing import packed_attention_masks

    config = tiny_gptoss_config(vocab_size=64, sliding_window=2)
    config._attn_implementation = "eager"
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])  # two packed sequences: 4 and 3 tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        masks = packed_attention_masks(config, positions, torch.float32)
    sequence = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    same_causal = (sequence[:, None] == sequence[None, :]) & (j <= i)
    expected = {"full_attention": same_causal, "sliding_attention": same_causal & (i - j < 2)}
    for layer_type, allowed in expected.items():
        mask = masks[layer_type]  # eager: additive float mask [1, 1, S, S], 0 where attended
        assert torch.equal(mask[0, 0] == 0, allowed), layer_type
