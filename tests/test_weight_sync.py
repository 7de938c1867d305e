"""trl_ext.weight_sync: what the trainer exports to the rollout engine, and the record each sync leaves."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssForCausalLM

from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext.weight_sync import export_policy_weights

peft = pytest.importorskip("peft")


def _lora_policy(dtype: torch.dtype, target_modules: list[str]):
    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config()).to(dtype)
    policy = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    with torch.no_grad():  # B starts at zero: make every delta non-zero
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return policy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_export_equals_peft_merge_and_leaves_the_base_weights_untouched(dtype):
    policy = _lora_policy(dtype, ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"])
    before = {k: v.clone() for k, v in policy.state_dict().items()}

    with export_policy_weights(policy) as named:
        exported = dict(named())

    after = policy.state_dict()
    for name, tensor in before.items():  # bit-equal: the export never writes into the live model
        assert torch.equal(after[name], tensor), name
    assert not any("lora_" in name for name in exported)

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
    expected = _lora_policy(dtype, targets).merge_and_unload().state_dict()
    base = _lora_policy(dtype, targets).unload().state_dict()
    assert exported.keys() == expected.keys()
    changed = 0
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype, name
        tol = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-3}  # PEFT merges in bf16, we sum in fp32
        torch.testing.assert_close(exported[name], tensor, **tol, msg=name)
        changed += not torch.equal(exported[name], base[name])
    assert changed == 4 * tiny_gptoss_config().num_hidden_layers + 1  # q/k/v/o of every layer, and lm_head


def test_full_model_export_is_its_state_dict():
    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config())
    with export_policy_weights(model) as named:
        exported = dict(named())
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())


def test_save_config_for_sglang_writes_swiglu_limit(tmp_path):
    """SGLang's GPT-OSS loader reads config.swiglu_limit; configs that lack it (transformers 5.17) get the clamp the
    experts apply, a value the config has is kept, and other models' configs are written unchanged."""
    import json

    from transformers import GptOssConfig, LlamaConfig

    from trl_ext.weight_sync.transport import GPTOSS_DEFAULT_SWIGLU_LIMIT, save_config_for_sglang

    config = GptOssConfig(num_hidden_layers=2)
    if hasattr(config, "swiglu_limit"):
        del config.swiglu_limit  # as in transformers 5.17, whose GptOssConfig has no such field
    save_config_for_sglang(config, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["swiglu_limit"] == GPTOSS_DEFAULT_SWIGLU_LIMIT

    config = GptOssConfig(num_hidden_layers=2)
    config.swiglu_limit = 5.5
    save_config_for_sglang(config, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["swiglu_limit"] == 5.5

    save_config_for_sglang(LlamaConfig(num_hidden_layers=1), tmp_path / "c")
    assert "swiglu_limit" not in json.loads((tmp_path / "c" / "config.json").read_text())


def test_reference_logprobs_ignore_the_callers_autocast():
    """The log-prob probe's reference is the same inside and outside a mixed-precision (autocast) region."""
    from trl_ext.weight_sync import reference_logprobs

    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config()).eval()
    ids = torch.randint(0, model.config.vocab_size, (12,)).tolist()
    plain = reference_logprobs(model, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = reference_logprobs(model, ids)
        autocast_logits = model(input_ids=torch.tensor([ids])).logits
    assert autocast_logits.dtype == torch.bfloat16  # the region really changes the model's own forward
    assert inside == plain


class _GatheringAccelerator:
    """What `accelerator.get_state_dict` hands the main process under FSDP (FULL_STATE_DICT): full tensors, the
    PEFT model's own names, copies unrelated to the live (sharded) parameters."""

    def __init__(self):
        self.calls = 0

    def get_state_dict(self, model):
        self.calls += 1
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_export_from_a_gathered_state_dict_equals_the_live_one(dtype):
    """FSDP: the merged LoRA export is computed from the gathered full state dict; it must equal the export from the
    live modules (same math: base + scaling * B A summed in fp32), and the adapter export must equal PEFT's."""
    from trl_ext.weight_sync import export_lora_adapter

    policy = _lora_policy(dtype, ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"])
    with export_policy_weights(policy) as named:
        live = dict(named())
    accelerator = _GatheringAccelerator()
    with export_policy_weights(policy, accelerator=accelerator, is_fsdp=True) as named:
        gathered = dict(named())
    assert accelerator.calls == 1
    assert gathered.keys() == live.keys()
    for name, tensor in live.items():
        assert gathered[name].dtype == tensor.dtype, name
        torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)

    adapter = export_lora_adapter(policy, accelerator=accelerator, is_fsdp=True)
    plain = export_lora_adapter(policy)
    assert [k for k, _ in adapter.named_tensors] == [k for k, _ in plain.named_tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(adapter.named_tensors, plain.named_tensors))


def test_lora_on_expert_parameters_under_fsdp_names_what_is_unsupported():
    """LoRA on the experts' 3-D parameters has no state-dict merge here: a clear error, never a silent skip."""
    from trl_ext.weight_sync import WeightSyncError

    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config())
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    policy = peft.get_peft_model(model, config)
    with pytest.raises(WeightSyncError, match="linear layers only"):
        with export_policy_weights(policy, accelerator=_GatheringAccelerator(), is_fsdp=True) as named:
            dict(named())


def test_a_served_model_is_stored_in_the_dtype_it_is_served_in(tmp_path):
    """SGLang builds GPT-OSS's layers in config.json's dtype, so a checkpoint written from fp32 master weights and
    served with ``--dtype bfloat16`` stops its warm-up. `write_served_model` stores the tensors and the config in
    the served dtype and leaves the model in fp32; `convert_checkpoint` gives the same files from a saved fp32
    checkpoint. Control: what `save_pretrained` writes from the same model is float32 throughout."""
    import json

    from trl_ext.weight_sync import checkpoint_dtypes, convert_checkpoint, write_served_model

    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=256))
    n = len(model.state_dict())
    model.save_pretrained(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert checkpoint_dtypes(tmp_path / "plain") == {"float32": n} and plain["dtype"] == "float32"  # the control

    write_served_model(model, tmp_path / "served", torch.bfloat16)
    served = json.loads((tmp_path / "served" / "config.json").read_text())
    assert checkpoint_dtypes(tmp_path / "served") == {"bfloat16": n}
    assert served["dtype"] == served["torch_dtype"] == "bfloat16" and "swiglu_limit" in served
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights are left as they are

    convert_checkpoint(tmp_path / "plain", tmp_path / "converted", torch.bfloat16)
    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert checkpoint_dtypes(tmp_path / "converted") == {"bfloat16": n} and converted["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "served" / "model.safetensors"))
    b = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="output folder is the input folder"):
        convert_checkpoint(tmp_path / "plain", tmp_path / "plain", torch.bfloat16)


def test_an_abandoned_group_join_ends_its_thread_without_an_error(monkeypatch):
    """The awaiting side gives up on a rendezvous (its deadline, a refused join) while the join thread still runs:
    the thread's outcome must not raise in that thread (InvalidStateError on a cancelled future)."""
    import threading

    from trl_ext.weight_sync.sglang import _in_daemon_thread

    errors, started, release = [], threading.Event(), threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))

    def join():
        started.set()
        release.wait(5)
        raise TimeoutError("rendezvous timed out")

    done = _in_daemon_thread(join)
    assert started.wait(5)
    done.cancel()  # the awaiting side gives up
    release.set()
    for thread in [t for t in threading.enumerate() if t.name == "weight-update-group-join"]:
        thread.join(5)
    assert errors == []
    assert isinstance(done.exception(timeout=5), TimeoutError)  # the outcome is kept on the future


# ------------------------------------------------------------------------------------------------ sync records


@pytest.fixture
def make_server():
    """`FakeSGLangServer`s (SGLang's HTTP API over an `EmbeddedEngine` of the tiny GPT-OSS), stopped afterwards;
    each comes with a trainer-side copy of the model it serves."""
    from fake_sglang_server import FakeSGLangServer

    from trl_ext.rollout import EmbeddedEngine

    made = []

    def tiny():
        torch.manual_seed(0)
        return GptOssForCausalLM(tiny_gptoss_config(vocab_size=128)).float().eval()

    def make(**kwargs):
        server = FakeSGLangServer(EmbeddedEngine(tiny(), seed=0), **kwargs)
        made.append(server)
        return server.start(), tiny()

    yield make
    for server in made:
        server.stop()
        server.engine.shutdown()


def _sync_client(url, **sync):
    from trl_ext.rollout import SGLangEngine
    from trl_ext.weight_sync import WeightSyncConfig

    return SGLangEngine(url, weight_sync=WeightSyncConfig(**sync), backoff_s=0.01, timeout_s=60, ready_timeout_s=30)


PROBE = [3, 17, 42, 5, 99, 23, 64, 8]


@pytest.mark.parametrize("mode", ["disk", "tensor"])
def test_a_merged_sync_and_its_probe_leave_one_record(make_server, tmp_path, mode):
    """One `SyncRecord` per sync: the bytes of the tensors sent, the outcome, the transfer's seconds; the log-prob
    probe that follows adds its outcome, seconds and what it measured to that record."""
    import asyncio

    from trl_ext.weight_sync import SyncRecord, reference_logprobs

    server, model = make_server()
    named = [(n, t.detach().clone()) for n, t in model.state_dict().items()]
    sent_bytes = sum(t.numel() * t.element_size() for _, t in named)

    async def main():
        c = _sync_client(server.url, mode=mode, weight_dir=str(tmp_path), model_config=model.config,
                         verify=("version", "logprobs"))  # fmt: skip
        try:
            await c.update_weights(named, version=0)
            first = c.weight_sync.sync_history[-1].as_dict()
            await c.verify_logprobs(PROBE, reference_logprobs(model, PROBE))
            await c.update_weights(named, version=1)
            return list(c.weight_sync.sync_history), first, dict(c.last_logprob_probe[server.url])
        finally:
            await c.close()

    history, first, probe = asyncio.run(main())
    assert [r.version for r in history] == [0, 1] and all(isinstance(r, SyncRecord) for r in history)
    assert set(first) == {"version", "kind", "bytes", "ok", "transfer_s"}  # no probe yet
    record = history[0]
    assert (record.kind, record.bytes, record.ok, record.error) == ("merged", sent_bytes, True, None)
    assert record.transfer_s > 0 and record.verify_s > 0 and record.probe_pass is True
    assert (record.probe_tokens, record.probe_dlogp_mean, record.probe_dlogp_max) == (
        len(PROBE) - 1, probe["mean_abs"], probe["max_abs"]
    )  # fmt: skip
    assert (record.probe_mean_abs_logp, record.probe_tolerance) == (probe["mean_abs_reference"], probe["tolerance"])
    assert history[1].ok is True and history[1].probe_pass is None  # the probe belongs to the sync it followed
    assert record.sync_total_s is None  # the trainer's whole push: set by `rollout_sync.sync_rollout_weights`


def test_a_lora_sync_records_the_adapter(make_server, tmp_path):
    import asyncio

    from trl_ext.weight_sync import export_lora_adapter

    server, model = make_server(enable_lora=True)
    adapter = export_lora_adapter(_lora_policy(torch.float32, ["q_proj", "k_proj", "v_proj", "o_proj"]))

    async def main():
        c = _sync_client(server.url, mode="tensor")
        try:
            await c.update_lora_adapter(adapter, version=1)
            return list(c.weight_sync.sync_history)
        finally:
            await c.close()

    (record,) = asyncio.run(main())
    assert (record.version, record.kind, record.ok) == (1, "lora", True)
    assert record.bytes == adapter.nbytes == sum(t.numel() * t.element_size() for _, t in adapter.named_tensors)
    assert record.lora_tensors == len(adapter.named_tensors) == 4 * tiny_gptoss_config().num_hidden_layers * 2


def test_a_failed_sync_and_a_failed_probe_are_recorded_with_their_errors(make_server, tmp_path):
    import asyncio

    from fake_sglang_server import Fault

    from trl_ext.weight_sync import WeightSyncError, reference_logprobs

    server, model = make_server()
    server.inject(Fault("refuse", path="/update_weights_from_disk"))
    named = list(model.state_dict().items())
    g = torch.Generator().manual_seed(1)
    other = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}

    async def main():
        c = _sync_client(server.url, mode="disk", weight_dir=str(tmp_path), model_config=model.config,
                         verify=("version", "logprobs"))  # fmt: skip
        try:
            with pytest.raises(WeightSyncError, match="injected refusal"):
                await c.update_weights(named, version=1)
            await c.update_weights(named, version=2)
            model.load_state_dict(other)  # the trainer's reference is now other weights than the served ones
            with pytest.raises(WeightSyncError, match="log-prob probe"):
                await c.verify_logprobs(PROBE, reference_logprobs(model, PROBE))
            return list(c.weight_sync.sync_history)
        finally:
            await c.close()

    failed, served = asyncio.run(main())
    assert failed.ok is False and failed.error.startswith("WeightSyncError: ") and "injected refusal" in failed.error
    assert failed.transfer_s > 0 and failed.as_dict()["ok"] is False
    assert served.ok is True and served.probe_pass is False and "log-prob probe" in served.error
    assert served.probe_dlogp_mean > served.probe_tolerance  # what made it fail, as the probe measured it


def test_the_trainers_push_sets_its_records_total_seconds():
    """`sync_rollout_weights` times the whole push once: the seconds it logs as ``timing/weight_sync_s`` are the new
    record's ``sync_total_s``; a push that fails before any record (an export error) leaves the last one alone."""
    from collections import defaultdict, deque
    from types import SimpleNamespace

    from trl_ext.rollout_sync import sync_rollout_weights
    from trl_ext.weight_sync import SyncRecord

    history = deque()
    engine = SimpleNamespace(weight_sync=SimpleNamespace(sync_history=history, last_verify_s=None))

    def push(eng, version):
        if version == 2:
            raise RuntimeError("export failed")
        history.append(SyncRecord(version=version, kind="merged", bytes=8, ok=True))

    trainer = SimpleNamespace(
        rollout_engine=engine, _push_weights=push, state=SimpleNamespace(global_step=1),
        _metrics={"train": defaultdict(list)}, args=SimpleNamespace(rollout_backend="sglang"),
        accelerator=SimpleNamespace(num_processes=1),
    )  # fmt: skip
    sync_rollout_weights(trainer)
    (record,) = history
    assert record.sync_total_s == trainer._metrics["train"]["timing/weight_sync_s"][-1] > 0
    total = record.sync_total_s
    trainer.state.global_step = 2
    with pytest.raises(RuntimeError, match="export failed"):
        sync_rollout_weights(trainer)
    assert len(trainer._metrics["train"]["timing/weight_sync_s"]) == 2 and record.sync_total_s == total
