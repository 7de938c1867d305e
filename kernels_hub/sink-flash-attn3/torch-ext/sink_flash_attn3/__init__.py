"""Sink-aware flash attention (GPT-OSS learnable attention sinks) with the sink gradient.

FlashAttention-compatible entry points, as transformers calls them:

- ``flash_attn_func(q, k, v, ..., s_aux=None)`` on ``[batch, seqlen, heads, head_dim]``;
- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ..., s_aux=None)``
  on ``[total_tokens, heads, head_dim]``.

CUDA tensors run the Triton kernels (on sm_90, Gluon kernels for the backward and for the forward of long
full-attention layers); CPU tensors run a plain PyTorch path (or, for float16/float32, the Triton kernels under
``TRITON_INTERPRET=1``). The one switch is the backend: ``backend="auto"`` (default), ``"triton"`` (no Gluon
kernel) or ``"torch"`` per call, defaulting to ``DEFAULT_BACKEND`` (``SINK_FLASH_ATTN3_BACKEND``, read at import).
See ``interface.py`` for the dispatch rules.
"""

# `interface` is bound explicitly: when the kernels loader imports these sources a second time under the same
# module name, the submodule comes from sys.modules and would otherwise not become an attribute of this package.
from . import interface
from .interface import BACKEND_ENV_VAR, DEFAULT_BACKEND, flash_attn_func, flash_attn_varlen_func, resolve_backend

__version__ = "0.1.0"

__all__ = [
    "BACKEND_ENV_VAR",
    "DEFAULT_BACKEND",
    "interface",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "resolve_backend",
]
