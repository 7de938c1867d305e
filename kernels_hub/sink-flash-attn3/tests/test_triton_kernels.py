"""Direct tests of the Triton kernels (``triton_kernels.sink_attention_forward/backward``) against fp64.

On CPU the kernels run under ``TRITON_INTERPRET=1``.  ``triton.jit`` decides interpreted vs compiled when a
function is decorated, and triton's own library (``tl.zeros``...) is decorated when triton is first imported, so
the variable must be set before anything imports triton.  This module sets it (CPU-only machines) before its
imports; if triton was already imported compiled in this process (another test module, torch.compile...), the
interpreter tests re-run this file in a fresh subprocess instead.  Shapes are tiny (the interpreter runs numpy
per block); the kernels use 16x16 blocks on CPU, so lengths of 20-40 tokens already cover edge blocks, full
blocks, skipped blocks and several programs per sequence.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "torch-ext" / "sink_flash_attn3"

triton = pytest.importorskip("triton")


def _triton_is_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.zeros, InterpretedFunction)


INTERPRETED = _triton_is_interpreted()


def _load_kernels(interpret: bool):
    """triton_kernels of a private copy of the package, decorated with TRITON_INTERPRET set as asked."""
    name = f"_sink_flash_attn3_{'interp' if interpret else 'cuda'}"
    if f"{name}.triton_kernels" in sys.modules:
        return sys.modules[f"{name}.triton_kernels"]
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(
            name, PACKAGE_DIR / "__init__.py", submodule_search_locations=[str(PACKAGE_DIR)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
        module = importlib.import_module(f"{name}.triton_kernels")
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module


@pytest.fixture(scope="module")
def tk():
    if not INTERPRETED:
        pytest.skip("triton was imported compiled in this process: test_interpreter_in_subprocess runs these")
    return _load_kernels(interpret=True)


def run_file_in_subprocess(path, interpret: bool, timeout: int) -> str:
    """Runs the CPU tests of the test file ``path`` in a fresh process with ``TRITON_INTERPRET`` set as asked (Triton
    reads it once, at import) and no GPU; returns pytest's output, failing with it when a test failed."""
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0", CUDA_VISIBLE_DEVICES="")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not gpu",
        str(Path(path).resolve()),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout


def test_interpreter_in_subprocess():
    """Runs this file's interpreter tests in a fresh process when this one cannot interpret kernels."""
    if INTERPRETED:
        pytest.skip("this process runs the interpreter tests itself")
    run_file_in_subprocess(__file__, interpret=True, timeout=900)


# ----------------------------------------------------------------------------------------------------------
# fp64 reference: explicit masks, the sink as one more logit, autograd for every gradient
# ----------------------------------------------------------------------------------------------------------
def reference(q, k, v, sinks, cu_q, cu_k, scale, causal, window_left, window_right, dout):
    q, k, v, dout = (t.detach().double().requires_grad_(t is not dout) for t in (q, k, v, dout))
    s_ref = sinks.detach().double().requires_grad_() if sinks is not None else None
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        kr, vr = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)  # [lk, Hq, D]
        scores = scale * torch.einsum("ihd,jhd->hij", qs, kr)
        pos = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        visible = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            visible &= j <= pos
        if window_left >= 0:
            visible &= j >= pos - window_left
        if window_right >= 0:
            visible &= j <= pos + window_right
        scores = scores.masked_fill(~visible, float("-inf"))
        if s_ref is not None:
            logits = torch.cat([scores, s_ref[:, None, None].expand(-1, lq, 1)], dim=-1)
        else:
            logits = scores
        lse = torch.logsumexp(logits, dim=-1)  # [H, lq]; -inf for empty rows without sink
        probs = torch.exp(scores - lse[..., None].masked_fill(lse[..., None] == float("-inf"), 0.0))
        probs = probs.masked_fill(~visible, 0.0)
        outs.append(torch.einsum("hij,jhd->ihd", probs, vr))
        lses.append(lse)
    out = torch.cat(outs)
    lse = torch.cat(lses, dim=1)
    (out * dout).sum().backward()
    return (out.detach(), lse.detach(), q.grad, k.grad, v.grad, None if s_ref is None else s_ref.grad)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_case(
    seqlens_q, seqlens_k, hq, hkv, d, dtype=torch.float32, sink_scale=1.0, with_sink=True, seed=0, device="cpu"
):
    g = torch.Generator().manual_seed(seed)
    tq, tk_ = sum(seqlens_q), sum(seqlens_k)
    q = torch.randn(tq, hq, d, generator=g)
    k = torch.randn(tk_, hkv, d, generator=g)
    v = torch.randn(tk_, hkv, d, generator=g)
    dout = torch.randn(tq, hq, d, generator=g)
    sinks = (torch.randn(hq, generator=g) * sink_scale) if with_sink else None
    cu_q = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(seqlens_k).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(
        q=to(q),
        k=to(k),
        v=to(v),
        dout=to(dout),
        sinks=None if sinks is None else sinks.to(device),
        cu_q=cu_q.to(device),
        cu_k=cu_k.to(device),
        max_q=max(seqlens_q),
        max_k=max(seqlens_k),
    )


def run_and_compare(
    tk, case, causal, window_left=-1, window_right=-1, tol=1e-4, scale=None, deterministic=True, gluon=True, plan=None
):
    """Forward and backward (``gluon`` and ``plan`` passed to both) against the fp64 reference."""
    q, k, v, dout, sinks = case["q"], case["k"], case["v"], case["dout"], case["sinks"]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = tk.sink_attention_forward(
        q,
        k,
        v,
        sinks,
        case["cu_q"],
        case["cu_k"],
        case["max_q"],
        case["max_k"],
        scale,
        causal,
        window_left,
        window_right,
        gluon=gluon,
        plan=plan,
    )
    dq, dk, dv, dsink = tk.sink_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        sinks,
        case["cu_q"],
        case["cu_k"],
        case["max_q"],
        case["max_k"],
        scale,
        causal,
        window_left,
        window_right,
        deterministic,
        gluon=gluon,
        plan=plan,
    )
    cu_q, cu_k = case["cu_q"].tolist(), case["cu_k"].tolist()
    r_out, r_lse, r_dq, r_dk, r_dv, r_dsink = reference(
        q.cpu(),
        k.cpu(),
        v.cpu(),
        None if sinks is None else sinks.cpu(),
        cu_q,
        cu_k,
        scale,
        causal,
        window_left,
        window_right,
        dout.cpu(),
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"NaN in {name}"
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(r_lse)), "empty rows must get lse = -inf exactly"
    finite = torch.isfinite(r_lse)
    errs = {
        "out": rel_err(out.cpu(), r_out),
        "lse": rel_err(lse.cpu()[finite], r_lse[finite]) if finite.any() else 0.0,
        "dq": rel_err(dq.cpu(), r_dq),
        "dk": rel_err(dk.cpu(), r_dk),
        "dv": rel_err(dv.cpu(), r_dv),
    }
    if sinks is not None:
        assert dsink.dtype == sinks.dtype and dsink.shape == sinks.shape
        errs["dsink"] = rel_err(dsink.cpu(), r_dsink)
    else:
        assert dsink is None
    bad = {name: e for name, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"
    return errs, (out, lse, dq, dk, dv, dsink)


# ----------------------------------------------------------------------------------------------------------
# Interpreter (CPU) tests, fp32, tolerance 1e-4
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seqlens, hq, hkv, d, causal, window",
    [
        ([37], 2, 2, 64, True, (-1, -1)),  # GQA 1, odd length, full causal
        ([33, 17, 40], 4, 1, 64, True, (-1, -1)),  # varlen, GQA 4
        ([41], 8, 1, 64, True, (7, 0)),  # GQA 8, window much smaller than S
        ([29, 35], 2, 1, 128, True, (100, 0)),  # head_dim 128, window larger than S
        ([34], 2, 2, 64, False, (-1, -1)),  # non-causal
        ([38, 21], 2, 1, 64, False, (5, 9)),  # two-sided window, non-causal
        # one long sequence among many short ones: dsink's partial sums (one per sequence and query block of the
        # longest) outgrow a row of the backward's per-row buffer and get their own
        ([1] * 24 + [480], 2, 1, 64, True, (15, 0)),
    ],
)
def test_matches_fp64(tk, seqlens, hq, hkv, d, causal, window):
    case = make_case(seqlens, seqlens, hq, hkv, d, seed=len(seqlens) * 100 + hq + d)
    run_and_compare(tk, case, causal, *window)


def test_cached_calls_follow_every_part_of_their_signature(tk):
    # the host derivation (checks, plan, grids, buffer shapes) is cached per input signature: calls that share
    # shapes but differ in window, causality, sinks, sequence lengths or alignment must each get their own entry and
    # their own correct results, and a repeated call must reuse its entry
    case = make_case([23, 18], [23, 18], 4, 2, 64, seed=11)
    tk._CALLS.clear()
    variants = [(True, -1, -1), (True, 5, 0), (False, 4, 2), (True, 5, 0)]
    for causal, left, right in variants:
        run_and_compare(tk, case, causal, left, right)
    assert len(tk._CALLS) == 2 * 3  # a forward and a backward entry per distinct signature; the repeat reused its own
    no_sink = dict(case, sinks=None)
    run_and_compare(tk, no_sink, True, 5, 0)
    shorter = dict(case, cu_q=torch.tensor([0, 23, 41, 41], dtype=torch.int32))  # one more (empty) sequence
    shorter["cu_k"] = shorter["cu_q"]
    run_and_compare(tk, shorter, True, 5, 0)
    storage = torch.empty(case["q"].numel() + 2)  # the same q, 8 bytes past a 16-byte boundary
    offset_q = storage[2:].view_as(case["q"]).copy_(case["q"])
    run_and_compare(tk, dict(case, q=offset_q), True, 5, 0)
    assert len(tk._CALLS) == 2 * 6
    # the backend choice (gluon) and a given plan are part of the signature too
    run_and_compare(tk, case, True, 5, 0, gluon=False)
    assert len(tk._CALLS) == 2 * 7
    plan = tk._plan(case["q"], case["k"], case["v"], True, 23, 23)._replace(head_splits=2)
    run_and_compare(tk, case, True, 5, 0, plan=plan)
    assert len(tk._CALLS) == 2 * 8


def test_dispatch_reads_no_environment():
    # The dispatch is a function of the call's tensors and its backend choice: no kernel module reads the environment
    # when it is called. Only the interface reads it, once, at import (SINK_FLASH_ATTN3_BACKEND and TRITON_INTERPRET).
    import ast

    readers = {}
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if names & {"environ", "getenv", "putenv"}:
                    readers.setdefault(path.name, set()).add(getattr(node, "name", "<lambda>"))
    assert readers == {"interface.py": {"_backend_from_environment"}}, readers
    called = ast.parse((PACKAGE_DIR / "interface.py").read_text())
    calls = [  # where _backend_from_environment is called: at module level only (import time)
        node
        for fn in ast.walk(called)
        if isinstance(fn, ast.FunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Name) and node.id == "_backend_from_environment"
    ]
    assert not calls


def test_the_gluon_argument_is_the_only_gluon_switch(tk):
    # gluon=False (backend="triton") keeps the Triton kernels; on CPU tensors the Gluon kernels never apply anyway
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    for gluon in (True, False):
        assert tk._plan(q, q[:, :1], q[:, :1], False, 1 << 14, 1 << 14, gluon) == (
            "fwd", "dkdv", "dq", False, False, False, 0
        )  # fmt: skip
    assert not hasattr(tk, "GLUON_ENV_VAR") and not hasattr(tk, "gluon_enabled")


class _GluonStub:
    """Stands in for gluon_kernels on CPU: records the launches."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def __getattr__(self, name):
        def launch(*args):
            if name == self.fail:
                raise RuntimeError("stub compile error")
            self.calls.append(name)

        return launch


@pytest.fixture
def sm90(tk, monkeypatch):
    """Pretends CPU tensors live on an sm_90 GPU with Gluon importable (the routing only; nothing is launched)."""
    stub = _GluonStub()
    monkeypatch.setattr(tk, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(tk, "_TensorDescriptor", object)
    monkeypatch.setitem(tk._GLUON, "module", stub)
    return stub


def test_dispatch_plan(tk, sm90):
    # Which kernels run (sm_90 routing, checked on CPU): the Gluon forward on layers without a left window from
    # GLUON_FWD_MIN_SEQLEN queries, the Triton forward on sliding layers, short sequences and decode steps; the
    # Gluon backward for every 16-bit head_dim-64 layer; Triton for fp32, other head dims and with gluon=False
    n = tk.GLUON_FWD_MIN_SEQLEN
    bf16 = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    assert tk._plan(bf16, bf16[:, :2], bf16[:, :2], False, n, n)[:3] == ("fwd", "dkdv", "dq")  # K/V rows strided
    assert tk._plan(bf16, kv, kv, False, n, n) == (
        "gluon_fwd",
        "gluon_dkdv",
        "gluon_dq",
        True,
        False,
        n >= tk.FUSED_MIN_SEQLEN,
        0,
    )
    # the fused backward (deterministic=False): full-attention layers from FUSED_MIN_SEQLEN keys
    f = tk.FUSED_MIN_SEQLEN
    assert tk._plan(bf16, kv, kv, False, f, f).fused_bwd
    assert tk._plan(bf16, kv, kv, False, 1, f).fused_bwd  # (decode against a long cache)
    assert not tk._plan(bf16, kv, kv, False, f, f - 1).fused_bwd
    assert not tk._plan(bf16, kv, kv, True, f, f).fused_bwd  # sliding layers
    assert not tk._plan(bf16.float(), kv.float(), kv.float(), False, f, f).fused_bwd
    assert tk._plan(bf16, kv, kv, True, n, n).fwd == "fwd_window"
    assert tk._plan(bf16, kv, kv, False, n - 1, n).fwd == "fwd"
    assert tk._plan(bf16, kv, kv, False, 1, n)[:3] == ("fwd", "gluon_dkdv", "gluon_dq")
    assert tk._plan(bf16.float(), kv.float(), kv.float(), False, n, n)[:3] == ("fwd", "dkdv", "dq")
    d128 = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    kv128 = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    assert tk._plan(d128, kv128, kv128, False, n, n)[:3] == ("fwd", "dkdv", "dq")
    unaligned = torch.zeros(8 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(8, 4, 64)  # rows not 16-byte aligned
    assert tk._plan(unaligned, kv, kv, False, n, n)[:3] == ("fwd", "dkdv", "dq")
    assert tk._plan(bf16, kv, kv, False, n, n, gluon=False)[:3] == ("fwd", "dkdv", "dq")  # backend="triton"
    assert not tk._plan(bf16, kv, kv, False, f, f, gluon=False).fused_bwd
    # the table of launch configurations is read-only (the thresholds are UPPER_CASE constants)
    with pytest.raises(TypeError):
        tk.CONFIGS[("gluon_fwd", 64)] = {}
    with pytest.raises(TypeError):
        tk.CONFIGS[("gluon_fwd", 64)]["STAGES"] = 3


def test_a_given_plan_is_checked(tk, sm90):
    # plan= runs kernels outside the shapes the dispatch gives them (tests, benchmarks), never ones that cannot run
    bf16 = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    plan = tk._plan(bf16, kv, kv, False, 8, 8)
    tk._check_plan(plan._replace(fwd="gluon_fwd", fused_bwd=True, head_splits=2), bf16, kv, kv)
    f32, kv32 = bf16.float(), kv.float()
    for bad, tensors, match in (
        (plan._replace(fwd="gluon_fwd"), (f32, kv32, kv32), "Gluon kernels need"),
        (plan._replace(dq="dq"), (bf16, kv, kv), "mixes Gluon and Triton"),
        (plan._replace(head_splits=3), (bf16, kv, kv), "head_splits must divide"),
        (plan._replace(concurrent=True), (bf16, kv, kv), "side stream needs CUDA"),
    ):
        with pytest.raises(ValueError, match=match):
            tk._check_plan(bad, *tensors)
    with pytest.raises(ValueError, match="fused backward needs"):
        tk._check_plan(plan._replace(dkdv="dkdv", dq="dq", fused_bwd=True), bf16, kv, kv)
    with pytest.raises(TypeError, match="plan must be"):
        tk._check_plan(tuple(plan), bf16, kv, kv)


def test_deterministic_selects_the_backward(tk, sm90, monkeypatch):
    # deterministic=False runs the fused Gluon backward where the plan gives it, True the deterministic dK/dV + dQ
    # launcher; both on the same inputs (the stub records launches, computes nothing)
    q = torch.randn(8, 4, 64, dtype=torch.float16)
    k = torch.randn(8, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    lse = torch.randn(4, 8)
    args = (q, q, k, k, q, lse, torch.zeros(4), cu, cu, 8, 8, 0.125, True, -1, -1)
    fused = tk._plan(q, k, k, False, 8, 8)._replace(fused_bwd=True)  # (8 keys: below FUSED_MIN_SEQLEN)
    for deterministic, launched in ((False, "backward_fused"), (True, "backward")):
        sm90.calls.clear()
        dq, dk, dv, dsink = tk.sink_attention_backward(*args, deterministic=deterministic, plan=fused)
        assert sm90.calls == [launched]
        assert dq.shape == q.shape and dk.shape == k.shape and dsink.shape == (4,)
    sm90.calls.clear()
    tk.sink_attention_backward(*args, deterministic=False)  # the plan of 8 keys: the deterministic kernels
    assert sm90.calls == ["backward"]
    sm90.calls.clear()
    tk.sink_attention_backward(*args[:-3], True, 127, 0, deterministic=False)  # a sliding layer
    assert sm90.calls == ["backward"]
    sm90.calls.clear()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)  # PyTorch's deterministic mode
    tk.sink_attention_backward(*args, deterministic=False, plan=fused)
    assert sm90.calls == ["backward"]


def test_gluon_failures_are_loud(tk, sm90, monkeypatch):
    # a Gluon kernel that fails raises (naming the way back to the Triton kernels) instead of switching Gluon off
    # silently
    q = torch.randn(8, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    monkeypatch.setitem(tk._GLUON, "module", _GluonStub(fail="fwd"))
    gluon_fwd = tk._plan(q, q, q, False, 8, 8)._replace(fwd="gluon_fwd")
    with pytest.raises(RuntimeError, match="backend='triton'") as info:
        tk.sink_attention_forward(q, q, q, None, cu, cu, 8, 8, 0.125, True, -1, -1, plan=gluon_fwd)
    assert "stub compile error" in str(info.value)
    tk.sink_attention_forward(q, q, q, None, cu, cu, 8, 8, 0.125, True, -1, -1, gluon=False)  # the Triton kernels
    # a Triton without usable Gluon: one warning with the cause, then the Triton kernels (no warning per call)
    monkeypatch.setattr(tk, "_GLUON", {})

    def no_gluon(name, package=None):
        raise ImportError("no module named triton.experimental.gluon")

    monkeypatch.setattr(tk.importlib, "import_module", no_gluon)
    with pytest.warns(RuntimeWarning, match="no module named triton.experimental.gluon"):
        assert tk._gluon_kernels() is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tk._plan(q, q, q, False, 8, 8)[:3] == ("fwd", "dkdv", "dq")


def test_interpreter_refuses_bf16(tk):
    # Triton's interpreter multiplies raw bf16 bits in tl.dot (triton#11584): refused, never silently wrong
    assert not tk._interpreter_bf16_dot_exact()  # the probe of the installed interpreter finds the bug
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="11584"):
        tk.sink_attention_forward(q, q, q, None, cu, cu, 8, 8, 0.125, True, -1, -1)


def test_one_batch_row_runs_without_a_view(tk):
    # the public path hands dense [1, seqlen, heads, head_dim] tensors over as they are (no view per call): the same
    # results as [tokens, heads, head_dim], in the caller's rank; a batch of several rows is refused
    case = make_case([45], [45], 4, 2, 64, seed=5)
    q, k, v, dout, sinks = case["q"], case["k"], case["v"], case["dout"], case["sinks"]
    args = (case["cu_q"], case["cu_k"], 45, 45, 0.125, True, 15, 0)
    out, lse = tk.sink_attention_forward(q, k, v, sinks, *args)
    grads = tk.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args)
    out4, lse4 = tk.sink_attention_forward(q[None], k[None], v[None], sinks, *args)
    grads4 = tk.sink_attention_backward(dout[None], q[None], k[None], v[None], out4, lse4, sinks, *args)
    assert out4.shape == (1, *q.shape) and torch.equal(out4[0], out) and torch.equal(lse4, lse)
    for g4, g in zip(grads4, grads):
        assert torch.equal(g4.reshape(g.shape), g)
    assert grads4[0].shape == (1, *q.shape) and grads4[3].dtype == sinks.dtype
    with pytest.raises(ValueError, match=r"\[1, tokens, heads, head_dim\]"):
        tk.sink_attention_forward(q.expand(2, *q.shape), k[None], v[None], sinks, *args)


def test_decode_shorter_queries_bottom_right(tk):
    # len_q < len_k (KV cache): causal aligned bottom-right, with a window and a 1-token decode sequence
    case = make_case([5, 1, 19], [37, 23, 19], 4, 2, 64, seed=3)
    run_and_compare(tk, case, True)
    run_and_compare(tk, case, True, 9, 0)


def test_no_sink(tk):
    case = make_case([35, 18], [35, 18], 4, 2, 64, with_sink=False, seed=4)
    run_and_compare(tk, case, True)
    run_and_compare(tk, case, True, 6, 0)


@pytest.mark.parametrize("sink_value", [30.0, -30.0])
def test_large_sinks(tk, sink_value):
    case = make_case([33], [33], 2, 1, 64, seed=5)
    case["sinks"] = torch.tensor([sink_value, -sink_value / 3])
    run_and_compare(tk, case, True)


def test_fully_masked_rows(tk):
    # queries longer than keys with a causal mask: the first len_q - len_k rows see no key at all
    case = make_case([20], [6], 2, 1, 64, seed=6)
    errs, (out, lse, *_rest) = run_and_compare(tk, case, True)
    empty = slice(0, 14)
    assert torch.all(out[empty] == 0)
    assert torch.allclose(lse[:, empty], case["sinks"][:, None].expand(-1, 14))
    nosink = dict(case, sinks=None)
    _, (out, lse, *_rest) = run_and_compare(tk, nosink, True)
    assert torch.all(out[empty] == 0) and torch.all(lse[:, empty] == float("-inf"))


def test_fused_backward_dsink_split(tk):
    # The fused backward (sm_90) sums -w_i dS_ij over its tiles; the preprocessing kernel adds the rest of dsink,
    # -sum_i w_i D_i (1 - w_i), with w_i = exp(s_h - LSE_i): since sum_j P_ij = 1 - w_i, the two parts add up to
    # dsink_h = -sum_i w_i sum_j P_ij dP_ij. The preprocessing kernel with its sink weights, run here, against fp64.
    case = make_case([21, 40, 7], [21, 40, 7], 4, 2, 16, seed=13)
    q, k, v, dout, sinks, cu = case["q"], case["k"], case["v"], case["dout"], case["sinks"], case["cu_q"]
    scale = 1.0 / math.sqrt(16)
    out, lse = tk.sink_attention_forward(q, k, v, sinks, cu, cu, 40, 40, scale, True, -1, -1)
    T, H, D = q.shape
    num_seqs = cu.numel() - 1
    stride_rows = tk._row_vector_stride(T, num_seqs)
    delta, lse2, sink_weights = torch.zeros(3, H, stride_rows).unbind(0)
    dsink_part = torch.zeros(H)
    block = 16
    tk._bwd_preprocess[(tk._cdiv(40, block), H, num_seqs)](
        out, dout, lse, delta, lse2, sinks, sink_weights, dsink_part, cu, stride_rows, out.stride(0), out.stride(1),
        dout.stride(0), dout.stride(1), lse.stride(0), HEAD_DIM=D, BLOCK=block, SINK_WEIGHTS=True,
    )  # fmt: skip
    rows = torch.cat([start + torch.arange(n) for start, n in zip(4 * ((cu[:-1] + 3) // 4) + 4 * torch.arange(num_seqs),
                                                                  (cu[1:] - cu[:-1]).tolist())])  # fmt: skip
    d_rows = (out.double() * dout.double()).sum(-1).T  # [H, T]
    w = torch.exp(sinks.double()[:, None] - lse.double())
    assert rel_err(delta[:, rows], d_rows) < 1e-6
    assert rel_err(lse2[:, rows], lse.double() * tk.LOG2E) < 1e-6
    assert rel_err(sink_weights[:, rows], w) < 1e-6
    assert rel_err(dsink_part, -(w * d_rows * (1 - w)).sum(-1)) < 1e-6
    # the fused kernel's part, from the fp64 P and dP of each sequence: the sum is the exact dsink
    dsink = dsink_part.double().clone()
    for b in range(num_seqs):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        kr, vr = (t[sl].double().repeat_interleave(2, dim=1) for t in (k, v))
        scores = scale * torch.einsum("ihd,jhd->hij", q[sl].double(), kr)
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(scores - lse[:, sl].double()[..., None])
        dp = torch.einsum("ihd,jhd->hij", dout[sl].double(), vr)
        ds = p * (dp - d_rows[:, sl, None])
        dsink -= (w[:, sl] * ds.sum(-1)).sum(-1)
    exact = reference(q, k, v, sinks, cu, cu, scale, True, -1, -1, dout)[5]
    assert rel_err(dsink, exact) < 1e-5


def test_strided_views_and_deterministic(tk):
    # q/k/v as views of one packed qkv buffer (non-contiguous token/head strides); two backward runs agree bitwise
    g = torch.Generator().manual_seed(7)
    t, hq, hkv, d = 30, 4, 2, 64
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    case = make_case([t], [t], hq, hkv, d, seed=7)
    case.update(q=q, k=k, v=v)
    _, first = run_and_compare(tk, case, True)
    cu = case["cu_q"]
    out, lse = first[0], first[1]
    again = tk.sink_attention_backward(
        case["dout"], q, k, v, out, lse, case["sinks"], cu, cu, t, t, d**-0.5, True, -1, -1
    )
    for a, b in zip(first[2:], again):
        assert torch.equal(a, b)


def test_tensor_descriptor_paths(tk, monkeypatch):
    # the sm_90+ Triton paths (K/V tiles of the forward and the dQ kernel, Q/dO tiles of the dK/dV kernel through
    # tensor descriptors) on packed sequences: tiles that run past a sequence read the next one (or zeros past the
    # tensor), which must change nothing (LSE = +inf and D = 0 there), on packed, windowed and decode shapes
    monkeypatch.setattr(tk, "_device_capability", lambda device: (10, 0))  # TMA, no Gluon (sm_90 only)
    monkeypatch.setattr(tk, "_tma_ok", lambda *tensors: True)
    case = make_case([37, 20, 9], [37, 20, 9], 4, 1, 64, dtype=torch.float16, seed=10)
    run_and_compare(tk, case, True, tol=2e-2)
    run_and_compare(tk, case, True, 8, 0, tol=2e-2)
    decode = make_case([5, 1, 19], [37, 23, 19], 4, 2, 64, dtype=torch.float16, seed=11)
    run_and_compare(tk, decode, True, tol=2e-2)


def test_launches_on_the_inputs_device(tk, monkeypatch):
    # Triton launches on the current device: both entry points make the inputs' GPU current for the call when it is
    # another one (a model split over GPUs), and leave the current device alone otherwise
    assert tk.sink_attention_forward.__wrapped__ and tk.sink_attention_backward.__wrapped__
    entered = []

    class DeviceGuard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append(None)

    monkeypatch.setattr(tk, "_current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", DeviceGuard)

    class OnGpu:
        def __init__(self, index):
            self.device = torch.device("cuda", index)

    seen = []
    probe = tk._on_input_device(lambda first, x, y=0: seen.append((list(entered), x, y)) or "result")
    assert probe(OnGpu(1), 2, y=3) == "result"
    assert seen[-1] == ([torch.device("cuda", 1)], 2, 3) and entered[-1] is None  # inside the guard, then left
    entered.clear()
    assert probe(OnGpu(0), 4) == "result" and seen[-1] == ([], 4, 0) and not entered  # already current
    assert probe(torch.zeros(1), 5) == "result" and seen[-1] == ([], 5, 0)  # CPU (the interpreter)


def test_dkdv_head_splits(tk):
    # the rule: GPT-OSS (group 8, dK/dV tiles of 64 keys) on 132 multiprocessors splits full layers below 8k only
    assert tk._dkdv_head_splits(8, 8 * 32, 132, windowed=False) == 4
    assert tk._dkdv_head_splits(8, 8 * 64, 132, windowed=False) == 2
    assert tk._dkdv_head_splits(8, 8 * 128, 132, windowed=False) == 1
    # the fused backward (128-key blocks, one program per multiprocessor) splits only a grid smaller than one wave
    fused = tk.FUSED_PROGRAMS_PER_SM
    assert tk._dkdv_head_splits(8, 8 * 16, 132, windowed=False, per_sm=fused) == 2
    assert tk._dkdv_head_splits(8, 8 * 32, 132, windowed=False, per_sm=fused) == 1
    assert tk._dkdv_head_splits(8, 8 * 64, 132, windowed=True) == 1
    assert tk._dkdv_head_splits(3, 1, 132, windowed=False) == 1  # no power of two divides the group
    assert tk._dkdv_head_splits(8, 1, 0, windowed=False) == 1  # CPU
    # split grids (partial sums over shares of each KV group's query heads) give the same gradients
    case = make_case([37, 20], [37, 20], 8, 2, 64, seed=13)
    _, whole = run_and_compare(tk, case, True)
    for splits in (2, 4):
        plan = tk._plan(case["q"], case["k"], case["v"], False, 37, 37)._replace(head_splits=splits)
        _, split = run_and_compare(tk, case, True, plan=plan)
        assert torch.equal(split[2], whole[2]) and torch.equal(split[5], whole[5])  # dq, dsink: untouched
        for a, b in zip(split[3:5], whole[3:5]):  # dk, dv: the same sums in another order
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def interpreter_bf16_dot(tk, monkeypatch):
    """Triton's interpreter stores bf16 as uint16 and multiplies the raw bit patterns in ``tl.dot``
    (triton-lang/triton#11584: bf16 is not supported by the interpreter).  Widen bf16 dot operands to fp32 (exact)
    so the kernels' bf16 path (loads, bf16 casts of P and dS, stores) runs on CPU; the dots then accumulate in
    fp32 as the GPU's tensor cores do."""
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_dot"):
        pytest.skip("this Triton's interpreter has no InterpreterBuilder.create_dot to adapt")
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != triton.language.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), triton.language.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    assert tk._interpreter_bf16_dot_exact()  # the kernels' own probe sees the widened dot: bf16 runs


@pytest.mark.parametrize(
    "seqlens_q, seqlens_k, hq, hkv, window",
    [
        ([37, 20], [37, 20], 4, 1, (-1, -1)),  # varlen, GQA 4, full causal
        ([41], [41], 8, 1, (7, 0)),  # GQA 8, sliding window
        ([5, 19], [37, 19], 4, 2, (9, 0)),  # decode-style len_q < len_k with a window
    ],
)
def test_bf16_matches_fp64(tk, interpreter_bf16_dot, seqlens_q, seqlens_k, hq, hkv, window):
    # bf16 inputs, fp32 accumulation: relative error of every output near bf16 precision (expected: 1e-3 - 1e-2)
    case = make_case(seqlens_q, seqlens_k, hq, hkv, 64, dtype=torch.bfloat16, seed=13 + hq)
    case["sinks"] = case["sinks"] * 3.0
    errs, (out, _lse, dq, dk, dv, _ds) = run_and_compare(tk, case, True, *window, tol=2e-2)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    assert max(errs.values()) > 1e-5, f"bf16 rounding should show ({errs}): the bf16 path did not run"


# ----------------------------------------------------------------------------------------------------------
# CUDA (compiled kernels), bf16 and fp32
# ----------------------------------------------------------------------------------------------------------
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SM90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon kernels need an sm_90 GPU",
)
# (seqlens_q, seqlens_k, hq, hkv, causal, window)
GPU_CASES = [
    ([700, 1029, 64], [700, 1029, 64], 16, 2, True, (-1, -1)),  # varlen, GQA 8, partial tiles
    ([700, 1029, 64], [700, 1029, 64], 16, 2, True, (127, 0)),  # GPT-OSS sliding window
    ([5, 1, 300], [37, 23, 300], 8, 2, True, (-1, -1)),  # decode: queries shorter than keys (bottom-right)
    ([40, 300], [9, 300], 8, 2, True, (-1, -1)),  # more queries than keys: rows with no key
    ([257], [257], 4, 4, True, (-1, -1)),  # GQA 1, odd length
    ([333, 190], [333, 190], 8, 2, True, (31, 0)),  # window smaller than one tile
    ([300, 77], [300, 77], 8, 2, False, (40, 9)),  # non-causal, two-sided window
]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [(-1, -1), (128, 0)])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "auto"])
def test_cuda_matches_fp64(dtype, tol, window, gluon):
    # the default dispatch (Gluon where it applies on sm_90) and the Triton kernels alone
    tk_cuda = _load_kernels(interpret=False)
    case = make_case([700, 1029, 64], [700, 1029, 64], 16, 2, 64, dtype=dtype, seed=8, device="cuda")
    run_and_compare(tk_cuda, case, True, *window, tol=tol, gluon=gluon)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("window", [(-1, -1), (127, 0)])
def test_cuda_concurrent_backward_is_bitwise_sequential(window):
    # Without Gluon, sliding layers and short sequences run the dQ kernel on a side stream next to the dK/dV
    # kernel: the same programs in the same order per output, so every gradient must equal the sequential run's bit
    # for bit, and the caller's stream must see finished results (a missing join would show as stale or partial dQ)
    tk_cuda = _load_kernels(interpret=False)
    case = make_case([700, 1029, 64], [700, 1029, 64], 16, 2, 64, dtype=torch.bfloat16, seed=21, device="cuda")
    q, k, v, dout, sinks = case["q"], case["k"], case["v"], case["dout"], case["sinks"]
    args = (case["cu_q"], case["cu_k"], case["max_q"], case["max_k"], 0.125, True, *window)
    out, lse = tk_cuda.sink_attention_forward(q, k, v, sinks, *args, gluon=False)
    plan = tk_cuda._plan(q, k, v, window[0] >= 0, case["max_q"], case["max_k"], gluon=False)
    assert plan.concurrent
    results = {}
    for concurrent in (False, True):
        grads = tk_cuda.sink_attention_backward(
            dout, q, k, v, out, lse, sinks, *args, plan=plan._replace(concurrent=concurrent)
        )
        results[concurrent] = [g.clone() for g in grads]  # clone on the caller's stream: must see the final dQ
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), results[False], results[True]):
        assert torch.equal(a, b), f"{name} differs between the sequential and the concurrent backward"


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqlens_q, seqlens_k, hq, hkv, causal, window", GPU_CASES)
def test_cuda_gluon_kernels(dtype, seqlens_q, seqlens_k, hq, hkv, causal, window):
    # The Gluon kernels (sm_90, 16-bit, head_dim 64: dK/dV, dQ, and the producer/consumer forward, here given by the
    # plan on every layer without a left window, short ones too) against fp64, against the Triton kernels, and bitwise
    # reproducible
    tk_cuda = _load_kernels(interpret=False)
    case = make_case(seqlens_q, seqlens_k, hq, hkv, 64, dtype=dtype, seed=31 + hq, device="cuda")
    q, k, v, dout, sinks = case["q"], case["k"], case["v"], case["dout"], case["sinks"]
    plan = tk_cuda._plan(q, k, v, window[0] >= 0, case["max_q"], case["max_k"])
    assert plan.dkdv == "gluon_dkdv" and plan.dq == "gluon_dq", tk_cuda._GLUON.get("error")
    assert plan.fwd == ("fwd_window" if window[0] >= 0 else "fwd")  # (below GLUON_FWD_MIN_SEQLEN queries)
    if window[0] < 0:
        plan = plan._replace(fwd="gluon_fwd")
    run_and_compare(tk_cuda, case, causal, *window, tol=2e-2, plan=plan)
    args = (case["cu_q"], case["cu_k"], case["max_q"], case["max_k"], 0.125, causal, *window)
    out, lse = tk_cuda.sink_attention_forward(q, k, v, sinks, *args, plan=plan)
    first = tk_cuda.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args, deterministic=True, plan=plan)
    again = tk_cuda.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args, deterministic=True, plan=plan)
    triton_out, triton_lse = tk_cuda.sink_attention_forward(q, k, v, sinks, *args, gluon=False)
    triton_grads = tk_cuda.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args, gluon=False)
    assert rel_err(out, triton_out) < 1e-2, f"Gluon and Triton forward differ by {rel_err(out, triton_out):.2e}"
    finite = torch.isfinite(triton_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - triton_lse[finite]).abs().max() < 1e-3
    for name, a, b, t in zip(("dq", "dk", "dv", "dsink"), first, again, triton_grads):
        assert torch.equal(a, b), f"{name}: the Gluon backward is not bitwise reproducible"
        assert rel_err(a, t) < 1e-2, f"{name}: Gluon and Triton backward differ by {rel_err(a, t):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_inputs_on_another_device():
    # inputs on the second GPU while the first is current (a model split over GPUs): the same results as with the
    # second GPU current
    tk_cuda = _load_kernels(interpret=False)
    case = make_case([300, 77], [300, 77], 8, 2, 64, dtype=torch.bfloat16, seed=5, device="cuda:1")
    q, k, v, dout, sinks = case["q"], case["k"], case["v"], case["dout"], case["sinks"]
    args = (case["cu_q"], case["cu_k"], case["max_q"], case["max_k"], 0.125, True, -1, -1)

    def run():
        out, lse = tk_cuda.sink_attention_forward(q, k, v, sinks, *args)
        grads = tk_cuda.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args, deterministic=True)
        torch.cuda.synchronize(q.device)
        return out, lse, *grads

    with torch.cuda.device(0):
        got = run()
    with torch.cuda.device(1):
        expected = run()
    for a, b in zip(got, expected):
        assert a.device == q.device and torch.equal(a, b)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "auto"])
def test_cuda_dkdv_head_splits(gluon):
    # a dK/dV grid split over the query heads of each KV group (fp32 partial sums, reduced in a fixed order): the
    # same dK/dV within rounding, every other output bitwise the same; and the split runs by default on short full
    # layers of a real GPU
    tk_cuda = _load_kernels(interpret=False)
    case = make_case([700, 1029, 64], [700, 1029, 64], 16, 4, 64, dtype=torch.bfloat16, seed=41, device="cuda")
    q, k, v, dout, sinks = case["q"], case["k"], case["v"], case["dout"], case["sinks"]
    args = (case["cu_q"], case["cu_k"], case["max_q"], case["max_k"], 0.125, True, -1, -1)
    assert tk_cuda._dkdv_head_splits(4, 4 * 17 * 3, tk_cuda._multiprocessors(q.device), False) == 4

    def run(plan=None):
        out, lse = tk_cuda.sink_attention_forward(q, k, v, sinks, *args, gluon=gluon)
        grads = tk_cuda.sink_attention_backward(
            dout, q, k, v, out, lse, sinks, *args, deterministic=True, gluon=gluon, plan=plan
        )
        return (out, lse, *grads)

    split = run()
    whole = run(tk_cuda._plan(q, k, v, False, case["max_q"], case["max_k"], gluon)._replace(head_splits=1))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), whole, split):
        if name in ("dk", "dv"):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert rel_err(b, a) < 4e-3, f"{name}: the split dK/dV grid differs by {rel_err(b, a):.2e}"
        else:
            assert torch.equal(a, b), f"{name} changed with a split dK/dV grid"


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("programs", [1, 5, 10_000])
def test_cuda_gluon_forward_any_number_of_programs(monkeypatch, programs):
    # The persistent Gluon forward walks its tiles with a stride of the grid: one program (every tile, the pipeline
    # counters running over tiles of different lengths, skipped tiles past short sequences), a few, or one program
    # per tile must give the same output and LSE bit for bit (a tile's arithmetic does not depend on its program)
    tk_cuda = _load_kernels(interpret=False)
    case = make_case(
        [700, 1029, 64, 0, 5], [700, 1029, 64, 0, 300], 8, 2, 64, dtype=torch.bfloat16, seed=43, device="cuda"
    )
    q, k, v, sinks = case["q"], case["k"], case["v"], case["sinks"]
    args = (case["cu_q"], case["cu_k"], case["max_q"], case["max_k"], 0.125, True, -1, -1)
    plan = tk_cuda._plan(q, k, v, False, case["max_q"], case["max_k"])._replace(fwd="gluon_fwd")
    expected = tk_cuda.sink_attention_forward(q, k, v, sinks, *args, plan=plan)
    monkeypatch.setattr(tk_cuda, "_multiprocessors", lambda device: programs)  # a GPU of that many multiprocessors
    tk_cuda._CALLS.clear()
    got = tk_cuda.sink_attention_forward(q, k, v, sinks, *args, plan=plan)
    for name, a, b in zip(("out", "lse"), got, expected):
        assert torch.equal(a, b), f"{name} changed with {programs} programs"


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqlens_q, seqlens_k, hq, hkv, causal, window", GPU_CASES)
def test_cuda_fused_backward(dtype, seqlens_q, seqlens_k, hq, hkv, causal, window):
    # deterministic=False on sm_90: the one-kernel backward (five products, dQ and dsink by atomic adds; given by the
    # plan on every shape here, sliding layers too) against fp64 and against the deterministic kernels, with and
    # without a split of the KV groups' query heads, with large sinks and without a sink. Both backwards take dsink
    # from the fp32 tiles (the fused one through sum_j P_ij dP_ij = sum_j dS_ij + D_i (1 - w_i)): they agree far
    # below the rounding of the 16-bit output.
    tk_cuda = _load_kernels(interpret=False)

    def backward_calls():  # the cached backward calls, in order: whether each ran the fused kernel
        return [call.fused for call in tk_cuda._CALLS.values() if isinstance(call, tk_cuda._BackwardCall)]

    for with_sink, sink_scale in ((True, 1.0), (True, 25.0), (False, 1.0)):
        case = make_case(
            seqlens_q, seqlens_k, hq, hkv, 64, dtype=dtype, sink_scale=sink_scale, with_sink=with_sink,
            seed=51 + hq, device="cuda",
        )  # fmt: skip
        q, k, v, dout, sinks = case["q"], case["k"], case["v"], case["dout"], case["sinks"]
        plan = tk_cuda._plan(q, k, v, window[0] >= 0, case["max_q"], case["max_k"])._replace(fused_bwd=True)
        assert plan.dkdv == "gluon_dkdv"
        tk_cuda._CALLS.clear()
        errs, (out, lse, *grads) = run_and_compare(
            tk_cuda, case, causal, *window, tol=2e-2, deterministic=False, plan=plan
        )
        assert backward_calls() == [True], "deterministic=False must run the fused backward on sm_90"
        args = (case["cu_q"], case["cu_k"], case["max_q"], case["max_k"], 1.0 / math.sqrt(64), causal, *window)
        exact = tk_cuda.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args, deterministic=True, plan=plan)
        assert backward_calls() == [True, False], "deterministic=True must not run the fused backward"
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, exact):
            if b is None:
                assert a is None
                continue
            assert a.dtype == b.dtype and a.shape == b.shape
            tol = 1e-4 if name == "dsink" else 1e-2
            assert rel_err(a, b) < tol, f"{name}: fused and deterministic backward differ by {rel_err(a, b):.2e}"
        whole_group = plan._replace(head_splits=1)  # the whole group in each program
        whole = tk_cuda.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args, plan=whole_group)
        assert backward_calls() == [True, False, True]
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), whole, exact):
            if b is not None:
                tol = 1e-4 if name == "dsink" else 1e-2
                assert rel_err(a, b) < tol, f"{name} (no head split): differs by {rel_err(a, b):.2e}"
