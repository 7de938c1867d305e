"""``attn_implementation="hf-gptoss-rl/sink-flash-attn3"`` inside transformers, on CPU (the kernel's PyTorch path).

A tiny GPT-OSS with the kernel must match eager attention in logits and in every gradient (sinks included) on
padded and packed batches, reach the kernel with the sinks and the sliding window, and decode like eager.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hf_gptoss_rl
from hf_gptoss_rl.attention import ATTN_IMPLEMENTATION, KERNEL_REPO_ID, build_local_kernel
from hf_gptoss_rl.testing import tiny_gptoss_config

pytest.importorskip("kernels")
from transformers import GptOssForCausalLM  # noqa: E402
from transformers import modeling_flash_attention_utils as fa_utils  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel  # noqa: E402

VOCAB = 128
SLIDING_WINDOW = 8

# The kernel's two CPU paths: plain PyTorch (the default in tests, see the root conftest) and the real Triton
# kernels under TRITON_INTERPRET=1 (set by the root conftest before triton is imported).
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
            reason="Triton on CPU tensors needs TRITON_INTERPRET=1 from the start of the session",
        ),
    ),
]


@pytest.fixture
def kernel_backend(request, monkeypatch):
    monkeypatch.setenv("SINK_FLASH_ATTN3_BACKEND", request.param)
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random GPT-OSS saved with save_pretrained; sinks large enough to matter."""
    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB, sliding_window=SLIDING_WINDOW))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks) * 2.0)
    path = tmp_path_factory.mktemp("tiny_gptoss")
    model.save_pretrained(path)
    return path


def load(model_dir, attn_implementation: str) -> GptOssForCausalLM:
    return GptOssForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation, dtype=torch.float32)


@pytest.fixture
def kernel_spy(monkeypatch):
    """Records the kwargs transformers passes to the kernel's flash functions (after the kernel is loaded)."""
    calls: list[tuple[str, dict]] = []

    def install():
        for name in ("_flash_fn", "_flash_varlen_fn"):
            original = getattr(fa_utils, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                calls.append((_name, kwargs))
                return _original(*args, **kwargs)

            monkeypatch.setattr(fa_utils, name, spy)
        return calls

    return install


def grads_by_name(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(kernel_model, eager_model):
    kernel_grads, eager_grads = grads_by_name(kernel_model), grads_by_name(eager_model)
    assert kernel_grads.keys() == eager_grads.keys()
    assert any("sinks" in name for name in kernel_grads)
    for name, grad in eager_grads.items():
        # fp32 vs fp32: error relative to the gradient's scale
        error = (kernel_grads[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-12)
        assert error <= 1e-4, f"{name}: relative error {error:.2e}"


def test_import_registers_the_kernel_id(model_dir):
    assert ATTN_IMPLEMENTATION == KERNEL_REPO_ID == "hf-gptoss-rl/sink-flash-attn3"
    assert KERNEL_REPO_ID in GptOssPreTrainedModel._compatible_flash_implementations
    mapping = dict(entry.split("=", 1) for entry in os.environ["LOCAL_KERNELS"].split(":"))
    assert (
        KERNEL_REPO_ID in mapping and (os.path.isdir(os.path.join(mapping[KERNEL_REPO_ID], "build", "torch-cpu")))
    )
    # not silently swapped for kernels-community/vllm-flash-attn3
    model = load(model_dir, ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_user_local_kernels_mapping_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_KERNELS", f"other/kernel=/x:{KERNEL_REPO_ID}={tmp_path}")
    assert hf_gptoss_rl.attention.register_sink_flash_attention()
    assert os.environ["LOCAL_KERNELS"] == f"other/kernel=/x:{KERNEL_REPO_ID}={tmp_path}"


def test_build_local_kernel_loads_through_kernels(tmp_path):
    import kernels

    root = build_local_kernel(tmp_path)
    assert sorted(p.name for p in (root / "build").iterdir()) == ["torch-cpu", "torch-cuda"]
    module = kernels.get_local_kernel(root)
    assert callable(module.flash_attn_varlen_func) and callable(module.flash_attn_func)
    assert build_local_kernel(tmp_path) == root  # cached by source hash


@pytest.mark.parametrize("kernel_backend", BACKENDS, indirect=True)
def test_padded_batch_matches_eager_logits_and_gradients(model_dir, kernel_spy, kernel_backend):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 13))
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    weights = torch.randn(3, 13, VOCAB)

    eager, kernel = load(model_dir, "eager"), load(model_dir, ATTN_IMPLEMENTATION)
    calls = kernel_spy()
    outputs = {}
    for name, model in (("eager", eager), ("kernel", kernel)):
        logits = model(input_ids=ids, attention_mask=mask).logits
        valid = mask.bool()
        (logits[valid] * weights[valid]).sum().backward()
        outputs[name] = logits[valid].detach()
    torch.testing.assert_close(outputs["kernel"], outputs["eager"], rtol=1e-4, atol=1e-5)
    assert_same_grads(kernel, eager)

    # every layer went through the varlen entry point, with the sinks; the sliding layers with their window
    assert len(calls) == kernel.config.num_hidden_layers
    assert all(name == "_flash_varlen_fn" and kwargs["s_aux"] is not None for name, kwargs in calls)
    windows = [kwargs.get("window_size") for _, kwargs in calls]
    assert windows == [(SLIDING_WINDOW - 1, SLIDING_WINDOW - 1), None]


@pytest.mark.parametrize("kernel_backend", BACKENDS, indirect=True)
def test_packed_batch_matches_eager_per_sequence(model_dir, kernel_spy, kernel_backend):
    """B=1 packed sequences (position_ids restart) == each sequence alone through eager; same gradients."""
    torch.manual_seed(2)
    lengths = [7, 12, 3]
    seqs = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    weights = [torch.randn(1, n, VOCAB) for n in lengths]
    eager, kernel = load(model_dir, "eager"), load(model_dir, ATTN_IMPLEMENTATION)
    calls = kernel_spy()

    packed_ids = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = kernel(input_ids=packed_ids, position_ids=position_ids).logits
    (packed * torch.cat(weights, dim=1)).sum().backward()

    separate = []
    for ids, w in zip(seqs, weights):
        logits = eager(input_ids=ids).logits
        (logits * w).sum().backward()
        separate.append(logits.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(separate, dim=1), rtol=1e-4, atol=1e-5)
    assert_same_grads(kernel, eager)
    assert calls and all(name == "_flash_varlen_fn" and kwargs["s_aux"] is not None for name, kwargs in calls)
    assert any(kwargs.get("window_size") == (SLIDING_WINDOW - 1, SLIDING_WINDOW - 1) for _, kwargs in calls)


def test_unpadded_batch_uses_dense_entry_point(model_dir, kernel_spy):
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 11))
    eager, kernel = load(model_dir, "eager"), load(model_dir, ATTN_IMPLEMENTATION)
    calls = kernel_spy()
    torch.testing.assert_close(kernel(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert [name for name, _ in calls] == ["_flash_fn"] * kernel.config.num_hidden_layers
    assert all(kwargs["s_aux"] is not None for _, kwargs in calls)


def test_set_attn_implementation_round_trip(model_dir):
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, 10))
    model = load(model_dir, "eager")
    reference = model(input_ids=ids).logits
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    torch.testing.assert_close(model(input_ids=ids).logits, reference, rtol=1e-4, atol=1e-5)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"


def test_generate_matches_eager_greedy(model_dir, kernel_spy):
    """KV-cache decoding (q shorter than k, past the sliding window) with a left-padded batch."""
    torch.manual_seed(5)
    ids = torch.randint(1, VOCAB, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    eager, kernel = load(model_dir, "eager"), load(model_dir, ATTN_IMPLEMENTATION)
    calls = kernel_spy()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = eager.generate(ids, **kwargs)
        produced = kernel.generate(ids, **kwargs)
    assert produced.shape == (2, 18)
    assert torch.equal(produced, expected)
    assert len(calls) >= 12 * kernel.config.num_hidden_layers


def test_import_without_kernels_warns_and_works():
    """The GPU image has no `kernels`: importing hf_gptoss_rl must still work, with a warning."""
    code = (
        "import sys, warnings; sys.modules['kernels'] = None; warnings.simplefilter('always');\n"
        "import hf_gptoss_rl\n"
        "from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel as M\n"
        "assert 'hf-gptoss-rl/sink-flash-attn3' in M._compatible_flash_implementations\n"
        "print('imported')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_KERNELS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "imported" in result.stdout
    assert "`kernels` package is missing" in result.stderr


def test_torch_compile_fullgraph_through_transformers(model_dir):
    """The kernel's custom ops trace inside a transformers GPT-OSS forward and backward (bf16: transformers'
    fp32-input warning inside the flash wrapper is itself a graph break)."""
    torch.manual_seed(6)
    ids = torch.randint(0, VOCAB, (2, 13))
    model = GptOssForCausalLM.from_pretrained(model_dir, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.bfloat16)
    expected = model(input_ids=ids).logits
    expected.float().square().sum().backward()
    expected_sink_grads = [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: model(input_ids=x).logits, fullgraph=True, backend="aot_eager")
    logits = compiled(ids)
    logits.float().square().sum().backward()
    torch.testing.assert_close(logits, expected)
    for layer, grad in zip(model.model.layers, expected_sink_grads):
        torch.testing.assert_close(layer.self_attn.sinks.grad, grad)


@pytest.mark.slow
def test_installed_wheel_resolves_the_kernel_offline(tmp_path):
    """A pip-installed (non-editable) hf_gptoss_rl ships the kernel sources and resolves the id with no network."""
    import shutil
    from pathlib import Path

    repo = Path(hf_gptoss_rl.__file__).resolve().parents[1]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    ignore = shutil.ignore_patterns("build", "__pycache__", "*.pyc", "tests")
    for name in ("hf_gptoss_rl", "trl_ext", "kernels_hub"):
        shutil.copytree(repo / name, src / name, symlinks=True, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    wheel = next((tmp_path / "dist").glob("hf_gptoss_rl-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    code = (
        "import os, torch, hf_gptoss_rl\n"
        "assert hf_gptoss_rl.__file__.startswith(os.environ['SITE']), hf_gptoss_rl.__file__\n"
        "assert os.environ['LOCAL_KERNELS'].startswith('hf-gptoss-rl/sink-flash-attn3=' + os.environ['CACHE'])\n"
        "attn = hf_gptoss_rl.attention.load_kernel()\n"
        "q = torch.randn(1, 5, 2, 16)\n"
        "print(tuple(attn.flash_attn_func(q, q, q, causal=True, s_aux=torch.zeros(2)).shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_KERNELS"}
    env.update(PYTHONPATH=str(tmp_path / "site"), SITE=str(tmp_path / "site"), CACHE=str(tmp_path / "cache"),
               HF_GPTOSS_RL_KERNEL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(1, 5, 2, 16)" in result.stdout
