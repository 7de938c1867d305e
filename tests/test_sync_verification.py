"""Weight sync and rollouts that cannot be silently wrong, against the SGLang test double (`fake_sglang_server`).

Each check has its positive control in the same test: the fake server really skips unknown names, really keeps
stale weights (`stale_weights`), really breaks the ``/generate`` contract and really cuts answers; the test first
shows the fault happening on the server, then that the client refuses it.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from fake_sglang_server import FakeSGLangServer, Fault
from transformers import GptOssForCausalLM

from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext.config import AgenticGRPOConfig
from trl_ext.rollout import AgentLoop, EmbeddedEngine, SamplingParams, SGLangEngine, SGLangError
from trl_ext.rollout.sglang import SGLangContractError
from trl_ext.weight_sync import WeightSyncConfig, WeightSyncError, export_lora_adapter, reference_logprobs
from trl_ext.weight_sync.transport import serialize_per_rank

VOCAB = 128
GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=(200 % VOCAB,))
PROBE = [3, 17, 42, 5, 99, 23, 64, 8, 71, 12, 33, 90, 7, 55, 101, 2]


def make_model(seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    return GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB)).float().eval()


@pytest.fixture
def make_server():
    made = []

    def make(**kwargs):
        srv = FakeSGLangServer(EmbeddedEngine(make_model(0), seed=0), **kwargs)
        made.append(srv)
        return srv.start()

    yield make
    for srv in made:
        srv.stop()
        srv.engine.shutdown()


def client(url, **sync) -> SGLangEngine:
    return SGLangEngine(url, weight_sync=WeightSyncConfig(**sync), backoff_s=0.01, timeout_s=60, ready_timeout_s=30)


def optimizer_step(model, lr: float, seed: int = 0) -> None:
    """One AdamW step on a language-modelling loss: what the trainer does between two syncs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def sent_state(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


# ------------------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("mode", ["disk", "tensor"])
@pytest.mark.parametrize("names_from", ["checkpoint", "server"])
@pytest.mark.parametrize("verify", [("version",), ("version", "checksum")])
def test_a_name_the_server_does_not_load_is_refused(make_server, tmp_path, mode, names_from, verify):
    model = make_model(0)
    checkpoint = tmp_path / "served"
    model.save_pretrained(checkpoint)
    server = make_server(model_path=str(checkpoint) if names_from == "checkpoint" else "embedded")
    bad = "base_model.model.lm_head.weight"  # a PEFT-prefixed name
    named = [(bad if n == "lm_head.weight" else n, t) for n, t in sent_state(model)]

    # positive control: SGLang (and the fake) skip the name and answer success
    httpx.post(server.url + "/begin_weight_update", json={})
    body = {"serialized_named_tensors": serialize_per_rank(named, 1), "weight_version": "x"}
    assert httpx.post(server.url + "/update_weights_from_tensor", json=body).json()["success"] is True
    httpx.post(server.url + "/end_weight_update", json={})
    assert server.skipped_names == [bad]
    sent_before = dict(server.request_counts)

    async def main():
        c = client(server.url, mode=mode, verify=verify, weight_dir=str(tmp_path / "w"))
        with pytest.raises(WeightSyncError, match=rf"1 tensor name\(s\) the server does not load: '{bad}'.*PEFT"):
            await c.update_weights(named, version=1)
        with pytest.raises(SGLangError, match="refusing to generate"):
            await c.generate([1, 2], GREEDY)
        await c.update_weights(sent_state(model), version=2)  # the right names: accepted
        await c.close()

    asyncio.run(main())
    loads = ("/update_weights_from_disk", "/update_weights_from_tensor")
    assert sum(server.request_counts.get(p, 0) - sent_before.get(p, 0) for p in loads) >= 1  # only the good sync
    assert server.skipped_names == [bad]  # nothing was sent with the bad name


def test_a_distributed_sync_with_an_unknown_name_is_refused_before_any_collective(make_server):
    server = make_server()
    named = [(n.replace("mlp.router", "mlp.gate"), t) for n, t in sent_state(make_model(0))]

    async def main():
        c = client(server.url, mode="distributed", dist_backend="gloo", dist_timeout_s=5)
        with pytest.raises(
            WeightSyncError, match=r"4 tensor name\(s\) the server does not load: 'model.layers.0.mlp.gate.weight'"
        ):
            await c.update_weights(named, version=1)
        await c.close()

    asyncio.run(main())
    assert "/init_weights_update_group" not in server.request_counts  # nobody waits in a collective
    assert "/pause_generation" not in server.request_counts


def test_lora_adapter_for_a_module_the_server_lacks_is_refused(make_server, tmp_path):
    from peft import LoraConfig, get_peft_model

    server = make_server(enable_lora=True)
    policy = get_peft_model(make_model(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
    adapter = export_lora_adapter(policy)
    renamed = [(n.replace("self_attn.q_proj", "self_attn.query"), t) for n, t in adapter.named_tensors]
    adapter_bad = type(adapter)(adapter.config_dict, renamed)

    async def main():
        c = client(server.url, mode="disk", weight_dir=str(tmp_path))
        with pytest.raises(WeightSyncError, match="targets 2 module\\(s\\) the served model does not have"):
            await c.update_lora_adapter(adapter_bad, version=1)
        await c.update_lora_adapter(adapter, version=2)
        await c.close()

    asyncio.run(main())
    assert list(server._adapters) == ["policy-v2"]


# ----------------------------------------------------------------------------------------------- stale weights


@pytest.mark.parametrize("mode", ["disk", "tensor"])
def test_checksum_catches_a_stale_server_after_one_step(make_server, tmp_path, mode):
    """At the trainer's default learning rate, one AdamW step: a server that kept its weights (and said success,
    and took the new version) fails the sync; a server that loaded them passes."""
    lr = AgenticGRPOConfig.__dataclass_fields__["learning_rate"].default
    outcomes = {}
    for stale in (False, True):
        server = make_server(stale_weights=stale)
        model = make_model(0)

        async def main(server=server, model=model):
            c = client(server.url, mode=mode, weight_dir=str(tmp_path / f"{mode}-{stale}"))
            await c.update_weights(sent_state(model), version=0)
            optimizer_step(model, lr)
            try:
                await c.update_weights(sent_state(model), version=1)
                return "ok"
            except WeightSyncError as exc:
                return str(exc)
            finally:
                await c.close()

        outcomes[stale] = asyncio.run(main())
        assert server.served_version == "1"  # the stale server took the version all the same
    assert outcomes[False] == "ok"
    assert "served parameter(s) unchanged although the tensors feeding them changed" in outcomes[True]
    assert "'model.layers.0.mlp.experts.w13_weight'" in outcomes[True]  # named as SGLang names its parameters


def test_checksum_names_the_parameters_a_half_loading_server_kept(make_server):
    server = make_server(stale_weights=lambda name: name.endswith("self_attn.sinks"))
    model = make_model(0)

    async def main():
        c = client(server.url, mode="tensor")
        await c.update_weights(sent_state(model), version=0)
        optimizer_step(model, 1e-3)
        with pytest.raises(WeightSyncError) as failed:
            await c.update_weights(sent_state(model), version=1)
        await c.close()
        return str(failed.value)

    message = asyncio.run(main())
    assert "model.layers.0.self_attn.sinks" in message and "model.layers.1.self_attn.sinks" in message
    assert "qkv_proj" not in message


def test_unchanged_weights_are_not_required_to_change(make_server):
    server = make_server()
    model = make_model(0)

    async def main():
        c = client(server.url, mode="tensor")
        for version in range(3):  # the same weights three times: nothing changed, nothing to show
            await c.update_weights(sent_state(model), version=version)
        await c.close()

    asyncio.run(main())
    assert server.served_version == "2"


def test_logprob_probe_rejects_a_stale_server_after_one_step(make_server):
    """fp32 serving: the probe's tolerance (3x the floor measured at the first sync) sits below what one step at
    the trainer's learning rate moves the log-probs, so it separates a stale server from a fresh one."""
    lr = AgenticGRPOConfig.__dataclass_fields__["learning_rate"].default
    measured = {}
    for stale in (False, True):
        server = make_server(stale_weights=stale)
        model = make_model(0)

        async def main(server=server, model=model):
            c = client(server.url, mode="tensor", verify=("version", "logprobs"))  # the probe alone
            await c.update_weights(sent_state(model), version=0)
            await c.verify_logprobs(PROBE, reference_logprobs(model, PROBE))
            optimizer_step(model, lr)
            await c.update_weights(sent_state(model), version=1)
            try:
                await c.verify_logprobs(PROBE, reference_logprobs(model, PROBE))
                return "ok", dict(c.last_logprob_probe[server.url])
            except WeightSyncError as exc:
                return str(exc), dict(c.last_logprob_probe.get(server.url, {}))
            finally:
                await c.close()

        measured[stale] = asyncio.run(main())
    fresh_outcome, fresh = measured[False]
    assert fresh_outcome == "ok" and fresh["separable"] is True, fresh
    assert fresh["step_movement"] > fresh["tolerance"] >= fresh["mean_abs"]
    assert "log-prob probe" in measured[True][0] and "mean |log-prob difference|" in measured[True][0]


# --------------------------------------------------------------------------------------------------- versions


def test_outputs_carry_the_version_the_server_served(make_server):
    server = make_server()
    model = make_model(0)

    async def main():
        c = client(server.url, mode="tensor")
        await c.update_weights(sent_state(model), version=4)
        first = await c.generate([1, 2, 3], GREEDY)
        server.served_version = "3"  # e.g. a restarted server that reloaded an older checkpoint
        second = await c.generate([1, 2, 3], GREEDY)
        await c.close()
        return first, second

    first, second = asyncio.run(main())
    assert first.weight_version == 4 and second.weight_version == 3


# ------------------------------------------------------------------------------------------------ the contract


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("extra_output_ids", r"6 output ids for max_new_tokens=3"),
        ("foreign_rid", r"meta_info.id is '[0-9a-f]+', not the rid sent"),
        ("wrong_prompt_tokens", r"meta_info.prompt_tokens is 4 for 3 input ids sent"),
    ],
)
def test_generate_answers_that_break_the_contract_are_refused(make_server, fault, message):
    server = make_server()
    # positive control: the fake really sends the broken answer
    server.inject(Fault(fault))
    raw = httpx.post(
        server.url + "/generate",
        json={"input_ids": [1, 2, 3], "rid": "r1", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True},
    ).json()
    meta = raw["meta_info"]
    assert len(raw["output_ids"]) > 3 or meta["id"] != "r1" or meta["prompt_tokens"] != 3

    async def main():
        c = client(server.url)
        server.inject(Fault(fault))
        with pytest.raises(SGLangContractError, match=rf"/generate request [0-9a-f]+: .*{message}"):
            await c.generate([1, 2, 3], GREEDY)
        retries = c.stats["retries"]
        loop = AgentLoop(c, [], sampling=GREEDY, max_turns=1)
        server.inject(Fault(fault))
        (traj,) = await loop.run_batch([[1, 2, 3]])
        await c.close()
        return retries, traj

    retries, traj = asyncio.run(main())
    assert retries == 0  # never retried: a server that answers another request is not asked again
    assert traj.completion_ids == [] and traj.finish_reason == "abort"
    assert any("breaks the contract" in e for e in traj.errors)


# ------------------------------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("release", ["next_sync", "close"])
def test_a_cut_lora_load_leaves_no_adapter_behind(make_server, tmp_path, release):
    """A cut adapter load may load it all the same: the next sync unloads it, and so does closing the client (an
    interrupted run, Ctrl-C), so a server holds only the adapter it serves."""
    from peft import LoraConfig, get_peft_model

    server = make_server(enable_lora=True)
    policy = get_peft_model(make_model(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))

    async def main():
        c = client(server.url, mode="disk", weight_dir=str(tmp_path))
        await c.update_lora_adapter(export_lora_adapter(policy), version=1)
        server.inject(Fault("cut", path="/load_lora_adapter"))
        with pytest.raises(WeightSyncError):
            await c.update_lora_adapter(export_lora_adapter(policy), version=2)
        leaked = sorted(server._adapters)  # positive control: the cut load did load the adapter
        if release == "close":
            await c.close()
            return leaked, sorted(server._adapters), None
        await c.update_lora_adapter(export_lora_adapter(policy), version=3)
        after = sorted(server._adapters)
        out = await c.generate([1, 2, 3], GREEDY)
        await c.close()
        return leaked, after, out

    leaked, after, out = asyncio.run(main())
    assert leaked == ["policy-v1", "policy-v2"]
    if release == "close":
        assert after == ["policy-v1"]
    else:
        assert after == ["policy-v3"] and out.weight_version == 3


# --------------------------------------------------------------------------------------------- in-place pause


def test_in_place_pause_flushes_the_radix_cache_once_requests_are_done(make_server):
    server = make_server()
    model = make_model(0)
    prompt = [5, 6, 7, 8, 9, 10]

    async def main():
        c = client(server.url, mode="tensor", pause_mode="in_place")
        await c.update_weights(sent_state(model), version=0)
        await c.generate(prompt, GREEDY)  # caches the prompt's prefix
        server.inject(Fault("delay", delay_s=1.0))  # a request in the running batch during the next sync
        running = asyncio.ensure_future(c.generate([1, 2, 3], GREEDY))
        await asyncio.sleep(0.3)
        optimizer_step(model, 1e-3)
        cached_before = server._cached_prefix(prompt)
        await c.update_weights(sent_state(model), version=1)
        await running
        after = await c.generate(prompt, GREEDY)
        await c.close()
        return cached_before, after

    cached_before, after = asyncio.run(main())
    assert cached_before == len(prompt) - 1  # positive control: old-weight prefixes were in the cache
    updates = [b for _, p, b in server.requests if p == "/update_weights_from_tensor"]
    assert updates[-1]["flush_cache"] is False  # SGLang refuses to flush a running batch
    assert server.request_counts["/flush_cache"] >= 1
    last_flush = max(i for i, (_, p, _) in enumerate(server.requests) if p == "/flush_cache")
    last_generate = max(i for i, (_, p, _) in enumerate(server.requests) if p == "/generate")
    assert last_flush < last_generate and after.weight_version == 1
