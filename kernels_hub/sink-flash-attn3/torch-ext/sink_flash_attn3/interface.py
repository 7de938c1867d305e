"""Public API: FlashAttention-compatible functions with learnable attention sinks (``s_aux``) and their gradient.

Design: the FlashAttention signatures users know and argument checks up front.  In eager mode the entry points call
the backend through one ``torch.autograd.Function`` (the cheapest host path: no dispatcher round trip per call);
under ``torch.compile`` they call one differentiable torch custom op instead (forward op + backward op, both with
fake implementations, joined by ``register_autograd``), so ``torch.compile(fullgraph=True)`` traces forward and
backward with no graph break (dynamo cannot trace ``Function.apply`` when one tensor feeds two inputs, and
transformers passes the same ``cu_seqlens`` tensor for queries and keys).  Both run the same backend functions.
The op namespace is derived from the name this package was imported under, so two loaded copies (e.g. the Hub
kernel loaded by ``kernels`` under its hashed module name, and the copy shipped inside ``hf_gptoss_rl``) never
clash.

Backend dispatch: a function of the call's tensors (device, dtype, shapes) and of one backend choice, the ``backend=``
argument of each call, whose default is ``DEFAULT_BACKEND``: the ``SINK_FLASH_ATTN3_BACKEND`` environment variable,
read once when this module is imported (as Dao-AILab/flash-attention's ``flash_attn/flash_attn_interface.py`` reads
``FLASH_ATTENTION_TRITON_AMD_ENABLE`` into ``USE_TRITON_ROCM``), else ``"auto"``.  Nothing else is read per call.

- ``"auto"``, CUDA tensors -> the Triton kernels (``triton_kernels.py``), and on sm_90 with 16-bit inputs at
  head_dim 64 the Gluon kernels of ``gluon_kernels.py`` for the shapes where they were measured faster (the backward;
  the forward of full-attention layers from ``triton_kernels.GLUON_FWD_MIN_SEQLEN`` queries; with
  ``deterministic=False``, the default, the one-kernel backward of full-attention layers from
  ``triton_kernels.FUSED_MIN_SEQLEN`` keys, whose dQ and dsink are summed with atomics);
- ``"auto"``, CPU tensors -> plain PyTorch (``reference.py``); when ``TRITON_INTERPRET=1`` was set at import,
  float16/float32 CPU tensors run the Triton kernels in Triton's interpreter (how CI exercises the real kernel code),
  bf16 ones stay on PyTorch (the interpreter multiplies raw bf16 bits in ``tl.dot``, triton-lang/triton#11584);
- ``"triton"`` -> the Triton kernels alone (no Gluon kernel; on CPU under the interpreter);
- ``"torch"`` -> plain PyTorch.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
from types import ModuleType

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

BACKEND_ENV_VAR = "SINK_FLASH_ATTN3_BACKEND"
_BACKENDS = ("auto", "triton", "torch")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------------------------


def _backend_from_environment() -> str:
    choice = os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"sink_flash_attn3: {BACKEND_ENV_VAR} must be one of {_BACKENDS}, got {choice!r}")
    return choice


# The backend of calls that pass none (``backend=None``): read once, here, not per call.
DEFAULT_BACKEND = _backend_from_environment()
# Whether Triton decorates kernels for its interpreter: it reads TRITON_INTERPRET when a kernel is decorated, so the
# value at import is the one that holds for this package's kernels.
TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _select(choice: str, device: torch.device, dtype: torch.dtype | None, interpreter: bool) -> str:
    """The kernels that run: ``"gluon"`` (the Triton kernels, and the Gluon kernels where they win), ``"triton"``
    (the Triton kernels alone) or ``"torch"``; see :func:`resolve_backend` for the rule and the errors."""
    if choice not in _BACKENDS:
        raise ValueError(f"sink_flash_attn3: backend must be one of {_BACKENDS}, got {choice!r}")
    on_cpu = device.type == "cpu"
    if choice == "auto":
        if device.type == "cuda":
            return "gluon"
        return "triton" if on_cpu and interpreter and dtype != torch.bfloat16 else "torch"
    if choice == "triton" and on_cpu:
        if not interpreter:
            raise RuntimeError(
                "sink_flash_attn3: the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
                "imported; use backend='torch' for the plain PyTorch path"
            )
        if dtype == torch.bfloat16:
            raise TypeError(
                "sink_flash_attn3: the Triton backend cannot run bf16 CPU tensors: Triton's interpreter multiplies "
                "raw bf16 bits in tl.dot (triton-lang/triton#11584); use backend='torch' or float16/float32"
            )
    return choice


def resolve_backend(device: torch.device, backend: str | None = None, dtype: torch.dtype | None = None) -> str:
    """The backend (``"triton"`` or ``"torch"``) that runs attention on ``device`` for inputs of ``dtype``.

    ``backend`` (``DEFAULT_BACKEND`` when None) forces a choice; ``"auto"`` picks Triton on CUDA (with the Gluon
    kernels where they win on sm_90), and on CPU only when ``TRITON_INTERPRET=1`` was set at import and ``dtype`` is
    not bf16 (Triton's interpreter multiplies raw bf16 bits in ``tl.dot``, triton-lang/triton#11584); ``"triton"``
    runs the Triton kernels alone.  Asking for Triton on CPU without the interpreter, or for bf16 CPU tensors, raises.
    """
    choice = DEFAULT_BACKEND if backend is None else backend
    return "torch" if _select(choice, device, dtype, TRITON_INTERPRETER) == "torch" else "triton"


_BACKEND_MODULES: dict = {}
# Keyword arguments of each selection's backend functions: the Triton module runs with or without Gluon
_BACKEND_KWARGS = {"gluon": {"gluon": True}, "triton": {"gluon": False}, "torch": {}}


def _backend_module(backend: str) -> ModuleType:
    # Imported lazily: Triton is optional on CPU-only machines, and TRITON_INTERPRET must be set before the
    # kernels are decorated.
    module = _BACKEND_MODULES.get(backend)
    if module is None:
        name = "reference" if backend == "torch" else "triton_kernels"
        module = _BACKEND_MODULES[backend] = importlib.import_module(f".{name}", __package__)
    return module


def _forward(
    q,
    k,
    v,
    sinks,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_left,
    window_right,
    backend,
    deterministic,
):
    # (deterministic is the backward's switch: it travels with the other parameters)
    # the sink logits go in as they are (fp32, bf16 or fp16): the kernels read them in fp32, and a cast here would
    # cost a launch and an autograd node per layer call
    return _backend_module(backend).sink_attention_forward(
        q,
        k,
        v,
        sinks,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_left,
        window_right,
        **_BACKEND_KWARGS[backend],
    )


def _backward_impl(
    dout,
    q,
    k,
    v,
    out,
    lse,
    sinks,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_left,
    window_right,
    backend,
    deterministic,
    grads=(None, None, None),
):
    dq_out, dk_out, dv_out = grads
    return _backend_module(backend).sink_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        sinks,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_left,
        window_right,
        deterministic,
        dq_out=dq_out,
        dk_out=dk_out,
        dv_out=dv_out,
        **_BACKEND_KWARGS[backend],
    )


def _tokens_major(t: torch.Tensor) -> torch.Tensor:
    """``[batch, seqlen, heads, head_dim]`` or ``[tokens, heads, head_dim]`` -> dense ``[tokens, heads, head_dim]``."""
    if t.dim() == 4:
        t = t.reshape(-1, t.shape[2], t.shape[3])
    return t if t.is_contiguous() else t.contiguous()


def _backend_rows(t: torch.Tensor, backend: str) -> torch.Tensor:
    """``_tokens_major``, except that the Triton kernels take a dense ``[1, seqlen, heads, head_dim]`` as it is: a
    view per tensor and call costs host time that the small layers of a model (sliding windows, short sequences)
    feel, and its results then need no view back to the caller's shape either."""
    if t.dim() == 4 and not (t.shape[0] == 1 and backend != "torch"):
        t = t.reshape(-1, t.shape[2], t.shape[3])
    return t if t.is_contiguous() else t.contiguous()


def _heads_first(t: torch.Tensor) -> bool:
    """``t`` (``[batch, seqlen, heads, head_dim]`` with one batch row, or ``[tokens, heads, head_dim]``) is a
    transposed view of a dense heads-first tensor: what transformers' attention layers pass (``[b, h, s, d]`` states
    transposed to ``[b, s, h, d]``)."""
    return (t.dim() == 3 or t.shape[0] == 1) and not t.is_contiguous() and t.transpose(-3, -2).is_contiguous()


def _empty_heads_first(shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``shape`` whose memory is heads-first, the layout ``_heads_first`` detects."""
    *lead, seqlen, heads, head_dim = shape
    return like.new_empty((*lead, heads, seqlen, head_dim)).transpose(-3, -2)


class _SinkAttention(torch.autograd.Function):
    """The eager path: the same backend calls as the custom ops below, without their dispatch overhead; the
    [batch, seqlen] -> tokens reshapes happen inside, so autograd records one node per call."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, params):
        backend = params[6]
        q_t, k_t, v_t = _backend_rows(q, backend), _backend_rows(k, backend), _backend_rows(v, backend)
        out, lse = _forward(q_t, k_t, v_t, sinks, cu_seqlens_q, cu_seqlens_k, *params)
        # the token-major tensors the backward reads (views of dense inputs; FlashAttention saves its contiguous
        # copies the same way), so the backward re-lays out nothing but dout
        ctx.save_for_backward(q_t, k_t, v_t, out, lse, sinks, cu_seqlens_q, cu_seqlens_k)
        ctx.params = params
        ctx.shapes = (q.shape, k.shape, v.shape)
        # Gradients take the inputs' layout, as FlashAttention's do (empty_like of its inputs): the ops before
        # attention (RoPE, the transposes of q/k/v) then run their backward on dense tensors
        ctx.heads_first = (_heads_first(q), _heads_first(k), _heads_first(v))
        ctx.mark_non_differentiable(lse)
        # lse has no gradient: without this, autograd would fill a zero tensor for it (an allocation and a launch per
        # layer) that the backward never reads
        ctx.set_materialize_grads(False)
        return (out if out.dim() == q.dim() else out.view(q.shape)), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        grads = [
            _empty_heads_first(shape, t) if heads_first else None
            for shape, t, heads_first in zip(ctx.shapes, (q, k, v), ctx.heads_first)
        ]
        rows = q.dim()  # the saved tensors' rank: the layout the backend reads and writes
        dq, dk, dv, dsink = _backward_impl(
            _backend_rows(dout, ctx.params[6]), q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k, *ctx.params,
            grads=[g if g is None or g.dim() == rows else g.view(-1, g.shape[-2], g.shape[-1]) for g in grads],
        )  # fmt: skip
        dq, dk, dv = (
            g if g is not None else d if d.dim() == len(shape) else d.view(shape)
            for g, d, shape in zip(grads, (dq, dk, dv), ctx.shapes)
        )
        return dq, dk, dv, dsink, None, None, None


def _needs_grad(q, k, v, sinks) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    )


def _attention(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, params):
    """``out`` (q's shape) and ``lse [heads, tokens]`` for q, k, v of ``[batch, seqlen, heads, head_dim]`` or
    ``[tokens, heads, head_dim]``."""
    # torch.compile traces the op, and so do dispatch modes (selective activation checkpointing's caching mode,
    # FlopCounterMode, fake tensors): they see ops, never the inside of an autograd.Function.
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        q_t, k_t, v_t = _tokens_major(q), _tokens_major(k), _tokens_major(v)
        out, lse = _fwd_op(q_t, k_t, v_t, sinks, cu_seqlens_q, cu_seqlens_k, *params)
        return out.view(q.shape), lse
    if _needs_grad(q, k, v, sinks):
        return _SinkAttention.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, params)
    # log-prob passes, evaluation, decoding: no autograd node to build
    backend = params[6]
    q_t, k_t, v_t = _backend_rows(q, backend), _backend_rows(k, backend), _backend_rows(v, backend)
    out, lse = _forward(q_t, k_t, v_t, sinks, cu_seqlens_q, cu_seqlens_k, *params)
    return (out if out.dim() == q.dim() else out.view(q.shape)), lse


# --------------------------------------------------------------------------------------------------------------
# Custom ops (the path torch.compile traces)
# --------------------------------------------------------------------------------------------------------------


def _op_namespace() -> str:
    """A torch.library namespace unique to this copy of the package (its import name, made an identifier)."""
    base = re.sub(r"\W", "_", __package__ or "sink_flash_attn3")
    if not (base[0].isalpha() or base[0] == "_"):
        base = f"_{base}"
    if "sink_flash_attn3" not in base:
        base = f"sink_flash_attn3_{base}"
    namespace, suffix = base, 1
    while hasattr(getattr(torch.ops, namespace), "fwd"):  # same package imported twice (e.g. a reload)
        suffix += 1
        namespace = f"{base}_{suffix}"
    return namespace


OPS_NAMESPACE = _op_namespace()


@torch.library.custom_op(f"{OPS_NAMESPACE}::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    backend: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``out [Tq, Hq, D]`` (q's dtype) and the sink-inclusive ``lse [Hq, Tq]`` (fp32)."""
    return _forward(
        q,
        k,
        v,
        sinks,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_left,
        window_right,
        backend,
        deterministic,
    )


@_fwd_op.register_fake
def _(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, backend, deterministic):  # fmt: skip
    total_q, num_heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((num_heads, total_q), dtype=torch.float32)


@torch.library.custom_op(f"{OPS_NAMESPACE}::bwd", mutates_args=())
def _bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    backend: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``dq, dk, dv`` (input dtypes) and ``dsink [Hq]`` in the sink's dtype (an empty tensor without sinks)."""
    dq, dk, dv, dsink = _backward_impl(
        dout,
        q,
        k,
        v,
        out,
        lse,
        sinks,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_left,
        window_right,
        backend,
        deterministic,
    )
    if dsink is None:  # custom ops return tensors only: an empty tensor stands for "no sink gradient"
        dsink = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      causal, window_left, window_right, backend, deterministic):  # fmt: skip
    dsink = q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty((q.shape[1],))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k)
    ctx.params = params  # max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left/right, backend, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv, dsink = _bwd_op(dout.contiguous(), q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k, *ctx.params)
    return dq, dk, dv, dsink if sinks is not None else None, None, None, None, None, None, None, None, None, None, None


# The op is its own autograd unit (rather than an autograd.Function around it): dynamo cannot trace
# autograd.Function.apply when one tensor feeds two inputs, and transformers passes the same tensor as
# cu_seqlens_q and cu_seqlens_k. A differentiable custom op traces with torch.compile(fullgraph=True).
torch.library.register_autograd(f"{OPS_NAMESPACE}::fwd", _backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------------------


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    """FA's default ``1 / sqrt(head_dim)``; a given scale must be positive and finite (the kernels fold it into the
    row max of the online softmax, which a negative scale would turn into a row min)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(softmax_scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def _check_inputs(q, k, v, s_aux, cu_seqlens_q, cu_seqlens_k, window_size, dropout_p, softcap, alibi_slopes,
                  return_attn_probs, varlen: bool) -> tuple[int, int]:  # fmt: skip
    """Validates the arguments up front; returns ``(window_left, window_right)``."""
    expected = "[total_tokens, heads, head_dim]" if varlen else "[batch, seqlen, heads, head_dim]"
    ndim = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"sink_flash_attn3: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"sink_flash_attn3: {name} must be {expected}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"sink_flash_attn3: {name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"sink_flash_attn3: q is on {q.device} but {name} is on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"sink_flash_attn3: {name} must have a contiguous last (head_dim) dimension")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"sink_flash_attn3: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"sink_flash_attn3: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if not varlen and (q.shape[0] != k.shape[0]):
        raise ValueError(f"sink_flash_attn3: q and k batch sizes differ ({q.shape[0]} vs {k.shape[0]})")
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"sink_flash_attn3: q head_dim {head_dim} differs from k/v head_dim {k.shape[-1]}")
    if head_dim > _MAX_HEAD_DIM or head_dim % 8 != 0:
        raise ValueError(
            f"sink_flash_attn3: head_dim must be a multiple of 8 and at most {_MAX_HEAD_DIM}, got {head_dim}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"sink_flash_attn3: the number of query heads ({num_heads}) must be a multiple of the number of "
            f"key/value heads ({num_kv_heads})"
        )
    if s_aux is not None:
        if not isinstance(s_aux, torch.Tensor):
            raise TypeError(
                f"sink_flash_attn3: s_aux must be a tensor of shape [{num_heads}], got {type(s_aux).__name__}"
            )
        if s_aux.shape != (num_heads,):
            raise ValueError(
                f"sink_flash_attn3: s_aux (sinks) must have shape [num_heads] = [{num_heads}], got {tuple(s_aux.shape)}"
            )
        if s_aux.dtype not in _DTYPES:
            raise TypeError(f"sink_flash_attn3: s_aux must be float16, bfloat16 or float32, got {s_aux.dtype}")
        if s_aux.device != q.device:
            raise ValueError(f"sink_flash_attn3: q is on {q.device} but s_aux is on {s_aux.device}")
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(
                    f"sink_flash_attn3: {name} must be a 1-D int32 tensor [batch + 1], got "
                    f"{getattr(cu, 'dtype', type(cu).__name__)} of shape {tuple(getattr(cu, 'shape', ()))}"
                )
            if cu.device != q.device:
                raise ValueError(f"sink_flash_attn3: q is on {q.device} but {name} is on {cu.device}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"sink_flash_attn3: cu_seqlens_q and cu_seqlens_k must have the same length [batch + 1], got "
                f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
            )
    if dropout_p:
        raise NotImplementedError("sink_flash_attn3: attention dropout is not supported (dropout_p must be 0.0)")
    if softcap:
        raise NotImplementedError("sink_flash_attn3: logit softcapping is not supported (softcap must be 0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError("sink_flash_attn3: ALiBi slopes are not supported")
    if return_attn_probs:
        raise NotImplementedError("sink_flash_attn3: return_attn_probs=True is not supported (no dense probabilities)")
    if window_size is None:
        window_size = (-1, -1)
    if len(window_size) != 2 or any(int(w) < -1 for w in window_size):
        raise ValueError(f"sink_flash_attn3: window_size must be (left, right) with -1 = unbounded, got {window_size}")
    return int(window_size[0]), int(window_size[1])


_TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)


def _select_backend(q: torch.Tensor, backend: str | None) -> str:
    """The kernels that run (``_select``), and a check of what only the Triton kernels restrict (head_dim is a tile
    dimension)."""
    selected = _select(DEFAULT_BACKEND if backend is None else backend, q.device, q.dtype, TRITON_INTERPRETER)
    if selected != "torch" and q.shape[-1] not in _TRITON_HEAD_DIMS:
        raise ValueError(
            f"sink_flash_attn3: the Triton kernels support head_dim in {_TRITON_HEAD_DIMS}, got {q.shape[-1]}; "
            "use backend='torch' (or SINK_FLASH_ATTN3_BACKEND=torch) for other sizes"
        )
    return selected


@functools.lru_cache(maxsize=64)
def _dense_cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """``[0, seqlen, 2 * seqlen, ...]`` (int32, ``batch + 1``) on ``device``, built once per shape (the tensors are
    only ever read)."""
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def _cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a traced graph builds its own (a cached tensor would become a constant)
        return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return _dense_cu_seqlens(batch, seqlen, device)


def _params(q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, backend, deterministic):
    """The non-tensor arguments the forward and the backward share (the order of the custom ops' parameters)."""
    return (
        max_seqlen_q,
        max_seqlen_k,
        _softmax_scale(softmax_scale, q.shape[-1]),
        bool(causal),
        window_left,
        window_right,
        _select_backend(q, backend),
        bool(deterministic),
    )


def _as_int(value):
    # transformers may hand max_seqlen over as a 0-dim tensor (packed batches from position_ids)
    return int(value.item()) if isinstance(value, torch.Tensor) else value


# --------------------------------------------------------------------------------------------------------------
# FlashAttention entry points
# --------------------------------------------------------------------------------------------------------------


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    s_aux: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_softmax_lse: bool = False,
    backend: str | None = None,
):
    """Sink attention on fixed-length batches, FlashAttention's ``flash_attn_func`` signature.

    Args:
        q: ``[batch, seqlen_q, num_heads, head_dim]``.
        k, v: ``[batch, seqlen_k, num_kv_heads, head_dim]``; ``num_heads`` must be a multiple of ``num_kv_heads``
            (GQA/MQA without repeating K/V).
        dropout_p, softcap, alibi_slopes, return_attn_probs: accepted for signature compatibility; anything but
            the defaults raises ``NotImplementedError``.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        causal: causal mask aligned to the bottom-right corner (query i sits at key ``i + seqlen_k - seqlen_q``),
            so decoding with a KV cache (``seqlen_q < seqlen_k``) works.
        window_size: ``(left, right)`` sliding window, -1 = unbounded: key j is visible from aligned query
            position i iff ``i - left <= j <= i + right``.
        s_aux: learnable sink logits ``[num_heads]`` (fp32, bf16 or fp16); receives a gradient in its own dtype.
        deterministic: FlashAttention's switch for a deterministic backward. ``False`` (the default) lets the
            backward run its one-kernel form where it has one (Hopper, 16-bit, head_dim 64): five products per
            tile, dQ and the sink gradient added up with atomics, so their last bits vary between runs. ``True``
            (or any other GPU, dtype or head_dim) reduces every gradient in a fixed order: bitwise reproducible.
        return_softmax_lse: also return the sink-inclusive log-sum-exp ``[batch, num_heads, seqlen_q]`` (fp32).
        backend: ``"auto"`` (the Triton kernels, and the Gluon kernels where they win on sm_90), ``"triton"`` (the
            Triton kernels alone) or ``"torch"``; None: ``DEFAULT_BACKEND`` (``SINK_FLASH_ATTN3_BACKEND`` at import,
            else ``"auto"``).  See the module docstring.

    Returns:
        ``out [batch, seqlen_q, num_heads, head_dim]`` in q's dtype (and the LSE if requested).
    """
    window_left, window_right = _check_inputs(
        q, k, v, s_aux, None, None, window_size, dropout_p, softcap, alibi_slopes, return_attn_probs, varlen=False
    )
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    # A fixed-length batch is the varlen problem with equal lengths: flatten the batch into the token axis.
    cu_seqlens_q = _cu_seqlens(batch, seqlen_q, q.device)
    cu_seqlens_k = cu_seqlens_q if seqlen_k == seqlen_q else _cu_seqlens(batch, seqlen_k, q.device)
    params = _params(q, seqlen_q, seqlen_k, softmax_scale, causal, window_left, window_right, backend, deterministic)
    out, lse = _attention(q, k, v, s_aux, cu_seqlens_q, cu_seqlens_k, params)
    if not return_softmax_lse:
        return out
    return out, lse.view(num_heads, batch, seqlen_q).transpose(0, 1)  # [B, H, S] like FlashAttention's softmax_lse


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    s_aux: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_softmax_lse: bool = False,
    backend: str | None = None,
):
    """Sink attention on packed variable-length sequences, FlashAttention's ``flash_attn_varlen_func`` signature.

    Args:
        q: ``[total_q, num_heads, head_dim]``; k, v: ``[total_k, num_kv_heads, head_dim]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` cumulative sequence lengths (sequence b owns rows
            ``cu[b]:cu[b+1]``); query and key lengths may differ per sequence (causal mask bottom-right aligned).
        max_seqlen_q, max_seqlen_k: longest query / key sequence (int or 0-dim tensor).
        The other arguments are as in :func:`flash_attn_func`; the LSE, if requested, is ``[num_heads, total_q]``.

    Returns:
        ``out [total_q, num_heads, head_dim]`` in q's dtype (and the LSE if requested).
    """
    window_left, window_right = _check_inputs(
        q, k, v, s_aux, cu_seqlens_q, cu_seqlens_k, window_size, dropout_p, softcap, alibi_slopes,
        return_attn_probs, varlen=True,
    )  # fmt: skip
    params = _params(
        q, _as_int(max_seqlen_q), _as_int(max_seqlen_k), softmax_scale, causal, window_left, window_right, backend,
        deterministic,
    )  # fmt: skip
    out, lse = _attention(q, k, v, s_aux, cu_seqlens_q, cu_seqlens_k, params)
    return (out, lse) if return_softmax_lse else out
