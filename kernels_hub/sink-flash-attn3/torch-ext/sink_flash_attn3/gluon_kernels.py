"""Hopper (sm_90) kernels in Gluon: the backward (dK/dV and dQ; or, with ``deterministic=False``, both in one
warp-specialized kernel, ``_bwd_fused_kernel``) and the forward of long full-attention layers.

The deterministic backward has the same math and the same two-kernel structure as ``triton_kernels.py`` (dK/dV per
key block looping over the KV group's query heads; dQ per query block), written with explicit asynchronous
warpgroup MMAs so that the exponentials and the elementwise dS work run on the MUFU/FMA units while the tensor cores
compute the next product.

Why: the Triton compiler (3.6, sm_90) waits for every ``tl.dot`` right after issuing it (``warp_group_dot_wait
{pendings = 0}``), so in its kernels the tensor cores idle during ``exp2`` and the dS arithmetic; at head_dim 64
those cost about as much as the matmuls.  Per iteration here (dK/dV kernel, transposed tiles, keys x queries)::

    issue  S^T = K Q^T,  dP^T = V dO^T            (async; Q, dO tiles arrived by TMA, next tiles already in flight)
    wait S^T     ->  P^T = exp2(S^T - LSE)         (overlaps dP^T on the tensor cores)
    issue  dV += P^T dO                            (async, P^T from registers)
    wait dP^T    ->  dS^T = P^T (dP^T - D)         (overlaps dV)
    issue  dK += dS^T Q ;  wait all                (the registers of P^T / dS^T live until their MMAs finish)

and the dQ kernel does the same with S = Q K^T, dP = dO V^T, dQ += dS K.  Loads go through TMA with STAGES buffers:
the tiles of step i+1 are requested at the start of step i; in the dK/dV kernel the query rows' LSE and D come with
them (1-D copies; a per-row global load per step cost ~25% of that kernel's instructions).

The forward ``_fwd_ws_kernel`` has FA4's sm_90 shape: a load warp and three consumer warpgroups of 64 query rows on
128-key tiles, each issuing S_{j+1} = Q K_{j+1}^T with P_j V_j, the consumers taking turns on the tensor cores.
It is persistent (one program per multiprocessor walking the tiles, as FlashAttention-3's tile schedulers do), so
the next tile's loads overlap a tile's last products and output stores.

Where they run (``triton_kernels._plan``, with ``backend="auto"``): only where they were measured faster than the
Triton kernels (benchmarks/notes/attention.md).  The forward on layers without a left window from
``GLUON_FWD_MIN_SEQLEN`` (2k) queries; the deterministic backward (``backward``) on every layer; with
``deterministic=False`` the fused backward on layers without a left window from ``FUSED_MIN_SEQLEN`` (2k) keys.
Scope (``triton_kernels._gluon_applies``): CUDA sm_90, 16-bit inputs, head_dim 64, rows 16-byte aligned.  The
launch configurations are ``triton_kernels.CONFIGS`` ("gluon_*" entries), passed in by the caller.  Gluon has no
interpreter, so CPU CI compiles these kernels for sm_90 (``tests/test_sm90_compile.py``) and the GPU tests compare
them with an fp64 reference.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gluon_builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ._bands import host_cdiv as _cdiv
from ._bands import key_block_ranges as _key_block_ranges
from ._bands import query_block_ranges as _query_block_ranges
from ._bands import row_vector_start as _row_vector_start
from ._launch import Tile, launch_at

__all__ = ["backward", "backward_fused", "fwd"]

# Triton 3.6 (tested on the H200) names the TMA load async_copy_global_to_shared; later releases call it async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# the partition-wide barrier: thread_barrier in Triton 3.6, barrier in later releases
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_reduce_add = getattr(tma, "async_atomic_add", None)
if _tma_reduce_add is None:  # Triton 3.6 builds the op (cp.reduce.async.bulk.tensor .add) but has no wrapper for it

    @_gluon_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        from triton._C.libtriton import ir  # noqa: PLC0415

        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
_LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _sequence_bounds(cu_seqlens_q, cu_seqlens_k, off_b):
    """Start and length of sequence ``off_b``'s queries and keys in the packed token axis."""
    q_start = gl.load(cu_seqlens_q + off_b)
    len_q = gl.load(cu_seqlens_q + off_b + 1) - q_start
    k_start = gl.load(cu_seqlens_k + off_b)
    len_k = gl.load(cu_seqlens_k + off_b + 1) - k_start
    return q_start, len_q, k_start, len_k


@gluon.jit
def _dkdv_request(
    q_desc,
    do_desc,
    lse_desc,
    delta_desc,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    bars,
    step,
    total,
    num_m,
    lo,
    q_start,
    rows_start,
    head0,
    stride_rows,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """TMA request of step ``step``'s Q and dO tiles and their rows' LSE and D into buffer ``step % STAGES``
    (nothing past the last step); the steps run over query heads ``head0, head0 + 1, ...``, query blocks inner."""
    if step < total:
        g = step // num_m
        start_m = lo + (step - g * num_m) * BLOCK_M
        off_h = head0 + g
        buf = step % STAGES
        mbarrier.expect(bars.index(buf), 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        _tma_load(q_desc, [q_start + start_m, off_h * HEAD_DIM], bars.index(buf), q_smem.index(buf))
        _tma_load(do_desc, [q_start + start_m, off_h * HEAD_DIM], bars.index(buf), do_smem.index(buf))
        # (16-byte aligned start: rows_start is, BLOCK_M and the row stride are multiples of 4)
        at = off_h * stride_rows + rows_start + start_m
        _tma_load(lse_desc, [at], bars.index(buf), lse_smem.index(buf))
        _tma_load(delta_desc, [at], bars.index(buf), delta_smem.index(buf))


@gluon.jit(do_not_specialize=["stride_rows", "stride_split", "head_splits"])
def _dkdv_kernel(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    lse_desc,
    delta_desc,
    DK,
    DV,
    cu_seqlens_q,
    cu_seqlens_k,
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
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dK, dV of one (KV head, key block), looping over the group's query heads and the visible query blocks.  With
    ``head_splits`` > 1, each of that many programs takes an equal share of the group's query heads and writes its
    fp32 partial sums at ``DK / DV + split * stride_split`` (summed afterwards in a fixed order)."""
    off_kh = gl.program_id(0) // head_splits
    split = gl.program_id(0) - off_kh * head_splits
    pid_n = gl.program_id(1)
    off_b = gl.program_id(2)
    q_start, len_q, k_start, len_k = _sequence_bounds(cu_seqlens_q, cu_seqlens_k, off_b)
    start_n = pid_n * BLOCK_N
    if start_n >= len_k:
        return
    shift = len_k - len_q
    rows_start = _row_vector_start(q_start, off_b)
    dtype: gl.constexpr = q_desc.dtype

    # S^T / dP^T tiles [BLOCK_N, BLOCK_M] and the dK / dV accumulators [BLOCK_N, HEAD_DIM]: warps stacked along keys
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # vectors over queries
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # vectors over keys

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    col = off_kh * HEAD_DIM
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [k_start + start_n, col], kv_bar, k_smem)
    _tma_load(v_desc, [k_start + start_n, col], kv_bar, v_smem)

    lo, full_lo, full_hi, hi = _query_block_ranges(start_n, len_q, len_k, shift, win_left, win_right, BLOCK_M, BLOCK_N)
    num_m = gl.cdiv(hi - lo, BLOCK_M)
    heads = GROUP // head_splits
    head0 = off_kh * GROUP + split * heads
    total = heads * num_m  # steps: (query head, query block), heads outermost
    # Q / dO tiles are requested STAGES - 1 steps early (a buffer is free once the MMAs of its step retired)
    AHEAD: gl.constexpr = STAGES - 1
    for i in gl.static_range(AHEAD):
        _dkdv_request(
            q_desc,
            do_desc,
            lse_desc,
            delta_desc,
            q_smem,
            do_smem,
            lse_smem,
            delta_smem,
            bars,
            i,
            total,
            num_m,
            lo,
            q_start,
            rows_start,
            head0,
            stride_rows,
            HEAD_DIM,
            BLOCK_M,
            STAGES,
        )

    offs_n = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
    offs_m0 = gl.arange(0, BLOCK_M, layout=col_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    pT_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)  # register operands of the MMAs in flight
    dsT_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
    mbarrier.wait(kv_bar, 0)
    for step in range(total):
        g = step // num_m
        start_m = lo + (step - g * num_m) * BLOCK_M
        buf = step % STAGES
        _dkdv_request(
            q_desc,
            do_desc,
            lse_desc,
            delta_desc,
            q_smem,
            do_smem,
            lse_smem,
            delta_smem,
            bars,
            step + AHEAD,
            total,
            num_m,
            lo,
            q_start,
            rows_start,
            head0,
            stride_rows,
            HEAD_DIM,
            BLOCK_M,
            STAGES,
        )
        mbarrier.wait(bars.index(buf), (step // STAGES) % 2)
        q_tile = q_smem.index(buf)
        do_tile = do_smem.index(buf)
        sT = warpgroup_mma(k_smem, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # retires S^T; dP^T may still run
        sT, dk, dv, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=1, deps=(sT, dk, dv, pT_op, dsT_op))
        # (rows past len_q hold the next sequence's or TMA's zero rows: only edge blocks have them, masked below;
        # LSE and D are read from shared memory where they are used, which keeps them out of the peak registers)
        pT = gl.exp2(sT * qk_scale - lse_smem.index(buf).load(col_layout)[None, :])
        if (start_m < full_lo) | (start_m >= full_hi):  # edge block: causal / window mask, rows past len_q
            row_pos = start_m + offs_m0 + shift
            visible = (
                (offs_n[:, None] >= row_pos[None, :] - win_left)
                & (offs_n[:, None] <= row_pos[None, :] + win_right)
                & (start_m + offs_m0 < len_q)[None, :]
            )
            pT = gl.where(visible, pT, 0.0)
        pT_op = gl.convert_layout(pT.to(dtype), a_layout)
        dv = warpgroup_mma(pT_op, do_tile, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        dsT = pT * (dpT - delta_smem.index(buf).load(col_layout)[None, :])
        dsT16 = dsT.to(dtype)
        dsT_op = gl.convert_layout(dsT16, a_layout)
        dk = warpgroup_mma(dsT_op, q_tile, dk, is_async=True)
        dk, dv, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pT_op, dsT_op))
        dk = warpgroup_mma_init(dk)
        dv = warpgroup_mma_init(dv)
    dk, dv, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pT_op, dsT_op))

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    dk = dk * sm_scale  # dS is w.r.t. S = scale * q.k
    out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    out_ok = (out_rows < len_k)[:, None]
    rows64 = (k_start + out_rows).to(gl.int64)[:, None]
    DK += split.to(gl.int64) * stride_split
    DV += split.to(gl.int64) * stride_split
    gl.store(
        DK + rows64 * stride_dkt + off_kh * stride_dkh + out_cols[None, :], dk.to(DK.dtype.element_ty), mask=out_ok
    )
    gl.store(
        DV + rows64 * stride_dvt + off_kh * stride_dvh + out_cols[None, :], dv.to(DV.dtype.element_ty), mask=out_ok
    )


@gluon.jit
def _dq_request(
    k_desc, v_desc, k_smem, v_smem, bars, step, num_n, row0, col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr
):
    """TMA request of step ``step``'s K and V tiles into buffer ``step % STAGES`` (nothing past the last step)."""
    if step < num_n:
        buf = step % STAGES
        mbarrier.expect(bars.index(buf), 2 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [row0 + step * BLOCK_N, col], bars.index(buf), k_smem.index(buf))
        _tma_load(v_desc, [row0 + step * BLOCK_N, col], bars.index(buf), v_smem.index(buf))


@gluon.jit(do_not_specialize=["stride_rows", "stride_part"])
def _dq_kernel(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    Lse2,
    Delta,
    DQ,
    Sinks,
    DSinkPart,
    cu_seqlens_q,
    cu_seqlens_k,
    stride_dqt,
    stride_dqh,
    stride_rows,
    stride_part,
    qk_scale,
    sm_scale,
    win_left,
    win_right,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINK: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dQ of one (query head, query block), looping over the visible key blocks.  With a sink, also this block's share
    of dsink_h = -sum_i w_i D_i (w_i = exp(s_h - LSE_i)), with D_i = sum_j P_ij dP_ij taken from the fp32 tiles (D
    from the bf16 output, as dS uses it, carries the output's rounding), into its own slot of ``DSinkPart``; as
    sum_j dS_ij + D_i (1 - w_i), since sum_j P_ij = 1 - w_i."""
    off_h = gl.program_id(0)
    pid_m = gl.program_id(1)
    off_b = gl.program_id(2)
    q_start, len_q, k_start, len_k = _sequence_bounds(cu_seqlens_q, cu_seqlens_k, off_b)
    start_m = (gl.num_programs(1) - 1 - pid_m) * BLOCK_M  # longest (last) query blocks first
    if start_m >= len_q:
        return
    shift = len_k - len_q
    off_kh = off_h // GROUP
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # vectors over queries
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # vectors over keys

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_start + start_m, off_h * HEAD_DIM], q_bar, q_smem)
    _tma_load(do_desc, [q_start + start_m, off_h * HEAD_DIM], q_bar, do_smem)

    lo, full_lo, full_hi, hi = _key_block_ranges(start_m, len_q, len_k, shift, win_left, win_right, BLOCK_M, BLOCK_N)
    num_n = gl.cdiv(hi - lo, BLOCK_N)
    kv_col = off_kh * HEAD_DIM
    AHEAD: gl.constexpr = STAGES - 1  # as in _dkdv_kernel
    for i in gl.static_range(AHEAD):
        _dq_request(k_desc, v_desc, k_smem, v_smem, bars, i, num_n, k_start + lo, kv_col, BLOCK_N, STAGES)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    row_ok = offs_m < len_q
    rows_at = off_h * stride_rows + _row_vector_start(q_start, off_b) + offs_m
    lse2 = gl.load(Lse2 + rows_at, mask=row_ok, other=float("inf"))
    delta = gl.load(Delta + rows_at, mask=row_ok, other=0.0)
    row_pos = offs_m + shift
    offs_n0 = gl.arange(0, BLOCK_N, layout=col_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
    ds_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, a_layout)  # register operand of the dQ MMA in flight
    sum_ds = gl.zeros([BLOCK_M], gl.float32, row_layout)  # sum_j dS_ij
    mbarrier.wait(q_bar, 0)
    for step in range(num_n):
        start_n = lo + step * BLOCK_N
        buf = step % STAGES
        _dq_request(k_desc, v_desc, k_smem, v_smem, bars, step + AHEAD, num_n, k_start + lo, kv_col, BLOCK_N, STAGES)
        mbarrier.wait(bars.index(buf), (step // STAGES) % 2)
        k_tile = k_smem.index(buf)
        s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_smem.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, dq, ds_op = warpgroup_mma_wait(num_outstanding=1, deps=(s, dq, ds_op))
        p = gl.exp2(s * qk_scale - lse2[:, None])
        if (start_n < full_lo) | (start_n >= full_hi):  # edge block (keys past len_k are masked here too)
            offs_n = start_n + offs_n0
            visible = (
                (offs_n[None, :] >= row_pos[:, None] - win_left)
                & (offs_n[None, :] <= row_pos[:, None] + win_right)
                & (offs_n[None, :] < len_k)
            )
            p = gl.where(visible, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - delta[:, None])
        if HAS_SINK:
            sum_ds += gl.sum(ds, axis=1)
        ds_op = gl.convert_layout(ds.to(dtype), a_layout)
        dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_op))
        dq = warpgroup_mma_init(dq)
    dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_op))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if HAS_SINK:  # rows past len_q: lse2 = +inf, P = 0
        sink2 = gl.load(Sinks + off_h).to(gl.float32) * _LOG2E
        w = gl.exp2(sink2 - lse2)
        part = gl.sum(gl.where(row_ok, w * (sum_ds + delta * (1.0 - w)), 0.0), axis=0)
        gl.store(DSinkPart + off_h * stride_part + off_b * gl.num_programs(1) + pid_m, -part)
    dq = dq * sm_scale
    out_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    gl.store(
        DQ + (q_start + out_rows).to(gl.int64)[:, None] * stride_dqt + off_h * stride_dqh + out_cols[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=(out_rows < len_q)[:, None],
    )


# ----------------------------------------------------------------------------------------------------------
# Backward in one kernel (deterministic=False): five products per tile, dQ and dsink reduced by atomic adds
# ----------------------------------------------------------------------------------------------------------
@gluon.jit
def _fused_bwd_loader(
    loads, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_SINK: gl.constexpr
):
    """The load warp of ``_bwd_fused_kernel``: each MMA warpgroup's K and V rows once, then each step's Q and dO
    tiles and its rows' LSE, D (and sink weights) into buffer ``step % STAGES`` once both MMA warpgroups released
    it."""
    (
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        lse_desc,
        delta_desc,
        sinkw_desc,
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        sinkw_smem,
        kv_bar,
        ready,
        empty,
        k_row,
        kv_col,
        total,
        num_m,
        lo,
        q_start,
        rows_start,
        head0,
        stride_rows,
    ) = loads
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(k_desc, [k_row + w * KEYS, kv_col], kv_bar, k_smem.index(w))
        _tma_load(v_desc, [k_row + w * KEYS, kv_col], kv_bar, v_smem.index(w))
    VECTORS: gl.constexpr = 3 if HAS_SINK else 2
    for step in range(total):
        buf = step % STAGES
        use = step // STAGES
        if use > 0:
            mbarrier.wait(empty.index(buf), (use - 1) % 2)
        g = step // num_m
        start_m = lo + (step - g * num_m) * BLOCK_M
        off_h = head0 + g
        at = off_h * stride_rows + rows_start + start_m
        bar = ready.index(buf)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + VECTORS * lse_desc.block_type.nbytes)
        _tma_load(q_desc, [q_start + start_m, off_h * HEAD_DIM], bar, q_smem.index(buf))
        _tma_load(do_desc, [q_start + start_m, off_h * HEAD_DIM], bar, do_smem.index(buf))
        _tma_load(lse_desc, [at], bar, lse_smem.index(buf))
        _tma_load(delta_desc, [at], bar, delta_smem.index(buf))
        if HAS_SINK:
            _tma_load(sinkw_desc, [at], bar, sinkw_smem.index(buf))


@gluon.jit
def _fused_bwd_dq(dq_args, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """The dQ warpgroup of ``_bwd_fused_kernel``: per step, once both MMA warpgroups wrote their rows of dS^T,
    dQ_tile = dS K = (dS^T)^T K over the program's keys, then the fp32 tile into shared memory and a TMA reduce-add
    (``cp.reduce.async.bulk.tensor``) into the dQ accumulator.  Its products run in the MMA warpgroups' gaps."""
    dq_desc, k_smem, ds_smem, dq_smem, kv_bar, ds_full, ds_free, empty, total, num_m, lo, q_start, head0, sm_scale = (
        dq_args
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for step in range(total):
        dsb = step % 2
        mbarrier.wait(ds_full.index(dsb), (step // 2) % 2)
        # both MMA warpgroups are done with the previous step's Q / dO buffer (``_fused_bwd_step``)
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=step > 0)
        dq = warpgroup_mma(
            ds_smem.index(2 * dsb).permute((1, 0)), k_smem.index(0), dq_zero, use_acc=False, is_async=True
        )
        dq = warpgroup_mma(ds_smem.index(2 * dsb + 1).permute((1, 0)), k_smem.index(1), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(ds_free.index(dsb), count=1)
        g = step // num_m
        start_m = lo + (step - g * num_m) * BLOCK_M
        tma.store_wait(1)  # the reduce-add of two steps ago has read this buffer
        dq_smem.index(dsb).store(dq * sm_scale)
        fence_async_shared()
        _thread_barrier()  # the whole tile is in shared memory before the copy starts
        # rows past the sequence's end hold zeros (their dS is masked): they add nothing to the next sequence's
        # rows, and TMA clips rows past the tensor
        _tma_reduce_add(dq_desc, [q_start + start_m, (head0 + g) * HEAD_DIM], dq_smem.index(dsb))
    tma.store_wait(0)


@gluon.jit
def _fused_bwd_step(
    ctx,
    dk,
    dv,
    sink_part,
    step,
    start_m,
    W: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    KEYS: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINK: gl.constexpr,
    EDGE: gl.constexpr,
):
    """One step of MMA warpgroup W of ``_bwd_fused_kernel`` (the query block at ``start_m`` of one head); the mask
    is compiled in only for edge blocks (``EDGE``), so the loop over full blocks keeps its registers for the per-row
    vectors below."""
    (
        k_tile,
        v_tile,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        sinkw_smem,
        ds_smem,
        ready,
        ds_full,
        ds_free,
        key0,
        len_q,
        len_k,
        shift,
        qk_scale,
        win_left,
        win_right,
    ) = ctx
    NUM_WARPS: gl.constexpr = 4
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # vectors over queries
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # vectors over keys
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    buf = step % STAGES
    mbarrier.wait(ready.index(buf), (step // STAGES) % 2)
    q_tile = q_smem.index(buf)
    do_tile = do_smem.index(buf)
    # The per-row vectors are read from shared memory before the products that need them are issued: a load issued
    # behind this warpgroup's MMAs waits for their operand reads, and the exponentials and dS would wait for it.
    lse = lse_smem.index(buf).load(col_layout)
    sT = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT,))
    pT = gl.exp2(sT * qk_scale - lse[None, :])
    if EDGE:
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        offs_n = key0 + gl.arange(0, KEYS, layout=row_layout)
        visible = (
            (offs_n[:, None] >= offs_m[None, :] + shift - win_left)
            & (offs_n[:, None] <= offs_m[None, :] + shift + win_right)
            & (offs_m < len_q)[None, :]
            & (offs_n < len_k)[:, None]
        )
        pT = gl.where(visible, pT, 0.0)
    delta = delta_smem.index(buf).load(col_layout)
    if HAS_SINK:
        sinkw = sinkw_smem.index(buf).load(col_layout)
    pT_op = gl.convert_layout(pT.to(dtype), a_layout)
    dv = warpgroup_mma(pT_op, do_tile, dv, is_async=True)
    dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
    dsT = pT * (dpT - delta[None, :])
    if HAS_SINK:
        # sum_j w_i dS_ij (one FMA per score; the preprocessing kernel adds sum_i w_i D_i (1 - w_i), see the
        # docstring), summed over each thread's columns only ([KEYS, 8] partial sums): the reduction across threads
        # waits until the head's last step
        sink_part += gl.sum(gl.reshape(dsT * sinkw[None, :], [KEYS, BLOCK_M // 8, 8]), axis=1)
    dsT16 = dsT.to(dtype)
    # dK first: the product runs while this warpgroup hands its rows of dS^T to the dQ warpgroup
    dsT_op = gl.convert_layout(dsT16, a_layout)
    dk = warpgroup_mma(dsT_op, q_tile, dk, is_async=True)
    # this warpgroup's rows of the step's dS^T into its buffer (free once the dQ product of two steps ago retired)
    dsb = step % 2
    if step >= 2:
        mbarrier.wait(ds_free.index(dsb), (step // 2 - 1) % 2)
    ds_smem.index(2 * dsb + W).store(dsT16)
    fence_async_shared()
    # every thread's part of the tile is written before the one arrive; every read of the previous step's Q / dO
    # buffer (the vectors' loads, the products retired at that step's end) is done too, so the dQ warpgroup, once
    # both warpgroups arrived, releases that buffer for them (no barrier and arrive of its own here)
    _thread_barrier()
    mbarrier.arrive(ds_full.index(dsb), count=1)
    dk, dv, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pT_op, dsT_op))
    dk = warpgroup_mma_init(dk)
    dv = warpgroup_mma_init(dv)
    return dk, dv, sink_part


@gluon.jit
def _fused_bwd_mma(
    shared,
    W: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    KEYS: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINK: gl.constexpr,
):
    """MMA warpgroup W of ``_bwd_fused_kernel``: key rows [start_n + W * KEYS, + KEYS) of the program's key block.

    Per step (one query head's block of BLOCK_M rows), with transposed tiles (keys x queries)::

        S^T = K_W Q^T, dP^T = V_W dO^T     (async)
        P^T = exp2(S^T - LSE)              (overlaps dP^T)           dV_W += P^T dO   (async)
        dS^T = P^T (dP^T - D)                                        dK_W += dS^T Q   (async)
        dS^T -> shared memory, this warpgroup's rows of the step's dS^T (the dQ warpgroup's operand; overlaps dK)

    dsink_h = -sum_i w_i sum_j P_ij dP_ij (w_i = exp(s_h - LSE_i), the sink's probability) comes from the fp32
    tiles, as in the deterministic kernels, not from the rounded output.  Since sum_j P_ij = 1 - w_i over a row's
    keys, sum_j P_ij dP_ij = sum_j dS_ij + D_i (1 - w_i): this warpgroup sums w_i dS_ij over its tiles (one FMA per
    score) and adds it once per head; the preprocessing kernel adds -sum_i w_i D_i (1 - w_i).  Per head, the edge
    blocks of this warpgroup's band (the diagonal, rows past len_q, keys past len_k) and its full blocks run in
    separate loops (``_fused_bwd_step``)."""
    (
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        sinkw_smem,
        ds_smem,
        kv_bar,
        ready,
        ds_full,
        ds_free,
        DK,
        DV,
        DSink,
        stride_dkt,
        stride_dkh,
        stride_dvt,
        stride_dvh,
        off_kh,
        k_start,
        start_n,
        len_q,
        len_k,
        shift,
        lo,
        num_m,
        heads,
        head0,
        qk_scale,
        sm_scale,
        win_left,
        win_right,
    ) = shared
    NUM_WARPS: gl.constexpr = 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )

    key0 = start_n + W * KEYS
    # this warpgroup's own band: blocks of the program's range outside it are edge blocks (fully masked); key rows
    # past len_k (the next sequence's keys) are masked too, since their dS would reach dQ
    _, full_lo, full_hi, _ = _query_block_ranges(key0, len_q, len_k, shift, win_left, win_right, BLOCK_M, KEYS)
    # steps [0, n_lo) and [n_hi, num_m) of each head are edge blocks, [n_lo, n_hi) full blocks
    n_lo = gl.minimum((full_lo - lo) // BLOCK_M, num_m)
    n_hi = gl.minimum((full_hi - lo) // BLOCK_M, num_m)
    if key0 + KEYS > len_k:
        n_lo = num_m
        n_hi = num_m
    ctx = (
        k_smem.index(W),
        v_smem.index(W),
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        sinkw_smem,
        ds_smem,
        ready,
        ds_full,
        ds_free,
        key0,
        len_q,
        len_k,
        shift,
        qk_scale,
        win_left,
        win_right,
    )
    dk = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout))
    part_zero = gl.sum(gl.reshape(gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout), [KEYS, BLOCK_M // 8, 8]), axis=1)
    mbarrier.wait(kv_bar, 0)
    for g in range(heads):
        part = part_zero  # per key row and thread: sum_i w_i P_ji dP_ji over the thread's columns
        for mb in range(0, n_lo):
            step, start_m = g * num_m + mb, lo + mb * BLOCK_M
            dk, dv, part = _fused_bwd_step(
                ctx, dk, dv, part, step, start_m, W, HEAD_DIM, BLOCK_M, KEYS, STAGES, HAS_SINK, True
            )
        for mb in range(n_lo, n_hi):
            step, start_m = g * num_m + mb, lo + mb * BLOCK_M
            dk, dv, part = _fused_bwd_step(
                ctx, dk, dv, part, step, start_m, W, HEAD_DIM, BLOCK_M, KEYS, STAGES, HAS_SINK, False
            )
        for mb in range(n_hi, num_m):
            step, start_m = g * num_m + mb, lo + mb * BLOCK_M
            dk, dv, part = _fused_bwd_step(
                ctx, dk, dv, part, step, start_m, W, HEAD_DIM, BLOCK_M, KEYS, STAGES, HAS_SINK, True
            )
        if HAS_SINK:
            gl.atomic_add(DSink + head0 + g, -gl.sum(gl.sum(part, axis=1), axis=0))
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))

    dk = dk * sm_scale  # dS is w.r.t. S = scale * q.k
    out_rows = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    out_ok = (out_rows < len_k)[:, None]
    rows64 = (k_start + out_rows).to(gl.int64)[:, None]
    gl.store(
        DK + rows64 * stride_dkt + off_kh * stride_dkh + out_cols[None, :], dk.to(DK.dtype.element_ty), mask=out_ok
    )
    gl.store(
        DV + rows64 * stride_dvt + off_kh * stride_dvh + out_cols[None, :], dv.to(DV.dtype.element_ty), mask=out_ok
    )


@gluon.jit(do_not_specialize=["stride_rows", "stride_split", "head_splits"])
def _bwd_fused_kernel(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    lse_desc,
    delta_desc,
    sinkw_desc,
    dq_desc,
    DK,
    DV,
    DSink,
    cu_seqlens_q,
    cu_seqlens_k,
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
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINK: gl.constexpr,
    MMA_REGS: gl.constexpr,
    DQ_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The whole backward of one (KV head, key block of BLOCK_N keys) in five products per tile, with warp
    specialization: two MMA warpgroups (BLOCK_N / 2 keys each: S^T, dP^T, dV, dK), a dQ warpgroup (the dQ product of
    every step and its TMA reduce-add into ``dq_desc``'s fp32 tensor) and a load warp (every TMA load).  dK and dV
    are accumulated in registers over the group's query heads (``head_splits`` as in ``_dkdv_kernel``), dQ and dsink
    by atomic adds, so their rounding order varies between runs."""
    off_kh = gl.program_id(0) // head_splits
    split = gl.program_id(0) - off_kh * head_splits
    pid_n = gl.program_id(1)
    off_b = gl.program_id(2)
    q_start, len_q, k_start, len_k = _sequence_bounds(cu_seqlens_q, cu_seqlens_k, off_b)
    start_n = pid_n * BLOCK_N
    if start_n >= len_k:
        return
    shift = len_k - len_q
    rows_start = _row_vector_start(q_start, off_b)
    dtype: gl.constexpr = q_desc.dtype
    KEYS: gl.constexpr = BLOCK_N // 2  # per MMA warpgroup

    k_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    sinkw_smem = gl.allocate_shared_memory(gl.float32, [STAGES if HAS_SINK else 1, BLOCK_M], sinkw_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [4, KEYS, BLOCK_M], ds_layout)  # dS^T: 2 buffers x 2 warpgroups
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)  # released by the dQ warpgroup for both MMA warpgroups
    for i in gl.static_range(2):
        mbarrier.init(ds_full.index(i), count=2)  # both warpgroups' rows of dS^T written
        mbarrier.init(ds_free.index(i), count=1)  # the dQ product has read them

    lo, _, _, hi = _query_block_ranges(start_n, len_q, len_k, shift, win_left, win_right, BLOCK_M, BLOCK_N)
    num_m = gl.cdiv(hi - lo, BLOCK_M)
    heads = GROUP // head_splits
    head0 = off_kh * GROUP + split * heads
    total = heads * num_m  # steps: (query head, query block), heads outermost
    split64 = split.to(gl.int64) * stride_split
    shared = (
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        sinkw_smem,
        ds_smem,
        kv_bar,
        ready,
        ds_full,
        ds_free,
        DK + split64,
        DV + split64,
        DSink,
        stride_dkt,
        stride_dkh,
        stride_dvt,
        stride_dvh,
        off_kh,
        k_start,
        start_n,
        len_q,
        len_k,
        shift,
        lo,
        num_m,
        heads,
        head0,
        qk_scale,
        sm_scale,
        win_left,
        win_right,
    )
    loads = (
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        lse_desc,
        delta_desc,
        sinkw_desc,
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        sinkw_smem,
        kv_bar,
        ready,
        empty,
        k_start + start_n,
        off_kh * HEAD_DIM,
        total,
        num_m,
        lo,
        q_start,
        rows_start,
        head0,
        stride_rows,
    )
    dq_args = (
        dq_desc, k_smem, ds_smem, dq_smem, kv_bar, ds_full, ds_free, empty, total, num_m, lo, q_start, head0, sm_scale
    )  # fmt: skip
    gl.warp_specialize(
        [
            (_fused_bwd_mma, (shared, 0, HEAD_DIM, BLOCK_M, KEYS, STAGES, HAS_SINK)),
            (_fused_bwd_mma, (shared, 1, HEAD_DIM, BLOCK_M, KEYS, STAGES, HAS_SINK)),
            (_fused_bwd_dq, (dq_args, HEAD_DIM, BLOCK_M, STAGES)),
            (_fused_bwd_loader, (loads, HEAD_DIM, BLOCK_M, STAGES, HAS_SINK)),
        ],
        [4, 4, 1],
        [MMA_REGS, DQ_REGS, LOAD_REGS],
    )


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@gluon.jit
def _fwd_softmax(s, m_i, l_i, start_n, offs_n0, row_pos, len_k, full_lo, full_hi, win_left, win_right, qk_scale):
    """Online softmax of one score tile, base 2: (P, the rescale factor of the accumulator, new max, new sum).

    As in triton_kernels._fwd_inner: the scale goes into the max and the exponent (one FMA per score), and the max
    never drops below its start (sink, or a finite floor), so a fully masked row never computes -inf - (-inf)."""
    if (start_n < full_lo) | (start_n >= full_hi):  # edge block: causal / window mask, keys past len_k
        offs_n = start_n + offs_n0
        visible = (
            (offs_n[None, :] >= row_pos[:, None] - win_left)
            & (offs_n[None, :] <= row_pos[:, None] + win_right)
            & (offs_n[None, :] < len_k)
        )
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _fwd_softmax_start(Sinks, off_h, HAS_SINK: gl.constexpr, BLOCK_M: gl.constexpr, row_layout: gl.constexpr):
    """Running max and sum of a query block before its first key block (base 2)."""
    if HAS_SINK:  # the sink is one more logit in the normaliser: start from it
        m_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout) + gl.load(Sinks + off_h).to(gl.float32) * _LOG2E
        l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_layout)
    else:  # finite floor instead of -inf: a row with no visible key never computes -inf - (-inf)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_layout)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout)
    return m_i, l_i


@gluon.jit
def _fwd_store(
    acc,
    m_i,
    l_i,
    staging,
    o_desc,
    Out,
    Lse,
    off_h,
    q_start,
    len_q,
    start_m,
    stride_ot,
    stride_oh,
    stride_lse_h,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    o_layout: gl.constexpr,
    row_layout: gl.constexpr,
):
    """Normalised output and natural-log LSE of query rows [start_m, start_m + BLOCK_M) (rows past len_q skipped).
    l_i == 0 only without a sink and with no visible key: out = 0, lse = -inf.

    A tile inside the sequence goes out through ``staging`` (the warpgroup's own buffer) and one TMA store, which is
    waited for only before the buffer's next write; the last tile of a sequence, whose rows past len_q belong to the
    next sequence, by masked stores (benchmarks/notes/attention.md: faster than masked stores of every tile)."""
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = (acc * gl.convert_layout(1.0 / l_safe, o_row_layout)[:, None]).to(Out.dtype.element_ty)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * _LN2)
    lse_rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    gl.store(Lse + off_h * stride_lse_h + q_start + lse_rows, lse, mask=lse_rows < len_q)
    if start_m + BLOCK_M <= len_q:
        tma.store_wait(0)  # the previous tile's store has read the buffer
        staging.store(out)
        fence_async_shared()
        _thread_barrier()  # the whole tile is in shared memory before the copy starts
        _tma_store(o_desc, [q_start + start_m, off_h * HEAD_DIM], staging)
    else:
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=o_row_layout)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(
            Out + (q_start + offs_m).to(gl.int64)[:, None] * stride_ot + off_h * stride_oh + offs_d[None, :],
            out,
            mask=(offs_m < len_q)[:, None],
        )


@gluon.jit
def _to_16bit_pairs(x, dtype: gl.constexpr):
    """``x.to(dtype)`` for 16-bit dtype, converting neighbouring elements in pairs (``cvt.rn.{bf16,f16}x2.f32``, element
    0 in the low half).  ``x.to`` converts one element at a time, and ptxas then packed the P operand of the ws
    forward's P V product with a half swap (PRMT) per register, 32 extra instructions per key block in two of the
    three consumers (sm_90 SASS, triton 3.6)."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    else:
        gl.static_assert(dtype == gl.float16, "16-bit P: bfloat16 or float16")
        return gl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16, is_pure=True, pack=2
        )


@gluon.jit
def _fwd_tile_of_round(rnd):
    """The tile this program takes in round ``rnd`` of the persistent forward (``rnd * grid`` + a position): the
    program's own position in even rounds, the mirrored one in odd rounds.  The tiles come longest first, so with a
    plain stride program 0 would take the longest tile of every round.  Counting key blocks (plus two per tile for
    its start and epilogue) on 132 multiprocessors, the busiest program's work lies 4.3%, 2.1% and 1.2% above the
    mean at 8k, 16k and 32k causal with a stride, 0.5%, 0.1% and 0.03% with the mirror.
    The position can pass ``num_tiles`` in the last round: the caller skips it."""
    programs = gl.num_programs(0)
    pid = gl.program_id(0)
    return rnd * programs + pid + (rnd % 2) * (programs - 1 - 2 * pid)


@gluon.jit
def _fwd_tile(
    tile,
    num_m,
    heads,
    num_seqs,
    cu_seqlens_q,
    cu_seqlens_k,
    win_left,
    win_right,
    ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Tile ``tile`` of the persistent forward: query rows [start_m0, start_m0 + ROWS) of head ``off_h`` of sequence
    ``off_b``, the longest (last) query blocks first, then sequences, heads fastest.  A tile past its sequence's end
    has ``start_m0 >= len_q``.  Its key blocks: [lo, lo + num_n * BLOCK_N), every key any of its rows sees."""
    per_block = heads * num_seqs
    mi = tile // per_block
    off_b = (tile - mi * per_block) // heads
    off_h = tile - mi * per_block - off_b * heads
    start_m0 = (num_m - 1 - mi) * ROWS
    q_start, len_q, k_start, len_k = _sequence_bounds(cu_seqlens_q, cu_seqlens_k, off_b)
    lo, _, _, hi = _key_block_ranges(start_m0, len_q, len_k, len_k - len_q, win_left, win_right, ROWS, BLOCK_N)
    num_n = gl.cdiv(hi - lo, BLOCK_N)
    return off_h, start_m0, q_start, len_q, k_start, len_k, lo, num_n


@gluon.jit
def _fwd_ws_load_q(
    q_desc, q_smem, q_ready, q_empty, row0, col, tiles_done, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr
):
    """Every consumer's Q tile of the next tile, each once that consumer's last S product of its previous tile
    retired."""
    for c in gl.static_range(CONSUMERS):
        if tiles_done > 0:
            mbarrier.wait(q_empty.index(c), (tiles_done - 1) % 2)
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        _tma_load(q_desc, [row0 + c * BLOCK_M, col], q_ready.index(c), q_smem.index(c))


@gluon.jit
def _fwd_ws_producer(
    loads,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """The load warp of ``_fwd_ws_kernel``.  Per tile: K_0 (it can land while the consumers finish the previous
    tile), the consumers' Q tiles, then V_0, K_1, V_1, ...  Key block i of the program (counted over its tiles) goes
    into buffer i % STAGES once every consumer released that buffer's previous use (its u-th use waits for the
    (u-1)-th completion of the buffer's ``empty`` barrier, which counts one arrival per consumer)."""
    (
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_empty,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        cu_seqlens_q,
        cu_seqlens_k,
        num_tiles,
        num_m,
        heads,
        num_seqs,
        win_left,
        win_right,
    ) = loads
    it = 0  # key blocks loaded by this program so far
    tiles_done = 0
    for rnd in range(gl.cdiv(num_tiles, gl.num_programs(0))):
        tile = _fwd_tile_of_round(rnd)
        off_h, start_m0, q_start, len_q, k_start, _, lo, num_n = _fwd_tile(
            tile, num_m, heads, num_seqs, cu_seqlens_q, cu_seqlens_k, win_left, win_right, CONSUMERS * BLOCK_M, BLOCK_N
        )
        if (tile < num_tiles) & (start_m0 < len_q):
            q_row0 = q_start + start_m0
            kv_row0 = k_start + lo
            kv_col = (off_h // GROUP) * HEAD_DIM
            if num_n == 0:
                _fwd_ws_load_q(
                    q_desc, q_smem, q_ready, q_empty, q_row0, off_h * HEAD_DIM, tiles_done, BLOCK_M, CONSUMERS
                )
            for j in range(num_n):
                buf = (it + j) % STAGES
                use = (it + j) // STAGES
                if use > 0:
                    mbarrier.wait(k_empty.index(buf), (use - 1) % 2)
                mbarrier.expect(k_ready.index(buf), k_desc.block_type.nbytes)
                _tma_load(k_desc, [kv_row0 + j * BLOCK_N, kv_col], k_ready.index(buf), k_smem.index(buf))
                if j == 0:
                    _fwd_ws_load_q(
                        q_desc, q_smem, q_ready, q_empty, q_row0, off_h * HEAD_DIM, tiles_done, BLOCK_M, CONSUMERS
                    )
                if use > 0:
                    mbarrier.wait(v_empty.index(buf), (use - 1) % 2)
                mbarrier.expect(v_ready.index(buf), v_desc.block_type.nbytes)
                _tma_load(v_desc, [kv_row0 + j * BLOCK_N, kv_col], v_ready.index(buf), v_smem.index(buf))
            it += num_n
            tiles_done += 1


@gluon.jit
def _fwd_ws_consumer(
    shared,
    C: gl.constexpr,
    CONSUMERS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HAS_SINK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Consumer warpgroup C of ``_fwd_ws_kernel``: per tile, query rows [start_m0 + C * BLOCK_M, + BLOCK_M) over
    every key block of the tile, issuing S_{j+1} and P_j V_j together as FlashAttention-3's in-warpgroup overlap
    does (the sm_90 compile retires P_j V_j before the softmax of block j+1: benchmarks/notes/attention.md).  The
    consumers issue their products in turn (mbarriers ``turn``, round robin over the program's key blocks), so one's
    softmax runs while the others' products hold the tensor cores.
    A consumer stops at the last key block its own rows see and only passes its turn through the tile's remaining
    blocks, so on causal layers the first consumers' output stores overlap the others' last blocks."""
    (
        q_smem,
        o_smem,
        k_smem,
        v_smem,
        q_ready,
        q_empty,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        turn,
        Sinks,
        Out,
        Lse,
        o_desc,
        cu_seqlens_q,
        cu_seqlens_k,
        num_tiles,
        num_m,
        heads,
        num_seqs,
        stride_ot,
        stride_oh,
        stride_lse_h,
        qk_scale,
        win_left,
        win_right,
    ) = shared
    NUM_WARPS: gl.constexpr = 4
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile = q_smem.index(C)
    offs_n0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if C == CONSUMERS - 1:  # consumer 0 issues first
        mbarrier.arrive(turn.index(0), count=1)
    it = 0  # key blocks of this program so far: buffer it % STAGES, this consumer's turn parity it % 2
    tiles_done = 0
    for rnd in range(gl.cdiv(num_tiles, gl.num_programs(0))):
        tile = _fwd_tile_of_round(rnd)
        off_h, start_m0, q_start, len_q, _, len_k, lo, num_n = _fwd_tile(
            tile, num_m, heads, num_seqs, cu_seqlens_q, cu_seqlens_k, win_left, win_right, CONSUMERS * BLOCK_M, BLOCK_N
        )
        if (tile < num_tiles) & (start_m0 < len_q):
            start_m = start_m0 + C * BLOCK_M
            shift = len_k - len_q
            # this warpgroup's masks: blocks of the tile's band outside its own full range are edge blocks
            _, full_lo, full_hi, own_hi = _key_block_ranges(
                start_m, len_q, len_k, shift, win_left, win_right, BLOCK_M, BLOCK_N
            )
            # the tile's key blocks this warpgroup's rows see: [lo, lo + own_n); on causal layers the tile's last
            # block (two of them for some tiles) lies past the diagonal of its first 64 rows
            own_n = gl.minimum(gl.cdiv(gl.maximum(own_hi - lo, 0), BLOCK_N), num_n)
            if start_m >= len_q:
                own_n = 0
            m_i, l_i = _fwd_softmax_start(Sinks, off_h, HAS_SINK, BLOCK_M, row_layout)
            row_pos = start_m + gl.arange(0, BLOCK_M, layout=row_layout) + shift
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
            mbarrier.wait(q_ready.index(C), tiles_done % 2)
            if own_n > 0:
                acc = warpgroup_mma_init(acc)
                buf = it % STAGES
                mbarrier.wait(k_ready.index(buf), (it // STAGES) % 2)
                mbarrier.wait(turn.index(C), it % 2)
                s = warpgroup_mma(q_tile, k_smem.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.arrive(turn.index((C + 1) % CONSUMERS), count=1)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                mbarrier.arrive(k_empty.index(buf), count=1)
                p, alpha, m_i, l_i = _fwd_softmax(
                    s, m_i, l_i, lo, offs_n0, row_pos, len_k, full_lo, full_hi, win_left, win_right, qk_scale
                )
                p_op = gl.convert_layout(_to_16bit_pairs(p, dtype), p_layout)
                for j in range(own_n - 1):
                    buf = (it + j) % STAGES
                    nxt = (it + j + 1) % STAGES
                    mbarrier.wait(k_ready.index(nxt), ((it + j + 1) // STAGES) % 2)
                    mbarrier.wait(v_ready.index(buf), ((it + j) // STAGES) % 2)
                    mbarrier.wait(turn.index(C), (it + j + 1) % 2)
                    s = warpgroup_mma(q_tile, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    acc = warpgroup_mma(p_op, v_smem.index(buf), acc, is_async=True)
                    mbarrier.arrive(turn.index((C + 1) % CONSUMERS), count=1)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_{j+1} retired; P_j V_j may still run
                    mbarrier.arrive(k_empty.index(nxt), count=1)
                    p, alpha, m_i, l_i = _fwd_softmax(
                        s,
                        m_i,
                        l_i,
                        lo + (j + 1) * BLOCK_N,
                        offs_n0,
                        row_pos,
                        len_k,
                        full_lo,
                        full_hi,
                        win_left,
                        win_right,
                        qk_scale,
                    )
                    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
                    mbarrier.arrive(v_empty.index(buf), count=1)
                    acc = warpgroup_mma_init(acc * gl.convert_layout(alpha, o_row_layout)[:, None])
                    p_op = gl.convert_layout(_to_16bit_pairs(p, dtype), p_layout)
                # the tile's last S product retired: the load warp may bring the next tile's Q while this
                # consumer runs its last P V product and the epilogue
                mbarrier.arrive(q_empty.index(C), count=1)
                last = (it + own_n - 1) % STAGES
                mbarrier.wait(v_ready.index(last), ((it + own_n - 1) // STAGES) % 2)
                acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
                mbarrier.arrive(v_empty.index(last), count=1)
            else:
                mbarrier.arrive(q_empty.index(C), count=1)  # no key block: Q unused
            # The tile's blocks past this warpgroup's rows: pass its turn on (the others' products go on) and release
            # the buffers, each once loaded, so that the arrivals count toward this use of the buffer.  Its output
            # store then overlaps the others' last blocks.
            for j in range(own_n, num_n):
                buf = (it + j) % STAGES
                mbarrier.wait(k_ready.index(buf), ((it + j) // STAGES) % 2)
                mbarrier.wait(turn.index(C), (it + j) % 2)
                mbarrier.arrive(turn.index((C + 1) % CONSUMERS), count=1)
                mbarrier.arrive(k_empty.index(buf), count=1)
                mbarrier.wait(v_ready.index(buf), ((it + j) // STAGES) % 2)
                mbarrier.arrive(v_empty.index(buf), count=1)
            _fwd_store(
                acc,
                m_i,
                l_i,
                o_smem.index(C),
                o_desc,
                Out,
                Lse,
                off_h,
                q_start,
                len_q,
                start_m,
                stride_ot,
                stride_oh,
                stride_lse_h,
                BLOCK_M,
                HEAD_DIM,
                o_layout,
                row_layout,
            )
            it += num_n
            tiles_done += 1
    tma.store_wait(0)  # the last output store has read its staging buffer before the program exits


@gluon.jit(do_not_specialize=["stride_lse_h", "num_tiles", "num_m", "num_seqs"])
def _fwd_ws_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    Sinks,
    Out,
    Lse,
    cu_seqlens_q,
    cu_seqlens_k,
    stride_ot,
    stride_oh,
    stride_lse_h,
    num_tiles,
    num_m,
    heads,
    num_seqs,
    qk_scale,
    win_left,
    win_right,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HAS_SINK: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Persistent forward with a load warp and three consumer warpgroups of BLOCK_M query rows (FA4's sm_90 forward
    at head_dim 64: 3 x 64 rows, 128-key tiles).  One program per multiprocessor walks the tiles (``_fwd_tile``,
    ``num_tiles`` = query blocks x sequences x heads) one round of the grid at a time (``_fwd_tile_of_round``), so
    the loads of a tile overlap the previous tile's last products and output stores.  The load warp alone issues
    TMA, so the consumers run no CTA barriers; K and V have their own ready / empty barriers, so S_{j+1} can start
    before V_j lands."""
    CONSUMERS: gl.constexpr = 3
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], q_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], o_desc.layout)  # output staging
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # released by every consumer
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    # runtime arguments travel as one tuple; the constexprs stay separate arguments (a tuple would make them tensors)
    shared = (
        q_smem,
        o_smem,
        k_smem,
        v_smem,
        q_ready,
        q_empty,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        turn,
        Sinks,
        Out,
        Lse,
        o_desc,
        cu_seqlens_q,
        cu_seqlens_k,
        num_tiles,
        num_m,
        heads,
        num_seqs,
        stride_ot,
        stride_oh,
        stride_lse_h,
        qk_scale,
        win_left,
        win_right,
    )
    loads = (
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_empty,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        cu_seqlens_q,
        cu_seqlens_k,
        num_tiles,
        num_m,
        heads,
        num_seqs,
        win_left,
        win_right,
    )
    gl.warp_specialize(
        [
            (_fwd_ws_consumer, (shared, 0, CONSUMERS, HEAD_DIM, BLOCK_M, BLOCK_N, HAS_SINK, STAGES)),
            (_fwd_ws_consumer, (shared, 1, CONSUMERS, HEAD_DIM, BLOCK_M, BLOCK_N, HAS_SINK, STAGES)),
            (_fwd_ws_consumer, (shared, 2, CONSUMERS, HEAD_DIM, BLOCK_M, BLOCK_N, HAS_SINK, STAGES)),
            (_fwd_ws_producer, (loads, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
        ],
        [4, 4, 1],
        [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
    )


# ----------------------------------------------------------------------------------------------------------
# Host side (the caller, triton_kernels.py, checks the scope and passes the launch configuration)
# ----------------------------------------------------------------------------------------------------------
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@functools.cache
def _shared_layout(block: tuple, dtype: torch.dtype):
    """The NVMMA shared-memory layout of a TMA tile (cached: building it costs more than the descriptor)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _descriptor(t, block_rows: int) -> Tile:
    """TMA descriptor over ``t [T, H, D]`` viewed as ``[T, H * D]``, tiles ``[block_rows, D]``."""
    T, H, D = t.shape[-3:]
    return Tile(t, (T, H * D), (H * D, 1), (block_rows, D), _shared_layout((block_rows, D), t.dtype))


def _row_vector(t, block: int) -> Tile:
    """1-D TMA descriptor over the float32 per-row vector ``t [H, T]`` (LSE or D) flattened, tiles of ``block``."""
    return Tile(t, (t.numel(),), (1,), (block,), _shared_layout((block,), t.dtype))


def _launch_options(config: dict) -> tuple[int, int, dict]:
    cfg = dict(config)
    return cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg


def backward(
    q,
    k,
    v,
    dout,
    lse2,
    delta,
    sinks,
    dsink_partials,
    dq_out,
    dk,
    dv,
    head_splits,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    qk_scale,
    sm_scale,
    win_left,
    win_right,
    dkdv_config,
    dq_config,
    sites,
):
    """dK, dV into ``dk``, ``dv`` (``_dkdv_kernel``; with ``head_splits`` > 1 those are fp32 partial sums
    ``[head_splits, T_k, H_kv, D]``), then dQ into ``dq_out`` (``_dq_kernel``); see
    ``triton_kernels.sink_attention_backward`` for the contract.  ``lse2`` and ``delta`` are the per-row vectors
    ``[H, stride_rows]`` laid out by ``_bands.row_vector_start``.  The two kernels share their Q / K / V / dO
    descriptors when their tiles agree (the host cost of a launch is mostly its arguments).  With ``sinks``, the dQ
    kernel writes dsink's partial sums into ``dsink_partials [H, >= num_seqs * num_query_blocks]`` (zeroed).
    ``sites``: the caller's launch records for this input signature (``_launch.launch_at``)."""
    H_q, D = q.shape[-2:]
    H_kv = k.shape[-2]
    num_seqs = cu_seqlens_q.numel() - 1
    bm, bn, cfg = _launch_options(dkdv_config)
    descs = {}

    def desc(t, rows):
        key = (id(t), rows)
        if key not in descs:
            descs[key] = _descriptor(t, rows)
        return descs[key]

    if int(max_seqlen_k) > 0:
        launch_at(
            sites,
            "gluon_dkdv",
            _dkdv_kernel,
            (H_kv * head_splits, _cdiv(int(max_seqlen_k), bn), num_seqs),
            desc(q, bm),
            desc(k, bn),
            desc(v, bn),
            desc(dout, bm),
            _row_vector(lse2, bm),
            _row_vector(delta, bm),
            dk,
            dv,
            cu_seqlens_q,
            cu_seqlens_k,
            dk.stride(-3),
            dk.stride(-2),
            dv.stride(-3),
            dv.stride(-2),
            lse2.stride(0),
            dk.stride(0) if head_splits > 1 else 0,
            head_splits,
            qk_scale,
            sm_scale,
            win_left,
            win_right,
            GROUP=H_q // H_kv,
            HEAD_DIM=D,
            BLOCK_M=bm,
            BLOCK_N=bn,
            **cfg,
        )
    else:
        dk.zero_()
        dv.zero_()
    bm, bn, cfg = _launch_options(dq_config)
    has_sink = sinks is not None
    launch_at(
        sites,
        "gluon_dq",
        _dq_kernel,
        (H_q, _cdiv(int(max_seqlen_q), bm), num_seqs),
        desc(q, bm),
        desc(k, bn),
        desc(v, bn),
        desc(dout, bm),
        lse2,
        delta,
        dq_out,
        sinks if has_sink else lse2,
        dsink_partials if has_sink else lse2,
        cu_seqlens_q,
        cu_seqlens_k,
        dq_out.stride(-3),
        dq_out.stride(-2),
        lse2.stride(0),
        dsink_partials.stride(0) if has_sink else 0,
        qk_scale,
        sm_scale,
        win_left,
        win_right,
        GROUP=H_q // H_kv,
        HEAD_DIM=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        HAS_SINK=has_sink,
        **cfg,
    )


def fwd(
    q,
    k,
    v,
    sinks,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    qk_scale,
    win_left,
    win_right,
    config,
    num_programs,
    sites,
):
    """Forward into ``out`` and ``lse`` with ``_fwd_ws_kernel`` (three consumers x BLOCK_M query rows per tile, at
    most ``num_programs`` persistent programs: one per multiprocessor); ``sites`` as in :func:`backward`."""
    H_q, D = q.shape[-2:]
    bm, bn, cfg = _launch_options(config)
    num_m = _cdiv(int(max_seqlen_q), 3 * bm)
    num_seqs = cu_seqlens_q.numel() - 1
    num_tiles = H_q * num_m * num_seqs
    has_sink = sinks is not None
    launch_at(
        sites,
        "gluon_fwd",
        _fwd_ws_kernel,
        (min(num_tiles, num_programs), 1, 1),
        _descriptor(q, bm),
        _descriptor(k, bn),
        _descriptor(v, bn),
        _descriptor(out, bm),
        sinks if has_sink else lse,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        out.stride(-3),
        out.stride(-2),
        lse.stride(0),
        num_tiles,
        num_m,
        H_q,
        num_seqs,
        qk_scale,
        win_left,
        win_right,
        GROUP=H_q // k.shape[-2],
        HEAD_DIM=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        HAS_SINK=has_sink,
        **cfg,
    )


def backward_fused(
    q,
    k,
    v,
    dout,
    lse2,
    delta,
    sink_weights,
    dsink,
    dq32,
    dk,
    dv,
    head_splits,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_k,
    qk_scale,
    sm_scale,
    win_left,
    win_right,
    config,
    sites,
):
    """The backward in one launch of ``_bwd_fused_kernel`` (``deterministic=False``): dK, dV into ``dk``, ``dv`` (fp32
    partial sums ``[head_splits, T_k, H_kv, D]`` when ``head_splits`` > 1, as in :func:`backward`); dQ added into the
    zeroed float32 ``dq32 [T_q, H_q, D]`` (already scaled), and with a sink dsink into the zeroed float32
    ``dsink [H_q]``.  ``sink_weights [H, stride_rows]`` holds exp(s_h - LSE_i) per row (zeros in unused slots).
    ``sites`` as in :func:`backward`."""
    H_q, D = q.shape[-2:]
    H_kv = k.shape[-2]
    num_seqs = cu_seqlens_q.numel() - 1
    bm, bn, cfg = _launch_options(config)
    has_sink = dsink is not None
    lse_desc = _row_vector(lse2, bm)
    keys = bn // 2  # K / V tiles: one per MMA warpgroup
    launch_at(
        sites,
        "gluon_bwd_fused",
        _bwd_fused_kernel,
        (H_kv * head_splits, _cdiv(int(max_seqlen_k), bn), num_seqs),
        _descriptor(q, bm),
        _descriptor(k, keys),
        _descriptor(v, keys),
        _descriptor(dout, bm),
        lse_desc,
        _row_vector(delta, bm),
        _row_vector(sink_weights, bm) if has_sink else lse_desc,
        _descriptor(dq32, bm),
        dk,
        dv,
        dsink if has_sink else lse2,
        cu_seqlens_q,
        cu_seqlens_k,
        dk.stride(-3),
        dk.stride(-2),
        dv.stride(-3),
        dv.stride(-2),
        lse2.stride(0),
        dk.stride(0) if head_splits > 1 else 0,
        head_splits,
        qk_scale,
        sm_scale,
        win_left,
        win_right,
        GROUP=H_q // H_kv,
        HEAD_DIM=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        HAS_SINK=has_sink,
        **cfg,
    )
