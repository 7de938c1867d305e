"""Sink-aware attention on the GPU: this repo's Triton kernels against the peers, GPT-OSS shapes.

B=1, 64 query heads, 8 KV heads, head_dim 64, bf16; S in {4k, 16k, 32k}; full causal and sliding window 128
(GPT-OSS sliding layers: causal, 128 tokens); forward and forward+backward (all of q, k, v and the sinks).
Peers in the same process: flex_attention + sink LSE renormalisation (compiled, what transformers runs),
transformers-style eager with sinks (only where its O(S^2) memory fits), SDPA flash without sinks (speed
reference only), FA4 ``learnable_sink`` when importable (else FACTS.md numbers, clearly labelled).

Also checks accuracy first: bf16 out/dq/dk/dv/dsink against fp64 at S=1024 and at S=8192 (where the default forward is
the producer/consumer kernel), FA4's on the same inputs when importable, varlen + GQA on fp32, and bitwise-reproducible
backward.  ``--sweep`` times candidate block configurations of each kernel at S=16k
(causal and window 128) and keeps the fastest before the main table.

    python benchmarks/attention.py [--sweep] [--out DIR]    # writes DIR/attention.md, attention.png, .json

Timings: ``triton.testing.do_bench`` medians; fwd+bwd TFLOP/s counts the backward as 2.5x the forward and a
causal/windowed forward as 4 * H * D * (visible query-key pairs) FLOP.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[1]
TORCH_EXT = ROOT / "kernels_hub" / "sink-flash-attn3" / "torch-ext"

# FACTS.md §6 (FA4 4.0.0b36 on the same kind of H200, torch 2.11): not measured by this script.
FA4_FACTS = {  # (S, window) -> (fwd ms, fwd+bwd ms, peak GiB)
    (4096, None): (0.42, 1.35, 0.15),
    (16384, None): (3.97, 15.17, 0.6),
    (16384, 128): (0.41, 1.75, 0.6),
}
FA4_FACTS_ERRORS = dict(out=3.4e-3, dq=4.4e-3, dk=4.4e-3, dv=3.7e-3, dsink=3.0e-3)


def load_kernels():
    """The kernels module: through the package when importable, else the file on its own (no relative imports)."""
    sys.path.insert(0, str(TORCH_EXT))
    try:
        from sink_flash_attn3 import triton_kernels  # noqa: PLC0415

        return triton_kernels
    except Exception as exc:  # package __init__ broken mid-development: load the kernels file directly
        print(f"[load] package import failed ({exc!r}); loading triton_kernels.py directly")
        path = TORCH_EXT / "sink_flash_attn3" / "triton_kernels.py"
        spec = importlib.util.spec_from_file_location("sink_triton_kernels", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


TK = None
DEVICE = "cuda"  # a CPU dry run of the script's logic (TRITON_INTERPRET=1) sets "cpu"


# ----------------------------------------------------------------------------------------------------------
# variants: each returns (fwd, fwd_bwd) closures over freshly made inputs
# ----------------------------------------------------------------------------------------------------------
def make_inputs(S, Hq=64, Hkv=8, D=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(S, Hq, D, device=DEVICE, dtype=dtype, generator=g)
    k = torch.randn(S, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
    v = torch.randn(S, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
    dout = torch.randn(S, Hq, D, device=DEVICE, dtype=dtype, generator=g)
    sinks = torch.randn(Hq, device=DEVICE, dtype=torch.float32, generator=g)
    return q, k, v, dout, sinks


def ours(S, window, inputs, deterministic=True):
    """This repo's kernels, called directly; deterministic=False takes the atomic-dQ backward."""
    q, k, v, dout, sinks = inputs
    cu = torch.tensor([0, S], device=DEVICE, dtype=torch.int32)
    scale = q.shape[-1] ** -0.5
    wl = -1 if window is None else window - 1  # GPT-OSS window W: the current token and W-1 before it

    def fwd():
        return TK.sink_attention_forward(q, k, v, sinks, cu, cu, S, S, scale, True, wl, 0)

    def fwd_bwd():
        out, lse = fwd()
        old, TK.ATOMIC_DQ = TK.ATOMIC_DQ, not deterministic
        try:
            return TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, scale, True, wl, 0,
                                              deterministic)
        finally:
            TK.ATOMIC_DQ = old

    return fwd, fwd_bwd


def ours_atomic(S, window, inputs):
    return ours(S, window, inputs, deterministic=False)


_FLEX = {}


def flex(S, window, inputs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        from torch.nn.attention.flex_attention import AuxRequest

        lse_kwargs = dict(return_aux=AuxRequest(lse=True))
    except ImportError:
        AuxRequest, lse_kwargs = None, dict(return_lse=True)
    q, k, v, dout, sinks = (t.detach() for t in inputs)
    qh, kh, vh, doh = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, dout))  # [1, H, S, D]
    qh, kh, vh = (t.requires_grad_() for t in (qh, kh, vh))
    sinks = sinks.clone().requires_grad_()
    if window is None:
        def mask_mod(b, h, qi, kv):
            return qi >= kv
    else:
        def mask_mod(b, h, qi, kv):
            return (qi >= kv) & (qi - kv < window)
    block_mask = create_block_mask(mask_mod, 1, None, S, S, device=DEVICE)
    if "fn" not in _FLEX:
        def flex_sink(q, k, v, sinks, block_mask):
            out, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, **lse_kwargs)
            lse = aux.lse if AuxRequest is not None else aux
            # softmax over [scores, sink]: renormalise flex's output by exp(lse) / (exp(lse) + exp(sink))
            renorm = torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1)
            return (out * renorm).to(q.dtype)

        # one graph per (S, mask, grad mode): past the default limit of 8, dynamo falls back to the unfused
        # eager flex, which materialises the S x S scores (256 GiB at 32k)
        torch._dynamo.config.recompile_limit = 64
        _FLEX["fn"] = torch.compile(flex_sink, dynamic=False)
    fn = _FLEX["fn"]

    def fwd():
        with torch.no_grad():
            return fn(qh, kh, vh, sinks, block_mask)

    def fwd_bwd():
        out = fn(qh, kh, vh, sinks, block_mask)
        return torch.autograd.grad(out, (qh, kh, vh, sinks), doh)

    return fwd, fwd_bwd


def eager(S, window, inputs):
    """transformers' GPT-OSS eager_attention_forward (repeat_kv, additive mask, sink column, softmax)."""
    q, k, v, dout, sinks = (t.detach() for t in inputs)
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    qh, kh, vh, doh = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, dout))
    qh, kh, vh = (t.requires_grad_() for t in (qh, kh, vh))
    sinks = sinks.to(q.dtype).clone().requires_grad_()
    i = torch.arange(S, device=DEVICE)
    visible = i[:, None] >= i[None, :]
    if window is not None:
        visible &= (i[:, None] - i[None, :]) < window
    mask = torch.zeros(S, S, device=DEVICE, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
    del visible, i

    def run():
        kr = kh.repeat_interleave(Hq // Hkv, dim=1)
        vr = vh.repeat_interleave(Hq // Hkv, dim=1)
        w = torch.matmul(qh, kr.transpose(2, 3)) * D ** -0.5 + mask
        logits = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(1, -1, S, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(vr.dtype)
        return torch.matmul(probs, vr)

    def fwd():
        with torch.no_grad():
            return run()

    def fwd_bwd():
        return torch.autograd.grad(run(), (qh, kh, vh, sinks), doh)

    return fwd, fwd_bwd


def sdpa_flash(S, window, inputs):
    """SDPA flash backend, causal, NO sinks (a speed reference, not a correct GPT-OSS attention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout, _ = (t.detach() for t in inputs)
    g = q.shape[1] // k.shape[1]
    qh, doh = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, dout))
    kh, vh = (t.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0).contiguous() for t in (k, v))
    qh, kh, vh = (t.requires_grad_() for t in (qh, kh, vh))

    def fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return torch.autograd.grad(out, (qh, kh, vh), doh)

    return fwd, fwd_bwd


def fa4(S, window, inputs):
    from flash_attn.cute import flash_attn_func  # noqa: PLC0415  (flash-attn-4; absent on the stock image)

    q, k, v, dout, sinks = (t.detach() for t in inputs)
    qb, kb, vb, dob = (t.unsqueeze(0).clone().requires_grad_(t is not dout) for t in (q, k, v, dout))
    sinks = sinks.clone().requires_grad_()
    ws = (None, None) if window is None else (window - 1, 0)

    def call():
        out = flash_attn_func(qb, kb, vb, causal=True, window_size=ws, learnable_sink=sinks)
        return out[0] if isinstance(out, tuple) else out

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd():
        return torch.autograd.grad(call(), (qb, kb, vb, sinks), dob)

    return fwd, fwd_bwd


# ----------------------------------------------------------------------------------------------------------
# accuracy
# ----------------------------------------------------------------------------------------------------------
def reference_fp64(q, k, v, sinks, dout, cu, causal=True, window_left=-1):
    """fp64 sink attention + autograd, per sequence of the packed layout."""
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    s = sinks.detach().double().requires_grad_()
    g = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cu) - 1):
        qs, ks, vs = q[cu[b]:cu[b + 1]], k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]]
        n = qs.shape[0]
        scores = torch.einsum("ihd,jhd->hij", qs, ks.repeat_interleave(g, 1)) * q.shape[-1] ** -0.5
        i = torch.arange(n, device=q.device)
        vis = i[None, :] <= i[:, None] if causal else torch.ones(n, n, dtype=torch.bool, device=q.device)
        if window_left >= 0:
            vis = vis & (i[None, :] >= i[:, None] - window_left)
        scores = scores.masked_fill(~vis, float("-inf"))
        lse = torch.logsumexp(torch.cat([scores, s[:, None, None].expand(-1, n, 1)], -1), -1, keepdim=True)
        outs.append(torch.einsum("hij,jhd->ihd", torch.exp(scores - lse), vs.repeat_interleave(g, 1)))
    out = torch.cat(outs)
    dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, s), dout)
    return out, dq, dk, dv, ds


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def rel_errors(results, ref):
    """{out, dq, dk, dv, dsink: relative error} of ``results`` against ``ref`` (both in that order)."""
    return {n: rel(x, r) for n, x, r in zip(("out", "dq", "dk", "dv", "dsink"), results, ref)}


def fa4_errors(S, window, inputs, ref):
    """FA4's relative errors on the same inputs and fp64 reference (None when flash_attn.cute is absent)."""
    try:
        fwd, fwd_bwd = fa4(S, window, inputs)
        out = fwd()[0]
        dq, dk, dv, dsink = fwd_bwd()
    except ImportError:
        return None
    return rel_errors((out, dq[0], dk[0], dv[0], dsink), ref)


def check_accuracy():
    """Relative errors against fp64; FA4's on the same inputs too when it is importable ("FA4 ..." entries)."""
    results = {}
    for window in (None, 128):
        S = 1024
        q, k, v, dout, sinks = make_inputs(S, seed=1)
        cu = torch.tensor([0, S], device=DEVICE, dtype=torch.int32)
        wl = -1 if window is None else window - 1
        out, lse = TK.sink_attention_forward(q, k, v, sinks, cu, cu, S, S, 64 ** -0.5, True, wl, 0)
        grads = TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, 64 ** -0.5, True, wl, 0,
                                           True)
        again = TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, 64 ** -0.5, True, wl,
                                           0, True)
        ref = reference_fp64(q, k, v, sinks, dout, [0, S], window_left=wl)
        errs = rel_errors((out, *grads), ref)
        errs["bitwise_reproducible"] = all(torch.equal(a, b) for a, b in zip(grads, again))
        results["bf16 S=1024 " + ("causal" if window is None else f"window {window}")] = errs
        errs_fa4 = fa4_errors(S, window, (q, k, v, dout, sinks), ref)
        if errs_fa4 is not None:
            results["FA4 bf16 S=1024 " + ("causal" if window is None else f"window {window}")] = errs_fa4
        TK.ATOMIC_DQ = True
        try:
            grads = TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, 64 ** -0.5, True, wl,
                                               0, False)
        finally:
            TK.ATOMIC_DQ = False
        errs = rel_errors((out, *grads), ref)
        results["bf16 S=1024 " + ("causal" if window is None else f"window {window}") + ", atomic dQ"] = errs
    # the default forward of long full layers (GLUON_FWD="auto": the producer/consumer kernel from 8k queries on
    # sm_90) against fp64, at 8 query / 1 KV heads so that the fp64 reference fits
    S = 8192
    q, k, v, dout, sinks = make_inputs(S, Hq=8, Hkv=1, seed=4)
    cu = torch.tensor([0, S], device=DEVICE, dtype=torch.int32)
    out, lse = TK.sink_attention_forward(q, k, v, sinks, cu, cu, S, S, 64 ** -0.5, True, -1, 0)
    grads = TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, 64 ** -0.5, True, -1, 0, True)
    ref = reference_fp64(q, k, v, sinks, dout, [0, S])
    results[f"bf16 S={S} causal, 8 / 1 heads (GLUON_FWD={TK.GLUON_FWD!r})"] = rel_errors((out, *grads), ref)
    errs_fa4 = fa4_errors(S, None, (q, k, v, dout, sinks), ref)
    if errs_fa4 is not None:
        results[f"FA4 bf16 S={S} causal, 8 / 1 heads"] = errs_fa4
    del ref
    torch.cuda.empty_cache()
    # varlen + GQA + decode-free fp32 check (tolerance 1e-4), several sequences of odd lengths, sinks +-30
    lens = [700, 1029, 64, 3]
    cu_list = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T = cu_list[-1]
    q, k, v, dout, sinks = make_inputs(T, Hq=16, Hkv=2, D=128, dtype=torch.float32, seed=2)
    sinks[0], sinks[1] = 30.0, -30.0
    cu = torch.tensor(cu_list, device=DEVICE, dtype=torch.int32)
    for window in (None, 100):
        wl = -1 if window is None else window
        out, lse = TK.sink_attention_forward(q, k, v, sinks, cu, cu, max(lens), max(lens), 128 ** -0.5, True, wl, 0)
        grads = TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, max(lens), max(lens),
                                           128 ** -0.5, True, wl, 0, False)
        ref = reference_fp64(q, k, v, sinks, dout, cu_list, window_left=wl)
        errs = rel_errors((out, *grads), ref)
        results[f"fp32 varlen {lens} GQA 8 D=128 sinks +-30 " + ("causal" if window is None else f"window {wl}")] = errs
    torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------
def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def peak_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def fwd_flops(S, window, H=64, D=64):
    pairs = S * (S + 1) / 2 if window is None else sum(min(i + 1, window) for i in range(S))
    return 4 * H * D * pairs


SWEEP = {
    "fwd": [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
            for bm, bn, w, s in [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4),
                                 (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 3), (128, 32, 4, 4),
                                 (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 4), (128, 64, 4, 2), (64, 128, 4, 2)]],
    "dkdv": [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
             for bm, bn, w, s in [(32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 8, 3), (64, 128, 8, 2),
                                  (64, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4),
                                  (128, 128, 8, 2), (32, 64, 4, 3), (16, 128, 4, 4), (64, 128, 8, 4)]],
    "dkdv_atomic": [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                    for bm, bn, w, s in [(32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 3),
                                         (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3)]],
    "dq": [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
           for bm, bn, w, s in [(128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2),
                                (64, 32, 4, 4), (128, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4), (64, 128, 4, 2)]],
}


def sweep(S=16384, D=64, kernels=None):
    """Time each candidate config per kernel (others at their current setting); keep the best per kernel."""
    log = {}
    for kernel, candidates in SWEEP.items():
        if kernels and kernel not in kernels:
            continue
        base = dict(TK.KERNEL_CONFIGS[(kernel, D)])
        rows = []
        for cfg in candidates:
            TK.KERNEL_CONFIGS[(kernel, D)] = dict(cfg)
            times = {}
            try:
                for window in (None, 128):
                    inputs = make_inputs(S)
                    f, fb = ours(S, window, inputs, deterministic=kernel != "dkdv_atomic")
                    times[window] = bench(f if kernel == "fwd" else fb, rep=60)
            except Exception as exc:  # e.g. out of shared memory
                print(f"[sweep] {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append((times[None], times[128], cfg))
            print(f"[sweep] {kernel} {cfg}: causal {times[None]:.3f} ms, window {times[128]:.3f} ms", flush=True)
        # rank by the full-causal time, plus the windowed time (both layer kinds alternate in GPT-OSS)
        rows.sort(key=lambda r: r[0] + r[1])
        TK.KERNEL_CONFIGS[(kernel, D)] = dict(rows[0][2]) if rows else base
        log[kernel] = [dict(causal_ms=a, window_ms=b, **c) for a, b, c in rows]
        print(f"[sweep] best {kernel}: {TK.KERNEL_CONFIGS[(kernel, D)]}", flush=True)
    return log


# Kernel variants (module switches of triton_kernels + block configs), compared at S=16k causal / window 128 and
# 4k causal with `--variants`; the fastest accurate forward and backward become the settings of the main table.
# Measured losers of earlier runs (benchmarks/notes/attention.md, v3) are no longer timed: pointer loads, 128x128
# forward tiles, warp specialisation, per-element dQ atomics, other tile reduce-add tiles.
FWD_VARIANTS = {
    "TMA 64x64 w4": dict(FWD_TMA=True, FWD_WARP_SPEC=False, GLUON_FWD=False, fwd=(64, 64, 4, 3)),
    "TMA 128x64 w8": dict(FWD_TMA=True, FWD_WARP_SPEC=False, GLUON_FWD=False, fwd=(128, 64, 8, 3)),
    # session 6 tile sweep (with the FMA softmax): 64x128 w4 s2 4.99 ms at 16k causal vs 5.35 for 128x64 w8 s3
    "TMA 64x128 w4 s2": dict(FWD_TMA=True, FWD_WARP_SPEC=False, GLUON_FWD=False, fwd=(64, 128, 4, 2)),
    # optional 5th entry: maxnreg.  Session 8 (16k causal / window 128, ms): 64x128 w4 s2 capped at 168 / 160
    # 4.98 / 4.93 (uncapped 5.00, 216 registers); 64x64 w4 s2 at 128 (four programs per SM) 5.28 / 0.238, shipped
    # for windowed layers; 64x64 s3 at 128 5.37 / 0.296; 128x64 w8 s2 at 128 5.46 / 0.357
    "TMA 64x128 w4 s2 maxnreg 160": dict(FWD_TMA=True, FWD_WARP_SPEC=False, GLUON_FWD=False,
                                         fwd=(64, 128, 4, 2, 160)),
    "TMA 64x64 w4 s2 maxnreg 128": dict(FWD_TMA=True, FWD_WARP_SPEC=False, GLUON_FWD=False,
                                        fwd=(64, 64, 4, 2, 128)),
    # Gluon forward (gluon_kernels._fwd_kernel, sm_90): gluon_fwd = changes to its config, used for full and
    # windowed layers alike.  Session 8 (16k causal / window 128 / 4k causal, ms): 64x64 s3 5.52 / 0.259 / 0.369,
    # 64x64 s2 5.35 / 0.236 / 0.355, 64x128 s2 5.10 / 0.312 / 0.344; Triton 64x128 in the same call 5.03
    "Gluon 64x64 w4 s3": dict(GLUON_FWD=True, gluon_fwd=dict(BLOCK_N=64, STAGES=3)),
    "Gluon 64x64 w4 s2": dict(GLUON_FWD=True, gluon_fwd=dict(BLOCK_N=64, STAGES=2)),
    "Gluon 64x128 w4 s2": dict(GLUON_FWD=True, gluon_fwd=dict(BLOCK_N=128, STAGES=2)),
    # (ping-pong, two warp-specialized warpgroups per program taking turns, retired in session 10: 16k causal /
    # window 128, ms: 2x64x64 s3 5.56 / 0.336, s4 5.07 / 0.323, 2x64x128 at 168 registers 6.60 / 0.486; Triton 5.07)
    # a load warp and 1-3 consumer warpgroups (FA4's sm_90 forward shape) for every layer.  Session 10, with the
    # paired P conversion (16k causal / window 128 / 4k causal / 8k causal, ms): 3 consumers s2 4.48 / 0.563 / 0.350 /
    # 1.20, no turns 4.50, s3 4.54, s3 no turns 4.57, s4 4.56; Triton 64x128 s2 5.01 / 0.322 / 0.341 / 1.26 in the
    # same call.  Before it: 2 consumers 5.08 / 0.485 / 0.380, 1 consumer s3 7.67
    "Gluon producer + 3 consumers, 192x128, s2": dict(GLUON_FWD="ws"),
    "Gluon producer + 3 consumers, 192x128, s2, no turns": dict(GLUON_FWD="ws", gluon_fwd_ws=dict(SCHEDULE=False)),
    "Gluon producer + 3 consumers, 192x128, s3": dict(GLUON_FWD="ws", gluon_fwd_ws=dict(STAGES=3)),
    "Gluon producer + 2 consumers, 128x128, s2": dict(
        GLUON_FWD="ws", gluon_fwd_ws=dict(CONSUMERS=2, CONSUMER_REGS=232, maxnreg=168)),
    "Gluon producer + 1 consumer, 64x128, s3": dict(GLUON_FWD="ws", gluon_fwd_ws=dict(CONSUMERS=1, STAGES=3,
                                                                                      maxnreg=168)),
    "Gluon producer + 3 consumers, 192x128, s3, no turns": dict(GLUON_FWD="ws",
                                                                gluon_fwd_ws=dict(STAGES=3, SCHEDULE=False)),
    "Gluon producer + 3 consumers, 192x128, s4": dict(GLUON_FWD="ws", gluon_fwd_ws=dict(STAGES=4)),
    # "auto" (the default): the producer/consumer forward on full layers of long sequences, Triton elsewhere
    "auto (ws on full layers, S >= 8k; Triton elsewhere)": dict(GLUON_FWD="auto"),
}
_GLUON_DET = dict(ATOMIC_DQ=False, BWD_CONCURRENT=False, GLUON_BWD=True, deterministic=True)
_GLUON_ATOMIC = dict(ATOMIC_DQ=True, BWD_CONCURRENT=False, GLUON_BWD=True, deterministic=False)
BWD_VARIANTS = {  # deterministic: separate dQ kernel; otherwise dQ reduced in fp32 inside the dK/dV kernel
    # BWD_TMA: Q/dO and K/V tiles through tensor descriptors (the dQ kernel then compiles without spills on sm_90)
    "deterministic, TMA loads": dict(ATOMIC_DQ=False, BWD_TMA=True, BWD_CONCURRENT=False, GLUON_BWD=False,
                                     deterministic=True),
    # BWD_CONCURRENT: the dQ kernel on a side stream, sharing the SMs with the dK/dV kernel
    "deterministic, TMA loads, concurrent dQ": dict(ATOMIC_DQ=False, BWD_TMA=True, BWD_CONCURRENT=True,
                                                    GLUON_BWD=False, deterministic=True),
    "TMA reduce 64x64 w4, last-first": dict(ATOMIC_DQ=True, ATOMIC_DQ_MODE="tma", DQ_REVERSE=True,
                                            dkdv_atomic=(64, 64, 4, 3), GLUON_BWD=False, deterministic=False),
    # Gluon (gluon_kernels.py, sm_90): the same two deterministic kernels with asynchronous warpgroup MMAs;
    # gluon_dkdv / gluon_dq = (BLOCK_M, BLOCK_N, num_warps, TMA stages, DEFER[, maxnreg]), or a dict of changes to
    # the shipped config.  Measured losers (benchmarks/notes/attention.md, v6-v7) are no longer timed: 8-warp and
    # 32x128 tiles, DEFER, deeper pipelines, register caps below 168 (spills), dS from the 16-bit P, a capped
    # 4-program dQ kernel.
    "Gluon 64x64 w4 s2 (shipped: dK/dV maxnreg 168)": dict(_GLUON_DET),
    "Gluon 64x64 w4 s2, no register cap": dict(_GLUON_DET, gluon_dkdv=(64, 64, 4, 2, 0)),
    "Gluon 64x64 w4 s3, dK/dV maxnreg 168": dict(_GLUON_DET, gluon_dkdv=(64, 64, 4, 3, 0, 168),
                                                 gluon_dq=(64, 64, 4, 3, 0)),
    "Gluon, dQ on a side stream": dict(_GLUON_DET, BWD_CONCURRENT=True),
    # deterministic=False: the Gluon dK/dV kernel also adds dQ (fifth product, TMA reduce-add), no dQ kernel (session 9)
    "Gluon TMA-reduce dQ, dK/dV maxnreg 184 (shipped)": dict(_GLUON_ATOMIC),
    "Gluon TMA-reduce dQ, dK/dV maxnreg 168": dict(_GLUON_ATOMIC, gluon_dkdv_atomic_dq=dict(maxnreg=168)),
    "Gluon TMA-reduce dQ, no register cap": dict(_GLUON_ATOMIC, gluon_dkdv_atomic_dq=(64, 64, 4, 2, 0)),
}
SWITCHES = ("FWD_TMA", "FWD_WARP_SPEC", "GLUON_FWD", "BWD_TMA", "BWD_CONCURRENT", "ATOMIC_DQ", "ATOMIC_DQ_MODE",
            "DQ_REVERSE", "GLUON_BWD")
VARIANT_SHAPES = [(16384, None), (16384, 128), (4096, None)]  # the first two rank the variants (--variant-shapes adds)
VARIANT_ACCURACY_S = 1024


def _shape_key(S, window):
    return f"{S}/{'causal' if window is None else window}_ms"


def _apply_variant(spec, D=64):
    """Set the module switches and block configs of one variant; returns the backward's `deterministic`."""
    for key, value in spec.items():
        if key in ("gluon_dkdv", "gluon_dkdv_atomic_dq", "gluon_dq", "gluon_fwd", "gluon_fwd_ws"):
            gluon = TK._gluon_kernels()
            if gluon is not None:
                name = (key.split("_", 1)[1], D)
                if isinstance(value, dict):  # changes to the kernel's default config
                    gluon.CONFIGS[name] = dict(gluon.CONFIGS[name], **value)
                    if key == "gluon_fwd":  # a forward variant is timed with the same tiles for windowed layers
                        gluon.CONFIGS[("fwd_window", D)] = dict(gluon.CONFIGS[name])
                    continue
                bm, bn, w, st, defer, *maxnreg = value  # optional 6th: a register cap per thread
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, STAGES=st, DEFER=defer)  # no cap unless given
                gluon.CONFIGS[name] = dict(cfg, maxnreg=maxnreg[0]) if maxnreg else cfg
        elif key in ("fwd", "fwd_window", "dkdv", "dkdv_atomic", "dq"):
            bm, bn, w, st, *maxnreg = value  # optional 5th: a register cap per thread
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            if maxnreg:
                cfg["maxnreg"] = maxnreg[0]
            TK.KERNEL_CONFIGS[(key, D)] = cfg
            if key == "fwd":  # a forward variant is timed with the same tiles for full and windowed layers
                TK.KERNEL_CONFIGS[("fwd_window", D)] = dict(cfg)
        elif key != "deterministic":
            setattr(TK, key, value)
    return spec.get("deterministic", True)


def kernel_times(fn, reps=5):
    """Per-kernel GPU time (ms per call) of ``fn``, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total > 0:
            times[event.key[:48]] = round(total / reps / 1000, 4)
    return times


def _peers_16k():
    """(name, fwd, fwd_bwd) of this kernel and, when importable, FA4, at S=16k full causal, warmed up."""
    inputs = make_inputs(16384)
    peers = [("this kernel", *ours(16384, None, inputs))]
    try:
        import flash_attn.cute  # noqa: F401, PLC0415

        peers.append(("FA4 + learnable_sink", *fa4(16384, None, inputs)))
    except Exception:
        print("[fa4] flash_attn.cute not importable: this kernel only")
    for _, fwd, fwd_bwd in peers:
        fwd(), fwd_bwd()
    torch.cuda.synchronize()
    return peers


def power_and_clocks(seconds=4.0):
    """Sustained time, SM clock and board power of each 16k causal pass (nvidia-smi sampled every 100 ms while the
    pass runs back to back): on an H200 attention runs at the 700 W cap, so time follows energy per call."""
    import statistics  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    rows = []
    for name, fwd, fwd_bwd in _peers_16k():
        for kind, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            time.sleep(3)  # start from the same idle state
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                    "-lms", "100"], stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            start, calls = time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                fn()
                calls += 1
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            smi.terminate()
            samples = [line.split(",") for line in smi.stdout.read().strip().splitlines()[8:]]  # skip the ramp
            ms = elapsed / calls * 1e3
            watts = statistics.median(float(p) for _, p in samples)
            row = dict(impl=name, pass_=kind, ms=ms, sm_mhz=statistics.median(float(c) for c, _ in samples),
                       watts=watts, joules=watts * ms / 1e3)
            rows.append(row)
            print(f"[power] {name} {kind}: {ms:.3f} ms/call sustained, SM {row['sm_mhz']:.0f} MHz, {watts:.0f} W, "
                  f"{row['joules']:.2f} J/call", flush=True)
    return rows


def ncu_region():
    """One 16k causal fwd+bwd of each peer between cudaProfilerStart/Stop, for
    ``ncu --profile-from-start off [--section ...] python benchmarks/attention.py --ncu-region``."""
    peers = _peers_16k()
    torch.cuda.cudart().cudaProfilerStart()
    for _, _, fwd_bwd in peers:
        fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def compare_variants(max_err=1e-2, name_filter=None):
    """Accuracy (bf16, S=1024 vs fp64) and speed of every forward and backward variant, side by side; keeps the
    fastest accurate forward, the fastest deterministic backward and the fastest non-deterministic one.
    ``name_filter``: a regular expression; only the variants whose name it matches (``re.search``) run."""
    log = dict(fwd=[], bwd=[])
    S_acc = VARIANT_ACCURACY_S
    acc_inputs = make_inputs(S_acc, seed=3)
    cu_acc = torch.tensor([0, S_acc], device=DEVICE, dtype=torch.int32)
    refs = {}
    for window in (None, 128):
        q, k, v, dout, sinks = acc_inputs
        refs[window] = reference_fp64(q, k, v, sinks, dout, [0, S_acc],
                                      window_left=-1 if window is None else window - 1)
    saved = {name: getattr(TK, name) for name in SWITCHES}
    saved_cfg = dict(TK.KERNEL_CONFIGS)
    gluon = TK._gluon_kernels()
    print(f"[variant] Gluon kernels: {'loaded' if gluon is not None else TK._GLUON.get('error')}", flush=True)
    saved_gluon_cfg = dict(gluon.CONFIGS) if gluon is not None else {}

    def restore_defaults():
        for attr, value in saved.items():
            setattr(TK, attr, value)
        TK.KERNEL_CONFIGS.clear()
        TK.KERNEL_CONFIGS.update(saved_cfg)
        if gluon is not None:
            gluon.CONFIGS.clear()
            gluon.CONFIGS.update(saved_gluon_cfg)

    for kind, table in (("fwd", FWD_VARIANTS), ("bwd", BWD_VARIANTS)):
        for name, spec in table.items():
            if name_filter and not re.search(name_filter, name):
                continue
            restore_defaults()
            deterministic = _apply_variant(spec)
            row = dict(name=name, kind=kind, spec={k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()})
            try:
                errs = {}
                for window in (None, 128):
                    q, k, v, dout, sinks = acc_inputs
                    wl = -1 if window is None else window - 1
                    out, lse = TK.sink_attention_forward(q, k, v, sinks, cu_acc, cu_acc, S_acc, S_acc, 0.125, True,
                                                         wl, 0)
                    grads = TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu_acc, cu_acc, S_acc, S_acc,
                                                       0.125, True, wl, 0, deterministic)
                    for n, e in rel_errors((out, *grads), refs[window]).items():
                        errs[n] = max(errs.get(n, 0.0), e)
                row["max_err"] = errs
                if ((spec.get("GLUON_BWD") and TK.GLUON_BWD is False)
                        or (spec.get("GLUON_FWD") and TK.GLUON_FWD is False)):  # _run_gluon fell back (it warned)
                    raise RuntimeError(f"Gluon kernel unavailable: {TK._GLUON.get('error', 'compile error')}")
                for S, window in VARIANT_SHAPES:
                    q, k, v, dout, sinks = make_inputs(S)
                    cu = torch.tensor([0, S], device=DEVICE, dtype=torch.int32)
                    wl = -1 if window is None else window - 1
                    if kind == "fwd":
                        def run():
                            return TK.sink_attention_forward(q, k, v, sinks, cu, cu, S, S, 0.125, True, wl, 0)
                        t = bench(run, rep=100)
                    else:
                        out, lse = TK.sink_attention_forward(q, k, v, sinks, cu, cu, S, S, 0.125, True, wl, 0)
                        def run():
                            return TK.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, 0.125,
                                                              True, wl, 0, deterministic)
                        t = bench(run, rep=100)
                    row[_shape_key(S, window)] = t
                    if kind == "bwd" and (S, window) == VARIANT_SHAPES[0]:
                        row["kernels_ms"] = kernel_times(run)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log[kind].append(row)
            print(f"[variant] {kind} {name}: " + ", ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                if k.endswith("_ms") or k in ("error", "kernels_ms")) + (" | max err " + ", ".join(
                    f"{n}={e:.1e}" for n, e in row.get("max_err", {}).items())), flush=True)
    restore_defaults()

    def score(row):  # GPT-OSS alternates full and window-128 layers: rank by their sum (at 16k)
        return row[_shape_key(*VARIANT_SHAPES[0])] + row[_shape_key(*VARIANT_SHAPES[1])]

    def ok(row):
        return "error" not in row and max(row["max_err"].values()) <= max_err

    chosen = {}
    # forward: the fastest on full-causal layers, then (same switches) the fastest tiles for windowed layers
    fwd_ok = sorted((r for r in log["fwd"] if ok(r)), key=lambda r: r[_shape_key(*VARIANT_SHAPES[0])])
    if fwd_ok:
        switches = {k: v for k, v in fwd_ok[0]["spec"].items() if k.startswith("FWD_") or k == "GLUON_FWD"}
        same = [r for r in fwd_ok if all(r["spec"].get(k) == v for k, v in switches.items())]
        chosen["fwd_window"] = min(same, key=lambda r: r[_shape_key(*VARIANT_SHAPES[1])])["name"]
    det_ok = sorted((r for r in log["bwd"] if ok(r) and r["spec"]["deterministic"]), key=score)
    nondet_ok = sorted((r for r in log["bwd"] if ok(r) and not r["spec"]["deterministic"]), key=score)
    for label, rows_ in (("fwd", fwd_ok), ("bwd_deterministic", det_ok), ("bwd_atomic", nondet_ok)):
        if rows_:
            chosen[label] = rows_[0]["name"]
    # apply: forward and deterministic backward switches, and the non-deterministic backward's switches/configs
    if "fwd" in chosen:
        _apply_variant(FWD_VARIANTS[chosen["fwd"]])
        window_spec = FWD_VARIANTS[chosen["fwd_window"]]
        if "gluon_fwd" in window_spec:
            gluon = TK._gluon_kernels()
            gluon.CONFIGS[("fwd_window", 64)] = dict(gluon.CONFIGS[("fwd", 64)], **window_spec["gluon_fwd"])
        elif "fwd" in window_spec:
            _apply_variant({"fwd_window": window_spec["fwd"]})
        # else (GLUON_FWD "ws" / "auto" without tiles): windowed layers keep their shipped settings
    if "bwd_deterministic" in chosen:
        _apply_variant(BWD_VARIANTS[chosen["bwd_deterministic"]])
    if "bwd_atomic" in chosen:
        spec = dict(BWD_VARIANTS[chosen["bwd_atomic"]])
        spec.pop("ATOMIC_DQ")  # ATOMIC_DQ stays as the table's variants set it (row by row)
        _apply_variant(spec)
    log["chosen"] = chosen
    print("[variant] chosen:", chosen, flush=True)
    return log


def main():
    global TK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="tune block configs at S=16k first")
    parser.add_argument("--sweep-kernels", default="", help=f"comma-separated subset of {list(SWEEP)} (default: all)")
    parser.add_argument("--sweep-only", action="store_true", help="stop after the sweep (no table)")
    parser.add_argument("--variants", action="store_true",
                        help="compare the kernel variants (TMA loads, concurrent dQ, dQ reduction) first")
    parser.add_argument("--variants-only", action="store_true", help="stop after --variants (no table)")
    parser.add_argument("--variant-filter", help="regular expression: only the --variants whose name matches")
    parser.add_argument("--variant-shapes", default="",
                        help="more --variants shapes, comma-separated S (causal) or S/window, e.g. 8192,32768")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "docs" / "benchmarks")))
    parser.add_argument("--seqlens", default="4096,16384,32768")
    parser.add_argument("--skip-flex", action="store_true")
    parser.add_argument("--flex-max-s", type=int, default=16384, help="flex compiles per shape: cap its S")
    parser.add_argument("--from-json", help="only rewrite attention.md/.png from a saved attention.json")
    parser.add_argument("--power", action="store_true",
                        help="only measure sustained time, SM clock and power at 16k causal (this kernel, FA4)")
    parser.add_argument("--ncu-region", action="store_true",
                        help="only run one 16k causal fwd+bwd per peer inside a cudaProfilerStart/Stop range")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        write_markdown(result, out_dir / "attention.md")
        write_plot(result["rows"], out_dir / "attention.png")
        print_summary(result["rows"])
        return
    TK = load_kernels()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(env, flush=True)
    if args.ncu_region:
        ncu_region()
        return
    if args.power:
        (out_dir / "attention_power.json").write_text(json.dumps(dict(env=env, rows=power_and_clocks()), indent=1))
        return
    t0 = time.time()
    kernels = [k for k in args.sweep_kernels.split(",") if k]
    if any(k not in SWEEP for k in kernels):
        parser.error(f"--sweep-kernels: choose from {list(SWEEP)}")
    sweep_log = sweep(kernels=kernels) if args.sweep else None
    if args.sweep_only:
        (out_dir / "attention_sweep.json").write_text(json.dumps(sweep_log, indent=1))
        return
    for shape in filter(None, args.variant_shapes.split(",")):
        S, _, window = shape.partition("/")
        VARIANT_SHAPES.append((int(S), int(window) if window else None))
    variants_log = compare_variants(name_filter=args.variant_filter) if args.variants else None
    if args.variants_only:
        (out_dir / "attention_variants.json").write_text(json.dumps(variants_log, indent=1))
        return
    accuracy = check_accuracy()  # with the settings the table runs with
    for name, errs in accuracy.items():
        print(f"[accuracy] {name}: " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in errs.items()), flush=True)
    configs = {f"{k}/{d}": v for (k, d), v in TK.KERNEL_CONFIGS.items()}
    gluon = TK._gluon_kernels()
    if gluon is not None:
        configs.update({f"gluon_{k}/{d}": v for (k, d), v in gluon.CONFIGS.items()})
    if gluon is None:
        dispatch = f"Gluon kernels unavailable ({TK._GLUON.get('error')}): the Triton backward everywhere"
    elif TK.GLUON_BWD in ("auto", True):
        dispatch = "the Gluon kernels (gluon_kernels.py, asynchronous warpgroup MMAs) wherever they apply"
    elif TK.GLUON_BWD is False:
        dispatch = "the Triton kernels everywhere"
    else:
        dispatch = f"the Gluon kernels for {TK.GLUON_BWD!r} wherever they apply"
    if gluon is None or not TK.GLUON_FWD:
        forward = "Triton"
    elif TK.GLUON_FWD == "auto":
        forward = (f"the producer/consumer Gluon kernel (gluon_kernels._fwd_ws_kernel) on layers without a left window "
                   f"from {TK._WS_MIN_SEQLEN} queries, Triton elsewhere")
    else:
        kernel = "_fwd_ws_kernel" if TK.GLUON_FWD == "ws" else "_fwd_kernel"
        forward = f"Gluon (gluon_kernels.{kernel}) where it applies"
    notes = [f"Backward (GLUON_BWD={TK.GLUON_BWD!r}): {dispatch}; the forward (GLUON_FWD={TK.GLUON_FWD!r}) is "
             f"{forward}."]
    switches = {name: getattr(TK, name) for name in SWITCHES}
    print("[switches]", json.dumps(switches), flush=True)
    print("[configs]", json.dumps(configs), flush=True)

    variants = {"sink-flash-attn3 (this repo)": ours,
                "sink-flash-attn3, atomic dQ (deterministic=False)": ours_atomic}
    if not args.skip_flex:
        variants["flex + sink renorm (compiled)"] = flex
    variants["eager + sinks (transformers)"] = eager
    variants["SDPA flash, NO sinks (speed ref)"] = sdpa_flash
    try:
        import flash_attn.cute  # noqa: F401, PLC0415

        variants["FA4 + learnable_sink"] = fa4
    except Exception:
        print("[fa4] flash_attn.cute not importable: FA4 rows come from FACTS.md §6 (not this run)")

    rows = []
    for S in [int(s) for s in args.seqlens.split(",")]:
        for window in (None, 128):
            for name, make in variants.items():
                if name.startswith("eager") and S > 4096:
                    continue  # O(S^2): 128.6 GiB at 16k (FACTS)
                if name.startswith("flex") and S > args.flex_max_s:
                    continue
                if name.startswith("SDPA") and window is not None:
                    continue  # flash backend has no sliding window
                inputs = make_inputs(S)
                try:
                    fwd, fwd_bwd = make(S, window, inputs)
                    t_f = bench(fwd)
                    t_fb = bench(fwd_bwd)
                    mem = peak_gib(fwd_bwd)
                except Exception as exc:
                    print(f"[skip] {name} S={S} window={window}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                finally:
                    del inputs
                fl = fwd_flops(S, window)
                rows.append(dict(S=S, window=window, impl=name, fwd_ms=t_f, fwd_bwd_ms=t_fb, peak_gib=mem,
                                 fwd_tflops=fl / t_f * 1e-9, fwd_bwd_tflops=3.5 * fl / t_fb * 1e-9))
                print(f"[time] S={S} window={window} {name}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms, "
                      f"peak {mem:.2f} GiB", flush=True)
                torch.cuda.empty_cache()
                # written after every row, so a run stopped at its time limit still leaves its table
                result = dict(env=env, command=" ".join(["attention.py", *sys.argv[1:]]), accuracy=accuracy,
                              configs=configs, sweep=sweep_log, variants=variants_log,
                              switches=switches, rows=rows, notes=notes,
                              wall_s=time.time() - t0)
                (out_dir / "attention.json").write_text(json.dumps(result, indent=1))
                write_markdown(result, out_dir / "attention.md")
    try:
        write_plot(rows, out_dir / "attention.png")
    except Exception as exc:  # matplotlib missing on the image: the table and json are still written
        print(f"[plot] not written: {exc!r}")
    print_summary(rows)


def _row(rows, S, window, prefix):
    return next((r for r in rows if r["S"] == S and r["window"] == window and r["impl"].startswith(prefix)), None)


def write_markdown(result, path):
    rows = result["rows"]
    env = result["env"]
    have_fa4 = any(r["impl"].startswith("FA4") for r in rows)
    fa4_source = ("FA4 rows: flash-attn-4 4.0.0b36 (CuTe DSL, `learnable_sink`), carried onto the image with "
                  "`scripts/fa4_carry.sh`, timed in the same process." if have_fa4 else
                  "FA4 is not installed on the GPU image: its rows are quoted from `FACTS.md` §6 (same GPU kind, an "
                  "earlier session, not this run).")
    lines = [
        "# Attention benchmark: sink-aware flash attention on one H200",
        "",
        f"Generated by `python benchmarks/{result.get('command', 'attention.py --sweep')}` (the numbers below are "
        "from that run; "
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}).",
        "GPT-OSS shapes: B=1, 64 query heads, 8 KV heads, head_dim 64, bf16, causal; `window 128` = GPT-OSS",
        "sliding layers (the token and the 127 before it). Medians of `triton.testing.do_bench`; fwd+bwd",
        "computes the gradients of q, k, v and the sinks (SDPA: q, k, v; it has no sinks); fwd runs under",
        "no_grad. flex is compiled once per shape with its block mask built once, outside the timing; it runs",
        "up to S=16k (`--flex-max-s`: every shape is a fresh compile) and eager up to 4k (O(S^2) memory:",
        "128.6 GiB at 16k, FACTS). TFLOP/s count the visible query-key pairs, backward as 2.5x forward. Peak =",
        "`max_memory_allocated` over one fwd+bwd, inputs included.",
        fa4_source,
        "",
        "| S | mask | implementation | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | peak GiB |"
        " flex / this (fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mask = "causal" if r["window"] is None else f"window {r['window']}"
        fl = _row(rows, r["S"], r["window"], "flex")
        ratio = f"{fl['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if fl else "-"
        lines.append(f"| {r['S']} | {mask} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                     f"{r['fwd_tflops']:.0f} | {r['fwd_bwd_tflops']:.0f} | {r['peak_gib']:.2f} | {ratio} |")
    if not have_fa4:
        for (S, w), (f, fb, m) in FA4_FACTS.items():
            mask = "causal" if w is None else f"window {w}"
            lines.append(f"| {S} | {mask} | FA4 + learnable_sink (**FACTS §6, not this run**) | {f:.2f} | {fb:.2f} "
                         f"| - | - | {m:.2f} | - |")
    lines += ["", "## This kernel against the targets (issue 2)", "",
              "| S | mask | variant | this fwd+bwd ms | flex ms | speed-up vs flex | FA4 ms | this / FA4 |",
              "|---|---|---|---|---|---|---|---|"]
    for me in [r for r in rows if r["impl"].startswith("sink-flash")]:
        S, w = me["S"], me["window"]
        mask = "causal" if w is None else f"window {w}"
        variant = "atomic dQ" if "atomic" in me["impl"] else "deterministic"
        fl = _row(rows, S, w, "flex")
        fa = _row(rows, S, w, "FA4")
        fa_ms = fa["fwd_bwd_ms"] if fa else FA4_FACTS.get((S, w), (None, None, None))[1]
        flex_cells = (f"{fl['fwd_bwd_ms']:.2f} | {fl['fwd_bwd_ms'] / me['fwd_bwd_ms']:.2f}x" if fl else "- | -")
        fa_cells = (f"{fa_ms:.2f}{'' if fa else ' (FACTS)'} | {me['fwd_bwd_ms'] / fa_ms:.2f}x" if fa_ms else "- | -")
        lines.append(f"| {S} | {mask} | {variant} | {me['fwd_bwd_ms']:.2f} | {flex_cells} | {fa_cells} |")
    if result.get("variants"):
        vlog = result["variants"]
        lines += ["", "## Kernel variants (`--variants`)", "",
                  "Forward rows time the forward alone, backward rows the backward alone (given out and LSE).",
                  "Max error: largest relative L2 error of out/dq/dk/dv/dsink against fp64 (bf16, S=1024, causal",
                  "and window 128). Chosen: " + ", ".join(f"{k} = {v}" for k, v in vlog.get("chosen", {}).items()),
                  "", "| pass | variant | 16k causal ms | 16k window 128 ms | 4k causal ms | max error |",
                  "|---|---|---|---|---|---|"]
        for r in vlog["fwd"] + vlog["bwd"]:
            if "error" in r:
                lines.append(f"| {r['kind']} | {r['name']} | failed: {r['error'][:80]} | | | |")
                continue
            times = " | ".join(f"{r[_shape_key(S, w)]:.3f}" for S, w in VARIANT_SHAPES)
            lines.append(f"| {r['kind']} | {r['name']} | {times} | {max(r['max_err'].values()):.1e} |")
    lines += ["", "## Accuracy (relative L2 error against fp64, same inputs)", "",
              "| case | out | dq | dk | dv | dsink | bitwise-reproducible bwd |", "|---|---|---|---|---|---|---|"]
    for name, e in result["accuracy"].items():
        lines.append(f"| {name} | {e['out']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} | {e['dv']:.2e} | "
                     f"{e['dsink']:.2e} | {e.get('bitwise_reproducible', '-')} |")
    if not any(name.startswith("FA4") for name in result["accuracy"]):
        f4 = FA4_FACTS_ERRORS
        lines.append(f"| FA4 bf16 S=1024 causal (FACTS §6, not this run) | {f4['out']:.1e} | {f4['dq']:.1e} | "
                     f"{f4['dk']:.1e} | {f4['dv']:.1e} | {f4['dsink']:.1e} | - |")
    lines += ["", "Kernel block configurations used: `" + json.dumps(result["configs"]) + "`", ""]
    if result.get("notes"):
        lines += ["## Notes on this run", "", *[f"- {note}" for note in result["notes"]], ""]
    path.write_text("\n".join(lines))


def write_plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    all_impls = list(dict.fromkeys(r["impl"] for r in rows))  # same colour for one implementation in both panels
    for ax, w in zip(axes, (None, 128)):
        for impl in all_impls:
            pts = sorted((r["S"], r["fwd_bwd_ms"]) for r in rows if r["window"] == w and r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl,
                        color=f"C{all_impls.index(impl)}")
        fa = sorted((S, v[1]) for (S, ww), v in FA4_FACTS.items() if ww == w)
        if fa and not any(r["impl"].startswith("FA4") for r in rows):
            ax.plot([p[0] for p in fa], [p[1] for p in fa], "k*", ms=10, ls="none",
                    label="FA4 + learnable_sink (FACTS, not this run)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("fwd+bwd ms (median)")
        ax.set_title("full causal" if w is None else f"sliding window {w}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Sink attention, GPT-OSS shapes (B=1, 64 q / 8 kv heads, D=64, bf16), H200")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_summary(rows):
    print("\nS      mask    implementation                          fwd ms   fwd+bwd ms  peak GiB")
    for r in rows:
        mask = "causal" if r["window"] is None else f"w{r['window']}"
        print(f"{r['S']:<6} {mask:<7} {r['impl'][:38]:<38} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:10.3f} "
              f"{r['peak_gib']:8.2f}")


if __name__ == "__main__":
    main()
