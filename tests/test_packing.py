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
