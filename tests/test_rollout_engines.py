"""EmbeddedEngine: exact temperature-scaled log-probs, stop tokens, batching under concurrency, weight sync."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from transformers import GptOssForCausalLM

from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext.rollout import EmbeddedEngine, GenerationOutput, SamplingParams, SGLangOfflineEngine

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB)).float().eval()


def teacher_forced_logprobs(model, prompt, output, temperature):
    """log_softmax(logits / T) of ``output`` given ``prompt`` in one unpadded forward (the trainer's computation)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].double()
    logits = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def gather(engine, prompts, samplings):
    async def main():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, samplings)))

    return asyncio.run(main())


def test_logprobs_equal_teacher_forced_forward(model):
    engine = EmbeddedEngine(model, seed=1)
    prompts = [[1, 2, 3], list(range(10, 31)), [7] * 12, [100, 5]]
    samplings = [
        SamplingParams(max_new_tokens=12, temperature=0.7, stop_token_ids=()),
        SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.8, stop_token_ids=()),
        SamplingParams(max_new_tokens=14, temperature=1.3, top_k=5, stop_token_ids=()),
        SamplingParams(max_new_tokens=6, temperature=0.5, top_p=0.9, top_k=20, stop_token_ids=()),
    ]
    outs = gather(engine, prompts, samplings)
    assert engine.max_batch_seen > 1  # the padded batched path is what is checked
    for prompt, sampling, out in zip(prompts, samplings, outs):
        assert out.finish_reason == "length" and len(out.output_ids) == sampling.max_new_tokens
        ref = teacher_forced_logprobs(model, prompt, out.output_ids, sampling.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref, rtol=0, atol=2e-5)
        assert out.weight_version == 0
    engine.shutdown()


def test_greedy_and_top_k_1_follow_argmax(model):
    engine = EmbeddedEngine(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy, topk1 = gather(
        engine,
        [prompt, prompt],
        [
            SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=()),
            SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1, stop_token_ids=()),
        ],
    )
    ids = list(prompt)
    for _ in range(10):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert greedy.output_ids == ids[len(prompt) :] == topk1.output_ids
    # temperature 0: unscaled log-probs; top-k never renormalises the reported log-probs
    torch.testing.assert_close(
        torch.tensor(greedy.logprobs, dtype=torch.float64),
        teacher_forced_logprobs(model, prompt, greedy.output_ids, 1.0),
        rtol=0,
        atol=2e-5,
    )
    assert max(topk1.logprobs) < -1e-3
    engine.shutdown()


def test_stop_tokens_kept_and_honoured(model):
    engine = EmbeddedEngine(model, seed=3)
    stop = tuple(range(0, VOCAB, 3))  # a third of the vocabulary: stops within a few tokens
    outs = gather(engine, [[1, 2]] * 6, [SamplingParams(max_new_tokens=40, stop_token_ids=stop)] * 6)
    for out in outs:
        assert out.finish_reason == "stop"
        assert out.output_ids[-1] in stop and not set(out.output_ids[:-1]) & set(stop)
        assert len(out.logprobs) == len(out.output_ids)
    engine.shutdown()


def test_concurrent_requests_are_batched_and_padding_free(model):
    engine = EmbeddedEngine(model, max_batch_size=8, batch_wait_s=0.05)
    prompts = [list(range(1, 2 + i)) for i in range(12)]  # 12 different lengths
    # different budgets: rows leave the batch (and the KV cache) at different steps
    samplings = [SamplingParams(max_new_tokens=2 + i % 5, temperature=0.0, stop_token_ids=()) for i in range(12)]
    outs = gather(engine, prompts, samplings)
    assert engine.num_batches < len(prompts) and engine.max_batch_seen > 1
    solo = EmbeddedEngine(model, max_batch_size=1)
    for prompt, sampling, out in zip(prompts, samplings, outs):  # padding/compaction must not change a row
        assert len(out.output_ids) == sampling.max_new_tokens
        alone = gather(solo, [prompt], [sampling])[0]
        assert alone.output_ids == out.output_ids
        torch.testing.assert_close(alone.logprobs, out.logprobs, rtol=0, atol=2e-5)
    engine.shutdown()
    solo.shutdown()


def test_engine_works_across_event_loops_and_threads(model):
    engine = EmbeddedEngine(model)
    sampling = SamplingParams(max_new_tokens=3, stop_token_ids=())
    first = asyncio.run(engine.generate([1, 2], sampling))
    second = asyncio.run(engine.generate([1, 2], sampling))  # a new loop: the worker thread is loop-agnostic
    third = engine.submit([1, 2], sampling).result(timeout=60)  # plain threads (the HTTP server) too
    assert all(isinstance(o, GenerationOutput) and len(o.output_ids) == 3 for o in (first, second, third))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1], sampling)


def test_from_policy_copy_and_update_weights(model):
    policy = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB)).float()
    policy.load_state_dict(model.state_dict())
    engine = EmbeddedEngine.from_policy(policy)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
    prompt = [5, 6, 7]
    before = gather(engine, [prompt], [sampling])[0]
    with torch.no_grad():  # a training step on the policy: the engine's copy must not move
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert gather(engine, [prompt], [sampling])[0].output_ids == before.output_ids

    asyncio.run(engine.update_weights(policy.state_dict().items(), version=7))
    after = gather(engine, [prompt], [sampling])[0]
    reference = EmbeddedEngine(policy)  # the updated policy itself
    expected = gather(reference, [prompt], [sampling])[0]
    assert after.output_ids == expected.output_ids != before.output_ids
    assert after.weight_version == 7 == engine.weight_version

    with pytest.raises(KeyError, match="unknown parameter"):
        engine.load_weights([("not.a.param", torch.zeros(1))], version=8)
    name, tensor = next(iter(policy.state_dict().items()))
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, torch.zeros(tensor.numel() + 1))], version=8)
    assert engine.weight_version == 7  # nothing loaded on error
    engine.shutdown()
    reference.shutdown()


def test_abort_and_shutdown_resolve_requests(model):
    engine = EmbeddedEngine(model, max_batch_size=2)

    async def main():
        long = SamplingParams(max_new_tokens=20000, stop_token_ids=())
        tasks = [asyncio.ensure_future(engine.generate([1, 2, 3], long)) for _ in range(4)]
        for _ in range(200):  # wait until the first batch is decoding
            if engine.num_batches:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        engine.abort_all()  # aborts the running batch
        await asyncio.to_thread(engine.shutdown)  # queued requests resolve with "abort"
        return await asyncio.gather(*tasks)

    outs = asyncio.run(main())
    assert any(o.finish_reason == "abort" for o in outs)
    for o in outs:
        assert len(o.output_ids) == len(o.logprobs) and len(o.output_ids) < 20000


def test_bad_inputs_are_rejected(model):
    engine = EmbeddedEngine(model)
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], sampling)
    with pytest.raises(ValueError, match="out of range"):
        engine.submit([VOCAB], sampling)
    with pytest.raises(TypeError):
        engine.submit([1], {"max_new_tokens": 2})
    for bad in (
        dict(max_new_tokens=0),
        dict(max_new_tokens=2, temperature=-1),
        dict(max_new_tokens=2, top_p=0),
        dict(max_new_tokens=2, top_k=0),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="log-probs"):
        GenerationOutput([1, 2], [0.0], "stop")
    engine.shutdown()


def test_offline_sglang_engine_needs_sglang():
    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="sglang"):
            SGLangOfflineEngine(model_path="unused")
    else:  # pragma: no cover - GPU machines with sglang
        pytest.skip("sglang installed: the offline engine is exercised on GPU only")


class _StubTokenizerManager:
    """What `SGLangOfflineEngine` uses of ``sglang.Engine.tokenizer_manager``, with SGLang's loop binding: the
    first coroutine binds the manager's output loop (``auto_create_handle_loop``); a later call from another loop
    would never get its answer, which is raised here instead of hanging."""

    def __init__(self, refuse: bool = False):
        self.loop = None
        self.refuse = refuse
        self.calls: list[str] = []
        self.version = "default"
        self.payload_counts: list[int] = []
        self.lora_paths: list[str | None] = []  # the ``lora_path`` of each generate call
        self.adapters: set[str] = set()  # the adapters loaded
        self.refuse_lora: set[str] = set()  # adapter names whose load fails, after loading them (a cut-off load)
        self.ignore_version_tag = False

    def _bind(self, what: str):
        loop = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = loop
        if loop is not self.loop:
            raise RuntimeError("the tokenizer manager's output loop runs on another event loop: this call would hang")
        self.calls.append(what)

    async def generate_item(self, **kwargs):
        self._bind("generate")
        self.lora_paths.append(kwargs.get("lora_path"))
        ids = [5, 6]
        return {
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": "length"},
                "weight_version": self.version,
                "output_token_logprobs": [[-0.1, t, None] for t in ids],
            },
        }

    async def begin_weight_update(self, obj, request):
        self._bind("begin")
        return True, "Success"

    async def end_weight_update(self, obj, request):
        self._bind("end")
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request):
        self._bind("update")
        self.payload_counts.append(len(obj.serialized_named_tensors))
        if self.refuse:
            return False, "Failed to update parameter online: shape mismatch"
        self.version = obj.weight_version
        return True, "Success"

    async def load_lora_adapter_from_tensors(self, obj, request):
        self._bind(f"load {obj.lora_name}")
        self.payload_counts.append(len(obj.serialized_named_tensors))
        self.adapters.add(obj.lora_name)
        if obj.lora_name in self.refuse_lora:
            return SimpleNamespace(success=False, error_message=f"the load of {obj.lora_name} was cut off")
        return SimpleNamespace(success=True, error_message=None)

    async def unload_lora_adapter(self, obj, request):
        self._bind(f"unload {obj.lora_name}")
        self.adapters.discard(obj.lora_name)
        return SimpleNamespace(success=True, error_message=None)

    async def update_weight_version(self, obj):
        self._bind(f"version {obj.new_version}")
        if not self.ignore_version_tag:
            self.version = obj.new_version
        return True, "Success"

    def config_value(self, name):
        assert name == "weight_version"
        return self.version


def _stub_sglang(monkeypatch):
    import sys
    import types
    from dataclasses import dataclass, field

    @dataclass
    class UpdateWeightsFromTensorReqInput:
        serialized_named_tensors: list
        load_format: str | None = None
        flush_cache: bool = True
        weight_version: str | None = None

    @dataclass
    class BeginWeightUpdateReqInput:
        selector: str = "all"

    @dataclass
    class EndWeightUpdateReqInput:
        rid: str | None = field(default=None)

    @dataclass
    class LoadLoRAAdapterFromTensorsReqInput:
        lora_name: str
        config_dict: dict
        serialized_named_tensors: list

    @dataclass
    class UnloadLoRAAdapterReqInput:
        lora_name: str

    @dataclass
    class UpdateWeightVersionReqInput:
        new_version: str
        abort_all_requests: bool = False

    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    for cls in (
        UpdateWeightsFromTensorReqInput,
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        LoadLoRAAdapterFromTensorsReqInput,
        UnloadLoRAAdapterReqInput,
        UpdateWeightVersionReqInput,
    ):
        setattr(io_struct, cls.__name__, cls)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    sys.modules["sglang.srt.managers"].io_struct = io_struct


@pytest.mark.parametrize("refuse", [False, True])
def test_offline_engine_keeps_one_loop_and_checks_updates(monkeypatch, refuse, tmp_path):
    from safetensors.torch import save_file

    from trl_ext.weight_sync import WeightSyncError

    _stub_sglang(monkeypatch)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))  # the checkpoint the engine serves
    tm = _StubTokenizerManager(refuse=refuse)
    stub = SimpleNamespace(
        tokenizer_manager=tm,
        server_args=SimpleNamespace(tp_size=2, model_path=str(tmp_path)),
        shutdown=lambda: None,
        async_generate=lambda **kw: tm.generate_item(**kw),
    )
    engine = SGLangOfflineEngine(engine=stub)
    sampling = SamplingParams(max_new_tokens=2, stop_token_ids=())
    first = asyncio.run(engine.generate([1, 2], sampling))  # one asyncio.run per batch, as the trainer does
    second = asyncio.run(engine.generate([1, 2], sampling))
    assert first.output_ids == second.output_ids == [5, 6]
    with pytest.raises(WeightSyncError, match="1 tensor name\\(s\\) the server does not load: 'base_model.model.w'"):
        asyncio.run(engine.update_weights([("base_model.model.w", torch.zeros(2))], version=1))
    assert tm.calls[2:] == []  # refused before any update call: sglang.Engine would have skipped it
    named = [("w", torch.zeros(2))]
    if refuse:
        with pytest.raises(WeightSyncError, match="shape mismatch"):
            asyncio.run(engine.update_weights(named, version=1))
        assert engine.weight_version is None  # the served weights did not change: neither does the version
    else:
        asyncio.run(engine.update_weights(named, version=1))
        assert engine.weight_version == 1 and tm.version == "1"
    assert tm.calls[2:] == ["begin", "update", "end"]  # the session is closed even when the update failed
    assert tm.payload_counts == [2]  # one payload per TP rank
    asyncio.run(engine.close())


def _stub_offline_engine(tm, checkpoint_dir):
    """What `SGLangOfflineEngine` reads of an ``sglang.Engine``: the tokenizer manager, TP size 2, the checkpoint."""
    return SimpleNamespace(
        tokenizer_manager=tm,
        server_args=SimpleNamespace(tp_size=2, model_path=str(checkpoint_dir)),
        shutdown=lambda: None,
        async_generate=lambda **kw: tm.generate_item(**kw),
    )


def _lora_adapter(module="layers.0.q"):
    from trl_ext.weight_sync import LoRAAdapter

    names = [f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"]
    return LoRAAdapter({"r": 2, "lora_alpha": 4}, [(n, torch.zeros(2, 2)) for n in names])


def test_offline_weight_sync_loads_adapters_and_checks_them(monkeypatch, tmp_path):
    """`SGLangOfflineWeightSync` alone, without SGLang: an adapter is loaded under a new name per version, the engine
    tagged with the version, the previous adapter unloaded; a failed load leaves the served adapter and version, and
    the adapter it may have left loaded is unloaded by the next sync; unknown modules and a version the engine does
    not report are refused."""
    from safetensors.torch import save_file

    from trl_ext.weight_sync import WeightSyncError
    from trl_ext.weight_sync.offline import SGLangOfflineWeightSync

    _stub_sglang(monkeypatch)
    save_file({"layers.0.q.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    tm = _StubTokenizerManager()

    async def run(coro):
        return await coro

    sync = SGLangOfflineWeightSync(_stub_offline_engine(tm, tmp_path), run)
    assert sync.config.checkpoint_path == str(tmp_path) and sync.config.verify == ("version",)

    async def steps():
        await sync.update_lora(_lora_adapter(), 1)
        assert (sync.served_adapter, sync.version, tm.adapters) == ("policy-v1", 1, {"policy-v1"})
        await sync.update_lora(_lora_adapter(), 2)
        assert (sync.served_adapter, sync.version, tm.adapters) == ("policy-v2", 2, {"policy-v2"})
        tm.refuse_lora.add("policy-v3")
        with pytest.raises(WeightSyncError, match="load_lora_adapter_from_tensors failed: the load of policy-v3"):
            await sync.update_lora(_lora_adapter(), 3)
        assert (sync.served_adapter, sync.version, tm.adapters) == ("policy-v2", 2, {"policy-v2", "policy-v3"})
        await sync.update_lora(_lora_adapter(), 4)
        assert (sync.served_adapter, sync.version, tm.adapters) == ("policy-v4", 4, {"policy-v4"})
        calls = len(tm.calls)
        with pytest.raises(WeightSyncError, match="modules the served model does not have: \\['layers.9.q'\\]"):
            await sync.update_lora(_lora_adapter("layers.9.q"), 5)
        assert len(tm.calls) == calls  # refused before anything was sent
        tm.ignore_version_tag = True  # an engine that answers the tag but keeps reporting version 4
        with pytest.raises(WeightSyncError, match="reports weight_version '4' after the sync to 6"):
            await sync.update_lora(_lora_adapter(), 6)
        assert sync.version == 4

    asyncio.run(steps())
    assert tm.calls[:7] == [
        "load policy-v1",
        "version 1",
        "load policy-v2",
        "version 2",
        "unload policy-v1",
        "load policy-v3",
        "unload policy-v3",  # the leftover of the failed load, before the next load
    ]
    assert set(tm.payload_counts) == {2}  # one payload per TP rank


def test_offline_engine_syncs_through_its_weight_sync(monkeypatch, tmp_path):
    """`SGLangOfflineEngine` has no sync logic of its own: its updates are those of its `SGLangOfflineWeightSync`
    (called on the engine's loop, with the detached tensors and the version), its `weight_version` is the sync's, and
    its requests name the adapter the sync serves."""
    from safetensors.torch import save_file

    from trl_ext.weight_sync.offline import SGLangOfflineWeightSync

    _stub_sglang(monkeypatch)
    save_file({"w": torch.zeros(2), "layers.0.q.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    tm = _StubTokenizerManager()
    delegated = []
    for method in ("update", "update_lora"):
        original = getattr(SGLangOfflineWeightSync, method)

        async def spy(self, payload, version, _original=original, _method=method):
            delegated.append((_method, payload, version))
            return await _original(self, payload, version)

        monkeypatch.setattr(SGLangOfflineWeightSync, method, spy)
    engine = SGLangOfflineEngine(engine=_stub_offline_engine(tm, tmp_path))
    try:
        assert isinstance(engine.weight_sync, SGLangOfflineWeightSync)
        weight = torch.zeros(2, requires_grad=True)
        asyncio.run(engine.update_weights([("w", weight)], version=1))
        adapter = _lora_adapter()
        asyncio.run(engine.update_lora_adapter(adapter, version=2))
        out = asyncio.run(engine.generate([1, 2], SamplingParams(max_new_tokens=2, stop_token_ids=())))
    finally:
        asyncio.run(engine.close())
    assert [(m, v) for m, _, v in delegated] == [("update", 1), ("update_lora", 2)]
    ((name, sent),) = delegated[0][1]
    assert name == "w" and not sent.requires_grad  # detached by the engine
    assert delegated[1][1] is adapter
    assert engine.weight_version == engine.weight_sync.version == 2 and tm.version == "2"
    assert tm.lora_paths == ["policy-v2"] and out.weight_version == 2
    assert tm.calls == ["begin", "update", "end", "load policy-v2", "version 2", "generate"]


def test_generation_passes_the_cache_under_its_current_name(model):
    """The engine's forwards name the KV cache as the installed transformers does (`cache` since 5.24, which deprecates
    `past_key_values` with a `FutureWarning` on every decoding step). transformers attributes that warning to its own
    wrapper module, so only a filter on every `FutureWarning` (here made an error) catches the call."""
    import warnings

    engine = EmbeddedEngine(model, seed=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            (out,) = gather(engine, [[1, 2, 3]], [SamplingParams(max_new_tokens=3, stop_token_ids=())])
    finally:
        engine.shutdown()
    assert len(out.output_ids) == 3 and out.finish_reason == "length"
