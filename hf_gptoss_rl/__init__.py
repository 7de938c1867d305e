"""hf_gptoss_rl: transformers patches that make GPT-OSS RL training stable, fast and memory-lean.

Importing the package registers, through transformers' own interfaces (:func:`register` does it again,
explicitly; it is idempotent):
- the sink-aware flash attention kernel as ``attn_implementation="hf-gptoss-rl/sink-flash-attn3"``;
- sink-aware Ulysses sequence parallelism as ``attn_implementation="ulysses_sp"``;
- the memory-efficient experts as ``experts_implementation="memory_efficient"``.

Without the import, transformers silently replaces ``"hf-gptoss-rl/sink-flash-attn3"`` on GPT-OSS models with
``kernels-community/vllm-flash-attn3``, a kernel with no sink gradient.
"""

__version__ = "0.1.0"

from . import attention as attention  # registers attn_implementation="hf-gptoss-rl/sink-flash-attn3"
from . import experts as experts  # registers experts_implementation="memory_efficient"
from .sequence_parallel import (  # registers attn_implementation="ulysses_sp" (sink-aware Ulysses SP)
    disable_sequence_parallel,
    enable_sequence_parallel,
    gather_outputs,
    get_sequence_parallel_group,
    sequence_parallel_disabled,
    sequence_parallel_logprobs,
    sequence_parallel_mesh,
    shard_inputs,
)


def register() -> dict[str, tuple[str, ...]]:
    """Register the project's implementations with transformers; idempotent.

    ``import hf_gptoss_rl`` already does this. Call it where the registration should be visible in your code
    (a bare import is easy to lose to an "unused import" clean-up). Nothing is written to disk or ``os.environ``.

    Returns the registered names, e.g. ``{"attn_implementation": ("hf-gptoss-rl/sink-flash-attn3",
    "ulysses_sp"), "experts_implementation": ("memory_efficient",)}``.
    """
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import AttentionMaskInterface

    from . import sequence_parallel

    attention_names = attention.register()
    AttentionInterface.register(sequence_parallel.ULYSSES_ATTENTION, sequence_parallel.ulysses_attention_forward)
    AttentionMaskInterface.register(sequence_parallel.ULYSSES_ATTENTION, sequence_parallel._sharded_padding_mask)
    ALL_EXPERTS_FUNCTIONS.register("memory_efficient", experts.memory_efficient_experts_forward)
    return {
        "attn_implementation": (*attention_names, sequence_parallel.ULYSSES_ATTENTION),
        "experts_implementation": ("memory_efficient",),
    }


__all__ = [
    "attention",
    "disable_sequence_parallel",
    "enable_sequence_parallel",
    "experts",
    "gather_outputs",
    "get_sequence_parallel_group",
    "register",
    "sequence_parallel_disabled",
    "sequence_parallel_logprobs",
    "sequence_parallel_mesh",
    "shard_inputs",
]
