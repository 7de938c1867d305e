"""Band arithmetic shared by the Triton and the Gluon kernels (``@triton.jit`` scalar helpers; Gluon kernels can call
them).  All bounds are in-sequence indices; ``shift = len_k - len_q`` (causal masks aligned bottom-right)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def key_block_ranges(start_m, len_q, len_k, shift, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
def query_block_ranges(start_n, len_q, len_k, shift, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
def row_vector_start(q_start, off_b):
    """Where sequence ``off_b``'s rows start in the backward's per-row vectors (LSE and D, ``[H, stride_rows]``):
    every sequence at a 16-byte aligned offset, because a TMA copy of a query block's values (the Gluon kernels)
    must start 16-byte aligned.  With ``c = q_start``: 4 * ceil(c / 4) + 4 * b leaves at least one slot between
    consecutive sequences, so no two rows share a slot."""
    return 4 * tl.cdiv(q_start, 4) + 4 * off_b


def host_cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids.  ``triton.cdiv`` is a ``constexpr_function`` in recent Triton releases: on
    the host each call unwraps its arguments (microseconds per launch on the eager path)."""
    return -(-a // b)
