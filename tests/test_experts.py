"""hf_gptoss_rl.experts: experts_implementation="memory_efficient" against eager experts and an fp64 reference."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GptOssForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

import hf_gptoss_rl  # noqa: F401  (registers "memory_efficient")
from hf_gptoss_rl import experts as me
from hf_gptoss_rl import set_backends
from hf_gptoss_rl.model_builders import tiny_gptoss_config

VOCAB = 96


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _reference_experts(x, index, weights, gate_up, gate_up_bias, down, down_bias, alpha=1.702, limit=7.0):
    """GPT-OSS experts written out in float64, token by token (independent of transformers' code)."""
    x, weights = x.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[t, k])
            if e >= gate_up.shape[0]:  # EP sentinel: no contribution
                continue
            pre = x[t] @ gate_up[e].double() + gate_up_bias[e].double()
            gate, up = pre[0::2].clamp(max=limit), pre[1::2].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] = out[t] + weights[t, k] * (h @ down[e].double() + down_bias[e].double())
    return out


def _experts_module(num_experts=5, hidden=32, inter=48, dtype=torch.float32, seed=0):
    config = tiny_gptoss_config(
        num_local_experts=num_experts, hidden_size=hidden, intermediate_size=inter, vocab_size=VOCAB
    )
    config._experts_implementation = "memory_efficient"
    torch.manual_seed(seed)
    module = GptOssExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 1.5 * hidden**-0.5)  # pre-activations past ±7 exercise both clamps
        module.gate_up_proj_bias.normal_(0, 1.0)
        module.down_proj.normal_(0, inter**-0.5)
        module.down_proj_bias.normal_(0, 0.5)
    return module.to(dtype)


def _tiny_model(dtype=torch.float32, top_k=2, num_experts=6, seed=0, **overrides):
    config = tiny_gptoss_config(
        num_local_experts=num_experts, num_experts_per_tok=top_k, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **overrides,
    )  # fmt: skip
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.router.weight.normal_(0, 0.5)
            mlp.router.bias.normal_(0, 0.5)
            mlp.router.bias[-1] = -1e4  # the last expert never wins: an empty expert in every layer
            mlp.experts.gate_up_proj.normal_(0, 0.4)
            mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            mlp.experts.down_proj.normal_(0, 0.2)
            mlp.experts.down_proj_bias.normal_(0, 0.2)
            layer.self_attn.sinks.normal_()
    return model.to(dtype)


def _set_experts(model, implementation, chunk_rows=None, recompute=False):
    model.set_experts_implementation(implementation)
    for layer in model.model.layers:
        layer.mlp.experts.experts_chunk_rows = chunk_rows or me.DEFAULT_CHUNK_ROWS
        layer.mlp.experts.experts_recompute_gate_up = recompute


def _loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids).logits
    loss = (logits.float().square().mean()) + logits.float().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_registered_and_selectable(tmp_path):
    assert ALL_EXPERTS_FUNCTIONS["memory_efficient"] is me.memory_efficient_experts_forward
    model = _tiny_model()
    model.save_pretrained(tmp_path)
    loaded = GptOssForCausalLM.from_pretrained(tmp_path, experts_implementation="memory_efficient")
    assert loaded.config._experts_implementation == "memory_efficient"
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
        got = loaded(ids).logits
        model.set_experts_implementation("memory_efficient")
        assert model.config._experts_implementation == "memory_efficient"
        again = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk_rows", [5, 4096])
def test_model_matches_eager_fp32(top_k, chunk_rows):
    """Logits and every gradient (router, experts, attention) of a tiny model, with an empty expert per layer."""
    model = _tiny_model(top_k=top_k)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(top_k))
    logits_ref, grads_ref = _loss_and_grads(model, ids)
    _set_experts(model, "memory_efficient", chunk_rows=chunk_rows, recompute=chunk_rows == 5)
    logits, grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys()
    assert any("router" in n for n in grads) and any("gate_up_proj_bias" in n for n in grads)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("top_k", [1, 4])
def test_model_bf16_as_accurate_as_eager(top_k):
    """bf16: the error against an fp64 copy of the model is no worse than eager's own bf16 error."""
    model64 = _tiny_model(top_k=top_k).double()
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(7))
    logits64, grads64 = _loss_and_grads(model64, ids)
    errors = {}
    for impl in ("eager", "memory_efficient"):
        model = copy.deepcopy(model64).to(torch.bfloat16)
        _set_experts(model, impl, chunk_rows=7)
        logits, grads = _loss_and_grads(model, ids)
        errors[impl] = {"logits": _rel(logits, logits64)}
        for name in grads64:
            if "experts" in name or "router" in name:
                errors[impl][name] = _rel(grads[name], grads64[name])
    for key, err in errors["memory_efficient"].items():
        assert err < max(2 * errors["eager"][key], 2e-2), (key, err, errors["eager"][key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows, max_experts", [(1, 8), (6, 8), (1000, 8), (1000, 1)])
def test_experts_against_fp64_reference_with_sentinels(dtype, chunk_rows, max_experts, monkeypatch):
    """Module level: fp64 reference, tiny chunks (and chunks cut at every expert), empty experts and EP
    sentinel indices (>= num_experts)."""
    monkeypatch.setattr(me, "MAX_EXPERTS_PER_CHUNK", max_experts)
    num_experts, tokens, top_k = 5, 11, 3
    module = _experts_module(num_experts=num_experts, dtype=dtype)
    module.experts_chunk_rows = chunk_rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 32, generator=g).to(dtype).requires_grad_()
    # experts 1 and 3 get no token; a few slots hold the EP sentinel `num_experts`
    choices = torch.tensor([0, 2, 4])
    index = torch.stack([choices[torch.randperm(3, generator=g)] for _ in range(tokens)])
    index[[0, 4, 9], [1, 0, 2]] = num_experts
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(dtype).requires_grad_()

    out = module(x, index, weights)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad_out)

    params = [module.gate_up_proj, module.gate_up_proj_bias, module.down_proj, module.down_proj_bias]
    leaves = [x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()]
    leaves += [p.detach().double().requires_grad_() for p in params]
    ref = _reference_experts(leaves[0], index, *leaves[1:])
    ref.backward(grad_out.double())

    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert _rel(out, ref) < tol
    for name, got, leaf in zip(["x", "weights", *[f"p{i}" for i in range(4)]], [x, weights, *params], leaves):
        assert _rel(got.grad, leaf.grad) < tol, name
    assert torch.all(weights.grad[index == num_experts] == 0)  # sentinels get no routing gradient
    for e in (1, 3):  # empty experts: exactly zero gradients
        assert module.gate_up_proj.grad[e].abs().max() == 0 and module.down_proj_bias.grad[e].abs().max() == 0

    with torch.no_grad():
        out_no_grad = module(x, index, weights)
    torch.testing.assert_close(out_no_grad, out.detach(), rtol=0, atol=0)


def test_inference_mode_and_autocast():
    model = _tiny_model(top_k=2)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(ids).logits
    _set_experts(model, "memory_efficient", chunk_rows=5)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    # fp32 weights under bf16 autocast: the experts still compute in the weights' dtype and train
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
    logits.float().mean().backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.dtype == torch.float32
    assert torch.isfinite(model.model.layers[0].mlp.experts.gate_up_proj.grad).all()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_matches_eager(use_reentrant):
    model = _tiny_model(top_k=2)
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(5))
    logits_ref, grads_ref = _loss_and_grads(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    _set_experts(model, "memory_efficient", chunk_rows=8)
    logits, grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_peft_lora_on_attention_skips_expert_weight_gradients(monkeypatch):
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, VOCAB, (1, 15), generator=torch.Generator().manual_seed(9))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)

    def lora_grads(implementation):
        torch.manual_seed(1)
        model = peft.get_peft_model(_tiny_model(top_k=2), lora)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero B so every LoRA weight gets a gradient
                torch.nn.init.normal_(p, std=0.1)
        _set_experts(model.base_model.model, implementation, chunk_rows=6)
        logits, grads = _loss_and_grads(model, ids)
        assert all("lora_" in n for n in grads)
        return logits, grads

    logits_ref, grads_ref = lora_grads("eager")
    weight_grad_calls = []
    real = me._gmm_weight_grad
    monkeypatch.setattr(me, "_gmm_weight_grad", lambda *a, **k: weight_grad_calls.append(1) or real(*a, **k))
    logits, grads = lora_grads("memory_efficient")
    assert weight_grad_calls == []  # frozen experts: no weight-gradient matmuls at all
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys() and len(grads) > 0
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_saved_activations_and_no_grad_do_not_scale_with_pairs():
    """Training saves at most the [S, 2I] pre-activation (nothing S-sized but indices with recompute);
    no-grad saves nothing."""
    module = _experts_module(num_experts=4, hidden=32, inter=48)
    tokens, top_k = 40, 2
    x = torch.randn(tokens, 32, requires_grad=True)
    index = torch.randint(0, 4, (tokens, top_k))
    weights = torch.rand(tokens, top_k, requires_grad=True)

    def saved_numels(recompute):
        module.experts_recompute_gate_up = recompute
        module.experts_chunk_rows = 16
        sizes = []

        def pack(t):
            sizes.append((t.numel(), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x, index, weights).sum().backward()
        params = {p.numel() for p in module.parameters()}
        return [(n, d) for n, d in sizes if n not in params]

    pairs = tokens * top_k
    saved = saved_numels(recompute=False)
    float_saved = sum(n for n, d in saved if d.is_floating_point)
    # x, the sorted routing weights and the biased pre-activation [S, 2I]
    assert float_saved == tokens * 32 + pairs + pairs * 2 * 48
    saved = saved_numels(recompute=True)
    assert sum(n for n, d in saved if d.is_floating_point) == tokens * 32 + pairs


def test_triton_kernels_match_torch_path(monkeypatch):
    """The Triton gate / combine kernels (CUDA, or CPU under TRITON_INTERPRET=1) and torch._grouped_mm
    against the PyTorch path, with several column blocks and masked edges (I = 160)."""
    if me._experts_triton is None:
        pytest.skip("triton is not importable")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 set before triton is imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    module = _experts_module(num_experts=4, hidden=48, inter=160).to(device)
    g = torch.Generator().manual_seed(11)
    tokens, top_k = 37, 2
    x = torch.randn(tokens, 48, generator=g).to(device)
    index = torch.randint(0, 5, (tokens, top_k), generator=g).to(device)  # 4 = sentinel
    weights = torch.rand(tokens, top_k, generator=g).to(device)
    grad_out = torch.randn(tokens, 48, generator=g).to(device)

    def run(backend, grouped):
        set_backends(experts=backend, experts_grouped_mm=grouped)
        module.zero_grad(set_to_none=True)
        module.experts_chunk_rows = 13
        xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xr, index, wr)
        out.backward(grad_out)
        return [out, xr.grad, wr.grad] + [p.grad for p in module.parameters()]

    expected = run("torch", grouped=False)
    for grouped in (False, True):
        if grouped and not hasattr(torch, "_grouped_mm"):
            continue
        for got, ref in zip(run("triton", grouped), expected):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise_clear_errors(monkeypatch):
    set_backends(experts_grouped_mm=False)  # the host plan raises ValueError
    module = _experts_module()
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="negative expert"):
        module(x, torch.tensor([[0, -1]] * 4), torch.rand(4, 2))
    with pytest.raises(ValueError, match="top_k_index"):
        module(x, torch.tensor([[0, 1]] * 3), torch.rand(3, 2))

    class NotGptOss(torch.nn.Module):
        num_experts = 2

    with pytest.raises(NotImplementedError, match="GPT-OSS experts only"):
        me.memory_efficient_experts_forward(NotGptOss(), x, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1))


# --------------------------------------------------------------------------------------------------------
# The sync-free plan (torch._grouped_mm; chunks fixed in pair space, offsets computed on the device) against
# the host plan and the fp64 reference, and proof that it reads nothing back to the host.
# --------------------------------------------------------------------------------------------------------


def _skip_unless_triton_runs(backend):
    if backend != "triton":
        return
    if me._experts_triton is None:
        pytest.skip("triton is not importable")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported (CPU tensors)")


def _sentinel_routing(tokens, top_k, num_experts, seed):
    """Expert 0 most often (more rows than a small chunk), 2 and 4 sometimes, 1 and 3 never (empty experts), EP
    sentinels `num_experts` and `num_experts + 4` in about a quarter of the slots, and a token (0) whose slots are
    all sentinels."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([0, 0, 0, 2, 4, 4, num_experts, num_experts + 4])
    index = choices[torch.randint(0, len(choices), (tokens, top_k), generator=g)]
    index[0] = num_experts
    return index


def _nan_past_groups(monkeypatch):
    """Make `torch._grouped_mm` fill the rows past its last group with NaN (it leaves them unwritten), so that any
    sentinel row reaching the output or a gradient shows."""
    real = torch._grouped_mm

    def grouped_mm(a, b, *args, offs=None, **kwargs):
        out = real(a, b, *args, offs=offs, **kwargs)
        if a.dim() == 2 and b.dim() == 3:
            out[int(offs[-1]) :] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("chunk_rows", [5, 4096])
@pytest.mark.parametrize("trainable", ["none", "biases", "all"])
def test_sync_free_plan_matches_host_plan_and_fp64(backend, top_k, chunk_rows, trainable, monkeypatch):
    """Output and every gradient, with EP sentinels, empty experts, S not a multiple of the chunk, chunks smaller
    than one expert's rows (and chunks of sentinels only), saved or recomputed pre-activations. Frozen expert
    weights keep the backward sync-free (bias gradients included); trainable ones take the host plan there."""
    _skip_unless_triton_runs(backend)
    _nan_past_groups(monkeypatch)
    num_experts, tokens = 5, 17
    module = _experts_module(num_experts=num_experts)
    module.experts_chunk_rows = chunk_rows
    module.experts_recompute_gate_up = chunk_rows == 5
    params = [module.gate_up_proj, module.gate_up_proj_bias, module.down_proj, module.down_proj_bias]
    for p in params:
        p.requires_grad_(trainable == "all" or (trainable == "biases" and p.dim() == 2))
    g = torch.Generator().manual_seed(top_k)
    x = torch.randn(tokens, 32, generator=g)
    index = _sentinel_routing(tokens, top_k, num_experts, seed=4)
    assert index.numel() % 5 and (index == 0).sum() > 5  # S not a multiple of 5; expert 0 outgrows a chunk
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    grad_out = torch.randn(tokens, 32, generator=g)
    plans = []
    real_plan = me._plan_routing
    monkeypatch.setattr(me, "_plan_routing", lambda *a: plans.append(a[-1]) or real_plan(*a))

    def run(grouped):
        set_backends(experts=backend, experts_grouped_mm=grouped)
        module.zero_grad(set_to_none=True)
        plans.clear()
        xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xr, index, wr)
        out.backward(grad_out)
        with torch.no_grad():
            out_no_grad = module(x, index, weights)
        torch.testing.assert_close(out_no_grad, out.detach(), rtol=0, atol=0)
        return plans.copy(), [out, xr.grad, wr.grad] + [p.grad for p in params if p.requires_grad]

    plans_free, free = run(grouped=True)
    plans_host, host = run(grouped=False)
    assert plans_free == [True, trainable != "all", True]  # forward, backward, no-grad forward
    assert plans_host == [False, False, False]
    for got, ref in zip(free, host):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

    leaves = [x.double().requires_grad_(), weights.double().requires_grad_()]
    leaves += [p.detach().double().requires_grad_(p.requires_grad) for p in params]
    ref = _reference_experts(leaves[0], index, *leaves[1:])
    ref.backward(grad_out.double())
    refs = [ref] + [leaf.grad for leaf in leaves if leaf.requires_grad]
    assert len(refs) == len(free)
    for got, expected in zip(free, refs):
        assert torch.isfinite(got).all() and _rel(got, expected) < 1e-5

    out, grad_x, grad_w = free[:3]
    assert torch.all(grad_w[index >= num_experts] == 0)  # sentinels: no routing-weight gradient
    assert torch.all(out[0] == 0) and torch.all(grad_x[0] == 0)  # a token with only sentinel slots
    for grad in free[3:]:  # empty experts 1 and 3: exactly zero
        assert torch.all(grad[[1, 3]] == 0)


def test_sync_free_plan_bf16_matches_host_plan(monkeypatch):
    """bf16 (the CUDA configuration's dtype), frozen experts: the two plans agree to bf16 rounding."""
    _nan_past_groups(monkeypatch)
    module = _experts_module(num_experts=5, dtype=torch.bfloat16).requires_grad_(False)
    module.experts_chunk_rows = 5
    index = _sentinel_routing(20, 4, 5, seed=2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 32, generator=g).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(20, 4, generator=g), -1).to(torch.bfloat16)
    grad_out = torch.randn(20, 32, generator=g).to(torch.bfloat16)

    def run(grouped):
        set_backends(experts_grouped_mm=grouped)
        xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xr, index, wr)
        out.backward(grad_out)
        return [out, xr.grad, wr.grad]

    for got, ref in zip(run(grouped=True), run(grouped=False)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


class _HostReads(TorchDispatchMode):
    """Counts reads of device data by the host: `aten._local_scalar_dense` (what `.item()`, `bool()`, `int()` of a
    tensor dispatch to) and ops whose output size depends on the data. Custom ops are run inside the mode so their
    own aten calls are seen. `Tensor.tolist` / `.cpu()` / `.numpy()` do not dispatch on CPU tensors: the test
    patches them."""

    SYNCING = {
        "_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
        "bincount", "repeat_interleave",
    }  # fmt: skip

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "hf_gptoss_rl":
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        if func.overloadpacket.__name__ in self.SYNCING:
            self.reads.append(str(func))
        return func(*args, **kwargs)


def _recording(method, name, calls):
    def wrapper(self, *args, **kwargs):
        calls.append(name)
        return method(self, *args, **kwargs)

    return wrapper


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sync_free_plan_reads_nothing_back(backend, monkeypatch):
    """With torch._grouped_mm, the forward (training op and no-grad) and the frozen-experts backward read nothing
    back to the host; the host plan does (so the count can fail), and so does a backward with expert weight
    gradients."""
    _skip_unless_triton_runs(backend)
    set_backends(experts=backend)
    module = _experts_module(num_experts=5)
    module.experts_chunk_rows = 7
    index = _sentinel_routing(12, 4, 5, seed=0)
    x = torch.randn(12, 32, requires_grad=True)
    weights = torch.rand(12, 4, requires_grad=True)

    method_calls = []
    for name in ("tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _recording(getattr(torch.Tensor, name), name, method_calls))

    def host_reads(fn):
        method_calls.clear()
        with _HostReads() as mode:
            result = fn()
        return mode.reads + method_calls, result

    def counts(grouped, frozen):
        set_backends(experts_grouped_mm=grouped)
        module.requires_grad_(not frozen)
        x.grad = weights.grad = None
        forward, out = host_reads(lambda: module(x, index, weights))
        backward, _ = host_reads(lambda: out.backward(torch.ones_like(out)))
        with torch.no_grad():
            no_grad, _ = host_reads(lambda: module(x, index, weights))
        assert x.grad is not None and weights.grad is not None
        return forward, backward, no_grad

    assert counts(grouped=True, frozen=True) == ([], [], [])
    forward, backward, no_grad = counts(grouped=True, frozen=False)
    assert forward == [] and no_grad == [] and backward  # expert weight gradients: the host plan
    assert all(counts(grouped=False, frozen=True))


def test_sync_free_plan_rejects_negative_indices(monkeypatch):
    """The sync-free plan checks negative indices on the device (at once on CPU, at the next sync on CUDA)."""
    set_backends(experts_grouped_mm=True)
    module = _experts_module()
    with pytest.raises(RuntimeError, match="negative expert"):
        module(torch.randn(4, 32), torch.tensor([[0, -1]] * 4), torch.rand(4, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sync_free_plan_does_not_synchronize():
    """On CUDA (bf16, grouped_mm, Triton): forward, frozen-experts backward and no-grad forward under
    `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronizing CUDA call."""
    module = _experts_module(num_experts=8, hidden=128, inter=128, dtype=torch.bfloat16).cuda().requires_grad_(False)
    module.experts_chunk_rows = 100
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    index = torch.randint(0, 9, (256, 4), generator=g).cuda()  # 8: EP sentinel
    weights = torch.rand(256, 4, generator=g).cuda().requires_grad_()
    assert me._use_sync_free_plan(x)

    def step():
        out = module(x, index, weights)
        out.float().square().sum().backward()
        with torch.no_grad():
            module(x, index, weights)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_backward_fills_no_gradient_for_the_saved_pre_activations():
    """The op's second output (the saved pre-activations) is non-differentiable: the backward must not be handed a
    zero-filled `[T * top_k, 2I]` gradient for it (a full pass over the largest activation of the layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_gptoss_rl.experts import _experts_op

    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 12, 16, 8, 4, 2
    x = torch.randn(tokens, hidden, requires_grad=True)
    index = torch.randint(0, experts, (tokens, top_k))
    weights = torch.rand(tokens, top_k, requires_grad=True)
    gate_up, gate_up_bias = torch.randn(experts, hidden, 2 * inter), torch.randn(experts, 2 * inter)
    down, down_bias = torch.randn(experts, inter, hidden), torch.randn(experts, hidden)
    out, saved = _experts_op(x, index, weights, gate_up, gate_up_bias, down, down_bias, 1.702, 7.0, 8, True)
    assert saved.shape == (tokens * top_k, 2 * inter) and not saved.requires_grad

    class Fills(TorchDispatchMode):
        shapes: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("aten::fill_", "aten::zeros", "aten::zeros_like", "aten::zero_"):
                self.shapes.append(tuple(args[0]) if func._schema.name == "aten::zeros" else tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Fills() as mode:
        out.sum().backward()
    assert (tokens * top_k, 2 * inter) not in mode.shapes
    assert x.grad is not None and weights.grad is not None
