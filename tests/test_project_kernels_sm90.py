"""The project's Triton kernels (experts, RoPE, RMSNorm, log-probs) compile for sm_90 with the installed Triton.

CPU CI runs these kernels in Triton's interpreter, which compiles nothing: a kernel the interpreter accepts can still
fail to compile for a GPU (an API change between Triton releases, a block that does not fit). Here each host function
runs on CPU tensors with its GPU launch configuration, at GPT-OSS-20b sizes, with every flag combination the project
passes; its launches are captured instead of run, then compiled for an sm_90 target with their own arguments (the
specialization Triton derives from them). The Triton compiler needs no GPU for this. The attention kernel has its own
such test (``kernels_hub/sink-flash-attn3/tests/test_sm90_compile.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# gpt-oss-20b: hidden 2880, expert intermediate 2880, 32 experts, top-4, 64 query heads of 64, vocab 201088
HIDDEN, INTER, EXPERTS, TOP_K, HEADS, HEAD_DIM, VOCAB = 2880, 2880, 32, 4, 64, 64, 201088


def test_compile_in_subprocess():
    """Runs this file in a fresh process with Triton compiling (Triton reads TRITON_INTERPRET once, at import)."""
    if not INTERPRETED:
        pytest.skip("this process compiles the kernels itself")
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture
def compile_launches(monkeypatch):
    """``compile_launches(fn)`` runs ``fn`` with every Triton launch captured, compiles each for sm_90 and returns
    the kernels' names in launch order."""
    if INTERPRETED:
        pytest.skip("triton was imported for the interpreter here: test_compile_in_subprocess runs these")
    from hf_gptoss_rl import _logprobs_triton, _rope_triton  # noqa: PLC0415

    for module in (_rope_triton, _logprobs_triton):  # the GPU's tiles, not the interpreter's
        monkeypatch.setattr(module, "_config", lambda t, *args, module=module: dict(module._CUDA_CONFIG))

    def run(fn):
        launches = []
        original = JITFunction.run

        def capture(self, *args, grid, warmup, **kwargs):
            if warmup:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            launches.append((self, grid, args, kwargs))

        with monkeypatch.context() as patch:
            patch.setattr(JITFunction, "run", capture)
            fn()
            # Triton's active driver as far as compiling needs it (``JITFunction.warmup``): an sm_90 device
            sm90 = SimpleNamespace(
                get_current_device=lambda: 0,
                get_current_stream=lambda device=None: 0,
                get_current_target=lambda: GPUTarget("cuda", 90, 32),
            )
            patch.setattr(triton.runtime.driver, "_active", sm90)
            for kernel, grid, args, kwargs in launches:
                grid = grid(kwargs) if callable(grid) else grid
                compiled = kernel.warmup(*args, grid=grid, **kwargs)
                assert compiled.asm["cubin"], f"{kernel.__name__}: no sm_90 binary"
        return [kernel.__name__ for kernel, *_ in launches]

    return run


def test_experts_kernels_compile_for_sm90(compile_launches):
    from hf_gptoss_rl import _experts_triton as ex  # noqa: PLC0415

    rows, tokens = 64, 16
    pre = torch.randn(rows, 2 * INTER, dtype=torch.bfloat16)
    bias = torch.randn(EXPERTS, 2 * INTER, dtype=torch.bfloat16)
    expert = torch.randint(0, EXPERTS, (rows,))
    g = torch.randn(rows, INTER, dtype=torch.bfloat16)
    w = torch.rand(rows)
    position = torch.randperm(tokens * TOP_K)
    parts = [(start, torch.randn(rows // 2, HIDDEN, dtype=torch.bfloat16)) for start in (0, rows // 2)]
    down_bias = torch.randn(EXPERTS, HIDDEN, dtype=torch.bfloat16)

    def calls():
        # the forward with and without saving the biased pre-activations, the recompute in the backward
        ex.gate_forward(pre.clone(), bias, expert, 1.702, 7.0)
        ex.gate_forward(pre, bias, expert, 1.702, 7.0, store_pre=False, pre_out=torch.empty_like(pre))
        ex.gate_forward(pre.clone(), bias, expert, 1.702, 7.0, write_h=False)
        for write_hw, write_dw in ((True, True), (True, False), (False, True)):
            ex.gate_backward(pre, g, w, 1.702, 7.0, write_hw, write_dw, expert, EXPERTS)
        # the combine (routing weights and the down projection's bias) and the input gradient's sum, 1 and 2 chunks
        ex.gather_rows_sum(parts[:1], HIDDEN, position % (rows // 2), expert, EXPERTS, TOP_K, w, down_bias)
        ex.gather_rows_sum(parts, HIDDEN, position, expert, EXPERTS, TOP_K)

    assert (
        compile_launches(calls)
        == ["_gate_forward_kernel"] * 3 + ["_gate_backward_kernel"] * 3 + ["_gather_rows_sum_kernel"] * 2
    )


def test_rope_and_rms_norm_kernels_compile_for_sm90(compile_launches):
    from hf_gptoss_rl import _rope_triton  # noqa: PLC0415
    from hf_gptoss_rl._rms_norm_triton import rms_norm_input_grad  # noqa: PLC0415

    seq = 256
    # the projections' [B, S, H, D] memory seen as [B, H, S, D], as the attention layer hands it over
    x = torch.randn(1, seq, HEADS, HEAD_DIM, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = (torch.randn(1, seq, HEAD_DIM // 2, dtype=torch.bfloat16) for _ in range(2))
    hidden = torch.randn(seq, HIDDEN, dtype=torch.bfloat16)
    weight = torch.randn(HIDDEN, dtype=torch.bfloat16)

    def calls():
        _rope_triton.rotate_half_pairs(x, cos, sin)
        _rope_triton.rotate_half_pairs(x.contiguous(), cos, sin, inverse=True)
        rms_norm_input_grad(hidden, weight, torch.randn_like(hidden), 1e-5)

    assert compile_launches(calls) == ["_rope_kernel", "_rope_kernel", "_rms_norm_dx_kernel"]


def test_logprob_kernels_compile_for_sm90(compile_launches):
    from hf_gptoss_rl import _logprobs_triton as lp  # noqa: PLC0415

    rows = 4
    logits = torch.randn(rows, VOCAB)
    targets = torch.randint(0, VOCAB, (rows,))
    bias = torch.randn(VOCAB)
    lse, logp, entropy = (torch.randn(rows) for _ in range(3))

    def calls():
        lp.row_stats(logits, None, targets, 1.0)
        lp.row_stats(logits, bias, targets, 1 / 0.7)
        lp.grad_logits(logits.clone(), None, targets, lse, entropy, logp, None, 1.0, torch.bfloat16)
        lp.grad_logits(logits.clone(), bias, targets, lse, entropy, logp, entropy, 1.0, torch.float32)
        lp.grad_logits(logits.clone(), None, targets, lse, entropy, None, entropy, 1.0, torch.bfloat16)

    assert compile_launches(calls) == ["_row_stats_kernel"] * 2 + ["_grad_logits_kernel"] * 3
