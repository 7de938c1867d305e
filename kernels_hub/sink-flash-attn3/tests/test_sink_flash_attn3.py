"""The public API, loaded through `kernels`, against a tiny fp64 eager reference, on both CPU backends.

``backend="torch"`` is the default CPU path (plain PyTorch); ``backend="triton"`` runs the real Triton kernels,
on CPU under ``TRITON_INTERPRET=1`` (set by the root conftest before triton is imported).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.kernels_ci

TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not TRITON_ON_CPU or __import__("importlib").util.find_spec("triton") is None,
            reason="needs triton and TRITON_INTERPRET=1 (set before triton is imported)",
        ),
    ),
]


# ----------------------------------------------------------------------------------------------------------------
# fp64 eager reference (independent of the kernel's own reference.py): one sequence at a time, K/V repeated.
# ----------------------------------------------------------------------------------------------------------------


def eager_sink_attention(q, k, v, sinks, scale, causal, window):
    """``q [Lq, Hq, D]``, ``k, v [Lk, Hkv, D]`` -> ``[Lq, Hq, D]`` in fp64, softmax over [scores, sink]."""
    len_q, num_heads, _ = q.shape
    len_k = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos_q = torch.arange(len_q).unsqueeze(1) + (len_k - len_q)  # bottom-right aligned
    pos_k = torch.arange(len_k).unsqueeze(0)
    visible = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal:
        visible &= pos_k <= pos_q
    if window[0] >= 0:
        visible &= pos_k >= pos_q - window[0]
    if window[1] >= 0:
        visible &= pos_k <= pos_q + window[1]
    scores = scores.masked_fill(~visible, -math.inf)
    sink_col = sinks.double() if sinks is not None else torch.full((num_heads,), -math.inf, dtype=torch.float64)
    logits = torch.cat([scores, sink_col.view(-1, 1, 1).expand(-1, len_q, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1].nan_to_num(0.0)  # a row with nothing visible -> 0
    return torch.einsum("hqk,khd->qhd", probs, v)


def eager_varlen(q, k, v, sinks, lens_q, lens_k, scale, causal, window):
    outs, oq, ok = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        q_seq, k_seq, v_seq = q[oq : oq + lq], k[ok : ok + lk], v[ok : ok + lk]
        outs.append(eager_sink_attention(q_seq, k_seq, v_seq, sinks, scale, causal, window))
        oq, ok = oq + lq, ok + lk
    return torch.cat(outs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()


def cu_seqlens(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@dataclass
class Case:
    lens_q: list[int]
    lens_k: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    window: tuple[int, int]
    sinks: str  # "none" | "normal" | "pm30"


CASES = {
    "gqa1_causal_odd_len_hd64": Case([13], [13], 2, 2, 64, True, (-1, -1), "normal"),
    "gqa4_varlen_window_small": Case([21, 9, 1], [21, 9, 1], 4, 1, 64, True, (4, 4), "normal"),
    "gqa8_window_larger_than_seq_hd128": Case([17, 5], [17, 5], 8, 1, 128, True, (40, 40), "normal"),
    "q_shorter_than_k_kv_cache": Case([3, 1], [19, 12], 4, 2, 64, True, (5, 5), "normal"),
    "no_sinks_noncausal_window_hd128": Case([11, 16], [11, 16], 4, 4, 128, False, (3, 2), "none"),
    "sinks_pm30": Case([15, 6], [15, 6], 4, 1, 64, True, (-1, -1), "pm30"),
    "rows_with_no_visible_key": Case([9, 4], [5, 2], 4, 2, 64, True, (1, 0), "normal"),
    "rows_with_no_visible_key_no_sink": Case([9], [5], 2, 1, 64, True, (-1, -1), "none"),
    "empty_sequence_in_batch": Case([5, 0, 6], [5, 0, 6], 4, 2, 64, True, (-1, -1), "normal"),
}


def make_sinks(kind: str, num_heads: int, dtype=torch.float32):
    if kind == "none":
        return None
    if kind == "pm30":
        return torch.tensor([30.0, -30.0] * (num_heads // 2), dtype=dtype)
    return torch.randn(num_heads, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_matches_fp64_reference(kernel, backend, name):
    case = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    q = torch.randn(tq, case.num_heads, case.head_dim, requires_grad=True)
    k = torch.randn(tk, case.num_kv_heads, case.head_dim, requires_grad=True)
    v = torch.randn(tk, case.num_kv_heads, case.head_dim, requires_grad=True)
    sinks = make_sinks(case.sinks, case.num_heads)
    if sinks is not None:
        sinks.requires_grad_()
    scale = case.head_dim**-0.5
    inputs = [t for t in (q, k, v, sinks) if t is not None]

    out = kernel.flash_attn_varlen_func(
        q, k, v, cu_seqlens(case.lens_q), cu_seqlens(case.lens_k), max(case.lens_q), max(case.lens_k),
        causal=case.causal, window_size=case.window, s_aux=sinks, backend=backend,
    )  # fmt: skip
    ref = eager_varlen(q, k, v, sinks, case.lens_q, case.lens_k, scale, case.causal, case.window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-4

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out.double())
    for label, g, r in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), label
        assert rel_err(g, r) <= 2e-4, f"{label}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_matches_fp64_reference_and_varlen(kernel, backend):
    """flash_attn_func on [B, S, H, D] (also with seqlen_q < seqlen_k) equals the per-sequence reference."""
    torch.manual_seed(1)
    for seqlen_q, seqlen_k in ((11, 11), (4, 11)):
        q = torch.randn(2, seqlen_q, 4, 64, requires_grad=True)
        k = torch.randn(2, seqlen_k, 2, 64, requires_grad=True)
        v = torch.randn(2, seqlen_k, 2, 64, requires_grad=True)
        sinks = torch.randn(4, requires_grad=True)
        out, lse = kernel.flash_attn_func(
            q, k, v, causal=True, window_size=(3, 3), s_aux=sinks, return_softmax_lse=True, backend=backend
        )
        assert out.shape == q.shape and lse.shape == (2, 4, seqlen_q) and lse.dtype == torch.float32
        ref = torch.stack([eager_sink_attention(q[b], k[b], v[b], sinks, 64**-0.5, True, (3, 3)) for b in range(2)])
        assert rel_err(out, ref) <= 1e-4
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
        ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), grad_out.double())
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) <= 2e-4


@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_computes_float64_inputs_in_float64(kernel, name):
    """``reference.py`` on float64 inputs (the fp64 reference of ``benchmarks/attention.py``): its output and the
    gradients it derives from its LSE equal the eager fp64 reference to fp64 rounding, far below fp32's."""
    import importlib

    reference = importlib.import_module(f"{kernel.interface.__package__}.reference")
    case = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    q = torch.randn(tq, case.num_heads, case.head_dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tk, case.num_kv_heads, case.head_dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tk, case.num_kv_heads, case.head_dim, dtype=torch.float64, requires_grad=True)
    sinks = make_sinks(case.sinks, case.num_heads, torch.float64)
    if sinks is not None:
        sinks.requires_grad_()
    dout = torch.randn(tq, case.num_heads, case.head_dim, dtype=torch.float64)
    scale = case.head_dim**-0.5
    args = (cu_seqlens(case.lens_q), cu_seqlens(case.lens_k), max(case.lens_q), max(case.lens_k), scale, case.causal)
    out, lse = reference.sink_attention_forward(q.detach(), k.detach(), v.detach(), sinks, *args, *case.window)
    grads = reference.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args, *case.window)
    assert out.dtype == lse.dtype == torch.float64
    ref = eager_varlen(q, k, v, sinks, case.lens_q, case.lens_k, scale, case.causal, case.window)
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    for label, got, want in zip(("out", "dq", "dk", "dv", "dsink"), (out, *grads), (ref, *ref_grads)):
        assert got.dtype == torch.float64 and rel_err(got, want) <= 1e-12, f"{label}: {rel_err(got, want):.2e}"


def _split_dkdv_grids(kernel, monkeypatch):
    """The Triton kernels planned as on a GPU of 132 multiprocessors, which splits the dK/dV grid of short full layers
    over the query heads of each KV group (``_dkdv_head_splits``); returns a function listing the splits of the
    backward calls made since."""
    import importlib

    triton_kernels = importlib.import_module(f"{kernel.interface.__package__}.triton_kernels")
    monkeypatch.setattr(triton_kernels, "_multiprocessors", lambda device: 132)  # (a hardware fact, not a setting)
    triton_kernels._CALLS.clear()
    return lambda: [
        c.head_splits for c in triton_kernels._CALLS.values() if isinstance(c, triton_kernels._BackwardCall)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_splits", [1, 2], ids=["whole_dkdv_grid", "split_dkdv_grid"])
def test_gradients_take_the_heads_first_layout_of_transformers_inputs(kernel, backend, head_splits, monkeypatch):
    """transformers passes q/k/v as [b, s, h, d] views of heads-first [b, h, s, d] states: the gradients come back
    in that layout (as FlashAttention's do), with the values of contiguous inputs; the varlen path alike."""
    window = (4, 0)  # a sliding layer: never split
    if head_splits > 1:
        splits = _split_dkdv_grids(kernel, monkeypatch)
        window = (-1, 0)  # a short full layer: split on a GPU
    torch.manual_seed(2)
    states = [torch.randn(1, h, 13, 64) for h in (4, 2, 2)]
    sinks = torch.randn(4, requires_grad=True)
    grad_out = torch.randn(1, 13, 4, 64)
    results = {}
    for layout in ("heads_first", "contiguous", "varlen"):
        leaves = [s.clone().requires_grad_() for s in states]
        q, k, v = (t.transpose(1, 2) for t in leaves)  # [1, 13, h, 64] views, heads-first in memory
        if layout == "contiguous":
            q, k, v = (t.contiguous() for t in (q, k, v))
        args = dict(causal=True, window_size=window, s_aux=sinks, backend=backend)
        if layout == "varlen":  # [tokens, h, d] views, heads-first in memory
            cu = torch.tensor([0, 13], dtype=torch.int32)
            q, k, v = q[0], k[0], v[0]
            out = kernel.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, **args)[None]
        else:
            out = kernel.flash_attn_func(q, k, v, **args)
        grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
        if layout != "contiguous":
            for g, t in zip(grads[:3], (q, k, v)):
                assert g.stride() == t.stride(), f"{layout}: gradient strides {g.stride()} != input {t.stride()}"
        results[layout] = (out, *grads)
    for layout in ("heads_first", "varlen"):
        for a, b in zip(results[layout], results["contiguous"]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), layout
    if head_splits > 1 and backend == "triton":
        assert set(splits()) == {head_splits}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink_half", [False, True], ids=["fp32_sinks", "half_sinks"])
def test_half_precision_inputs_and_sink_gradient_dtype(kernel, backend, sink_half):
    """bf16 (fp16 under the Triton interpreter, whose numpy backend mishandles bf16) q/k/v; the sink gradient
    comes back in the sink's own dtype (fp32 and half-precision sinks)."""
    dtype = torch.float16 if backend == "triton" and TRITON_ON_CPU else torch.bfloat16
    sink_dtype = dtype if sink_half else torch.float32
    torch.manual_seed(2)
    lens = [14, 7]
    q = torch.randn(sum(lens), 4, 64, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens), 2, 64, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens), 2, 64, dtype=dtype, requires_grad=True)
    sinks = torch.randn(4, dtype=sink_dtype, requires_grad=True)
    out = kernel.flash_attn_varlen_func(
        q, k, v, cu_seqlens(lens), cu_seqlens(lens), 14, 14, causal=True, s_aux=sinks, backend=backend
    )
    ref = eager_varlen(q, k, v, sinks, lens, lens, 64**-0.5, True, (-1, -1))
    assert out.dtype == dtype
    assert rel_err(out, ref) <= 2e-2
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), grad_out.double())
    assert [g.dtype for g in grads] == [dtype, dtype, dtype, sink_dtype]
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 3e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float16], ids=["bf16_sinks", "fp16_sinks"])
def test_half_precision_sinks_go_in_as_they_are(kernel, backend, sink_dtype):
    """GPT-OSS keeps its sinks in the model's dtype: the kernels read 16-bit sink logits themselves (no cast on the
    way in), fp32 q/k/v keep fp32 accuracy against fp64 with the sink's exact value, and the sink gradient comes
    back in the sink's dtype."""
    torch.manual_seed(4)
    lens = [9, 16]
    q = torch.randn(sum(lens), 4, 32, requires_grad=True)
    k = torch.randn(sum(lens), 2, 32, requires_grad=True)
    v = torch.randn(sum(lens), 2, 32, requires_grad=True)
    sinks = (torch.randn(4) * 2).to(sink_dtype).requires_grad_()
    out = kernel.flash_attn_varlen_func(
        q, k, v, cu_seqlens(lens), cu_seqlens(lens), 16, 16, causal=True, window_size=(5, 0), s_aux=sinks,
        backend=backend,
    )  # fmt: skip
    ref = eager_varlen(q, k, v, sinks, lens, lens, 32**-0.5, True, (5, 0))
    assert rel_err(out, ref) <= 1e-4
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), grad_out.double())
    assert grads[3].dtype == sink_dtype
    for g, r in zip(grads[:3], ref_grads[:3]):
        assert rel_err(g, r) <= 1e-4
    assert rel_err(grads[3], ref_grads[3]) <= 1e-2  # the gradient rounded to the sink's 16-bit dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_calls_skip_autograd_with_the_same_output(kernel, backend):
    """Without a gradient to compute (no_grad, or no input that requires one) the call builds no autograd node and
    returns what the differentiable call returns."""
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 12, 4, 32), torch.randn(2, 12, 2, 32), torch.randn(2, 12, 2, 32)
    sinks = torch.randn(4)
    args = dict(causal=True, window_size=(3, 0), backend=backend)
    plain = kernel.flash_attn_func(q, k, v, s_aux=sinks, **args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    differentiable = kernel.flash_attn_func(*leaves[:3], s_aux=leaves[3], **args)
    with torch.no_grad():
        no_grad = kernel.flash_attn_func(*leaves[:3], s_aux=leaves[3], **args)
    assert plain.grad_fn is None and no_grad.grad_fn is None and differentiable.grad_fn is not None
    assert torch.equal(plain, differentiable) and torch.equal(no_grad, differentiable)


def test_backends_agree_and_auto_dispatch(kernel):
    """The backend picks the path; "auto" follows the device, the dtype and whether the interpreter runs the kernels
    (TRITON_INTERPRET at import): a pure function of those, which ``_select`` takes as arguments."""
    select = kernel.interface._select
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select("auto", cpu, torch.float32, True) == select("auto", cpu, torch.float16, True) == "triton"
    # Triton's interpreter multiplies raw bf16 bits in tl.dot (triton#11584): bf16 CPU tensors stay on PyTorch, and
    # asking for Triton with them raises
    assert select("auto", cpu, torch.bfloat16, True) == "torch"
    with pytest.raises(TypeError, match="11584"):
        select("triton", cpu, torch.bfloat16, True)
    # CUDA: "auto" is the Triton kernels with the Gluon kernels where they win, "triton" the Triton kernels alone
    assert select("auto", cuda, torch.bfloat16, False) == select("auto", cuda, None, True) == "gluon"
    assert select("triton", cuda, torch.bfloat16, False) == "triton"
    assert select("auto", cpu, torch.float32, False) == "torch"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        select("triton", cpu, torch.float32, False)
    assert select("torch", cuda, torch.bfloat16, True) == select("torch", cpu, None, False) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        select("cutlass", cpu, None, True)
    # the public resolution names the module that runs: Triton (with or without Gluon) or PyTorch
    assert kernel.resolve_backend(cuda, "auto") == kernel.resolve_backend(cuda, "triton") == "triton"
    assert kernel.resolve_backend(cuda) == ("torch" if kernel.DEFAULT_BACKEND == "torch" else "triton")
    assert kernel.resolve_backend(cuda, "torch") == "torch"
    assert kernel.resolve_backend(cpu, "triton" if TRITON_ON_CPU else "torch") == (
        "triton" if TRITON_ON_CPU else "torch"
    )
    with pytest.raises(ValueError, match="backend must be one of"):
        kernel.resolve_backend(cpu, "cutlass")


def test_the_backend_variable_is_read_once_at_import(kernel, monkeypatch):
    """SINK_FLASH_ATTN3_BACKEND sets DEFAULT_BACKEND when the package is imported; later changes of the environment
    change nothing (the root conftest sets it to "torch" before the import); a bad value fails the import, naming
    the variable."""
    assert kernel.DEFAULT_BACKEND == kernel.interface.DEFAULT_BACKEND == os.environ.get(kernel.BACKEND_ENV_VAR, "auto")
    cpu = torch.device("cpu")
    before = kernel.resolve_backend(cpu, dtype=torch.float32)
    monkeypatch.setenv(kernel.BACKEND_ENV_VAR, "auto" if kernel.DEFAULT_BACKEND == "torch" else "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "0" if TRITON_ON_CPU else "1")
    assert kernel.resolve_backend(cpu, dtype=torch.float32) == before
    q, k, v = _qkv()
    cu = torch.tensor([0, 8], dtype=torch.int32)
    kernel.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True)  # the import-time choice, no error
    for value, expected in (("Triton ", "triton"), ("", "auto")):
        monkeypatch.setenv(kernel.BACKEND_ENV_VAR, value)
        assert _fresh_interface(kernel, monkeypatch).DEFAULT_BACKEND == expected
    monkeypatch.setenv(kernel.BACKEND_ENV_VAR, "cutlass")
    with pytest.raises(ValueError, match="SINK_FLASH_ATTN3_BACKEND must be one of"):
        _fresh_interface(kernel, monkeypatch)


def _fresh_interface(kernel, monkeypatch):
    """A further import of the package (its own module name and op namespace), with the environment as it is now."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(kernel.interface.__file__).parent
    name = f"_sink_flash_attn3_fresh_{next(_FRESH_IMPORTS)}"
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py", submodule_search_locations=[str(path)])
    package = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, package)
    try:
        spec.loader.exec_module(package)
    finally:  # (the submodules the import added leave sys.modules with the package, after the test)
        for module in [m for m in sys.modules if m.startswith(f"{name}.")]:
            monkeypatch.setitem(sys.modules, module, sys.modules.pop(module))
    return package.interface


_FRESH_IMPORTS = __import__("itertools").count()


def _qkv(t=8, hq=4, hkv=2, d=64, dtype=torch.float32):
    return torch.randn(t, hq, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype)


BAD_INPUTS = {
    "sink shape": (lambda q, k, v, cu: dict(s_aux=torch.zeros(3)), "s_aux .*shape"),
    "head_dim mismatch": (lambda q, k, v, cu: dict(k=k[..., :32], v=v[..., :32]), "head_dim"),
    "head_dim too large": (
        lambda q, k, v, cu: dict(q=torch.randn(8, 4, 264), k=torch.randn(8, 2, 264), v=torch.randn(8, 2, 264)),
        "head_dim",
    ),  # fmt: skip
    "dtype mismatch": (lambda q, k, v, cu: dict(k=k.bfloat16()), "share a dtype"),
    "float64": (lambda q, k, v, cu: dict(q=q.double(), k=k.double(), v=v.double()), "float16, bfloat16 or float32"),
    "layout 4-D to varlen": (lambda q, k, v, cu: dict(q=q.unsqueeze(0)), r"\[total_tokens, heads, head_dim\]"),
    "non-contiguous head_dim": (
        lambda q, k, v, cu: dict(q=q.transpose(0, 2).contiguous().transpose(0, 2)),
        "contiguous last",
    ),  # fmt: skip
    "heads not divisible": (lambda q, k, v, cu: dict(k=torch.randn(8, 3, 64), v=torch.randn(8, 3, 64)), "multiple"),
    "cu_seqlens int64": (lambda q, k, v, cu: dict(cu_seqlens_q=cu.long()), "int32"),
    "cu_seqlens lengths differ": (
        lambda q, k, v, cu: dict(cu_seqlens_k=torch.tensor([0, 4, 8, 8], dtype=torch.int32)),
        "same length",
    ),  # fmt: skip
    "device mismatch": (lambda q, k, v, cu: dict(v=v.to("meta")), "device|meta"),
    "dropout": (lambda q, k, v, cu: dict(dropout_p=0.1), "dropout"),
    "softcap": (lambda q, k, v, cu: dict(softcap=30.0), "softcap"),
    "alibi": (lambda q, k, v, cu: dict(alibi_slopes=torch.ones(4)), "ALiBi"),
    "window": (lambda q, k, v, cu: dict(window_size=(-2, 0)), "window_size"),
    "negative scale": (lambda q, k, v, cu: dict(softmax_scale=-0.125), "softmax_scale"),
    "nan scale": (lambda q, k, v, cu: dict(softmax_scale=float("nan")), "softmax_scale"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise_clear_errors(kernel, name):
    make_override, message = BAD_INPUTS[name]
    q, k, v = _qkv()
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    kwargs = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5, s_aux=torch.zeros(4))
    kwargs.update(make_override(q, k, v, cu))
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        kernel.flash_attn_varlen_func(**kwargs)


def test_head_dim_outside_triton_tiles(kernel):
    """head_dim 80: fine on the PyTorch path, a clear error on the Triton path (its tiles are powers of two)."""
    q, k, v = torch.randn(1, 6, 2, 80), torch.randn(1, 6, 1, 80), torch.randn(1, 6, 1, 80)
    assert kernel.flash_attn_func(q, k, v, causal=True, backend="torch").shape == q.shape
    if TRITON_ON_CPU:
        with pytest.raises(ValueError, match="Triton kernels support head_dim"):
            kernel.flash_attn_func(q, k, v, causal=True, backend="triton")


def test_dense_layout_error(kernel):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"\[batch, seqlen, heads, head_dim\]"):
        kernel.flash_attn_func(q, k, v)


def test_torch_compile_fullgraph_matches_eager(kernel):
    """Custom ops with fake implementations: dynamo traces forward and backward with no graph break."""
    torch.manual_seed(3)
    lens = [9, 6]
    cu = cu_seqlens(lens)

    def loss_fn(q, k, v, sinks, q_dense, k_dense, v_dense):
        varlen = kernel.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, window_size=(3, 3), s_aux=sinks)
        dense = kernel.flash_attn_func(q_dense, k_dense, v_dense, causal=True, s_aux=sinks)
        return (varlen * varlen).sum() + dense.square().sum()

    args = [torch.randn(15, 4, 64), torch.randn(15, 2, 64), torch.randn(15, 2, 64), torch.randn(4),
            torch.randn(2, 5, 4, 64), torch.randn(2, 7, 2, 64), torch.randn(2, 7, 2, 64)]  # fmt: skip
    eager_args = [a.clone().requires_grad_() for a in args]
    compiled_args = [a.clone().requires_grad_() for a in args]
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    eager_loss, compiled_loss = loss_fn(*eager_args), compiled(*compiled_args)
    torch.testing.assert_close(compiled_loss, eager_loss)
    for a, b in zip(torch.autograd.grad(compiled_loss, compiled_args), torch.autograd.grad(eager_loss, eager_args)):
        torch.testing.assert_close(a, b)


def test_custom_op_passes_opcheck(kernel):
    """torch.library.opcheck: schema, fake tensor, autograd registration and AOT dispatch of the forward op."""
    ops = getattr(torch.ops, kernel.interface.OPS_NAMESPACE)
    q, k, v = _qkv(t=10)
    sinks = torch.randn(4)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    for t in (q, k, v, sinks):
        t.requires_grad_()
    torch.library.opcheck(ops.fwd.default, (q, k, v, sinks, cu, cu, 6, 6, 0.125, True, 2, 2, "torch", False))


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs TRITON_INTERPRET=1 (set before triton is imported)")
def test_backward_op_with_a_split_dkdv_grid_passes_opcheck(kernel, monkeypatch):
    """The backward op (what torch.compile and dispatch modes such as selective checkpointing's run) with the dK/dV
    grid split over each KV group's query heads (short full-attention layers on a GPU): its outputs must not alias
    one another, or the custom op refuses them."""
    pytest.importorskip("triton")
    splits = _split_dkdv_grids(kernel, monkeypatch)
    ops = getattr(torch.ops, kernel.interface.OPS_NAMESPACE)
    q, k, v = _qkv(t=10)
    sinks = torch.randn(4)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    out, lse = ops.fwd.default(q, k, v, sinks, cu, cu, 6, 6, 0.125, True, -1, 0, "triton", False)
    args = (torch.randn_like(out), q, k, v, out, lse, sinks, cu, cu, 6, 6, 0.125, True, -1, 0, "triton", False)
    dq, dk, dv, dsink = ops.bwd.default(*args)
    assert splits() == [2] and dk.untyped_storage().data_ptr() != dv.untyped_storage().data_ptr()
    torch.library.opcheck(ops.bwd.default, args, test_utils=("test_schema", "test_faketensor"))


def test_two_loaded_copies_do_not_clash(kernel, hub_kernel, built_kernel_repo):
    """get_local_kernel and get_kernel(LOCAL_KERNELS) may import the same sources twice: distinct op namespaces."""
    # Two separately executed copies of the ops module must register distinct namespaces; a loader that reuses the
    # already-imported module (same metadata id) shares one registration, which is equally safe.
    if hub_kernel.interface is not kernel.interface:
        assert kernel.interface.OPS_NAMESPACE != hub_kernel.interface.OPS_NAMESPACE
    q, k, v = _qkv()
    cu = torch.tensor([0, 8], dtype=torch.int32)
    a = kernel.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True, s_aux=torch.zeros(4))
    b = hub_kernel.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True, s_aux=torch.zeros(4))
    torch.testing.assert_close(a, b)


def test_bf16_under_the_interpreter_takes_the_pytorch_path(kernel):
    """With TRITON_INTERPRET=1, "auto" must not hand bf16 CPU tensors to the interpreter (its bf16 tl.dot is wrong):
    the result matches fp64 to bf16 precision (the interpreter's would be off by ~1e9)."""
    assert kernel.interface._select("auto", torch.device("cpu"), torch.bfloat16, True) == "torch"
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 12, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    sinks = torch.randn(4)
    out = kernel.flash_attn_func(q, k, v, causal=True, s_aux=sinks, backend="auto")
    ref = eager_sink_attention(q[0], k[0], v[0], sinks, 64**-0.5, True, (-1, -1))
    assert rel_err(out[0], ref) <= 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_argument(kernel, backend, monkeypatch):
    """deterministic= reaches the backend's backward; on CPU both values run the fixed-order kernels (the fused,
    atomic backward exists on sm_90 only), so they give the same gradients, bit for bit."""
    torch.manual_seed(5)
    lens = [13, 6]
    cu = cu_seqlens(lens)
    q, k, v = (torch.randn(19, h, 64, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, requires_grad=True)
    module = kernel.interface._backend_module(backend)
    backward, seen = module.sink_attention_backward, []
    monkeypatch.setattr(module, "sink_attention_backward", lambda *a, **kw: seen.append(a[-1]) or backward(*a, **kw))
    grads = []
    for deterministic in (True, False, True):
        out = kernel.flash_attn_varlen_func(
            q, k, v, cu, cu, 13, 13, causal=True, s_aux=sinks, deterministic=deterministic, backend=backend
        )
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v, sinks)))
    assert seen == [True, False, True]
    for first, other in zip(grads[0], grads[1]):
        assert torch.equal(first, other)
    for first, other in zip(grads[0], grads[2]):
        assert torch.equal(first, other)
