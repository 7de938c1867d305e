"""Triton forward/backward kernels of sink-aware flash attention (varlen, GQA, causal, sliding window), and the
one place that decides which kernel runs (``_plan``) with which launch configuration (``CONFIGS``).

Layout: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]`` (last dim contiguous, other strides arbitrary), sequences
packed along the token axis and delimited by ``cu_seqlens_q/k`` (int32 ``[B + 1]``).  One program handles one
(block of rows, head, sequence); the grid runs over ``max_seqlen`` and programs past the end of a shorter
sequence exit at once.

Math (per query row i of head h, with the learnable sink logit s_h)::

    S_ij   = scale * q_i . k_j                       (only visible j: causal / window band, j < len_k)
    LSE_i  = log(sum_j exp(S_ij) + exp(s_h))         (the sink joins the normaliser but carries no value)
    P_ij   = exp(S_ij - LSE_i),   O_i = sum_j P_ij V_j
    D_i    = rowsum(dO_i * O_i),  dS_ij = P_ij (dP_ij - D_i),  dP = dO V^T
    dQ = scale dS K,  dK = scale dS^T Q,  dV = P^T dO,  dsink_h = -sum_i exp(s_h - LSE_i) D_i

The kernels work in base 2: ``log2(e)`` is folded into the score scale (``exp2`` is one MUFU op), the online
softmax starts from the sink (running max m = s_h log2 e, running sum l = 1), and the backward reloads the
sink-inclusive LSE in base 2, so dQ/dK/dV come out exact with no sink-specific term.

Causal masks are aligned bottom-right like FlashAttention: query i of a sequence sits at key position
``i + len_k - len_q``.  The window follows FA's convention (-1 = unbounded): key j is visible from the
aligned query position a iff ``a - window_left <= j <= a + window_right`` (and ``j <= a`` when causal).
Each program only visits key (or query) blocks that intersect that band (``_bands.py``) — sliding layers cost
O(S * W) — and splits them into blocks fully inside the band (no mask arithmetic) and edge blocks (masked).

The backward here is deterministic (bitwise reproducible) with no atomics: dK/dV are accumulated by one program per
key block that loops over every query head of its KV group (GQA needs no repeated K/V and no reduction afterwards),
dQ by one program per query block that loops over key blocks, and dsink from per-block partial sums (written by the
dQ kernel) reduced in a fixed order (``_dsink_finish``).

On Hopper (sm_90) with 16-bit inputs at head_dim 64, the entry points' ``gluon=True`` (the interface's
``backend="auto"``) runs the Gluon kernels of ``gluon_kernels.py`` for the shapes where they were measured faster
(asynchronous warpgroup MMAs): the backward, and the forward of full-attention layers from ``GLUON_FWD_MIN_SEQLEN``
queries.  There, with ``deterministic=False`` (FlashAttention's default), full-attention layers from
``FUSED_MIN_SEQLEN`` keys run the one-kernel backward (``gluon_kernels.backward_fused``: five products per tile, dQ
and dsink added up with atomics).  ``gluon=False`` (``backend="triton"``) runs the Triton kernels alone.

Dispatch is a pure function of the inputs (shapes, strides, dtypes, device) and of ``gluon``: ``_plan``, with the
thresholds and launch configurations below as read-only constants.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ._bands import host_cdiv as _cdiv
from ._bands import key_block_ranges as _key_block_ranges
from ._bands import query_block_ranges as _query_block_ranges
from ._bands import row_vector_start as _row_vector_start
from ._launch import Tile as _Tile
from ._launch import current_device as _current_device
from ._launch import launch_at as _launch_at

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # older Triton: the pointer paths only
    _TensorDescriptor = None

__all__ = [
    "CONCURRENT_MAX_SEQLEN",
    "CONFIGS",
    "DKDV_PROGRAMS_PER_SM",
    "FUSED_MIN_SEQLEN",
    "FUSED_PROGRAMS_PER_SM",
    "GLUON_FWD_MIN_SEQLEN",
    "sink_attention_backward",
    "sink_attention_forward",
]

LOG2E = 1.4426950408889634
# constexpr copies for use inside kernels (compiled Triton only reads constexpr globals)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# "Unbounded" window side: far beyond any sequence, small enough that a +/- seq_len stays in int32.
_UNBOUNDED = 1 << 30

# --------------------------------------------------------------------------------------------------------------
# Launch configurations: one read-only table, (kernel, head_dim) -> tile sizes and launch options.  Measured on an H200
# (bf16, 64 query / 8 KV heads; benchmarks/notes/attention.md).  Triton kernels: "fwd" (layers without a left
# window), "fwd_window" (sliding layers: short rows favour small tiles; 128 registers -> four programs per SM),
# "dkdv", "dq"; head dims other than 64 and 128 take the 128 entries (smaller tiles at 256).  Gluon kernels (sm_90,
# 16-bit, head_dim 64 only): "gluon_fwd" (a load warp and three 64-row consumer warpgroups on 128-key tiles, FA4's
# sm_90 forward shape; consumers take CONSUMER_REGS registers, the load warp PRODUCER_REGS), "gluon_dkdv" (capped at
# 168 registers: three programs per SM), "gluon_dq".  maxnreg is an NVIDIA compile option.
# --------------------------------------------------------------------------------------------------------------
_CONFIGS = {
    ("fwd", 64): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    ("fwd", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("fwd_window", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, maxnreg=128),
    ("fwd_window", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("dkdv", 64): dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=4),
    ("dkdv", 128): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    ("dq", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("dq", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    ("gluon_fwd", 64): dict(
        BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=2, CONSUMER_REGS=160, PRODUCER_REGS=24, maxnreg=128
    ),
    ("gluon_dkdv", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=2, maxnreg=168),
    ("gluon_dq", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=2),
    ("gluon_bwd_fused", 64): dict(
        BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=3, MMA_REGS=216, DQ_REGS=64, LOAD_REGS=24, maxnreg=128
    ),
}
CONFIGS: MappingProxyType = MappingProxyType({key: MappingProxyType(cfg) for key, cfg in _CONFIGS.items()})
del _CONFIGS
_INTERPRET_CONFIG = MappingProxyType(dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1))  # CPU: numpy per block

# Dispatch thresholds (read-only; measured on an H200, bf16, 64 query / 8 KV heads, head_dim 64: the tables of
# benchmarks/notes/attention.md).
# The Gluon forward runs on full-attention layers from this many queries (max_seqlen_q): ahead of the Triton forward
# from 3k and on packed 4 x 2k, a tie at 2k, behind at 1k; on sliding layers (a window-128 program sees two or three
# key blocks, too few to fill its pipeline) the Triton forward is faster at every length.
GLUON_FWD_MIN_SEQLEN = 2048
# The fused backward (deterministic=False) runs on full-attention layers from this many keys (max_seqlen_k): below,
# and on sliding layers, the deterministic kernels are as fast or faster.
FUSED_MIN_SEQLEN = 2048
# The dK/dV grid of a full layer is split over the query heads of a KV group until it has this many programs per
# multiprocessor (``_dkdv_head_splits``): six for the deterministic dK/dV kernels (three share a multiprocessor),
# one for the fused backward (one program per multiprocessor; more splits only add partial sums).  2k-16k keys.
DKDV_PROGRAMS_PER_SM = 6
FUSED_PROGRAMS_PER_SM = 1
# Without the Gluon kernels, the dQ kernel runs on a side stream next to the dK/dV kernel for sliding layers and up
# to this many keys (their programs then share the SMs; longer full layers already fill the GPU).
CONCURRENT_MAX_SEQLEN = 8192


def _compiled(device: torch.device) -> bool:
    """Whether the kernels for ``device`` are compiled (a GPU), not run by the interpreter (CPU): their tile sizes."""
    return device.type == "cuda"


def _config(kernel: str, head_dim: int, device: torch.device) -> dict:
    if not _compiled(device):
        return dict(_INTERPRET_CONFIG)
    cfg = CONFIGS.get((kernel, head_dim))
    if cfg is None:
        cfg = dict(CONFIGS[(kernel, 128)])
        if head_dim > 128:
            cfg.update(BLOCK_M=64, BLOCK_N=32, num_stages=1)
    cfg = dict(cfg)  # (the caller's own copy: it pops entries)
    if torch.version.hip is not None:
        cfg.pop("maxnreg", None)
    return cfg


# --------------------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------------------
_GLUON: dict = {}


def _gluon_kernels():
    """gluon_kernels.py, imported once; None (with one warning naming the cause) when this Triton cannot import it."""
    if "module" not in _GLUON:
        try:
            _GLUON["module"] = importlib.import_module(".gluon_kernels", __package__)
        except Exception as exc:  # noqa: BLE001 - a Triton without Gluon, or with a Gluon API this code predates
            _GLUON["module"] = None
            _GLUON["error"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"sink_flash_attn3: the Gluon kernels cannot be imported with triton {triton.__version__} "
                f"({_GLUON['error']}); the Triton kernels run instead (slower on sm_90). Pass backend='triton' "
                "(or set SINK_FLASH_ATTN3_BACKEND=triton) to choose that explicitly.",
                RuntimeWarning,
                stacklevel=4,
            )
    return _GLUON["module"]


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU, None elsewhere (CPU, ROCm)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need NVIDIA sm_90+ and a [T, H * D] row-major view (16-byte aligned rows)."""
    cap = _device_capability(tensors[0].device)
    if _TensorDescriptor is None or cap is None or cap[0] < 9:
        return False
    for t in tensors:
        T, H, D = t.shape[-3:]
        if t.stride(-2) != D or t.stride(-3) != H * D or (H * D * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


class _Plan(NamedTuple):
    """Which kernels a call runs (``_plan``); the entry points also take one as ``plan=``."""

    fwd: str  # "fwd" | "fwd_window" | "gluon_fwd"
    dkdv: str  # "dkdv" | "gluon_dkdv"
    dq: str  # "dq" | "gluon_dq"
    tma: bool  # Triton kernels load their streamed tiles through tensor descriptors
    concurrent: bool  # the Triton dQ kernel runs on a side stream next to the dK/dV kernel
    fused_bwd: bool  # with deterministic=False, the backward runs gluon_kernels.backward_fused
    head_splits: int = 0  # programs sharing a (KV head, key block) of the dK/dV grid; 0: ``_dkdv_head_splits``


def _gluon_applies(q, k, v) -> bool:
    """Whether the Gluon kernels can run on these inputs: sm_90, 16-bit, head_dim 64, TMA-readable rows."""
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and _device_capability(q.device) == (9, 0)
        and ("gluon_dkdv", q.shape[-1]) in CONFIGS
        and _tma_ok(q, k, v)
        and _gluon_kernels() is not None
    )


def _plan(q, k, v, windowed: bool, max_seqlen_q: int, max_seqlen_k: int, gluon: bool = True) -> _Plan:
    """Which kernels run for these inputs: the one dispatch rule of the forward and the backward, a function of the
    inputs' shapes, strides, dtypes and device and of ``gluon`` (the Gluon kernels allowed where they win)."""
    tma = _tma_ok(q, k, v)
    gluon = gluon and _gluon_applies(q, k, v)
    if gluon and not windowed and max_seqlen_q >= GLUON_FWD_MIN_SEQLEN:
        fwd = "gluon_fwd"
    else:
        fwd = "fwd_window" if windowed else "fwd"
    concurrent = not gluon and q.device.type == "cuda" and (windowed or max_seqlen_k <= CONCURRENT_MAX_SEQLEN)
    fused_bwd = gluon and not windowed and max_seqlen_k >= FUSED_MIN_SEQLEN
    return _Plan(fwd, "gluon_dkdv" if gluon else "dkdv", "gluon_dq" if gluon else "dq", tma, concurrent, fused_bwd)


def _check_plan(plan: _Plan, q, k, v) -> None:
    """A plan given to an entry point (tests and benchmarks run a kernel outside the shapes ``_plan`` gives it) must
    name kernels that can run on these inputs."""
    if not isinstance(plan, _Plan):
        raise TypeError(f"sink_flash_attn3: plan must be a triton_kernels._Plan, got {type(plan).__name__}")
    if plan.fwd not in ("fwd", "fwd_window", "gluon_fwd") or (plan.dkdv, plan.dq) not in (
        ("dkdv", "dq"),
        ("gluon_dkdv", "gluon_dq"),
    ):
        raise ValueError(f"sink_flash_attn3: plan names unknown kernels or mixes Gluon and Triton backwards: {plan}")
    uses_gluon = plan.fwd == "gluon_fwd" or plan.dkdv == "gluon_dkdv" or plan.fused_bwd
    if uses_gluon and not _gluon_applies(q, k, v):
        raise ValueError(f"sink_flash_attn3: plan: the Gluon kernels need sm_90, 16-bit, head_dim 64, TMA rows: {plan}")
    if plan.fused_bwd and plan.dkdv != "gluon_dkdv":
        raise ValueError(f"sink_flash_attn3: plan: the fused backward needs the Gluon backward's plan: {plan}")
    if plan.tma and not _tma_ok(q, k, v):
        raise ValueError(f"sink_flash_attn3: plan: tensor descriptors need sm_90+ and 16-byte aligned rows: {plan}")
    if plan.concurrent and q.device.type != "cuda":
        raise ValueError(f"sink_flash_attn3: plan: a side stream needs CUDA tensors: {plan}")
    group = q.shape[-2] // k.shape[-2]
    if plan.head_splits < 0 or (plan.head_splits and group % plan.head_splits):
        raise ValueError(f"sink_flash_attn3: plan: head_splits must divide the KV group ({group}): {plan}")


def _run_gluon(name: str, *args) -> None:
    """Launch one Gluon kernel; a failure is an error that names the way back to the Triton kernels."""
    try:
        getattr(_GLUON["module"], name)(*args)
    except Exception as exc:
        raise RuntimeError(
            f"sink_flash_attn3: the Gluon {name} kernel failed with triton {triton.__version__} "
            f"({type(exc).__name__}: {exc}); pass backend='triton' (or set SINK_FLASH_ATTN3_BACKEND=triton) to run "
            "the Triton kernels instead"
        ) from exc


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@functools.cache
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere: the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 0
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


def _dkdv_head_splits(
    group: int, programs: int, multiprocessors: int, windowed: bool, per_sm: int = DKDV_PROGRAMS_PER_SM
) -> int:
    """Programs that share one (KV head, key block) of the dK/dV kernel, each taking ``group / splits`` query heads.

    Without a left window the first key blocks see every query: a program loops over all ``group`` query heads of
    every query block, while the grid of a short sequence has few programs (8 KV heads x 64 key blocks at 4k), so
    those longest programs outlast the rest of the grid.  Splitting the group (a power of two dividing it) until the
    grid has ``per_sm`` programs per multiprocessor shortens them (``DKDV_PROGRAMS_PER_SM`` for the dK/dV kernels,
    three of which share a multiprocessor; ``FUSED_PROGRAMS_PER_SM`` for the fused backward, one per multiprocessor);
    the partial sums cost one reduction.
    Sliding layers have short, even programs and stay whole."""
    if windowed or multiprocessors == 0:
        return 1
    splits = 1
    while group % (2 * splits) == 0 and programs * splits < per_sm * multiprocessors:
        splits *= 2
    return splits


def _check_inputs(tensors) -> None:
    for name, t in tensors:
        if not (t.dim() == 3 or (t.dim() == 4 and t.shape[0] == 1)) or t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be [tokens, heads, head_dim] (or [1, tokens, heads, head_dim]) with a contiguous last "
                f"dim, got shape {tuple(t.shape)} strides {t.stride()}"
            )


def _interpreter_bf16_dot_exact() -> bool:
    """Whether Triton's interpreter multiplies bf16 ``tl.dot`` operands as numbers.  It stores bf16 as uint16 and
    multiplies the raw bit patterns (triton-lang/triton#11584), so 1.0 x 1.0 comes out near 2.6e8.  Asked of the
    interpreter itself (``InterpreterBuilder.create_dot``, the function that bug is in), so a Triton with the fix
    runs bf16 on CPU; any failure of the probe counts as the bug."""
    try:
        import numpy as np  # noqa: PLC0415 - the interpreter's own array library
        from triton.runtime import interpreter  # noqa: PLC0415

        one = interpreter.TensorHandle(np.full((1, 1), 0x3F80, dtype=np.uint16), tl.bfloat16)  # bf16 bits of 1.0
        acc = interpreter.TensorHandle(np.zeros((1, 1), dtype=np.float32), tl.float32)
        product = interpreter.InterpreterBuilder().create_dot(one, one, acc, "ieee", 0)
        return float(np.asarray(product.data).reshape(-1)[0]) == 1.0
    except Exception:  # noqa: BLE001 - an interpreter this probe does not know: treated as the bug
        return False


def _check_interpreter_dtype(q: torch.Tensor) -> None:
    if q.dtype == torch.bfloat16 and _INTERPRETED and not _interpreter_bf16_dot_exact():
        raise TypeError(
            "sink_flash_attn3: the Triton kernels cannot run bf16 on CPU: Triton's interpreter "
            "multiplies raw bf16 bits in tl.dot (triton-lang/triton#11584); use the PyTorch backend "
            "(backend='torch') or float16/float32 inputs"
        )


def _row_descriptor(t: torch.Tensor, block_rows: int) -> _Tile:
    """Descriptor over ``t [T, H, D]`` viewed as ``[T, H * D]``, tiles of ``[block_rows, D]``."""
    T, H, D = t.shape[-3:]
    return _Tile(t, (T, H * D), (H * D, 1), (block_rows, D))


def _descriptors_if(use_tma: bool, block_rows: int, *tensors: torch.Tensor) -> tuple:
    """``_row_descriptor`` of each tensor when the kernel loads them through TMA, else the tensors themselves (the
    kernel's pointer path ignores that argument)."""
    return tuple(_row_descriptor(t, block_rows) if use_tma else t for t in tensors)


def _row_vector_stride(T_q: int, num_seqs: int) -> int:
    """Row stride of the backward's per-row vectors: room for every sequence at its `row_vector_start`."""
    return 4 * _cdiv(T_q, 4) + 4 * num_seqs


def _window_bounds(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """FA window convention (-1 = unbounded) -> finite (left, right) extents; causal caps right at 0."""
    left = _UNBOUNDED if window_left is None or window_left < 0 else int(window_left)
    right = _UNBOUNDED if window_right is None or window_right < 0 else int(window_right)
    if causal:
        right = min(right, 0)
    return left, right


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (no TF32) so that fp32 results match an fp64 reference to ~1e-6
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    k_desc,
    v_desc,
    desc_row,
    desc_col,
    stride_kt,
    stride_vt,
    offs_n0,
    offs_d,
    row_pos,
    lo,
    hi,
    len_k,
    win_left,
    win_right,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # 64-bit pointers built once, then advanced by a 32-bit step per block
    k_ptrs = k_base + (lo + offs_n0)[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
    v_ptrs = v_base + (lo + offs_n0)[:, None].to(tl.int64) * stride_vt + offs_d[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        if USE_TMA:  # bulk tensor copy; rows past len_k are masked below (past the tensor: zero-filled)
            k = k_desc.load([desc_row + start_n, desc_col])
        elif MASK:
            k = tl.load(k_ptrs, mask=(offs_n < len_k)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK:
            visible = (
                (offs_n[None, :] >= row_pos[:, None] - win_left)
                & (offs_n[None, :] <= row_pos[:, None] + win_right)
                & (offs_n[None, :] < len_k)
            )
            qk = tl.where(visible, qk, float("-inf"))
        # online softmax in base 2 (scores s * log2(e)); the scale is applied to the row max and inside the
        # exponent, so each score costs one FMA instead of a multiply and a subtract (qk_scale > 0 keeps the max).
        # m_i never drops below its start (sink, or a finite floor), so no inf - inf
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:  # V rows past len_k meet P = 0 (they are finite rows of the next sequence, or zeros)
            v = v_desc.load([desc_row + start_n, desc_col])
        elif MASK:
            v = tl.load(v_ptrs, mask=(offs_n < len_k)[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_lse_h"])
def _sink_attn_fwd(
    Q,
    K,
    V,
    K_desc,
    V_desc,
    Sinks,
    Out,
    Lse,
    cu_seqlens_q,
    cu_seqlens_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lse_h,
    qk_scale,
    win_left,
    win_right,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    off_h = tl.program_id(0)  # heads fastest: programs sharing K/V (a GQA group) run together
    pid_m = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + off_b)
    len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
    k_start = tl.load(cu_seqlens_k + off_b)
    len_k = tl.load(cu_seqlens_k + off_b + 1) - k_start
    # last query blocks first: under a causal mask they are the longest, so the tail of the grid is short
    start_m = (tl.num_programs(1) - 1 - pid_m) * BLOCK_M
    if start_m >= len_q:
        return
    off_kh = off_h // GROUP
    shift = len_k - len_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < len_q
    q_ptrs = (
        Q
        + q_start.to(tl.int64) * stride_qt
        + off_h * stride_qh
        + offs_m[:, None].to(tl.int64) * stride_qt
        + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_base = K + k_start.to(tl.int64) * stride_kt + off_kh * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + off_kh * stride_vh

    if HAS_SINK:  # the sink is one more logit in the normaliser: start from it
        sink = tl.load(Sinks + off_h).to(tl.float32) * _LOG2E
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:  # finite floor instead of -inf: a row with no visible key never computes -inf - (-inf)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    row_pos = offs_m + shift
    lo, full_lo, full_hi, hi = _key_block_ranges(start_m, len_q, len_k, shift, win_left, win_right, BLOCK_M, BLOCK_N)
    # K/V descriptors view k, v as [Tk, Hkv * D]: this (sequence, KV head) tile starts at (k_start, off_kh * D)
    desc_col = off_kh * HEAD_DIM
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        K_desc,
        V_desc,
        k_start,
        desc_col,
        stride_kt,
        stride_vt,
        offs_n0,
        offs_d,
        row_pos,
        lo,
        full_lo,
        len_k,
        win_left,
        win_right,
        qk_scale,
        BLOCK_N,
        True,
        DOT_PRECISION,
        USE_TMA,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        K_desc,
        V_desc,
        k_start,
        desc_col,
        stride_kt,
        stride_vt,
        offs_n0,
        offs_d,
        row_pos,
        full_lo,
        full_hi,
        len_k,
        win_left,
        win_right,
        qk_scale,
        BLOCK_N,
        False,
        DOT_PRECISION,
        USE_TMA,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        K_desc,
        V_desc,
        k_start,
        desc_col,
        stride_kt,
        stride_vt,
        offs_n0,
        offs_d,
        row_pos,
        full_hi,
        hi,
        len_k,
        win_left,
        win_right,
        qk_scale,
        BLOCK_N,
        True,
        DOT_PRECISION,
        USE_TMA,
    )

    # l_i == 0 only without a sink and with no visible key: out = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    o_ptrs = (
        Out
        + q_start.to(tl.int64) * stride_ot
        + off_h * stride_oh
        + offs_m[:, None].to(tl.int64) * stride_ot
        + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + off_h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_rows", "stride_lse_h"])
def _bwd_preprocess(
    Out,
    DO,
    Lse,
    Delta,
    Lse2,
    Sinks,
    SinkW,
    DSink,
    cu_seqlens_q,
    stride_rows,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_lse_h,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    SINK_WEIGHTS: tl.constexpr,
):
    """D_i = rowsum(dO_i * O_i) and the base-2 LSE used by the other kernels (-inf -> +inf so that P = 0), written
    at the sequence's aligned offset (`row_vector_start`); with SINK_WEIGHTS (the fused backward) also the sink's
    probability w_i = exp(s_h - LSE_i) per row, and -sum_i w_i D_i (1 - w_i) added into ``DSink[h]``: the part of
    dsink that the fused kernel leaves out (``gluon_kernels._fused_bwd_mma``)."""
    pid = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + off_b)
    len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs < len_q
    rows = (q_start + offs).to(tl.int64)
    o = tl.load(Out + rows[:, None] * stride_ot + off_h * stride_oh + offs_d[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32
    )
    do = tl.load(
        DO + rows[:, None] * stride_dot + off_h * stride_doh + offs_d[None, :], mask=ok[:, None], other=0.0
    ).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    lse = tl.load(Lse + off_h * stride_lse_h + rows, mask=ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    at = off_h * stride_rows + _row_vector_start(q_start, off_b) + offs
    tl.store(Delta + at, delta, mask=ok)
    tl.store(Lse2 + at, lse2, mask=ok)
    if SINK_WEIGHTS:
        sink2 = tl.load(Sinks + off_h).to(tl.float32) * _LOG2E
        w = tl.exp2(sink2 - lse2)  # 0 on rows past the sequence (lse2 = +inf there, and D = 0)
        tl.store(SinkW + at, w, mask=ok)
        tl.atomic_add(DSink + off_h, -tl.sum(w * delta * (1.0 - w), axis=0))


@triton.jit
def _bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse2_base,
    delta_base,
    q_desc,
    do_desc,
    desc_row,
    desc_col,
    stride_qt,
    stride_dot,
    offs_m0,
    offs_n,
    offs_d,
    lo,
    hi,
    len_q,
    shift,
    win_left,
    win_right,
    qk_scale,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # works on transposed tiles (keys x queries) so the accumulators stay [BLOCK_N, D]
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :]
        do_ptrs = do_base + offs_m[:, None].to(tl.int64) * stride_dot + offs_d[None, :]
        if MASK:  # rows past len_q: LSE = +inf and delta = 0 (and q = dO = 0), so they contribute exactly nothing
            row_ok = offs_m < len_q
            lse2 = tl.load(lse2_base + offs_m, mask=row_ok, other=float("inf"))
        else:
            lse2 = tl.load(lse2_base + offs_m)
        if USE_TMA:  # bulk tensor copy; rows past len_q are finite rows of the next sequence (P = 0) or zeros
            q = q_desc.load([desc_row + start_m, desc_col])
        elif MASK:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        pT = tl.math.exp2(qkT - lse2[None, :])
        if MASK:
            row_pos = offs_m + shift
            visible = (offs_n[:, None] >= row_pos[None, :] - win_left) & (
                offs_n[:, None] <= row_pos[None, :] + win_right
            )
            pT = tl.where(visible, pT, 0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            delta = tl.load(delta_base + offs_m)
        if USE_TMA:
            do = do_desc.load([desc_row + start_m, desc_col])
        elif MASK:
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            do = tl.load(do_ptrs)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["stride_rows", "stride_split", "head_splits"])
def _sink_attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    Lse2,
    Delta,
    DK,
    DV,
    Q_desc,
    DO_desc,
    cu_seqlens_q,
    cu_seqlens_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_rows,
    stride_split,
    head_splits,
    qk_scale,
    sm_scale,
    win_left,
    win_right,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """dK, dV of one (KV head, key block); with ``head_splits`` > 1, of an equal share of the KV group's query heads,
    written as fp32 partial sums at ``DK / DV + split * stride_split``."""
    off_kh = tl.program_id(0) // head_splits
    split = tl.program_id(0) - off_kh * head_splits
    pid_n = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + off_b)
    len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
    k_start = tl.load(cu_seqlens_k + off_b)
    len_k = tl.load(cu_seqlens_k + off_b + 1) - k_start
    start_n = pid_n * BLOCK_N  # first key blocks first: under a causal mask they see the most queries
    if start_n >= len_k:
        return
    shift = len_k - len_q

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < len_k
    k = tl.load(
        K + (k_start + offs_n)[:, None].to(tl.int64) * stride_kt + off_kh * stride_kh + offs_d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V + (k_start + offs_n)[:, None].to(tl.int64) * stride_vt + off_kh * stride_vh + offs_d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_block_ranges(start_n, len_q, len_k, shift, win_left, win_right, BLOCK_M, BLOCK_N)
    # three ranges: an edge (masked), the full blocks, the other edge (masked)
    rows_start = _row_vector_start(q_start, off_b)
    # GQA: the KV head's gradient is the sum over its query heads, accumulated here in a fixed order
    heads = GROUP // head_splits
    for g in range(split * heads, split * heads + heads):
        off_h = off_kh * GROUP + g
        q_base = Q + q_start.to(tl.int64) * stride_qt + off_h * stride_qh
        do_base = DO + q_start.to(tl.int64) * stride_dot + off_h * stride_doh
        lse2_base = Lse2 + off_h * stride_rows + rows_start
        delta_base = Delta + off_h * stride_rows + rows_start
        desc_col = off_h * HEAD_DIM
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse2_base,
            delta_base,
            Q_desc,
            DO_desc,
            q_start,
            desc_col,
            stride_qt,
            stride_dot,
            offs_m0,
            offs_n,
            offs_d,
            lo,
            full_lo,
            len_q,
            shift,
            win_left,
            win_right,
            qk_scale,
            BLOCK_M,
            True,
            DOT_PRECISION,
            USE_TMA,
        )
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse2_base,
            delta_base,
            Q_desc,
            DO_desc,
            q_start,
            desc_col,
            stride_qt,
            stride_dot,
            offs_m0,
            offs_n,
            offs_d,
            full_lo,
            full_hi,
            len_q,
            shift,
            win_left,
            win_right,
            qk_scale,
            BLOCK_M,
            False,
            DOT_PRECISION,
            USE_TMA,
        )
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse2_base,
            delta_base,
            Q_desc,
            DO_desc,
            q_start,
            desc_col,
            stride_qt,
            stride_dot,
            offs_m0,
            offs_n,
            offs_d,
            full_hi,
            hi,
            len_q,
            shift,
            win_left,
            win_right,
            qk_scale,
            BLOCK_M,
            True,
            DOT_PRECISION,
            USE_TMA,
        )
    dk = dk * sm_scale  # dS is w.r.t. S = scale * q.k
    DK += split.to(tl.int64) * stride_split
    DV += split.to(tl.int64) * stride_split
    dk_ptrs = DK + (k_start + offs_n)[:, None].to(tl.int64) * stride_dkt + off_kh * stride_dkh + offs_d[None, :]
    dv_ptrs = DV + (k_start + offs_n)[:, None].to(tl.int64) * stride_dvt + off_kh * stride_dvh + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_inner(
    dq,
    sum_ds,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    k_desc,
    v_desc,
    desc_row,
    desc_col,
    stride_kt,
    stride_vt,
    offs_n0,
    offs_d,
    row_pos,
    lo,
    hi,
    len_k,
    win_left,
    win_right,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    k_ptrs = k_base + (lo + offs_n0)[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
    v_ptrs = v_base + (lo + offs_n0)[:, None].to(tl.int64) * stride_vt + offs_d[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        if USE_TMA:  # keys past len_k meet P = 0, so dS = 0 there (finite rows of the next sequence, or zeros)
            k = k_desc.load([desc_row + start_n, desc_col])
            v = v_desc.load([desc_row + start_n, desc_col])
        elif MASK:
            k = tl.load(k_ptrs, mask=(offs_n < len_k)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n < len_k)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse2[:, None])
        if MASK:
            visible = (
                (offs_n[None, :] >= row_pos[:, None] - win_left)
                & (offs_n[None, :] <= row_pos[:, None] + win_right)
                & (offs_n[None, :] < len_k)
            )
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SINK:
            sum_ds += tl.sum(ds, 1)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return dq, sum_ds


@triton.jit
def _dsink_finish(Part, DSink, stride_part, num_parts, BLOCK: tl.constexpr):
    """dsink_h = the sum of head h's ``num_parts`` partial sums (written by the dQ kernel), added up in a fixed order and
    written in the sink's dtype: one launch instead of a ``torch.sum`` and a cast (host time per layer counts)."""
    off_h = tl.program_id(0)
    row = Part + off_h * stride_part
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.load(row + offs, mask=offs < num_parts, other=0.0)
    tl.store(DSink + off_h, tl.sum(total, axis=0).to(DSink.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_rows", "stride_part"])
def _sink_attn_bwd_dq(
    Q,
    K,
    V,
    K_desc,
    V_desc,
    DO,
    Lse2,
    Delta,
    DQ,
    Sinks,
    DSinkPart,
    cu_seqlens_q,
    cu_seqlens_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_rows,
    stride_part,
    qk_scale,
    sm_scale,
    win_left,
    win_right,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """dQ of one (query head, query block).  With a sink, also this block's share of dsink_h =
    -sum_i w_i D_i (w_i = exp(s_h - LSE_i)) with D_i = sum_j P_ij dP_ij from the fp32 tiles (D from the 16-bit output,
    as dS uses it, carries the output's rounding) into its own slot of ``DSinkPart`` (summed afterwards in a fixed
    order).  Since sum_j P_ij = 1 - w_i, sum_j P_ij dP_ij = sum_j dS_ij + D_i (1 - w_i): one sum per score."""
    off_h = tl.program_id(0)
    pid_m = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + off_b)
    len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
    k_start = tl.load(cu_seqlens_k + off_b)
    len_k = tl.load(cu_seqlens_k + off_b + 1) - k_start
    # last query blocks first: under a causal mask they are the longest, so the tail of the grid is short
    start_m = (tl.num_programs(1) - 1 - pid_m) * BLOCK_M
    if start_m >= len_q:
        return
    off_kh = off_h // GROUP
    shift = len_k - len_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < len_q
    q = tl.load(
        Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + off_h * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + (q_start + offs_m)[:, None].to(tl.int64) * stride_dot + off_h * stride_doh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    rows_at = off_h * stride_rows + _row_vector_start(q_start, off_b) + offs_m
    lse2 = tl.load(Lse2 + rows_at, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + rows_at, mask=row_ok, other=0.0)
    k_base = K + k_start.to(tl.int64) * stride_kt + off_kh * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + off_kh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_pos = offs_m + shift
    lo, full_lo, full_hi, hi = _key_block_ranges(start_m, len_q, len_k, shift, win_left, win_right, BLOCK_M, BLOCK_N)
    sum_ds = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum_j dS_ij
    dq, sum_ds = _bwd_dq_inner(
        dq,
        sum_ds,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        K_desc,
        V_desc,
        k_start,
        off_kh * HEAD_DIM,
        stride_kt,
        stride_vt,
        offs_n0,
        offs_d,
        row_pos,
        lo,
        full_lo,
        len_k,
        win_left,
        win_right,
        qk_scale,
        BLOCK_N,
        True,
        DOT_PRECISION,
        USE_TMA,
        HAS_SINK,
    )
    dq, sum_ds = _bwd_dq_inner(
        dq,
        sum_ds,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        K_desc,
        V_desc,
        k_start,
        off_kh * HEAD_DIM,
        stride_kt,
        stride_vt,
        offs_n0,
        offs_d,
        row_pos,
        full_lo,
        full_hi,
        len_k,
        win_left,
        win_right,
        qk_scale,
        BLOCK_N,
        False,
        DOT_PRECISION,
        USE_TMA,
        HAS_SINK,
    )
    dq, sum_ds = _bwd_dq_inner(
        dq,
        sum_ds,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        K_desc,
        V_desc,
        k_start,
        off_kh * HEAD_DIM,
        stride_kt,
        stride_vt,
        offs_n0,
        offs_d,
        row_pos,
        full_hi,
        hi,
        len_k,
        win_left,
        win_right,
        qk_scale,
        BLOCK_N,
        True,
        DOT_PRECISION,
        USE_TMA,
        HAS_SINK,
    )
    if HAS_SINK:  # rows past len_q: lse2 = +inf, P = 0
        sink2 = tl.load(Sinks + off_h).to(tl.float32) * _LOG2E
        w = tl.math.exp2(sink2 - lse2)
        part = tl.sum(tl.where(row_ok, w * (sum_ds + delta * (1.0 - w)), 0.0), axis=0)
        tl.store(DSinkPart + off_h * stride_part + off_b * tl.num_programs(1) + pid_m, -part)
    dq = dq * sm_scale
    tl.store(
        DQ + (q_start + offs_m)[:, None].to(tl.int64) * stride_dqt + off_h * stride_dqh + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )


# Whether this module's kernels were decorated for Triton's interpreter (TRITON_INTERPRET=1 when triton was imported:
# CPU tensors) rather than compiled.
_INTERPRETED = isinstance(_sink_attn_fwd, InterpretedFunction)


# ----------------------------------------------------------------------------------------------------------
# Host side: the contract used by the package's autograd function / custom ops
# ----------------------------------------------------------------------------------------------------------
def _on_input_device(fn):
    """Runs ``fn`` with its first tensor's GPU as the current device.  Triton launches on the current device's
    stream, which need not hold the inputs: a model split over GPUs in one process (``device_map="auto"``) calls its
    layers from whichever device is current.  FlashAttention's Triton ops guard the same way
    (``flash_attn/ops/triton/layer_norm.py``)."""

    @functools.wraps(fn)
    def on_input_device(first, *args, **kwargs):
        device = first.device
        if device.type == "cuda" and device.index != _current_device():
            with torch.cuda.device(device):
                return fn(first, *args, **kwargs)
        return fn(first, *args, **kwargs)

    return on_input_device


# A forward or backward call first derives everything that follows from its inputs' shapes, strides, dtypes, 16-byte
# alignment and parameters (``gluon`` and a given ``plan`` included): checks, the plan, grids, tile sizes, buffer
# shapes. That is cached per key, together with the call's launch records (``_launch.launch_at``), so later calls with
# the same signature (every layer of a model, every step) only allocate and launch. The tensors' data never enters:
# only the values the key holds are read, and the dispatch reads nothing else (its thresholds are constants).
_CALLS: dict = {}
_CALLS_MAX = 1024


def _tensor_key(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)


def _cached_call(key, build):
    call = _CALLS.get(key)
    if call is None:
        call = build()
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = call
    return call


class _ForwardCall(NamedTuple):
    """What a forward derives from its inputs' signature (``_forward_call``)."""

    lse_shape: tuple
    empty: bool  # no query rows or no sequences: out = 0, lse = -inf
    kernel: str  # the plan's forward kernel
    grid: tuple
    tma: bool
    constexprs: dict  # the Triton kernel's constexprs and launch options, or the Gluon kernel's configuration
    sites: dict  # launch records (``_launch.launch_at``)
    strides: tuple = ()  # the Triton kernel's token and head strides of q, k, v, out, and lse's head stride


def _forward_call(q, k, v, sinks, cu_seqlens_q, max_seqlen_q, max_seqlen_k, left, right, gluon, plan) -> _ForwardCall:
    _check_inputs((("q", q), ("k", k), ("v", v)))
    T_q, H_q, D = q.shape[-3:]
    H_kv = k.shape[-2]
    if H_q % H_kv:
        raise ValueError(f"number of query heads {H_q} must be a multiple of KV heads {H_kv}")
    num_seqs = cu_seqlens_q.numel() - 1
    empty = T_q == 0 or num_seqs == 0 or max_seqlen_q == 0
    if plan is None:
        plan = _plan(q, k, v, left < _UNBOUNDED, max_seqlen_q, max_seqlen_k, gluon)
    else:
        _check_plan(plan, q, k, v)
    if plan.fwd == "gluon_fwd":
        return _ForwardCall((H_q, T_q), empty, plan.fwd, (), True, CONFIGS[("gluon_fwd", D)], {})
    cfg = _config(plan.fwd, D, q.device)
    block_m = cfg.pop("BLOCK_M")
    constexprs = dict(
        GROUP=H_q // H_kv,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        HAS_SINK=sinks is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
        USE_TMA=plan.tma,
        **cfg,
    )
    grid = (H_q, _cdiv(max_seqlen_q, block_m), num_seqs)
    out = torch.empty_like(q, device="meta")  # (the strides the call's torch.empty_like(q) gives out)
    strides = (*q.stride()[-3:-1], *k.stride()[-3:-1], *v.stride()[-3:-1], *out.stride()[-3:-1], T_q)
    return _ForwardCall((H_q, T_q), empty, plan.fwd, grid, plan.tma, constexprs, {}, strides)


@_on_input_device
def sink_attention_forward(
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
    *,
    gluon=True,
    plan=None,
):
    """Sink-aware attention forward on packed sequences.

    q ``[Tq, Hq, D]``; k, v ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0``; sinks ``[Hq]`` (any float dtype, read as
    float32) or None;
    cu_seqlens int32 ``[B + 1]``.  Returns ``out [Tq, Hq, D]`` in q's dtype and the sink-inclusive natural-log
    ``lse [Hq, Tq]`` float32.  A row with no visible key gets out = 0 and lse = sink (or -inf without sink).

    ``gluon``: the Gluon kernels where they win on sm_90 (``backend="auto"``), or the Triton kernels alone (False,
    ``backend="triton"``).  ``plan``: the kernels to run instead of ``_plan``'s choice (a ``_Plan``; checked), for
    tests and benchmarks that run a kernel outside the shapes the dispatch gives it.
    """
    _check_interpreter_dtype(q)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    left, right = _window_bounds(causal, window_left, window_right)
    gluon = bool(gluon)
    key = (
        "fwd", q.device, _tensor_key(q), _tensor_key(k), _tensor_key(v), _tensor_key(sinks), _tensor_key(cu_seqlens_q),
        _tensor_key(cu_seqlens_k), max_seqlen_q, max_seqlen_k, left, right, gluon, plan,
    )  # fmt: skip
    call = _cached_call(
        key,
        lambda: _forward_call(q, k, v, sinks, cu_seqlens_q, max_seqlen_q, max_seqlen_k, left, right, gluon, plan),
    )
    out = torch.empty_like(q)  # same layout rule as the custom op's fake (q's strides when q is dense)
    lse = torch.empty(call.lse_shape, device=q.device, dtype=torch.float32)
    if call.empty:
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    qk_scale = float(softmax_scale) * LOG2E
    if call.kernel == "gluon_fwd":
        _run_gluon(
            "fwd", q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, qk_scale, left, right,
            call.constexprs, _multiprocessors(q.device), call.sites,
        )  # fmt: skip
        return out, lse
    k_desc, v_desc = _descriptors_if(call.tma, call.constexprs["BLOCK_N"], k, v)
    _launch_at(
        call.sites,
        "fwd",
        _sink_attn_fwd,
        call.grid,
        q,
        k,
        v,
        k_desc,
        v_desc,
        sinks if sinks is not None else q,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        *call.strides,
        qk_scale,
        left,
        right,
        **call.constexprs,
    )
    return out, lse


class _BackwardCall(NamedTuple):
    """What a backward derives from its inputs' signature (``_backward_call``)."""

    empty: bool  # no query rows or no sequences: zero gradients
    fused: bool  # gluon_kernels.backward_fused
    gluon: bool  # gluon_kernels.backward (dK/dV then dQ)
    side_stream: bool  # the Triton dQ kernel runs on a side stream next to the dK/dV kernel
    tma: bool  # the Triton backward kernels load tiles through descriptors
    keys: bool  # the layer has keys (else dK = dV = 0 and no dK/dV launch)
    buffer_shape: tuple  # [rows, H, stride_rows]: the per-row vectors' zero-filled buffer
    rows: int  # 2 when the fused kernel reads the sink weights (a second per-row vector)
    stride_rows: int
    dq_blocks: int  # columns of dsink's partial sums (0: none)
    shared_partials: bool  # the partial sums are the buffer's last row (else their own allocation)
    dsink_block: int  # partial sums per step of _dsink_finish
    head_splits: int
    pre_grid: tuple
    pre_block: int
    dkdv_grid: tuple
    dkdv_constexprs: dict
    dq_grid: tuple
    dq_constexprs: dict
    sites: dict  # launch records (``_launch.launch_at``)
    strides: tuple  # the Triton kernels' token and head strides of q, k, v and dout


def _backward_call(
    dout,
    q,
    k,
    v,
    out,
    sinks,
    cu_seqlens_q,
    max_seqlen_q,
    max_seqlen_k,
    left,
    right,
    deterministic,
    outputs,
    gluon,
    plan,
) -> _BackwardCall:
    _check_inputs((("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)))
    for name, given, like in zip(("dq_out", "dk_out", "dv_out"), outputs, (q, k, v)):
        if given is not None and (given.shape != like.shape or given.dtype != like.dtype or given.stride(-1) != 1):
            raise ValueError(
                f"{name} must be a {tuple(like.shape)} {like.dtype} tensor with a contiguous last dim, got "
                f"{tuple(given.shape)} {given.dtype} strides {given.stride()}"
            )
    T_q, H_q, D = q.shape[-3:]
    H_kv = k.shape[-2]
    num_seqs = cu_seqlens_q.numel() - 1
    group = H_q // H_kv
    windowed = left < _UNBOUNDED
    if plan is None:
        plan = _plan(q, k, v, windowed, max_seqlen_q, max_seqlen_k, gluon)
    else:
        _check_plan(plan, q, k, v)
    dout_tma = plan.tma and _tma_ok(dout)
    gluon = plan.dkdv == "gluon_dkdv" and dout_tma  # (a dout that TMA cannot read: the Triton kernels this call)
    # (PyTorch's deterministic mode forces the deterministic backward, as it does for PyTorch's own atomic kernels)
    fused = gluon and plan.fused_bwd and not deterministic
    # Per-row vectors D and base-2 LSE, [H, stride_rows] with every sequence 16-byte aligned (row_vector_start).
    # D's unused slots must be finite where the Gluon dK/dV kernel reads a query block's D by TMA past its
    # sequence's end (those rows have P = 0): zeros. The fused kernel also reads the sink weights exp(s_h - LSE_i)
    # by TMA: zeros in the unused slots too.
    stride_rows = _row_vector_stride(T_q, num_seqs)
    rows = 2 if fused and sinks is not None else 1
    # dsink's partial sums of the deterministic kernels, one per (head, dQ program; programs past a sequence's end
    # leave their zero): the dQ kernel writes them, ``_dsink_finish`` adds them up in a fixed order. They share the
    # zero-filled buffer of the per-row vectors when they fit in a row (one allocation and one fill per call: host
    # time counts at these sizes); each row is contiguous and 16-byte aligned (stride_rows % 4 == 0).
    dq_cfg = dict(CONFIGS[("gluon_dq", D)] if gluon else _config("dq", D, q.device))
    dq_blocks = num_seqs * _cdiv(max_seqlen_q, dq_cfg["BLOCK_M"]) if sinks is not None and not fused else 0
    shared_partials = 0 < dq_blocks <= stride_rows
    buffer_shape = (rows + 1 + shared_partials, H_q, stride_rows)
    pre_block = 64 if _compiled(q.device) else 16
    pre_grid = (max(_cdiv(max_seqlen_q, pre_block), 1), H_q, num_seqs)
    # dK / dV: written by the kernel, or, when the dK/dV grid is split over the heads of a KV group, its fp32 partial
    # sums [splits, T_k, H_kv, D] (dK's and dV's in one buffer), reduced in a fixed order
    if fused:
        dkdv_block_n, per_sm = CONFIGS[("gluon_bwd_fused", D)]["BLOCK_N"], FUSED_PROGRAMS_PER_SM
    elif gluon:
        dkdv_block_n, per_sm = CONFIGS[("gluon_dkdv", D)]["BLOCK_N"], DKDV_PROGRAMS_PER_SM
    else:
        dkdv_block_n, per_sm = _config("dkdv", D, q.device)["BLOCK_N"], DKDV_PROGRAMS_PER_SM
    head_splits = plan.head_splits or _dkdv_head_splits(
        group, H_kv * _cdiv(max_seqlen_k, dkdv_block_n) * num_seqs, _multiprocessors(q.device), windowed, per_sm
    )
    # the Triton kernels' grids and constexprs (the Gluon ones take their configurations from CONFIGS)
    tma = dout_tma and q.element_size() == 2  # fp32 tiles overflow the dK/dV kernel's shared memory
    precision = _dot_precision(q.dtype)
    dkdv_cfg = _config("dkdv", D, q.device)
    block_n = dkdv_cfg.pop("BLOCK_N")
    dkdv_grid = (H_kv * head_splits, _cdiv(max_seqlen_k, block_n), num_seqs)
    dkdv_constexprs = dict(GROUP=group, HEAD_DIM=D, BLOCK_N=block_n, DOT_PRECISION=precision, USE_TMA=tma, **dkdv_cfg)
    if gluon:
        dq_grid, dq_constexprs = (), dq_cfg
    else:
        block_m = dq_cfg.pop("BLOCK_M")
        dq_grid = (H_q, _cdiv(max_seqlen_q, block_m), num_seqs)
        dq_constexprs = dict(
            GROUP=group,
            HEAD_DIM=D,
            BLOCK_M=block_m,
            DOT_PRECISION=precision,
            USE_TMA=tma,
            HAS_SINK=sinks is not None,
            **dq_cfg,
        )
    return _BackwardCall(
        empty=T_q == 0 or num_seqs == 0,
        fused=fused,
        gluon=gluon,
        side_stream=plan.concurrent,
        tma=tma,
        keys=k.shape[-3] > 0 and max_seqlen_k > 0,
        buffer_shape=buffer_shape,
        rows=rows,
        stride_rows=stride_rows,
        dq_blocks=dq_blocks,
        shared_partials=shared_partials,
        dsink_block=min(1024, triton.next_power_of_2(max(dq_blocks, 1))),
        head_splits=head_splits,
        pre_grid=pre_grid,
        pre_block=pre_block,
        dkdv_grid=dkdv_grid,
        dkdv_constexprs=dkdv_constexprs,
        dq_grid=dq_grid,
        dq_constexprs=dq_constexprs,
        sites={},
        strides=(*q.stride()[-3:-1], *k.stride()[-3:-1], *v.stride()[-3:-1], *dout.stride()[-3:-1]),
    )


def _finish_dsink(call: _BackwardCall, partials: torch.Tensor, dsink: torch.Tensor) -> None:
    """dsink [H] from the dQ kernel's partial sums (``_dsink_finish``)."""
    _launch_at(
        call.sites, "dsink", _dsink_finish, (dsink.shape[0], 1, 1), partials, dsink, partials.stride(0), call.dq_blocks,
        BLOCK=call.dsink_block,
    )  # fmt: skip


@_on_input_device
def sink_attention_backward(
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
    deterministic=False,
    dq_out=None,
    dk_out=None,
    dv_out=None,
    *,
    gluon=True,
    plan=None,
):
    """Gradients of :func:`sink_attention_forward`: ``dq [Tq,Hq,D]``, ``dk, dv [Tk,Hkv,D]`` (input dtype,
    summed over each KV group's query heads) and ``dsink [Hq]`` in the sink's dtype (None without sinks).  ``dq_out``,
    ``dk_out``, ``dv_out``, when given, receive dq, dk, dv (any strides with a contiguous last dim) and are returned:
    gradients laid out like the caller's inputs (FlashAttention's ``dq``, ``dk``, ``dv`` arguments).

    ``deterministic=False`` (FlashAttention's default) runs the one-kernel backward where it exists (sm_90, 16-bit,
    head_dim 64: ``gluon_kernels.backward_fused``, five products per tile instead of seven), which adds dQ and dsink
    up with atomics: their rounding order varies between runs.  Everywhere else, with ``deterministic=True`` and
    under ``torch.use_deterministic_algorithms(True)``, every gradient is written in a fixed order (no atomics) and
    the results are bitwise reproducible.  ``gluon`` and ``plan`` as in :func:`sink_attention_forward`."""
    _check_interpreter_dtype(q)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    left, right = _window_bounds(causal, window_left, window_right)
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    gluon = bool(gluon)
    lse = lse.contiguous()
    key = (
        "bwd", q.device, _tensor_key(dout), _tensor_key(q), _tensor_key(k), _tensor_key(v), _tensor_key(out),
        _tensor_key(lse), _tensor_key(sinks), _tensor_key(cu_seqlens_q), _tensor_key(cu_seqlens_k), max_seqlen_q,
        max_seqlen_k, left, right, deterministic, gluon, plan, _tensor_key(dq_out), _tensor_key(dk_out),
        _tensor_key(dv_out),
    )  # fmt: skip
    derive = (dout, q, k, v, out, sinks, cu_seqlens_q, max_seqlen_q, max_seqlen_k, left, right, deterministic)
    call = _cached_call(key, lambda: _backward_call(*derive, (dq_out, dk_out, dv_out), gluon, plan))
    H_q = q.shape[-2]
    dq = torch.empty_like(q) if dq_out is None else dq_out
    if call.empty:
        dk = torch.empty_like(k) if dk_out is None else dk_out
        dv = torch.empty_like(v) if dv_out is None else dv_out
        dsink = torch.zeros(H_q, device=q.device, dtype=sinks.dtype) if sinks is not None else None
        return dq.zero_(), dk.zero_(), dv.zero_(), dsink
    qk_scale = float(softmax_scale) * LOG2E
    sm_scale = float(softmax_scale)
    stride_rows, rows = call.stride_rows, call.rows
    buffer = torch.zeros(call.buffer_shape, device=q.device, dtype=torch.float32)
    scratch = buffer.unbind(0)
    delta, sink_weights, lse2 = scratch[0], scratch[rows - 1], scratch[rows]
    # dsink: added up by the fused kernel (and its preprocessing) in fp32, else by _dsink_finish in the sink's dtype
    if sinks is None:
        dsink = None
    elif call.fused:
        dsink = torch.zeros(H_q, device=q.device, dtype=torch.float32)
    else:
        dsink = torch.empty(H_q, device=q.device, dtype=sinks.dtype)
    if call.shared_partials:
        partials = scratch[rows + 1]
    elif call.dq_blocks:
        partials = torch.zeros((H_q, call.dq_blocks), device=q.device, dtype=torch.float32)
    else:
        partials = None
    _launch_at(
        call.sites,
        "preprocess",
        _bwd_preprocess,
        call.pre_grid,
        out,
        dout,
        lse,
        delta,
        lse2,
        sinks if rows == 2 else lse2,
        sink_weights,
        dsink if rows == 2 else lse2,
        cu_seqlens_q,
        stride_rows,
        out.stride(-3),
        out.stride(-2),
        dout.stride(-3),
        dout.stride(-2),
        lse.stride(0),
        HEAD_DIM=q.shape[-1],
        BLOCK=call.pre_block,
        SINK_WEIGHTS=rows == 2,
    )
    head_splits = call.head_splits
    if head_splits > 1:  # the kernels write fp32 partial sums, reduced into dk and dv in a fixed order
        partial = torch.empty((2, head_splits, *k.shape), device=q.device, dtype=torch.float32)
        dk_dest, dv_dest = partial[0], partial[1]
    else:
        dk_dest = torch.empty_like(k) if dk_out is None else dk_out
        dv_dest = torch.empty_like(v) if dv_out is None else dv_out

    def dkdv_result():
        if head_splits == 1:
            return dk_dest, dv_dest
        # one tensor each: the custom op (the path torch.compile and dispatch modes take) may not return outputs
        # that alias one another
        dk_sum, dv_sum = partial[0].sum(dim=0), partial[1].sum(dim=0)
        return (
            dk_sum.to(k.dtype) if dk_out is None else dk_out.copy_(dk_sum),
            dv_sum.to(v.dtype) if dv_out is None else dv_out.copy_(dv_sum),
        )

    if call.fused:  # (the plan gives it full-attention layers of at least FUSED_MIN_SEQLEN keys)
        dq32 = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        _run_gluon(
            "backward_fused",
            q,
            k,
            v,
            dout,
            lse2,
            delta,
            sink_weights,
            dsink,
            dq32,
            dk_dest,
            dv_dest,
            head_splits,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_k,
            qk_scale,
            sm_scale,
            left,
            right,
            CONFIGS[("gluon_bwd_fused", q.shape[-1])],
            call.sites,
        )
        if dsink is not None and dsink.dtype != sinks.dtype:
            dsink = dsink.to(sinks.dtype)
        return dq.copy_(dq32), *dkdv_result(), dsink
    if call.gluon:
        _run_gluon(
            "backward",
            q,
            k,
            v,
            dout,
            lse2,
            delta,
            sinks,
            partials,
            dq,
            dk_dest,
            dv_dest,
            head_splits,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            qk_scale,
            sm_scale,
            left,
            right,
            CONFIGS[("gluon_dkdv", q.shape[-1])],
            call.dq_constexprs,
            call.sites,
        )
        if dsink is not None:
            _finish_dsink(call, partials, dsink)
        return dq, *dkdv_result(), dsink

    side = _side_stream(q.device) if call.side_stream else None
    if side is not None:  # the dQ kernel below starts on the side stream once delta/lse2 are written
        side.wait_stream(torch.cuda.current_stream(q.device))
    if not call.keys:
        dk_dest.zero_()
        dv_dest.zero_()
    else:
        q_desc, do_desc = _descriptors_if(call.tma, call.dkdv_constexprs["BLOCK_M"], q, dout)
        _launch_at(
            call.sites,
            "dkdv",
            _sink_attn_bwd_dkdv,
            call.dkdv_grid,
            q,
            k,
            v,
            dout,
            lse2,
            delta,
            dk_dest,
            dv_dest,
            q_desc,
            do_desc,
            cu_seqlens_q,
            cu_seqlens_k,
            *call.strides,
            dk_dest.stride(-3),
            dk_dest.stride(-2),
            dv_dest.stride(-3),
            dv_dest.stride(-2),
            stride_rows,
            dk_dest.stride(0) if head_splits > 1 else 0,
            head_splits,
            qk_scale,
            sm_scale,
            left,
            right,
            **call.dkdv_constexprs,
        )
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        k_desc, v_desc = _descriptors_if(call.tma, call.dq_constexprs["BLOCK_N"], k, v)
        _launch_at(
            call.sites,
            "dq",
            _sink_attn_bwd_dq,
            call.dq_grid,
            q,
            k,
            v,
            k_desc,
            v_desc,
            dout,
            lse2,
            delta,
            dq,
            sinks if sinks is not None else lse2,
            partials if sinks is not None else lse2,
            cu_seqlens_q,
            cu_seqlens_k,
            *call.strides,
            dq.stride(-3),
            dq.stride(-2),
            stride_rows,
            partials.stride(0) if sinks is not None else 0,
            qk_scale,
            sm_scale,
            left,
            right,
            **call.dq_constexprs,
        )
        if dsink is not None:
            _finish_dsink(call, partials, dsink)
    if side is not None:
        # join: later work on the caller's stream (and the frees of delta/lse2 here) waits for the dQ kernel
        torch.cuda.current_stream(q.device).wait_stream(side)
    return dq, *dkdv_result(), dsink
