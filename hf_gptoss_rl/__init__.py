"""hf_gptoss_rl: transformers patches that make GPT-OSS RL training stable, fast and memory-lean.

Importing the package calls :func:`register` once, which registers, through transformers' own interfaces:
- the sink-aware flash attention kernel as ``attn_implementation="hf-gptoss-rl/sink-flash-attn3"``;
- sink-aware Ulysses sequence parallelism as ``attn_implementation="ulysses_sp"``;
- the memory-efficient experts as ``experts_implementation="memory_efficient"``.

:func:`register` is the only place that touches transformers' registries: importing a submodule
(``hf_gptoss_rl.attention``, ``.experts``, ``.sequence_parallel``, ...) registers nothing by itself, as in
transformers' own ``integrations/`` modules. Without the import, transformers silently replaces
``"hf-gptoss-rl/sink-flash-attn3"`` on GPT-OSS models with ``kernels-community/vllm-flash-attn3``, a kernel with no
sink gradient.

Triton-or-PyTorch choices (``experts``, ``logprobs``, ``rope``) start from ``HF_GPTOSS_RL_<PART>_BACKEND``, read
once at import; :func:`set_backends` / :func:`use_backends` change them in-process.
"""

__version__ = "0.1.0"

import threading

from . import attention as attention
from . import experts as experts
from ._backend import set_backends, use_backends
from .sequence_parallel import (
    disable_sequence_parallel,
    enable_sequence_parallel,
    gather_outputs,
    get_sequence_parallel_group,
    sequence_parallel_disabled,
    sequence_parallel_logprobs,
    sequence_parallel_mesh,
    shard_inputs,
)

_registration_lock = threading.Lock()


def register() -> dict[str, tuple[str, ...]]:
    """Register the project's implementations with transformers; idempotent.

    ``import hf_gptoss_rl`` calls it once. Call it where the registration should be visible in your code (a bare
    import is easy to lose to an "unused import" clean-up). Nothing is built, downloaded or written, to disk or to
    ``os.environ``: the kernel's packaged sources are imported when a model first selects the id.

    - ``"hf-gptoss-rl/sink-flash-attn3"``: listed in ``GptOssPreTrainedModel._compatible_flash_implementations``
      (else transformers swaps it for another flash kernel), registered in ``AttentionInterface`` and
      ``AttentionMaskInterface`` as transformers' hub-kernel loader registers a flash kernel, resolved from the
      packaged sources by a wrapper of ``load_and_register_attn_kernel``, and guarded against silent remaps
      (``hf_gptoss_rl.attention`` explains each);
    - ``"ulysses_sp"``: the sequence-parallel wrapper and its mask function;
    - ``"memory_efficient"`` in ``ALL_EXPERTS_FUNCTIONS``.

    Returns the registered names, e.g. ``{"attn_implementation": ("hf-gptoss-rl/sink-flash-attn3",
    "ulysses_sp"), "experts_implementation": ("memory_efficient",)}``.
    """
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import AttentionMaskInterface

    from . import sequence_parallel

    with _registration_lock:  # the two wrappers below check-then-install; two threads must not both install
        attention._mark_gptoss_compatible()
        attention._register_attention_function(attention.KERNEL_REPO_ID)
        attention._install_kernel_loader()
        attention._install_remap_guard()
        AttentionInterface.register(sequence_parallel.ULYSSES_ATTENTION, sequence_parallel.ulysses_attention_forward)
        AttentionMaskInterface.register(sequence_parallel.ULYSSES_ATTENTION, sequence_parallel._sharded_padding_mask)
        ALL_EXPERTS_FUNCTIONS.register("memory_efficient", experts.memory_efficient_experts_forward)
    return {
        "attn_implementation": (attention.KERNEL_REPO_ID, sequence_parallel.ULYSSES_ATTENTION),
        "experts_implementation": ("memory_efficient",),
    }


register()

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
    "set_backends",
    "shard_inputs",
    "use_backends",
]
