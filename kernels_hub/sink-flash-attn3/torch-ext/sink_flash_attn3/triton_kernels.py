"""Triton forward/backward kernels of sink-aware flash attention (varlen, GQA, causal, sliding window).

Layout: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]`` (last dim contiguous, other strides arbitrary), sequences
packed along the token axis and delimited by ``cu_seqlens_q/k`` (int32 ``[B + 1]``).  One program handles one
(block of rows, head, sequence); the grid runs over ``max_seqlen`` and programs past the end of a shorter
sequence exit at once.

Math (per query row i of head h, with the learnable sink logit s_h, FACTS §2)::

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
Each program only visits key (or query) blocks that intersect that band — sliding layers cost O(S * W) —
and splits them into blocks fully inside the band (no mask arithmetic) and edge blocks (masked), like the
Triton fused-attention tutorial.

The backward is deterministic with no atomics at all: dK/dV are accumulated by one program per key block
that loops over every query head of its KV group (GQA needs no repeated K/V and no reduction afterwards),
dQ by one program per query block that loops over key blocks, and dsink by one program per head.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # older Triton: the pointer paths only
    _TensorDescriptor = None

__all__ = ["sink_attention_forward", "sink_attention_backward", "KERNEL_CONFIGS"]

LOG2E = 1.4426950408889634
# constexpr copies for use inside kernels (compiled Triton only reads constexpr globals)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# "Unbounded" window side: far beyond any sequence, small enough that a +/- seq_len stays in int32.
_UNBOUNDED = 1 << 30

# Block sizes / launch parameters per (kernel, head_dim).  D=64 (GPT-OSS): the fastest on the H200
# (benchmarks/attention.py --sweep / --variants; notes in benchmarks/notes/attention.md); "fwd_window" is the
# forward of a bounded window (GPT-OSS sliding layers), where short rows favour smaller tiles.  D=128: checked for
# correctness on the H200, not timed.  The benchmark overrides entries to sweep configurations.
KERNEL_CONFIGS: dict[tuple[str, int], dict[str, int]] = {
    ("fwd", 64): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),  # 4.99 ms at 16k causal (128x64 w8: 5.35)
    ("fwd", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    # (windowed: 128 registers per thread -> four programs per SM, 0.29 -> 0.24 ms at 16k, notes v7)
    ("fwd_window", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, maxnreg=128),
    ("fwd_window", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("dkdv", 64): dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=4),
    ("dkdv", 128): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    ("dkdv_atomic", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("dkdv_atomic", 128): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    ("dq", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("dq", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
}
# Non-deterministic dQ accumulated in fp32 inside the dK/dV kernel (used only when deterministic=False): 5 matmuls
# instead of 7.  Where the Gluon kernels apply (sm_90, 16-bit, head_dim 64) the Gluon dK/dV kernel does it with one
# TMA reduce-add of each dQ tile from shared memory; elsewhere the Triton one, "tma": one bulk tensor reduce-add per
# tile (sm_90+), "atomic": per-element fp32 atomics.  Off by default: on the H200 the 16k causal backward takes
# 15.3 ms this way against 13.7 for the deterministic two-kernel one (the reduce traffic of 64-key tiles, 35 GB of
# fp32 at 16k, costs more than the dQ kernel's recomputation; benchmarks/notes/attention.md v10).  DQ_REVERSE (the
# Triton kernel): visit query blocks last-first (a few % faster: concurrent programs reduce into the same rows).
ATOMIC_DQ = False
ATOMIC_DQ_MODE = "tma"
DQ_REVERSE = True
# Forward: K/V through tensor descriptors (TMA) on sm_90+ (3-7% faster than pointer loads on the H200), and
# Triton's automatic warp specialisation of the unmasked key loop (no gain measured: off).
FWD_TMA = True
FWD_WARP_SPEC = False
# Backward: Q/dO (dK/dV kernel) and K/V (dQ kernel) through tensor descriptors on sm_90+, as the forward does:
# 16k causal backward 16.45 -> 15.55 ms on the H200.  16-bit inputs only: fp32 tiles at head_dim 128 overflow the
# shared memory of the dK/dV kernel (262,680 B needed, 232,448 B on an H200).
BWD_TMA = True
# Deterministic backward: the dK/dV and dQ kernels read the same inputs and write disjoint outputs, so the dQ kernel
# can run on a side stream while the dK/dV kernel runs (their programs then share the SMs, and the dK/dV kernel's
# long-tail programs no longer leave SMs idle).  H200, bf16 backward alone (benchmarks/notes/attention.md, v4): 4k
# causal 1.45 -> 1.20 ms, 16k window 128 1.07 -> 1.03 ms, 16k causal 15.55 -> 15.71 ms (slightly slower: the
# 1,024 dK/dV programs already fill the GPU).  "auto": concurrent for windowed layers and for keys up to
# _CONCURRENT_MAX_SEQLEN; True / False force it.
BWD_CONCURRENT = "auto"
_CONCURRENT_MAX_SEQLEN = 8192
_SIDE_STREAMS: dict = {}
# Backward on Hopper (sm_90): the Gluon kernels of gluon_kernels.py, same math and the same deterministic structure,
# with asynchronous warpgroup MMAs so that exp2 and the dS arithmetic overlap the tensor cores (which Triton's
# tl.dot does not do), for 16-bit inputs at the head dims in gluon_kernels.CONFIGS.  H200 (benchmarks/notes/
# attention.md, v6-v7), backward alone: 16k causal 15.4 -> 13.6 ms, 16k window 128 1.09 -> 0.60 ms, 4k causal
# 1.47 -> 1.00 ms.  "auto" / True: Gluon wherever it applies; "dkdv" / "dq": Gluon for that kernel only; False:
# Triton only.  If this Triton cannot compile them (Gluon is experimental and its API moves between releases), the
# first call warns and the Triton kernels take over for the rest of the process.  The environment variable
# SINK_FLASH_ATTN3_GLUON_BWD (auto | 1 | 0 | dkdv | dq) sets it at import.
GLUON_BWD_ENV_VAR = "SINK_FLASH_ATTN3_GLUON_BWD"
_GLUON_SETTINGS = {"auto": "auto", "1": True, "true": True, "on": True, "0": False, "false": False, "off": False,
                   "dkdv": "dkdv", "dq": "dq"}


def _gluon_setting(value: str):
    try:
        return _GLUON_SETTINGS[value.strip().lower()]
    except KeyError:
        raise ValueError(f"{GLUON_BWD_ENV_VAR} must be one of {sorted(_GLUON_SETTINGS)}, got {value!r}") from None


GLUON_BWD = _gluon_setting(os.environ.get(GLUON_BWD_ENV_VAR, "auto"))
# Forward on Hopper (sm_90) in Gluon.  "auto" (the default): gluon_kernels._fwd_ws_kernel, FA4's sm_90 forward shape
# (a load warp and three consumer warpgroups, 192 x 128 tiles), for layers without a left window on sequences of at
# least _WS_MIN_SEQLEN queries, where it is faster (H200, same call: 16k causal 4.48 vs 5.01 ms, 8k 1.20 vs 1.26;
# benchmarks/notes/attention.md, v12), and the Triton forward elsewhere: a window-128 program sees two or three key
# blocks, too few to fill a producer/consumer pipeline (0.56 vs 0.32 ms), and at 4k one 192-row program per SM
# leaves a longer tail (0.350 vs 0.341).  "ws": that kernel for every layer.  True: gluon_kernels._fwd_kernel (one
# warpgroup per program, FlashAttention-3's in-warpgroup overlap; correct, not faster than Triton: notes v8).
# False: the Triton forward only.  (A ping-pong variant, two warpgroups taking turns, measured no faster and was
# retired once the ws kernel was verified: notes v10, v12.)
GLUON_FWD = "auto"
_WS_MIN_SEQLEN = 8192
_GLUON: dict = {}
_INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
# Integer arguments that change with every batch (total token count, number of sequences) are not specialised:
# Triton would otherwise compile a new binary whenever T crosses "divisible by 16" (measured on the H200 in an RL
# run: two ~50 s compile stalls of the fp32 kernels within the first 5 steps).  Strides and windows stay
# specialised: they are fixed per model.  (The forward's `stride_lse_h` is T_q: lse is [H, T_q].)


def _config(kernel: str, head_dim: int, device: torch.device) -> dict[str, int]:
    if device.type != "cuda":  # TRITON_INTERPRET=1 on CPU tensors: small blocks keep numpy fast
        return dict(_INTERPRET_CONFIG)
    cfg = KERNEL_CONFIGS.get((kernel, head_dim))
    if cfg is None:  # other head dims: the D=128 settings with smaller tiles for D=256
        cfg = dict(KERNEL_CONFIGS[(kernel, 128)])
        if head_dim > 128:
            cfg.update(BLOCK_M=64, BLOCK_N=32, num_stages=1)
    if torch.version.hip is not None:
        cfg.pop("maxnreg", None)  # an NVIDIA compile option
    return dict(cfg)


# ----------------------------------------------------------------------------------------------------------
# Band arithmetic shared by the kernels.  All bounds are in-sequence indices; `shift = len_k - len_q`.
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _key_block_ranges(start_m, len_q, len_k, shift, win_left, win_right, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Key blocks seen by query rows [start_m, start_m + BLOCK_M): returns (lo, full_lo, full_hi, hi).

    [lo, full_lo) and [full_hi, hi) are edge blocks (need the mask); [full_lo, full_hi) are blocks whose every
    key is visible from every valid row of the block (and < len_k), so no mask is computed there."""
    a_min = start_m + shift  # aligned positions of the first / last valid row
    a_max = tl.minimum(start_m + BLOCK_M, len_q) - 1 + shift
    lo_raw = tl.maximum(a_min - win_left, 0)
    hi = tl.minimum(len_k, a_max + win_right + 1)
    lo = (lo_raw // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)  # empty band -> empty loops
    end = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(a_max - win_left, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), end)
    full_hi = (tl.maximum(tl.minimum(len_k, a_min + win_right + 1), 0) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_block_ranges(start_n, len_q, len_k, shift, win_left, win_right, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Query blocks that see keys [start_n, start_n + BLOCK_N): (lo, full_lo, full_hi, hi) as above; the full
    blocks have every row valid (< len_q) and seeing every key of the block."""
    n_max = tl.minimum(start_n + BLOCK_N, len_k) - 1
    # row i (aligned a = i + shift) sees key j iff j - win_right <= a <= j + win_left
    lo_raw = tl.maximum(start_n - win_right - shift, 0)
    hi = tl.minimum(len_q, n_max + win_left - shift + 1)
    lo = (lo_raw // BLOCK_M) * BLOCK_M
    hi = tl.maximum(hi, lo)
    end = tl.cdiv(hi, BLOCK_M) * BLOCK_M
    full_lo = tl.cdiv(tl.maximum(n_max - win_right - shift, 0), BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), end)
    full_hi = (tl.maximum(tl.minimum(len_q, start_n + win_left - shift + 1), 0) // BLOCK_M) * BLOCK_M
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return lo, full_lo, full_hi, hi


@triton.jit
def _row_vector_start(q_start, off_b):
    """Where sequence ``off_b``'s rows start in the backward's per-row vectors (LSE and D, ``[H, stride_rows]``,
    see ``_row_vector_stride``): every sequence at a 16-byte aligned offset, because a TMA copy of a query block's
    values (the Gluon kernels) must start 16-byte aligned.  With ``c = q_start``: 4 * ceil(c / 4) + 4 * b leaves
    at least one slot between consecutive sequences, so no two rows share a slot."""
    return 4 * tl.cdiv(q_start, 4) + 4 * off_b


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, desc_row, desc_col, stride_kt, stride_vt,
               offs_n0, offs_d, row_pos, lo, hi, len_k, win_left, win_right, qk_scale, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr):
    # 64-bit pointers built once, then advanced by a 32-bit step per block
    k_ptrs = k_base + (lo + offs_n0)[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
    v_ptrs = v_base + (lo + offs_n0)[:, None].to(tl.int64) * stride_vt + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
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
            visible = ((offs_n[None, :] >= row_pos[:, None] - win_left)
                       & (offs_n[None, :] <= row_pos[:, None] + win_right)
                       & (offs_n[None, :] < len_k))
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
def _sink_attn_fwd(Q, K, V, K_desc, V_desc, Sinks, Out, Lse, cu_seqlens_q, cu_seqlens_k,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   stride_lse_h, qk_scale, win_left, win_right,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_SINK: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                   WARP_SPEC: tl.constexpr):
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
    q_ptrs = (Q + q_start.to(tl.int64) * stride_qt + off_h * stride_qh
              + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :])
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
    lo, full_lo, full_hi, hi = _key_block_ranges(start_m, len_q, len_k, shift, win_left, win_right,
                                                 BLOCK_M, BLOCK_N)
    # K/V descriptors view k, v as [Tk, Hkv * D]: this (sequence, KV head) tile starts at (k_start, off_kh * D)
    desc_col = off_kh * HEAD_DIM
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, K_desc, V_desc, k_start, desc_col, stride_kt,
                               stride_vt, offs_n0, offs_d, row_pos, lo, full_lo, len_k, win_left, win_right,
                               qk_scale, BLOCK_N, True, DOT_PRECISION, USE_TMA, False)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, K_desc, V_desc, k_start, desc_col, stride_kt,
                               stride_vt, offs_n0, offs_d, row_pos, full_lo, full_hi, len_k, win_left, win_right,
                               qk_scale, BLOCK_N, False, DOT_PRECISION, USE_TMA, WARP_SPEC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, K_desc, V_desc, k_start, desc_col, stride_kt,
                               stride_vt, offs_n0, offs_d, row_pos, full_hi, hi, len_k, win_left, win_right,
                               qk_scale, BLOCK_N, True, DOT_PRECISION, USE_TMA, False)

    # l_i == 0 only without a sink and with no visible key: out = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    o_ptrs = (Out + q_start.to(tl.int64) * stride_ot + off_h * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_ot + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + off_h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_rows", "stride_lse_h"])
def _bwd_preprocess(Out, DO, Lse, Delta, Lse2, cu_seqlens_q, stride_rows, stride_ot, stride_oh, stride_dot,
                    stride_doh, stride_lse_h, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """D_i = rowsum(dO_i * O_i) and the base-2 LSE used by the other kernels (-inf -> +inf so that P = 0), written
    at the sequence's aligned offset (`_row_vector_start`)."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + off_b)
    len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs < len_q
    rows = (q_start + offs).to(tl.int64)
    o = tl.load(Out + rows[:, None] * stride_ot + off_h * stride_oh + offs_d[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None] * stride_dot + off_h * stride_doh + offs_d[None, :], mask=ok[:, None],
                 other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    lse = tl.load(Lse + off_h * stride_lse_h + rows, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    at = off_h * stride_rows + _row_vector_start(q_start, off_b) + offs
    tl.store(Delta + at, delta, mask=ok)
    tl.store(Lse2 + at, lse2, mask=ok)


@triton.jit(do_not_specialize=["stride_rows", "NUM_SEQS"])
def _bwd_dsink(Sinks, Lse2, Delta, DSink, cu_seqlens_q, stride_rows, NUM_SEQS, BLOCK: tl.constexpr):
    """dsink_h = -sum_i exp(s_h - LSE_i) D_i over every row of head h: one program per head, fixed order."""
    off_h = tl.program_id(0)
    sink2 = tl.load(Sinks + off_h).to(tl.float32) * _LOG2E
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off_b in range(NUM_SEQS):
        q_start = tl.load(cu_seqlens_q + off_b)
        len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
        base = off_h * stride_rows + _row_vector_start(q_start, off_b)
        for start in range(0, len_q, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < len_q
            lse2 = tl.load(Lse2 + base + offs, mask=ok, other=float("inf"))
            delta = tl.load(Delta + base + offs, mask=ok, other=0.0)
            acc += tl.math.exp2(sink2 - lse2) * delta
    tl.store(DSink + off_h, -tl.sum(acc, axis=0))


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, dq_base, dq_desc, dq_row, dq_col,
                    q_desc, do_desc, stride_qt, stride_dot, stride_dqt, offs_m0, offs_n, offs_d, lo, hi, len_q,
                    shift, win_left, win_right, qk_scale, sm_scale, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, DQ_MODE: tl.constexpr, REVERSE: tl.constexpr,
                    USE_TMA: tl.constexpr):
    # works on transposed tiles (keys x queries) so the accumulators stay [BLOCK_N, D]
    num_blocks = tl.cdiv(hi - lo, BLOCK_M)
    for i in range(0, num_blocks):
        # REVERSE visits the last query blocks first: under a causal mask every key block's range ends at the
        # last query block, so concurrent programs then reduce dQ into the same rows (L2-resident) at once
        if REVERSE:
            start_m = lo + (num_blocks - 1 - i) * BLOCK_M
        else:
            start_m = lo + i * BLOCK_M
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
            q = q_desc.load([dq_row + start_m, dq_col])
        elif MASK:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        pT = tl.math.exp2(qkT - lse2[None, :])
        if MASK:
            row_pos = offs_m + shift
            visible = ((offs_n[:, None] >= row_pos[None, :] - win_left)
                       & (offs_n[:, None] <= row_pos[None, :] + win_right))
            pT = tl.where(visible, pT, 0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            delta = tl.load(delta_base + offs_m)
        if USE_TMA:
            do = do_desc.load([dq_row + start_m, dq_col])
        elif MASK:
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            do = tl.load(do_ptrs)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if DQ_MODE != 0:  # non-deterministic mode: dQ += scale * dS K straight into an fp32 buffer
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=DOT_PRECISION) * sm_scale
            if DQ_MODE == 2:  # one bulk tensor reduce-add per tile (rows past len_q add exact zeros)
                dq_desc.atomic_add([dq_row + start_m, dq_col], dq)
            else:  # per-element fp32 atomics
                dq_ptrs = dq_base + offs_m[:, None].to(tl.int64) * stride_dqt + offs_d[None, :]
                if MASK:
                    tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None], sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["stride_rows"])
def _sink_attn_bwd_dkdv(Q, K, V, DO, Lse2, Delta, DK, DV, DQ32, DQ_desc, Q_desc, DO_desc, cu_seqlens_q, cu_seqlens_k,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                        stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh, stride_rows, qk_scale,
                        sm_scale, win_left, win_right, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        DQ_MODE: tl.constexpr, REVERSE: tl.constexpr, USE_TMA: tl.constexpr):
    off_kh = tl.program_id(0)
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
    k = tl.load(K + (k_start + offs_n)[:, None].to(tl.int64) * stride_kt + off_kh * stride_kh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + (k_start + offs_n)[:, None].to(tl.int64) * stride_vt + off_kh * stride_vh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_block_ranges(start_n, len_q, len_k, shift, win_left, win_right,
                                                   BLOCK_M, BLOCK_N)
    # three ranges: an edge (masked), the full blocks, the other edge (masked); REVERSE visits them back to front
    a_lo, a_hi, c_lo, c_hi = lo, full_lo, full_hi, hi
    rows_start = _row_vector_start(q_start, off_b)
    if REVERSE:
        a_lo, a_hi, c_lo, c_hi = full_hi, hi, lo, full_lo
    # GQA: the KV head's gradient is the sum over its query heads, accumulated here in a fixed order
    for g in range(GROUP):
        off_h = off_kh * GROUP + g
        q_base = Q + q_start.to(tl.int64) * stride_qt + off_h * stride_qh
        do_base = DO + q_start.to(tl.int64) * stride_dot + off_h * stride_doh
        lse2_base = Lse2 + off_h * stride_rows + rows_start
        delta_base = Delta + off_h * stride_rows + rows_start
        dq_base = DQ32 + q_start.to(tl.int64) * stride_dqt + off_h * stride_dqh
        dq_col = off_h * HEAD_DIM
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, dq_base, DQ_desc, q_start,
                                 dq_col, Q_desc, DO_desc, stride_qt, stride_dot, stride_dqt, offs_m0, offs_n, offs_d,
                                 a_lo, a_hi, len_q, shift, win_left, win_right, qk_scale, sm_scale, BLOCK_M, True,
                                 DOT_PRECISION, DQ_MODE, REVERSE, USE_TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, dq_base, DQ_desc, q_start,
                                 dq_col, Q_desc, DO_desc, stride_qt, stride_dot, stride_dqt, offs_m0, offs_n, offs_d,
                                 full_lo, full_hi, len_q, shift, win_left, win_right, qk_scale, sm_scale, BLOCK_M,
                                 False, DOT_PRECISION, DQ_MODE, REVERSE, USE_TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, dq_base, DQ_desc, q_start,
                                 dq_col, Q_desc, DO_desc, stride_qt, stride_dot, stride_dqt, offs_m0, offs_n, offs_d,
                                 c_lo, c_hi, len_q, shift, win_left, win_right, qk_scale, sm_scale, BLOCK_M, True,
                                 DOT_PRECISION, DQ_MODE, REVERSE, USE_TMA)
    dk = dk * sm_scale  # dS is w.r.t. S = scale * q.k
    dk_ptrs = DK + (k_start + offs_n)[:, None].to(tl.int64) * stride_dkt + off_kh * stride_dkh + offs_d[None, :]
    dv_ptrs = DV + (k_start + offs_n)[:, None].to(tl.int64) * stride_dvt + off_kh * stride_dvh + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, desc_row, desc_col, stride_kt,
                  stride_vt, offs_n0, offs_d, row_pos, lo, hi, len_k, win_left, win_right, qk_scale,
                  BLOCK_N: tl.constexpr, MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
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
            visible = ((offs_n[None, :] >= row_pos[:, None] - win_left)
                       & (offs_n[None, :] <= row_pos[:, None] + win_right)
                       & (offs_n[None, :] < len_k))
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return dq


@triton.jit(do_not_specialize=["stride_rows"])
def _sink_attn_bwd_dq(Q, K, V, K_desc, V_desc, DO, Lse2, Delta, DQ, cu_seqlens_q, cu_seqlens_k,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                      stride_dqt, stride_dqh, stride_rows, qk_scale, sm_scale, win_left, win_right,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    off_h = tl.program_id(0)
    pid_m = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + off_b)
    len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
    k_start = tl.load(cu_seqlens_k + off_b)
    len_k = tl.load(cu_seqlens_k + off_b + 1) - k_start
    start_m = (tl.num_programs(1) - 1 - pid_m) * BLOCK_M
    if start_m >= len_q:
        return
    off_kh = off_h // GROUP
    shift = len_k - len_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < len_q
    q = tl.load(Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + off_h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + (q_start + offs_m)[:, None].to(tl.int64) * stride_dot + off_h * stride_doh
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    rows_at = off_h * stride_rows + _row_vector_start(q_start, off_b) + offs_m
    lse2 = tl.load(Lse2 + rows_at, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + rows_at, mask=row_ok, other=0.0)
    k_base = K + k_start.to(tl.int64) * stride_kt + off_kh * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + off_kh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_pos = offs_m + shift
    lo, full_lo, full_hi, hi = _key_block_ranges(start_m, len_q, len_k, shift, win_left, win_right,
                                                 BLOCK_M, BLOCK_N)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, K_desc, V_desc, k_start, off_kh * HEAD_DIM,
                       stride_kt, stride_vt, offs_n0, offs_d, row_pos,
                       lo, full_lo, len_k, win_left, win_right, qk_scale, BLOCK_N, True, DOT_PRECISION, USE_TMA)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, K_desc, V_desc, k_start, off_kh * HEAD_DIM,
                       stride_kt, stride_vt, offs_n0, offs_d, row_pos,
                       full_lo, full_hi, len_k, win_left, win_right, qk_scale, BLOCK_N, False, DOT_PRECISION, USE_TMA)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, K_desc, V_desc, k_start, off_kh * HEAD_DIM,
                       stride_kt, stride_vt, offs_n0, offs_d, row_pos,
                       full_hi, hi, len_k, win_left, win_right, qk_scale, BLOCK_N, True, DOT_PRECISION, USE_TMA)
    dq = dq * sm_scale
    tl.store(DQ + (q_start + offs_m)[:, None].to(tl.int64) * stride_dqt + off_h * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------
# Host wrappers (the contract used by the package's autograd functions / custom ops)
# ----------------------------------------------------------------------------------------------------------
def _row_vector_stride(T_q: int, num_seqs: int) -> int:
    """Row stride of the backward's per-row vectors: room for every sequence at its `_row_vector_start`."""
    return 4 * triton.cdiv(T_q, 4) + 4 * num_seqs


def _window_bounds(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """FA window convention (-1 = unbounded) -> finite (left, right) extents; causal caps right at 0."""
    left = _UNBOUNDED if window_left is None or window_left < 0 else int(window_left)
    right = _UNBOUNDED if window_right is None or window_right < 0 else int(window_right)
    if causal:
        right = min(right, 0)
    return left, right


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need NVIDIA sm_90+ and a [T, H * D] row-major view (16-byte aligned rows)."""
    if _TensorDescriptor is None or tensors[0].device.type != "cuda" or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(t.stride(1) == t.shape[2] and t.stride(0) == t.shape[1] * t.shape[2]
               and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)


def _row_descriptor(t: torch.Tensor, block_rows: int):
    """Descriptor over ``t [T, H, D]`` viewed as ``[T, H * D]``, tiles of ``[block_rows, D]``."""
    T, H, D = t.shape
    return _TensorDescriptor(t, [T, H * D], [H * D, 1], [block_rows, D])


def _row_descriptors_if(use_tma: bool, block_rows: int, *tensors: torch.Tensor) -> tuple:
    """``_row_descriptor`` of each tensor when the kernel loads them through TMA, else the tensors themselves (the
    kernel's pointer path ignores that argument)."""
    return tuple(_row_descriptor(t, block_rows) if use_tma else t for t in tensors)


def _side_stream(device: torch.device):
    """One cached side stream per CUDA device (None elsewhere: the interpreter runs kernels in order anyway)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _gluon_kernels():
    """gluon_kernels.py, imported once (None when this Triton has no usable Gluon)."""
    if "module" not in _GLUON:
        try:
            if __package__:
                module = importlib.import_module(".gluon_kernels", __package__)
            else:  # this file was loaded on its own (tests, benchmark fallback): load the sibling by path
                path = Path(__file__).with_name("gluon_kernels.py")
                spec = importlib.util.spec_from_file_location(f"{__name__}_gluon", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            # one copy of which blocks to visit and of where a sequence's LSE / D start
            module.bind_triton_helpers(_key_block_ranges, _query_block_ranges, _row_vector_start)
        except Exception as exc:  # noqa: BLE001 - Triton without Gluon, or a Gluon API this code predates
            module = None
            _GLUON["error"] = f"{type(exc).__name__}: {exc}"
        _GLUON["module"] = module
    return _GLUON["module"]


def _gluon_applies(q, *tensors) -> bool:
    """Whether the Gluon kernels can take these inputs: sm_90, 16-bit, TMA-compatible rows, Gluon importable."""
    if q.device.type != "cuda" or torch.version.hip is not None:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False  # warpgroup MMA is sm_90(a) only
    return _tma_ok(q, *tensors) and _gluon_kernels() is not None


def _gluon_backward_kernels(q, k, v, dout, atomic_dq: bool = False) -> tuple[str, ...]:
    """Which backward kernels ("dkdv", "dq") run in Gluon for these inputs (empty: Triton only).  With
    ``atomic_dq`` only the dK/dV kernel, which then also adds dQ (its "dkdv_atomic_dq" config)."""
    if GLUON_BWD is False or not _gluon_applies(q, k, v, dout):
        return ()
    if atomic_dq:
        configs = _GLUON["module"].CONFIGS
        return ("dkdv",) if GLUON_BWD in ("auto", True, "dkdv") and ("dkdv_atomic_dq", q.shape[2]) in configs else ()
    kernels = ("dkdv", "dq") if GLUON_BWD in ("auto", True) else (GLUON_BWD,)
    return tuple(name for name in kernels if (name, q.shape[2]) in _GLUON["module"].CONFIGS)


def _run_gluon(name: str, *args) -> bool:
    """Launch one Gluon kernel; on a compile error warn, switch Gluon off for that pass (GLUON_FWD or GLUON_BWD)
    and return False."""
    try:
        getattr(_GLUON["module"], name)(*args)
        return True
    except Exception as exc:  # noqa: BLE001 - compile errors surface before the launch: nothing was written
        global GLUON_BWD, GLUON_FWD
        if name.startswith("fwd"):
            GLUON_FWD = False
        else:
            GLUON_BWD = False
        _GLUON["error"] = f"{name}: {type(exc).__name__}: {exc}"
        pass_name = "forward" if name.startswith("fwd") else "backward"
        warnings.warn(f"sink_flash_attn3: the Gluon {name} kernel failed ({type(exc).__name__}: {exc}); using the "
                      f"Triton {pass_name} kernels from now on", RuntimeWarning, stacklevel=3)
        return False


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (no TF32) so that fp32 results match an fp64 reference to ~1e-6
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_token_major(name: str, t: torch.Tensor) -> None:
    if t.dim() != 3 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [tokens, heads, head_dim] with a contiguous last dim, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")


def sink_attention_forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_left, window_right):
    """Sink-aware attention forward on packed sequences.

    q ``[Tq, Hq, D]``; k, v ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0``; sinks ``[Hq]`` (float32) or None;
    cu_seqlens int32 ``[B + 1]``.  Returns ``out [Tq, Hq, D]`` in q's dtype and the sink-inclusive natural-log
    ``lse [Hq, Tq]`` float32.  A row with no visible key gets out = 0 and lse = sink (or -inf without sink).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_token_major(name, t)
    T_q, H_q, D = q.shape
    H_kv = k.shape[1]
    if H_q % H_kv:
        raise ValueError(f"number of query heads {H_q} must be a multiple of KV heads {H_kv}")
    num_seqs = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q)  # same layout rule as the custom op's fake (q's strides when q is dense)
    lse = torch.empty((H_q, T_q), device=q.device, dtype=torch.float32)
    if T_q == 0 or num_seqs == 0 or max_seqlen_q == 0:
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    left, right = _window_bounds(causal, window_left, window_right)
    has_sink = sinks is not None
    qk_scale = float(softmax_scale) * LOG2E
    if GLUON_FWD == "auto":
        use_gluon = left >= _UNBOUNDED and max_seqlen_q >= _WS_MIN_SEQLEN and _gluon_applies(q, k, v)
        kernel = "fwd_ws"
    elif GLUON_FWD in ("ws", True, False):
        use_gluon = bool(GLUON_FWD) and _gluon_applies(q, k, v)
        kernel = "fwd_ws" if GLUON_FWD == "ws" else "fwd"
    else:
        raise ValueError(f"triton_kernels.GLUON_FWD must be 'auto', 'ws', True or False, got {GLUON_FWD!r}")
    if use_gluon and (kernel, D) in _GLUON["module"].CONFIGS:
        args = (q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, qk_scale, left, right)
        done = _run_gluon(kernel, *args) if kernel == "fwd_ws" else _run_gluon(kernel, *args, left < _UNBOUNDED)
        if done:
            return out, lse
    cfg = _config("fwd_window" if left < _UNBOUNDED else "fwd", D, q.device)
    block_m = cfg.pop("BLOCK_M")
    grid = (H_q, triton.cdiv(int(max_seqlen_q), block_m), num_seqs)
    use_tma = FWD_TMA and _tma_ok(k, v)
    k_desc, v_desc = _row_descriptors_if(use_tma, cfg["BLOCK_N"], k, v)
    _sink_attn_fwd[grid](
        q, k, v, k_desc, v_desc, sinks if has_sink else q, out, lse, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), qk_scale, left, right,
        GROUP=H_q // H_kv, HEAD_DIM=D, BLOCK_M=block_m, HAS_SINK=has_sink,
        DOT_PRECISION=_dot_precision(q.dtype), USE_TMA=use_tma, WARP_SPEC=FWD_WARP_SPEC and use_tma, **cfg)
    return out, lse


def sink_attention_backward(dout, q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, softmax_scale, causal, window_left, window_right, deterministic):
    """Gradients of :func:`sink_attention_forward`: ``dq [Tq,Hq,D]``, ``dk, dv [Tk,Hkv,D]`` (input dtype,
    summed over each KV group's query heads) and ``dsink [Hq]`` float32 (None without sinks).

    By default every gradient is written by exactly one program in a fixed order (no atomics): bitwise
    reproducible.  With ``ATOMIC_DQ`` set and ``deterministic=False``, dQ is instead accumulated with fp32
    atomics inside the dK/dV kernel (one kernel fewer, run-to-run rounding differences in dQ only)."""
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        _check_token_major(name, t)
    T_q, H_q, D = q.shape
    T_k, H_kv, _ = k.shape
    num_seqs = cu_seqlens_q.numel() - 1
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = torch.zeros(H_q, device=q.device, dtype=torch.float32) if sinks is not None else None
    if T_q == 0 or num_seqs == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dsink
    lse = lse.contiguous()
    left, right = _window_bounds(causal, window_left, window_right)
    qk_scale = float(softmax_scale) * LOG2E
    precision = _dot_precision(q.dtype)
    group = H_q // H_kv

    # per-row vectors D and base-2 LSE, [H, stride_rows] with every sequence 16-byte aligned (_row_vector_start).
    # D's unused slots stay 0: a TMA copy of a query block's D past its sequence's end must read finite values
    # (those rows are masked to P = 0, and 0 * (dP - D) must stay 0)
    stride_rows = _row_vector_stride(T_q, num_seqs)
    delta = torch.zeros((H_q, stride_rows), device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    pre_block = 64 if q.device.type == "cuda" else 16
    _bwd_preprocess[(max(triton.cdiv(int(max_seqlen_q), pre_block), 1), H_q, num_seqs)](
        out, dout, lse, delta, lse2, cu_seqlens_q, stride_rows, out.stride(0), out.stride(1), dout.stride(0),
        dout.stride(1), lse.stride(0), HEAD_DIM=D, BLOCK=pre_block)
    if sinks is not None:
        _bwd_dsink[(H_q,)](sinks, lse2, delta, dsink, cu_seqlens_q, stride_rows, num_seqs,
                           BLOCK=1024 if q.device.type == "cuda" else 64)

    atomic_dq = ATOMIC_DQ and not deterministic
    dq32 = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic_dq else dq
    bwd_tma = BWD_TMA and q.element_size() == 2  # 16-bit only (see BWD_TMA)
    gluon = _gluon_backward_kernels(q, k, v, dout, atomic_dq)
    concurrent = BWD_CONCURRENT
    if concurrent == "auto":  # (measured with the Gluon kernels: no gain, 0.83 -> 0.91 ms at 16k window 128)
        concurrent = not gluon and (left < _UNBOUNDED or int(max_seqlen_k) <= _CONCURRENT_MAX_SEQLEN)
    side = _side_stream(q.device) if concurrent and not atomic_dq else None
    if side is not None:  # the dQ kernel below starts on the side stream once delta/lse2 are written
        side.wait_stream(torch.cuda.current_stream(q.device))
    dkdv_done = T_k == 0 or int(max_seqlen_k) == 0
    if not dkdv_done and "dkdv" in gluon:
        dkdv_done = _run_gluon("dkdv", q, k, v, dout, lse2, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                               qk_scale, float(softmax_scale), left, right, None, dq32 if atomic_dq else None)
    if not dkdv_done:
        cfg = _config("dkdv_atomic" if atomic_dq else "dkdv", D, q.device)
        block_n = cfg.pop("BLOCK_N")
        dq_mode = 0
        if atomic_dq:
            dq_mode = 2 if ATOMIC_DQ_MODE == "tma" and _tma_ok(dq32) else 1
        dq_desc = _row_descriptor(dq32, cfg["BLOCK_M"]) if dq_mode == 2 else dq32
        tma_qdo = bwd_tma and _tma_ok(q, dout)
        q_desc, do_desc = _row_descriptors_if(tma_qdo, cfg["BLOCK_M"], q, dout)
        grid = (H_kv, triton.cdiv(int(max_seqlen_k), block_n), num_seqs)
        _sink_attn_bwd_dkdv[grid](
            q, k, v, dout, lse2, delta, dk, dv, dq32, dq_desc, q_desc, do_desc, cu_seqlens_q, cu_seqlens_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
            dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), dq32.stride(0), dq32.stride(1),
            stride_rows, qk_scale, float(softmax_scale), left, right, GROUP=group, HEAD_DIM=D, BLOCK_N=block_n,
            DOT_PRECISION=precision, DQ_MODE=dq_mode, REVERSE=DQ_REVERSE and atomic_dq, USE_TMA=tma_qdo, **cfg)
    if atomic_dq:
        dq.copy_(dq32)
        return dq, dk, dv, dsink
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        # (GLUON_BWD is checked again: a failed Gluon dK/dV compile above switched it off)
        dq_done = "dq" in gluon and GLUON_BWD is not False and _run_gluon(
            "dq", q, k, v, dout, lse2, delta, dq, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, qk_scale,
            float(softmax_scale), left, right)
        if not dq_done:
            cfg = _config("dq", D, q.device)
            block_m = cfg.pop("BLOCK_M")
            grid = (H_q, triton.cdiv(int(max_seqlen_q), block_m), num_seqs)
            tma_kv = bwd_tma and _tma_ok(k, v)
            k_desc, v_desc = _row_descriptors_if(tma_kv, cfg["BLOCK_N"], k, v)
            _sink_attn_bwd_dq[grid](
                q, k, v, k_desc, v_desc, dout, lse2, delta, dq, cu_seqlens_q, cu_seqlens_k,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
                dout.stride(1), dq.stride(0), dq.stride(1), stride_rows, qk_scale, float(softmax_scale), left, right,
                GROUP=group, HEAD_DIM=D, BLOCK_M=block_m, DOT_PRECISION=precision, USE_TMA=tma_kv, **cfg)
    if side is not None:
        # join: later work on the caller's stream (and the frees of delta/lse2 here) waits for the dQ kernel
        torch.cuda.current_stream(q.device).wait_stream(side)
    return dq, dk, dv, dsink
