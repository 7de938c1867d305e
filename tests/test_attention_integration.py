"""``attn_implementation="hf-gptoss-rl/sink-flash-attn3"`` inside transformers, on CPU (the kernel's PyTorch path).

A tiny GPT-OSS with the kernel must match eager attention in logits and in every gradient (sinks included) on
padded and packed batches, reach the kernel with the sinks and the sliding window, and decode like eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GptOssForCausalLM
from transformers import modeling_flash_attention_utils as fa_utils
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

import hf_gptoss_rl
from hf_gptoss_rl.attention import ATTN_IMPLEMENTATION, CACHE_ENV_VAR, KERNEL_REPO_ID, build_local_kernel
from hf_gptoss_rl.model_builders import tiny_gptoss_config

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
def kernel_backend(request):
    """The kernel backend a test runs (``kernel_spy`` passes it to every kernel call as ``backend=``: the kernel reads
    ``SINK_FLASH_ATTN3_BACKEND`` once, at import, and the root conftest set it to "torch")."""
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
    """Records the kwargs transformers passes to the kernel's flash functions (after the kernel is loaded); with a
    ``backend``, the kernel runs each call on that backend (``backend=`` added to what transformers passes)."""
    calls: list[tuple[str, dict]] = []

    def install(backend=None):
        extra = {} if backend is None else {"backend": backend}
        for name in ("_flash_fn", "_flash_varlen_fn"):
            original = getattr(fa_utils, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                calls.append((_name, kwargs))
                return _original(*args, **kwargs, **extra)

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
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert ATTN_IMPLEMENTATION == KERNEL_REPO_ID == "hf-gptoss-rl/sink-flash-attn3"
    assert KERNEL_REPO_ID in GptOssPreTrainedModel._compatible_flash_implementations
    assert KERNEL_REPO_ID in AttentionInterface._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS[KERNEL_REPO_ID] is ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    # not silently swapped for kernels-community/vllm-flash-attn3
    model = load(model_dir, ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_register_is_idempotent_and_returns_what_it_registered():
    from transformers.integrations import hub_kernels

    loader = hub_kernels.load_and_register_attn_kernel
    check = GptOssPreTrainedModel._check_and_adjust_attn_implementation
    expected = {
        "attn_implementation": (KERNEL_REPO_ID, "ulysses_sp"),
        "experts_implementation": ("memory_efficient",),
    }
    assert hf_gptoss_rl.register() == expected
    assert hf_gptoss_rl.register() == expected
    assert GptOssPreTrainedModel._compatible_flash_implementations.count(KERNEL_REPO_ID) == 1
    # the wrappers are installed once, not stacked
    assert hub_kernels.load_and_register_attn_kernel is loader
    assert GptOssPreTrainedModel._check_and_adjust_attn_implementation is check
    assert not getattr(loader.__wrapped__, "_hf_gptoss_rl", False)


def test_import_has_no_side_effects_and_the_id_needs_no_kernels_package(tmp_path):
    """`import hf_gptoss_rl` is silent, writes nothing under the cache and changes no environment variable; the
    kernel is imported when a model first selects the id, still without writing or setting anything, and without
    the `kernels` package (blocked here, as on a machine without it)."""
    home = tmp_path / "home"
    home.mkdir()
    code = (
        "import json, os, sys, warnings\n"
        "sys.modules['kernels'] = None\n"
        # what transformers and torch do to the environment on import is theirs, not this package's
        "import torch, transformers\n"
        "from transformers.models.gpt_oss import modeling_gpt_oss\n"
        "before = dict(os.environ)\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('error')\n"
        "    import hf_gptoss_rl\n"
        "after_import = dict(os.environ)\n"
        "assert 'hf_gptoss_rl._sink_flash_attn3' not in sys.modules, 'kernel imported eagerly'\n"
        "from hf_gptoss_rl.model_builders import tiny_gptoss_config\n"
        "torch.manual_seed(0)\n"
        "model = transformers.GptOssForCausalLM(tiny_gptoss_config(vocab_size=32))\n"
        "ids = torch.tensor([[1, 2, 3, 4, 5]])\n"
        "expected = model(input_ids=ids).logits\n"
        "model.set_attn_implementation('hf-gptoss-rl/sink-flash-attn3')\n"
        "torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)\n"
        "assert model.config._attn_implementation == 'hf-gptoss-rl/sink-flash-attn3'\n"
        "assert 'hf_gptoss_rl._sink_flash_attn3' in sys.modules\n"
        "changed = lambda a, b: sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))\n"
        "print(json.dumps({'import': changed(before, after_import), 'use': changed(after_import, dict(os.environ))}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_KERNELS", "XDG_CACHE_HOME", CACHE_ENV_VAR)}
    env.update(HOME=str(home))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"import": [], "use": []}
    assert not (home / ".cache" / "hf_gptoss_rl").exists()


def test_user_local_kernels_mapping_is_loaded_through_kernels(monkeypatch, tmp_path):
    """A build the user maps in LOCAL_KERNELS wins over the packaged sources; register() leaves the mapping."""
    pytest.importorskip("kernels")
    root = build_local_kernel(tmp_path / "cache")
    monkeypatch.setenv("LOCAL_KERNELS", f"other/kernel=/x:{KERNEL_REPO_ID}={root}")
    hf_gptoss_rl.register()
    assert os.environ["LOCAL_KERNELS"] == f"other/kernel=/x:{KERNEL_REPO_ID}={root}"
    module = hf_gptoss_rl.attention.load_kernel()
    assert module is not hf_gptoss_rl.attention.import_kernel_sources()
    assert Path(module.__file__).resolve().is_relative_to(root.resolve())
    monkeypatch.delenv("LOCAL_KERNELS")
    assert hf_gptoss_rl.attention.load_kernel() is hf_gptoss_rl.attention.import_kernel_sources()


def test_build_local_kernel_loads_through_kernels(tmp_path):
    kernels = pytest.importorskip("kernels")

    root = build_local_kernel(tmp_path)
    assert sorted(p.name for p in (root / "build").iterdir()) == ["torch-cpu", "torch-cuda"]
    module = kernels.get_local_kernel(root)
    assert callable(module.flash_attn_varlen_func) and callable(module.flash_attn_func)
    assert build_local_kernel(tmp_path) == root  # cached by source hash


def test_the_id_resolves_when_transformers_rejects_the_kernels_package(model_dir, monkeypatch):
    """transformers 5.23+ accept only kernels 0.18 for hub kernels; with any other `kernels` (or none) the id still
    loads and runs the packaged kernel, with no Hub access."""
    from transformers import modeling_utils
    from transformers.integrations import hub_kernels

    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda *a, **k: False)
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda *a, **k: False)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)  # force transformers to resolve the id again
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, 9))
    kernel, eager = load(model_dir, ATTN_IMPLEMENTATION), load(model_dir, "eager")
    assert kernel.config._attn_implementation == ATTN_IMPLEMENTATION
    torch.testing.assert_close(kernel(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert fa_utils._flash_fn is hf_gptoss_rl.attention.import_kernel_sources().flash_attn_func


def test_other_ids_go_to_transformers_unchanged():
    from transformers.integrations import hub_kernels

    # not a hub id: transformers' own loader answers None
    assert hub_kernels.load_and_register_attn_kernel("sdpa") is None
    assert hub_kernels.load_and_register_attn_kernel.__wrapped__("sdpa") is None


# ---- no silent remaps ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "hf-gptoss-rl/sink-flash-attn",
        "hf-gptoss-rl/sink-flash-attn2",
        "hf_gptoss_rl/sink_flash_attn3",
        "HF-GPTOSS-RL/sink-flash-attn3",
        "sink-flash-attn3",
        "someone/sink-flash-attn3",
        "paged|hf-gptoss-rl/sink-flash-atn3",
    ],
)
def test_misspelt_id_raises(model_dir, name):
    with pytest.raises(ValueError, match='did you mean "hf-gptoss-rl/sink-flash-attn3"'):
        load(model_dir, name)


def test_flash_attention_2_remap_warns(model_dir, monkeypatch):
    """GPT-OSS only runs the flash kernels it lists; transformers replaces `flash_attention_2` (and any other flash
    name) by one of them. With the project's kernel listed, the replacement is announced, never silent."""
    from hf_gptoss_rl.attention import AttentionRemapWarning

    # the project's kernel as the only listed one: transformers 5.17 takes the first entry, 5.18+ the first that
    # runs on this device, so this makes the replacement the same (and offline) on every version
    monkeypatch.setattr(GptOssPreTrainedModel, "_compatible_flash_implementations", [KERNEL_REPO_ID])
    with pytest.warns(AttentionRemapWarning, match='"flash_attention_2" with "hf-gptoss-rl/sink-flash-attn3"'):
        model = load(model_dir, "flash_attention_2")
    assert model.config._attn_implementation == KERNEL_REPO_ID
    with pytest.warns(AttentionRemapWarning, match='"kernels-community/flash-attn3" with "hf-gptoss-rl'):
        model.set_attn_implementation("kernels-community/flash-attn3")


def test_no_warning_when_nothing_is_remapped(model_dir):
    import warnings

    from hf_gptoss_rl.attention import AttentionRemapWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionRemapWarning)
        for name in ("eager", "flex_attention", ATTN_IMPLEMENTATION):
            assert load(model_dir, name).config._attn_implementation == name


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA transformers picks kernels-community/vllm-flash-attn3")
def test_flash_attention_2_remap_warns_with_the_real_list(model_dir):
    """transformers 5.18+ pick the first listed kernel that runs on the device: on CPU, the project's kernel."""
    import transformers
    from packaging.version import Version

    from hf_gptoss_rl.attention import AttentionRemapWarning

    if Version(transformers.__version__) < Version("5.18"):
        pytest.skip("transformers 5.17 takes the list's first entry, kernels-community/vllm-flash-attn3 (Hub)")
    with pytest.warns(AttentionRemapWarning, match="flash_attention_2"):
        model = load(model_dir, "flash_attention_2")
    assert model.config._attn_implementation == KERNEL_REPO_ID


def test_without_registration_transformers_rewrites_the_id(model_dir, monkeypatch):
    """The trap the README warns about, checked against the installed transformers: with GPT-OSS's own list (no
    `import hf_gptoss_rl`), the id becomes kernels-community/vllm-flash-attn3, with only a log line."""
    from transformers import PreTrainedModel, modeling_utils

    model = load(model_dir, "eager")
    upstream = [i for i in GptOssPreTrainedModel._compatible_flash_implementations if i != KERNEL_REPO_ID]
    monkeypatch.setattr(GptOssPreTrainedModel, "_compatible_flash_implementations", upstream)
    loaded = []
    monkeypatch.setattr(modeling_utils, "lazy_import_flash_attention", lambda name, **kw: loaded.append(name))
    # the unwrapped transformers check, as without the import
    result = PreTrainedModel._check_and_adjust_attn_implementation(model, ATTN_IMPLEMENTATION)
    assert result == loaded[-1] == "kernels-community/vllm-flash-attn3"


@pytest.mark.parametrize("kernel_backend", BACKENDS, indirect=True)
def test_padded_batch_matches_eager_logits_and_gradients(model_dir, kernel_spy, kernel_backend):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 13))
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    weights = torch.randn(3, 13, VOCAB)

    eager, kernel = load(model_dir, "eager"), load(model_dir, ATTN_IMPLEMENTATION)
    calls = kernel_spy(kernel_backend)
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
    calls = kernel_spy(kernel_backend)

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
        "assert 'LOCAL_KERNELS' not in os.environ\n"
        "attn = hf_gptoss_rl.attention.load_kernel()\n"
        "assert attn.__file__.startswith(os.environ['SITE']), attn.__file__\n"
        "root = hf_gptoss_rl.attention.build_local_kernel()\n"
        "assert str(root).startswith(os.environ['CACHE']), root\n"
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
