"""SGLangEngine and the weight sync against a local test double of SGLang's HTTP server (`fake_sglang_server`).

The fake server follows SGLang's semantics where the client depends on them (begin/end sessions, per-rank
payloads, unknown names skipped with success, pause modes), and every request the client sends is checked
against SGLang's own request classes, parsed from the sglang 0.5.17 and 0.5.23 wheels (`sglang_schema`; skipped
when the wheels cannot be downloaded). Faults are injected by the server: 5xx, slow and trickled answers, dropped
connections, restarts, dead URLs, refused updates, ``abort`` finish reasons, log-prob/ids length mismatches, and a
server process killed in the middle of a distributed (gloo) weight sync, then restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
import torch
from fake_sglang_server import FakeSGLangServer, Fault
from transformers import GptOssForCausalLM

from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext.rollout import AgentLoop, EmbeddedEngine, SamplingParams, SGLangEngine, SGLangError
from trl_ext.rollout.sglang import SGLangUnavailableError
from trl_ext.weight_sync import (
    ServerLostError,
    WeightSyncConfig,
    WeightSyncError,
    export_lora_adapter,
    reference_logprobs,
)
from trl_ext.weight_sync.transport import flatten_bucket, free_port, plan_buckets, serialize_per_rank, unflatten_bucket

VOCAB = 128
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(200 % VOCAB,))
SGLANG_VERSIONS = ("0.5.17", "0.5.23")


def make_model(seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    return GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB)).float().eval()


@pytest.fixture(scope="session")
def sglang_schemas():
    """SGLang's request schemas per version, or {} when the wheels cannot be fetched (offline)."""
    from sglang_schema import fetch_schemas

    cache = os.environ.get("SGLANG_SCHEMA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hf_gptoss_rl", "sglang-schemas"
    )
    out = {}
    for version in SGLANG_VERSIONS:
        try:
            out[version] = fetch_schemas(version, cache)
        except Exception as exc:  # noqa: BLE001 - offline: the schema checks skip, the rest runs
            logging.getLogger(__name__).warning("no SGLang %s schemas: %s", version, exc)
    return out


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture
def make_server(sglang_schemas):
    made = []

    def make(version="0.5.23", *, seed=0, **kwargs):
        engine = EmbeddedEngine(make_model(seed), seed=0)
        schema = sglang_schemas.get(version)
        srv = FakeSGLangServer(engine, version=version, validator=schema.validate if schema else None, **kwargs)
        made.append(srv)
        return srv.start()

    yield make
    for srv in made:
        srv.stop()
        srv.engine.shutdown()
        assert not srv.schema_violations, srv.schema_violations


@pytest.fixture
def server(make_server):
    return make_server()


_SYNC_FIELDS = set(WeightSyncConfig.__dataclass_fields__)


def client(url, **kwargs) -> SGLangEngine:
    """An engine with short test deadlines; `WeightSyncConfig` fields among ``kwargs`` go to its ``weight_sync``."""
    sync = {k: kwargs.pop(k) for k in list(kwargs) if k in _SYNC_FIELDS}
    kwargs.setdefault("backoff_s", 0.01)
    kwargs.setdefault("timeout_s", 60.0)
    kwargs.setdefault("ready_timeout_s", 30.0)
    return SGLangEngine(url, weight_sync=WeightSyncConfig(**sync), **kwargs)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s; returns once the process is gone."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def greedy_reference(model, prompt, n=GREEDY.max_new_tokens):
    engine = EmbeddedEngine(model)
    out = engine.submit(prompt, GREEDY).result(timeout=60)
    engine.shutdown()
    return out.output_ids


def perturbed_state(model, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- generation


def test_generate_speaks_the_native_api(server, model):
    async def main():
        engine = client(server.url)
        outs = await asyncio.gather(*(engine.generate([1, 2, 3 + i], GREEDY) for i in range(6)))
        await engine.close()
        return outs

    outs = asyncio.run(main())
    payload = server.last_generate_payload
    assert payload["return_logprob"] is True and payload["logprob_start_len"] == -1 and "lora_path" not in payload
    assert payload["sampling_params"] == {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [200 % VOCAB],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    for i, out in enumerate(outs):
        assert out.output_ids == greedy_reference(model, [1, 2, 3 + i])
        assert len(out.logprobs) == len(out.output_ids) and out.weight_version == 0
        assert out.finish_reason in ("stop", "length")


def test_one_client_serves_many_event_loops(server):
    """A trainer runs each batch with asyncio.run; a notebook has its own loop: the client must not care."""
    engine = client(server.url)
    first = asyncio.run(engine.generate([1, 2], GREEDY))
    second = asyncio.run(engine.generate([1, 2], GREEDY))

    async def in_running_loop():
        return await engine.generate([1, 2], GREEDY), await engine.health()

    third, healthy = asyncio.run(in_running_loop())
    assert first.output_ids == second.output_ids == third.output_ids and healthy
    asyncio.run(engine.close())
    asyncio.run(engine.close())  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(engine.generate([1, 2], GREEDY))


def test_fake_server_rejects_what_sglang_rejects(server):
    r = httpx.post(server.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 400 and "unknown keys" in r.text
    server.schema_violations.clear()
    assert httpx.get(server.url + "/get_weight_version").status_code == 404  # gone from SGLang's server

    async def main():
        engine = client(server.url)
        with pytest.raises(SGLangError, match="HTTP 400"):
            await engine.generate([VOCAB + 5], GREEDY)  # out-of-range id: a 4xx is not retried
        stats = dict(engine.stats)
        await engine.close()
        return stats

    assert asyncio.run(main())["retries"] == 0


def test_retries_5xx_disconnects_mismatches_and_timeouts(server, model):
    server.inject(
        Fault("status", status=503),
        Fault("disconnect"),
        Fault("drop_logprob"),  # len(logprobs) != len(output_ids): malformed, retried
        Fault("delay", delay_s=6.0),  # longer than the client's deadline
    )

    async def main():
        engine = client(server.url, timeout_s=4.0)
        out = await engine.generate([4, 5, 6], GREEDY)
        stats = dict(engine.stats)
        await engine.close()
        return out, stats

    out, stats = asyncio.run(main())
    assert out.output_ids == greedy_reference(model, [4, 5, 6])
    assert stats["retries"] == 4 and not server.faults


def test_retries_end_at_max_retries_or_the_retry_deadline(server):
    assert SGLangEngine("http://127.0.0.1:1").retry_deadline_s >= 60  # spans an ordinary restart by default
    server.inject(*[Fault("status", status=500)] * 3)

    async def main():
        engine = client(server.url, max_retries=2)
        with pytest.raises(SGLangError, match=r"after 3 attempt\(s\).*HTTP 500"):
            await engine.generate([1], GREEDY)
        server.inject(*[Fault("status", status=500)] * 100)
        engine.retry_deadline_s, engine.max_retries, engine.backoff_s = 0.5, None, 0.05
        start = time.monotonic()
        with pytest.raises(SGLangError, match="retry_deadline_s=0.5"):
            await engine.generate([1], GREEDY)
        elapsed = time.monotonic() - start
        await engine.close()
        return elapsed

    assert asyncio.run(main()) < 2.0
    server.faults.clear()


def test_abort_finish_reason_is_surfaced(server):
    server.inject(Fault("abort"))

    async def main():
        engine = client(server.url)
        out = await engine.generate([1, 2], SamplingParams(max_new_tokens=8, stop_token_ids=()))
        await engine.close()
        return out, engine.stats

    out, stats = asyncio.run(main())
    assert out.finish_reason == "abort" and len(out.output_ids) == len(out.logprobs) == 4
    assert stats["aborts"] == 1 and stats["retries"] == 0


def test_dead_url_fails_fast_with_url_and_cause(caplog):
    dead = f"http://127.0.0.1:{free_port()}"
    engine = client(dead, ready_timeout_s=1.5, log_every_s=0.2)
    caplog.set_level(logging.INFO, logger="trl_ext.rollout.sglang")
    start = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match=f"{dead}: ConnectError") as info:
        engine.check_servers()
    assert isinstance(info.value, TimeoutError) and time.monotonic() - start < 4
    assert any("still waiting for SGLang server" in r.message and dead in r.message for r in caplog.records)

    async def batch():  # every trajectory fails at once: the readiness failure is not waited out again
        loop = AgentLoop(engine, [], sampling=GREEDY, max_completion_tokens=8)
        return await loop.run_batch([[1, 2]] * 8)

    start = time.monotonic()
    trajs = asyncio.run(batch())
    assert time.monotonic() - start < 3.0  # not 8 readiness deadlines in turn (12 s)
    assert all(t.finish_reason == "abort" and "not ready" in t.errors[0] for t in trajs)
    assert not asyncio.run(engine.health())
    asyncio.run(engine.close())


def test_refused_then_recovered(model, make_server):
    port = free_port()
    srv = make_server(port=port)
    srv.stop()  # connections are refused until it starts again
    timer = threading.Timer(0.8, srv.start)

    async def main():
        c = client(f"http://127.0.0.1:{port}")
        timer.start()
        out = await c.generate([1, 2, 3], GREEDY)
        await c.close()
        return out

    out = asyncio.run(main())
    timer.join()
    assert out.output_ids == greedy_reference(model, [1, 2, 3])
    assert srv.request_counts.get("/health", 0) >= 1


def test_request_spans_a_server_restart(server):
    async def main():
        c = client(server.url, backoff_s=0.1, max_backoff_s=0.5, retry_deadline_s=20)
        first = await c.generate([1, 2], GREEDY)
        thread = server.restart(down_s=1.5)  # longer than the old fixed retry window would tolerate
        second = await c.generate([1, 2], GREEDY)
        thread.join()
        await c.close()
        return first, second, dict(c.stats)

    first, second, stats = asyncio.run(main())
    assert first.output_ids == second.output_ids and stats["retries"] >= 2


def test_trickled_body_trips_the_request_deadline(make_server, model):
    slow, fast = make_server(), make_server()
    slow.inject(Fault("trickle", delay_s=0.05))  # a ~400-byte answer at 20 bytes/s: ~20 s, each read quick

    async def one_server():
        c = client(slow.url, timeout_s=0.5, retry_deadline_s=0)
        await c.wait_until_ready()
        with pytest.raises(SGLangError, match="timeout_s=0.5"):
            await c.generate([1, 2], GREEDY)
        await c.close()

    start = time.monotonic()
    asyncio.run(one_server())
    assert time.monotonic() - start < 2.0

    slow.inject(*[Fault("trickle", delay_s=0.1)] * 4)

    async def two_servers():  # the slow server's requests move to the other one: the batch is not stalled
        c = client([slow.url, fast.url], timeout_s=3.0)
        await c.wait_until_ready()
        start = time.monotonic()
        outs = await asyncio.gather(*(c.generate([1, 2, i], GREEDY) for i in range(4)))
        elapsed = time.monotonic() - start
        await c.close()
        return outs, elapsed

    outs, elapsed = asyncio.run(two_servers())
    assert elapsed < 15.0  # the trickled answers alone would take ~40 s
    assert [o.output_ids for o in outs] == [greedy_reference(model, [1, 2, i]) for i in range(4)]
    slow.faults.clear()


def test_trajectory_turns_stay_on_one_server_and_cached_tokens_are_logged(make_server, caplog):
    servers = [make_server(), make_server()]
    turns = {}

    async def trajectory(c, k):
        ids = [1, 2, 3, k]
        for _ in range(3):  # each turn extends the previous prompt + output, as the agent loop does
            out = await c.generate(ids, SamplingParams(max_new_tokens=3, temperature=1.0, stop_token_ids=()))
            ids = ids + out.output_ids + [5]
        turns[k] = ids

    async def main():
        c = client([s.url for s in servers], log_every_s=0.05)
        await asyncio.gather(*(trajectory(c, k) for k in range(6)))
        await asyncio.sleep(0.1)
        stats = dict(c.stats)
        await c.close()
        return stats

    caplog.set_level(logging.INFO, logger="trl_ext.rollout.sglang")
    stats = asyncio.run(main())
    for k in range(6):  # every request of trajectory k went to the same server
        hosts = {
            i
            for i, s in enumerate(servers)
            for (_, p, b) in s.requests
            if p == "/generate" and b["input_ids"][:4] == [1, 2, 3, k]
        }
        assert len(hosts) == 1
    assert min(s.request_counts["/generate"] for s in servers) >= 3  # trajectories are spread
    # turns 2 and 3 reuse the trajectory's prefix on its server
    assert stats["cached_tokens"] >= 6 * 2 * 4 and stats["prompt_tokens"] > stats["cached_tokens"]


def test_progress_lines_while_requests_run(server, caplog):
    server.inject(Fault("delay", delay_s=0.5))
    caplog.set_level(logging.INFO, logger="trl_ext.rollout.sglang")

    async def main():
        c = client(server.url, log_every_s=0.1)
        await asyncio.gather(*(c.generate([1, i], GREEDY) for i in range(3)))
        await c.close()

    asyncio.run(main())
    records = [r for r in caplog.records if r.message.startswith("SGLang rollouts:")]
    assert records and "in flight" in records[0].message and "cached" in records[0].message
    # the delayed request: periods with nothing finished are warnings (visible under the default logging level)
    assert any(r.levelno == logging.WARNING and "none finished in the last 0.1 s" in r.message for r in records)


def test_load_balancing_over_servers(make_server):
    servers = [make_server(), make_server()]

    async def main():
        c = client([s.url for s in servers], max_concurrency=4)
        outs = await asyncio.gather(*(c.generate([1, 2, i], GREEDY) for i in range(12)))
        await c.close()
        return outs

    outs = asyncio.run(main())
    counts = [s.request_counts.get("/generate", 0) for s in servers]
    assert sum(counts) == 12 and min(counts) >= 3
    assert all(len(o.output_ids) == len(o.logprobs) for o in outs)


def test_flush_cache_retries_while_busy(server):
    server.inject(Fault("status", status=400, path="/flush_cache"), Fault("status", status=400, path="/flush_cache"))

    async def main():
        c = client(server.url)
        await c.flush_cache()
        await c.close()

    asyncio.run(main())
    assert server.request_counts["/flush_cache"] == 3


# ---------------------------------------------------------------------------------------------- weight sync


def test_buckets_are_aligned_and_round_trip():
    named = [
        ("a", torch.arange(3, dtype=torch.bfloat16)),
        ("b", torch.randn(5)),
        ("c", torch.ones(2, dtype=torch.int64)),
        ("d", torch.randn(4, 4)),
    ]
    buckets = plan_buckets(named, bucket_bytes=64)
    assert sorted(n for b in buckets for n, _ in b) == ["a", "b", "c", "d"]
    for bucket in buckets:
        flat, meta = flatten_bucket(bucket)
        assert flat.dtype == torch.uint8 and all(m.start_idx % m.dtype.itemsize == 0 for m in meta)
        for (name, t), (name2, t2) in zip(bucket, unflatten_bucket(flat, meta)):
            assert name == name2 and torch.equal(t, t2)
    with pytest.raises(ValueError, match="multiple of"):
        flatten_bucket([("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(1))])


def test_one_payload_per_tp_rank():
    import base64
    from multiprocessing.reduction import ForkingPickler

    named = [("w", torch.randn(3))]
    payloads = serialize_per_rank(named, 3)
    assert len(payloads) == 3 and all(isinstance(p, str) for p in payloads)
    for p in payloads:
        ((name, t),) = ForkingPickler.loads(base64.b64decode(p))
        assert name == "w" and torch.equal(t, named[0][1])
    with pytest.raises(ValueError, match="tp_size"):
        serialize_per_rank(named, 0)


def _load_recording_globals(payload: str, stand_ins: dict):
    """Unpickle ``payload`` recording every global it references; ``stand_ins`` replace some of them."""
    import base64
    import io
    import pickle

    seen = []

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            if (module, name) in stand_ins:
                return stand_ins[(module, name)]
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(base64.b64decode(payload))).load(), seen


def test_cuda_payloads_carry_the_device_uuid_and_only_globals_sglang_unpickles(monkeypatch, sglang_schemas):
    """What SGLang's patched sender writes for a CUDA tensor, built without sglang: torch's IPC reduction, the device
    UUID in place of its index, and SGLang's ``_rebuild_cuda_tensor_modified`` as the rebuild function. CUDA is
    simulated (torch's reduction is replaced by one returning CUDA-shaped rebuild args)."""
    from types import SimpleNamespace

    from torch.multiprocessing import reductions

    original = reductions.reduce_tensor

    def fake_cuda_reduce(tensor):
        if tensor.dtype == torch.float16:  # stands for "a CUDA tensor"
            return reductions.rebuild_cuda_tensor, (
                torch.Tensor,
                (2,),
                (1,),
                0,
                torch.UntypedStorage,
                torch.float16,
                3,
                b"handle",
                4,
                0,
                b"ref",
                0,
                b"event",
                False,
            )
        return original(tensor)

    monkeypatch.setattr(reductions, "reduce_tensor", fake_cuda_reduce)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-uuid-of-{i}"))
    payloads = serialize_per_rank([("cuda_w", torch.zeros(2, dtype=torch.float16)), ("cpu_w", torch.ones(3))], 2)
    rebuilt = {}
    stand_in = {
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): lambda *a: rebuilt.setdefault("args", a)
    }
    (cuda_item, cpu_item), seen = _load_recording_globals(payloads[1], stand_in)
    assert cuda_item[0] == "cuda_w" and rebuilt["args"][6] == "GPU-uuid-of-3"  # the device travels as its UUID
    assert cpu_item[0] == "cpu_w" and torch.equal(cpu_item[1], torch.ones(3))
    assert ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified") in seen
    if not sglang_schemas:
        pytest.skip("sglang wheels not available (offline): SafeUnpickler's allow-list not checked")
    for version, schema in sglang_schemas.items():
        blocked = [g for g in seen if not schema.unpickle_allowed(*g)]
        assert not blocked, f"sglang {version}'s SafeUnpickler blocks {blocked}"


@pytest.mark.parametrize("version", SGLANG_VERSIONS)
@pytest.mark.parametrize("sync_mode", ["disk", "tensor"])
def test_weight_sync_changes_outputs(make_server, model, sync_mode, version, tmp_path):
    server = make_server(version, tp_size=2 if sync_mode == "tensor" else 1)
    new_state = perturbed_state(model)
    target = make_model(0)
    target.load_state_dict(new_state)
    prompt = [9, 8, 7]

    async def main():
        c = client(
            server.url,
            mode=sync_mode,
            weight_dir=str(tmp_path / "w"),
            model_config=model.config,
            max_shard_size=200_000,
            bucket_bytes=50_000,
            verify=("version", "checksum"),
        )
        before = await c.generate(prompt, GREEDY)
        await c.update_weights(new_state.items(), version=5)
        after = await c.generate(prompt, GREEDY)
        await c.update_weights(model.state_dict().items(), version=6)
        back = await c.generate(prompt, GREEDY)
        await c.close()
        return before, after, back, c.weight_version

    before, after, back, served = asyncio.run(main())
    assert before.output_ids == greedy_reference(model, prompt) == back.output_ids
    assert after.output_ids == greedy_reference(target, prompt) != before.output_ids
    assert after.weight_version == 5 and back.weight_version == 6 == served
    counts = server.request_counts
    assert counts["/pause_generation"] == 2 == counts["/continue_generation"]
    assert counts["/weights_checker"] == 3 and not server.skipped_names  # a baseline, then one per sync
    sessions = 2 if (sync_mode == "tensor" and version == "0.5.23") else 0
    assert counts.get("/begin_weight_update", 0) == sessions == counts.get("/end_weight_update", 0)
    if sync_mode == "tensor":
        assert counts["/update_weights_from_tensor"] > 2  # several buckets per sync
        bodies = [b for _, p, b in server.requests if p == "/update_weights_from_tensor"]
        assert all(len(b["serialized_named_tensors"]) == 2 for b in bodies)  # one payload per TP rank
        assert [b["flush_cache"] for b in bodies].count(True) == 2  # flushed once per sync, at the end
    else:
        files = os.listdir(tmp_path / "w")
        assert "config.json" in files and "model.safetensors.index.json" in files  # sharded at 200 kB


def test_session_support_is_probed_when_the_version_is_unknown(make_server, model):
    """A server that does not report its version: ``/begin_weight_update`` is tried, and a 404 (0.5.17) means
    no session."""
    server = make_server("0.5.17")
    server._server_info = lambda body: {"tp_size": 1, "dp_size": 1}

    async def main():
        c = client(server.url, mode="tensor")
        await c.update_weights(perturbed_state(model).items(), version=1)
        await c.close()

    asyncio.run(main())
    assert server.request_counts["/begin_weight_update"] == 1 and "/end_weight_update" not in server.request_counts
    assert server.served_version == "1"


def test_sglang_0_5_23_requires_a_session():
    """The fake server's semantics, as in SGLang 0.5.23's weight updater: no session, no update."""
    engine = EmbeddedEngine(make_model(0))
    with FakeSGLangServer(engine) as srv:
        body = {"serialized_named_tensors": serialize_per_rank([("x", torch.zeros(1))], 1), "weight_version": "1"}
        r = httpx.post(srv.url + "/update_weights_from_tensor", json=body)
        assert r.status_code == 400 and "begin_weight_update() and end_weight_update()" in r.text
        assert httpx.post(srv.url + "/end_weight_update", json={}).status_code == 400
    engine.shutdown()


def test_in_place_pause_sends_no_flush_and_versions_agree(server, model):
    server.inject(Fault("delay", delay_s=1.0))  # a request in the running batch during the sync

    async def main():
        c = client(server.url, mode="tensor", pause_mode="in_place")
        running = asyncio.ensure_future(c.generate([1, 2, 3], GREEDY))
        await asyncio.sleep(0.3)
        await c.update_weights(perturbed_state(model).items(), version=1)
        await running
        after = await c.generate([1, 2, 3], GREEDY)
        await c.close()
        return after

    assert asyncio.run(main()).weight_version == 1
    bodies = [b for _, p, b in server.requests if p == "/update_weights_from_tensor"]
    assert bodies and all(b["flush_cache"] is False for b in bodies)
    # what the client avoids: with flush_cache=True SGLang 0.5.23 loads the weights, then answers 400
    server.inject(Fault("delay", delay_s=1.0))
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    runner = threading.Thread(target=lambda: httpx.post(server.url + "/generate", json=body, timeout=30))
    runner.start()
    time.sleep(0.3)
    httpx.post(server.url + "/pause_generation", json={"mode": "in_place"})
    httpx.post(server.url + "/begin_weight_update", json={})
    r = httpx.post(
        server.url + "/update_weights_from_tensor",
        json={
            "serialized_named_tensors": serialize_per_rank(list(model.state_dict().items()), 1),
            "weight_version": "9",
        },
    )
    httpx.post(server.url + "/end_weight_update", json={})
    httpx.post(server.url + "/continue_generation", json={})
    runner.join()
    assert r.status_code == 400 and "Weights were updated" in r.text and server.served_version == "1"


def test_sync_with_pause_mode_abort_aborts_running_requests(server, model):
    async def main():
        c = client(server.url, mode="tensor", pause_mode="abort")
        long = asyncio.ensure_future(c.generate([1, 2, 3], SamplingParams(max_new_tokens=20000, stop_token_ids=())))
        for _ in range(500):  # until the server decodes it
            if server.engine.num_batches:
                break
            await asyncio.sleep(0.01)
        await c.update_weights(perturbed_state(model).items(), version=1)
        aborted = await long
        after = await c.generate([1, 2, 3], GREEDY)  # generation continues after the sync
        await c.close()
        return aborted, after

    aborted, after = asyncio.run(main())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 20000
    assert after.weight_version == 1 and after.finish_reason in ("stop", "length")


def test_failed_pause_on_one_server_continues_the_others(make_server, model):
    a, b = make_server(), make_server()
    b.inject(Fault("status", status=500, path="/pause_generation"))

    async def main():
        c = client([a.url, b.url], retry_deadline_s=0)
        with pytest.raises(WeightSyncError, match=rf"{b.url}/pause_generation"):
            await c.update_weights(perturbed_state(model).items(), version=1)
        await c.close()

    asyncio.run(main())
    assert a.request_counts["/pause_generation"] == 1 == a.request_counts["/continue_generation"]
    assert b.request_counts["/continue_generation"] == 1  # the failed pause may have half-happened: continued too
    assert a._running.is_set() and b._running.is_set()  # nothing left paused
    assert a.served_version == "0" and b.served_version == "0"


def test_update_failing_on_one_server_fails_the_step_loudly(make_server, model, tmp_path):
    a, b = make_server(), make_server()
    b.inject(Fault("refuse", path="/update_weights_from_disk"))
    target = make_model(0)
    target.load_state_dict(perturbed_state(model))

    async def main():
        c = client([a.url, b.url], weight_dir=str(tmp_path))
        with pytest.raises(WeightSyncError) as info:
            await c.update_weights(target.state_dict().items(), version=1)
        msg = str(info.value)
        assert f"{b.url}: " in msg and "injected refusal" in msg and f"{a.url} loaded" in msg
        with pytest.raises(SGLangError, match="refusing to generate"):
            await c.generate([1, 2], GREEDY)
        assert c.weight_version is None
        await c.update_weights(target.state_dict().items(), version=2)  # a later sync repairs it
        out = await c.generate([1, 2], GREEDY)
        await c.close()
        return out

    assert asyncio.run(main()).weight_version == 2
    assert a.served_version == b.served_version == "2"
    for s in (a, b):
        assert s.request_counts["/pause_generation"] == 2 == s.request_counts["/continue_generation"]


def test_a_server_on_another_version_after_the_sync_is_an_error(make_server, model):
    a, b = make_server(), make_server()
    original = b._load

    def load_without_version(named, body):
        return original(named, {k: v for k, v in body.items() if k != "weight_version"})

    b._load = load_without_version

    async def main():
        c = client([a.url, b.url], mode="tensor")
        with pytest.raises(WeightSyncError, match=rf"{b.url} reports weight_version '0'.*expected '3'"):
            await c.update_weights(model.state_dict().items(), version=3)
        await c.close()

    asyncio.run(main())


def test_logprob_probe_names_the_mismatch(server, model):
    target = make_model(0)
    target.load_state_dict(perturbed_state(model))
    probe = [3, 1, 4, 1, 5, 9, 2, 6]

    async def main():
        c = client(server.url, mode="tensor", verify=("version", "logprobs"))
        await c.update_weights(target.state_dict().items(), version=1)
        agrees = await c.verify_logprobs(probe, reference_logprobs(target, probe))
        assert agrees[server.url]["tokens"] == len(probe) - 1
        assert (
            agrees[server.url]["mean_abs"]
            <= agrees[server.url]["max_abs"]
            <= c.weight_sync.config.probe_atol * len(probe)
        )
        with pytest.raises(WeightSyncError, match=rf"{server.url}: mean \|log-prob difference\|"):
            await c.verify_logprobs(probe, reference_logprobs(model, probe))  # the old weights do not
        assert c.last_logprob_probe[server.url]["mean_abs"] > c.weight_sync.config.probe_atol  # kept when it raises
        await c.close()

    asyncio.run(main())


def test_logprob_probe_tolerance_is_relative_to_the_log_probs(server, model):
    """The tolerance never exceeds atol + rtol * mean |reference|: a reference off by 0.5% of each log-prob passes
    rtol 1% (and sets the floor: 3 x 0.5% is above the 1% bound), one off by 2% fails."""
    probe = [3, 1, 4, 1, 5, 9, 2, 6]
    exact = reference_logprobs(model, probe)

    async def main():
        c = client(server.url, mode="tensor", verify=("version", "logprobs"), probe_atol=0.0)
        await c.update_weights(model.state_dict().items(), version=1)
        near = (await c.verify_logprobs(probe, [v * 1.005 for v in exact]))[server.url]
        scale = sum(abs(v) for v in exact) * 1.005 / len(exact)
        assert near["mean_abs_reference"] == pytest.approx(scale)
        assert near["tolerance"] == pytest.approx(0.01 * scale)
        assert 0.003 * scale < near["mean_abs"] < near["tolerance"]
        with pytest.raises(
            WeightSyncError, match=r"> tolerance [0-9.e-]+ .*at most atol 0 \+ rtol 0.01 \* mean \|trainer"
        ):
            await c.verify_logprobs(probe, [v * 1.02 for v in exact])
        await c.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="probe_atol and probe_rtol must be >= 0"):
        client(server.url, probe_rtol=-1.0)


def _lora_policy():
    from peft import LoraConfig, get_peft_model

    base = make_model(0)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return peft_model


@pytest.mark.parametrize("sync_mode", ["disk", "tensor"])
def test_lora_adapter_sync(make_server, sync_mode, tmp_path):
    server = make_server(enable_lora=True)
    policy = _lora_policy()
    adapter = export_lora_adapter(policy)
    merged = make_model(0)
    with torch.no_grad():
        policy.merge_adapter()
        merged.load_state_dict(
            {
                k.removeprefix("base_model.model.").replace(".base_layer", ""): v
                for k, v in policy.state_dict().items()
                if "lora_" not in k
            }
        )
        policy.unmerge_adapter()
    prompt = [7, 7, 1]
    full = sum(t.numel() * t.element_size() for t in merged.state_dict().values())
    assert adapter.nbytes < full / 5

    async def main():
        c = client(server.url, mode=sync_mode, weight_dir=str(tmp_path))
        await c.update_lora_adapter(adapter, version=1)
        first = await c.generate(prompt, GREEDY)
        await c.update_lora_adapter(adapter, version=2)  # a new name; the old adapter is unloaded
        second = await c.generate(prompt, GREEDY)
        await c.close()
        return first, second

    first, second = asyncio.run(main())
    assert first.output_ids == greedy_reference(merged, prompt) == second.output_ids
    assert first.weight_version == 1 and second.weight_version == 2
    assert server.last_generate_payload["lora_path"] == "policy-v2" and list(server._adapters) == ["policy-v2"]
    assert server.request_counts.get("/update_weights_from_disk", 0) == 0


def test_lora_sync_needs_enable_lora(server):
    async def main():
        c = client(server.url, mode="tensor")
        with pytest.raises(WeightSyncError, match="--enable-lora"):
            await c.update_lora_adapter(export_lora_adapter(_lora_policy()), version=1)
        await c.close()

    asyncio.run(main())
    assert server.request_counts["/continue_generation"] == 1


# ---------------------------------------------------------------------------------------------- SGLang's schemas


def test_fake_server_has_only_sglang_routes(sglang_schemas):
    if not sglang_schemas:
        pytest.skip("sglang wheels not available (offline)")
    for version, schema in sglang_schemas.items():
        fake = FakeSGLangServer.__new__(FakeSGLangServer)
        fake.version = version
        missing = [f"{m} {p}" for m, p in FakeSGLangServer.routes(fake) if not schema.has_route(m, p)]
        assert not missing, f"sglang {version} lacks {missing}"


def test_client_requests_match_sglang_schemas(sglang_schemas, make_server, model, tmp_path):
    """Every body the client sends in every mode is valid for SGLang's own request classes (both versions)."""
    if set(sglang_schemas) != set(SGLANG_VERSIONS):
        pytest.skip("sglang wheels not available (offline)")
    for version in SGLANG_VERSIONS:
        probe = [1, 2, 3, 4]
        used = []

        async def main():
            for mode in ("disk", "tensor"):
                servers = [make_server(version, enable_lora=True) for _ in range(2)]
                used.extend(servers)
                c = client(
                    [s.url for s in servers],
                    mode=mode,
                    weight_dir=str(tmp_path / version / mode),
                    verify=("version", "checksum", "logprobs"),
                    api_key="k",
                )
                await c.generate([1, 2], SamplingParams(max_new_tokens=3, min_p=0.1, repetition_penalty=1.1))
                target = make_model(0)
                target.load_state_dict(perturbed_state(model, seed=len(mode)))
                await c.update_weights(target.state_dict().items(), version=1)
                await c.verify_logprobs(probe, reference_logprobs(target, probe))
                await c.update_lora_adapter(export_lora_adapter(_lora_policy()), version=2)
                await c.generate([1, 2], GREEDY)
                await c.flush_cache()
                await c.close()

        asyncio.run(main())
        assert sum(s.request_counts["/generate"] for s in used) == 8  # 2 generate + 2 probes, twice
        for s in used:
            assert not s.schema_violations, s.schema_violations


@pytest.mark.multiprocess
def test_weight_sync_distributed_gloo(model, tmp_path):
    """The trainer broadcasts flattened buckets from rank 0 of a fresh gloo group to a server in another
    process, inside a begin/end session."""
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    port = free_port()
    repo_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("fake_sglang_server.py")),
            "--model-path",
            str(model_dir),
            "--port",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    new_state = perturbed_state(model, seed=2)
    target = make_model(0)
    target.load_state_dict(new_state)
    prompt = [11, 12, 13]

    async def main():
        c = client(
            f"http://127.0.0.1:{port}",
            mode="distributed",
            dist_backend="gloo",
            bucket_bytes=100_000,
            ready_timeout_s=120,
        )
        before = await c.generate(prompt, GREEDY)
        await c.update_weights(new_state.items(), version=3)
        after = await c.generate(prompt, GREEDY)
        await c.update_weights(model.state_dict().items(), version=4)  # the group is reused
        back = await c.generate(prompt, GREEDY)
        counts = httpx.get(f"http://127.0.0.1:{port}/server_info").json()
        await c.close()
        return before, after, back, counts

    try:
        before, after, back, info = asyncio.run(asyncio.wait_for(main(), timeout=180))
    except BaseException:
        print((tmp_path / "server.log").read_text()[-3000:])  # the server's side of the story
        raise
    finally:
        stop_process(proc)
        log.close()
    assert info["version"] == "0.5.23"  # so the session was required
    assert before.weight_version is None  # SGLang's "default" before any sync
    assert after.output_ids == greedy_reference(target, prompt) != before.output_ids
    assert after.weight_version == 3 and back.weight_version == 4
    assert back.output_ids == before.output_ids


# ---------------------------------------------------------------------------------------------- the trainer


def _tiny_policy() -> GptOssForCausalLM:
    torch.manual_seed(0)
    config = tiny_gptoss_config(num_hidden_layers=2, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    return GptOssForCausalLM(config)


def _trainer_kwargs(tmp_path, model, urls, **overrides):
    from datasets import Dataset

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from trl_ext import AgenticGRPOConfig

    args = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_turns=1,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        rollout_concurrency=4,
        disable_tqdm=True,
        rollout_backend="sglang",
        sglang_urls=urls,
        sglang_ready_timeout_s=30,
    )
    args.update(overrides)
    rows = [{"prompt": [{"role": "user", "content": f"Say hi ({i})"}]} for i in range(4)]
    return dict(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=AgenticGRPOConfig(**args),
        train_dataset=Dataset.from_list(rows),
        processing_class=load_gptoss_tokenizer(),
    )


def _serve(model, schemas, **kwargs) -> FakeSGLangServer:
    import copy

    schema = schemas.get("0.5.23")
    engine = EmbeddedEngine(copy.deepcopy(model).float().eval(), seed=0)
    return FakeSGLangServer(engine, validator=schema.validate if schema else None, **kwargs).start()


def test_trainer_fails_at_start_when_no_server_answers(tmp_path):
    from trl_ext import AgenticGRPOTrainer

    dead = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match=f"{dead}: ConnectError"):
        AgenticGRPOTrainer(**_trainer_kwargs(tmp_path, _tiny_policy(), [dead], sglang_ready_timeout_s=0.5))
    assert time.monotonic() - start < 30


def test_trainer_syncs_the_lora_adapter_and_verifies_it(tmp_path, sglang_schemas):
    """LoRA: only the adapter travels (lora_path per request); the probe checks the served log-probs."""
    from peft import LoraConfig

    from trl_ext import AgenticGRPOTrainer

    model = _tiny_policy()
    servers = [_serve(model, sglang_schemas, enable_lora=True) for _ in range(2)]
    kwargs = _trainer_kwargs(
        tmp_path,
        model,
        [s.url for s in servers],
        weight_sync_lora=True,
        weight_sync_mode="tensor",
        weight_sync_verify=["version", "logprobs"],
        weight_sync_probe_atol=1e-3,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    try:
        trainer = AgenticGRPOTrainer(**kwargs, peft_config=lora)
        trainer.train()
        assert trainer.rollout_engine.weight_version == 1
        for srv in servers:
            assert list(srv._adapters) == ["policy-v1"] and srv.served_version == "1"
            assert srv.request_counts["/load_lora_adapter_from_tensors"] == 1
            assert srv.request_counts.get("/update_weights_from_tensor", 0) == 0
            probes = [b for _, p, b in srv.requests if p == "/generate" and b.get("logprob_start_len") == 0]
            assert len(probes) == 1 and probes[0]["lora_path"] == "policy-v1"
            assert not srv.schema_violations, srv.schema_violations
        merged = trainer.model.merge_and_unload().state_dict()
        served = servers[0].engine.model.state_dict()
        for name, tensor in merged.items():
            torch.testing.assert_close(served[name], tensor, rtol=1e-5, atol=1e-6)
    finally:
        for srv in servers:
            srv.stop()
            srv.engine.shutdown()


@pytest.mark.parametrize(
    "server, match",
    [
        (dict(enable_lora=False), "launched without --enable-lora"),
        (dict(enable_lora=True, max_lora_rank=2), "--max-lora-rank 2, below the adapter's rank 4"),
        (dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["o_proj"]), "without qkv_proj"),
        (dict(enable_lora=True, max_lora_rank=4, lora_target_modules=["qkv_proj", "o_proj"]), None),
        (dict(enable_lora=True, max_lora_rank=64, lora_target_modules=["all"]), None),
    ],
)
def test_trainer_checks_the_servers_lora_flags_at_start(tmp_path, sglang_schemas, server, match):
    """weight_sync_lora: a server launched without room for the adapter is named at construction, not at step 1."""
    from peft import LoraConfig

    from trl_ext import AgenticGRPOTrainer

    model = _tiny_policy()
    srv = _serve(model, sglang_schemas, **server)
    kwargs = _trainer_kwargs(tmp_path, model, [srv.url], weight_sync_lora=True, weight_sync_mode="tensor")
    # PEFT's names: SGLang fuses q/k/v into qkv_proj, so a server listing qkv_proj covers them
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    try:
        if match is None:
            AgenticGRPOTrainer(**kwargs, peft_config=lora)
        else:
            with pytest.raises(WeightSyncError, match=rf"{srv.url} (was|has) .*{match}"):
                AgenticGRPOTrainer(**kwargs, peft_config=lora)
        assert srv.request_counts.get("/load_lora_adapter_from_tensors", 0) == 0
    finally:
        srv.stop()
        srv.engine.shutdown()


def test_trainer_step_fails_loudly_when_a_server_refuses_the_sync(tmp_path, sglang_schemas):
    from trl_ext import AgenticGRPOTrainer

    model = _tiny_policy()
    srv = _serve(model, sglang_schemas)
    srv.inject(Fault("refuse", path="/update_weights_from_disk"))
    try:
        trainer = AgenticGRPOTrainer(**_trainer_kwargs(tmp_path, model, [srv.url]))
        with pytest.raises(WeightSyncError, match=rf"{srv.url}: .*injected refusal"):
            trainer.train()
        # one pause, continued after the refusal (and once at start-up: a server a killed client left paused)
        assert srv.request_counts["/pause_generation"] == 1 and srv.request_counts["/continue_generation"] == 2
        assert not srv.schema_violations, srv.schema_violations
    finally:
        srv.stop()
        srv.engine.shutdown()


def test_sglang_config_fields_are_validated(tmp_path):
    from trl_ext import AgenticGRPOConfig

    def config(**kw):
        return AgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kw)

    sglang = dict(rollout_backend="sglang", sglang_urls="http://a:1")
    args = config(**sglang, weight_sync_verify="checksum,logprobs", weight_sync_pause_mode="in_place")
    assert args.weight_sync_verify == ["version", "checksum", "logprobs"]  # "version" is always on
    assert args.sglang_retry_deadline_s >= 60 and args.weight_sync_master_address == "127.0.0.1"
    for bad, match in [
        (dict(weight_sync_verify=["nope"]), "weight_sync_verify"),
        (dict(weight_sync_pause_mode="later"), "weight_sync_pause_mode"),
        (dict(weight_sync_lora=True, weight_sync_mode="distributed"), "not over NCCL"),
        (dict(sglang_timeout_s=0), "sglang_timeout_s"),
        (dict(sglang_retry_deadline_s=-1), "sglang_retry_deadline_s"),
    ]:
        with pytest.raises(ValueError, match=match):
            config(**sglang, **bad)
    with pytest.raises(ValueError, match="apply to rollout_backend='sglang'"):
        config(weight_sync_lora=True)  # the embedded engine would silently ignore it


# ------------------------------------------------------------------ distributed sync: a server dies mid-broadcast
# A crashed SGLang process takes its end of the weight-update group with it: the trainer's collective fails (gloo:
# "Connection closed by peer"; NCCL: an error or a hang until the group's timeout), and a restarted server holds no
# group at all. The fake server runs in its own process and SIGKILLs itself on the N-th request to a path.

DIST_BUCKET_BYTES = 100_000


@pytest.fixture
def spawn_server(model, tmp_path):
    """``spawn(port, *args)``: the fake server in its own process, returned once it serves (its log: server.log);
    ``spawn((port, *args), (port, *args), ...)`` starts several at once and returns their processes."""
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    repo_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / "server.log", "a")
    procs = []

    def start(port: int, *args: str) -> subprocess.Popen:
        script = str(Path(__file__).with_name("fake_sglang_server.py"))
        proc = subprocess.Popen(
            [sys.executable, script, "--model-path", str(model_dir), "--port", str(port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        procs.append(proc)
        return proc

    def serving(proc: subprocess.Popen) -> None:
        first_line = []
        reader = threading.Thread(target=lambda: first_line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=90)  # the server prints "serving ..." once it listens
        if not (first_line and first_line[0].startswith("serving")):
            raise AssertionError(f"fake server did not start: {first_line}; {(tmp_path / 'server.log').read_text()}")

    def spawn(*specs):
        if specs and isinstance(specs[0], int):
            specs = (specs,)
        started = [start(*spec) for spec in specs]
        for proc in started:
            serving(proc)
        return started[0] if len(started) == 1 else started

    yield spawn
    for proc in procs:
        stop_process(proc)
        proc.stdout.close()
    log.close()


def _dist_client(ports: list[int], **kwargs) -> SGLangEngine:
    kwargs.setdefault("dist_timeout_s", 10.0)
    return client(
        [f"http://127.0.0.1:{p}" for p in ports],
        mode="distributed",
        dist_backend="gloo",
        bucket_bytes=DIST_BUCKET_BYTES,
        **kwargs,
    )


def _n_buckets(state: dict) -> int:
    return len(plan_buckets(list(state.items()), DIST_BUCKET_BYTES))


def test_distributed_sync_names_a_server_that_dies_mid_broadcast_and_stays_down(model, spawn_server):
    """Of two servers, one dies when the second bucket's request arrives and is not restarted: the sync waits
    ``retry_deadline_s`` for it to answer again (not ``dist_timeout_s``), then fails with `ServerLostError` naming
    that server, the bucket and the cause; generation is refused afterwards, on the surviving server too (the
    servers may hold different weights)."""
    new_state = perturbed_state(model, seed=2)
    assert _n_buckets(new_state) >= 3  # the death is in the middle of the sync
    ports = [free_port(), free_port()]
    survivor, dying = spawn_server((ports[0],), (ports[1], "--die-on", "/update_weights_from_distributed:2"))
    urls = [f"http://127.0.0.1:{p}" for p in ports]

    async def main():
        c = _dist_client(ports, retry_deadline_s=2.0, dist_timeout_s=30.0)
        try:
            await c.wait_until_ready()
            started = time.perf_counter()
            with pytest.raises(ServerLostError) as failed:
                await c.update_weights(new_state.items(), version=1)
            elapsed = time.perf_counter() - started
            with pytest.raises(SGLangError, match="refusing to generate: .*did not answer again"):
                await c.generate([11, 12, 13], GREEDY)  # although a server is alive
            return str(failed.value), elapsed, c.weight_sync.group
        finally:
            await c.close()

    message, elapsed, group = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert dying.wait(timeout=10) == -signal.SIGKILL  # it died of the injected crash, in the sync
    assert survivor.poll() is None
    # the retry deadline (2 s) plus the answers of the failed sync; far below dist_timeout_s (30 s)
    assert 2.0 <= elapsed < 10.0, f"the failed sync took {elapsed:.1f} s"
    assert message.count("/model_info failed") == 1  # polled until the deadline, the last error named
    n = _n_buckets(new_state)
    assert f"{urls[1]} stopped answering during the weight sync to version 1" in message, message
    assert "did not answer again within retry_deadline_s=2 s" in message, message
    assert f"{urls[1]}: bucket 2/{n}: {urls[1]}/update_weights_from_distributed" in message, message
    assert "Server disconnected without sending a response" in message, message  # the cause, from the HTTP side
    assert f"servers: {urls[0]} not loaded, {urls[1]} not loaded" in message
    assert group is None  # the broken group was dropped: the next sync builds a new one


def test_distributed_sync_survives_a_server_restart_mid_broadcast(model, spawn_server):
    """One of two servers dies in the middle of the second sync and a supervisor starts it again on the same URL
    (launch weights, no group): the same sync waits for it, destroys the old group (trainer and survivor), joins a
    new one on the fixed master port, sends every bucket again and verifies; both servers then serve the trainer's
    weights. A third sync goes through the new group."""
    state_1, state_2 = perturbed_state(model, seed=2), perturbed_state(model, seed=3)
    target = make_model(0)
    target.load_state_dict(perturbed_state(model, seed=4))
    prompt, probe = [11, 12, 13], [5, 17, 29, 41, 53, 65, 77]
    ports = [free_port(), free_port()]
    die_at = _n_buckets(state_1) + 2  # the second bucket of the second sync
    _, dying = spawn_server((ports[0],), (ports[1], "--die-on", f"/update_weights_from_distributed:{die_at}"))
    restarted = []

    def supervisor():  # what a process supervisor does: start the server again once it died
        if dying.wait(timeout=60) == -signal.SIGKILL:
            restarted.append(spawn_server(ports[1]))

    threading.Thread(target=supervisor, daemon=True).start()

    async def main():
        from torch.distributed.distributed_c10d import _world

        c = _dist_client(ports, dist_master_port=free_port(), retry_deadline_s=60.0)
        try:
            await c.update_weights(state_1.items(), version=1)
            old_group = weakref.ref(c.weight_sync.group)  # no strong reference: the engine must free it
            lost_before = c.lost_connections[f"http://127.0.0.1:{ports[1]}"]
            await c.update_weights(state_2.items(), version=2)  # the server dies and comes back inside this sync
            assert restarted and c.lost_connections[f"http://127.0.0.1:{ports[1]}"] > lost_before
            assert old_group() is None  # destroyed and freed (its store too: the fixed master port was reused)
            assert c.weight_sync.group in _world.pg_map
            await c.update_weights(target.state_dict().items(), version=3)
            outs = [await c.generate(prompt, GREEDY) for _ in ports]  # round robin: one on each server
            await c.verify_logprobs(probe, reference_logprobs(target, probe))  # on every server
            with pytest.raises(WeightSyncError, match="log-prob"):  # the probe does tell the weights apart
                await c.verify_logprobs(probe, reference_logprobs(model, probe))
            return outs, c.weight_version
        finally:
            await c.close()

    outs, version = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert version == 3 and [o.weight_version for o in outs] == [3, 3]
    expected = greedy_reference(target, prompt)
    assert [o.output_ids for o in outs] == [expected, expected] and expected != greedy_reference(model, prompt)


def test_start_up_continues_a_server_left_paused_by_a_killed_client(server, model):
    """A client killed between a sync's ``/pause_generation`` and ``/continue_generation`` leaves the server holding
    every request: the next client's start-up check continues it, so its first request is answered."""
    httpx.post(server.url + "/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()

    async def main():
        c = client(server.url, timeout_s=3.0, retry_deadline_s=0.0)
        try:
            await asyncio.to_thread(c.check_servers)
            return await c.generate([1, 2, 3], GREEDY)
        finally:
            await c.close()

    out = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert out.output_ids == greedy_reference(model, [1, 2, 3])


def test_a_server_refusing_to_join_the_group_fails_the_sync_at_once(make_server, model):
    """A server that answers ``/init_weights_update_group`` with an error never joins the group: the sync fails at
    once, naming it, instead of this process waiting ``dist_timeout_s`` for it on its side of the group."""
    bad = make_server()
    bad.inject(Fault("status", status=400, path="/init_weights_update_group"))

    async def main():
        c = client(bad.url, mode="distributed", dist_backend="gloo", dist_timeout_s=20.0)
        try:
            started = time.perf_counter()
            with pytest.raises(WeightSyncError) as failed:
                await c.update_weights(model.state_dict().items(), version=1)
            return str(failed.value), time.perf_counter() - started
        finally:
            await c.close()

    message, elapsed = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert elapsed < 5.0, f"the sync waited {elapsed:.1f} s for a server that had refused"
    assert f"init_weights_update_group failed: {bad.url}: {bad.url}/init_weights_update_group" in message, message
    assert "HTTP 400" in message, message


def test_distributed_sync_under_torchrun_hosts_the_rendezvous_store(model, spawn_server, monkeypatch):
    """torchrun (and so ``accelerate launch``) sets TORCHELASTIC_USE_AGENT_STORE=True in its workers, which turns
    torch's ``tcp://`` rendezvous into a client on every rank: the trainer (rank 0) must still host the store of
    the weight-update group, or nobody does and the group times out."""
    port = free_port()
    spawn_server(port)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the trainer's process only
    target = make_model(0)
    target.load_state_dict(perturbed_state(model, seed=2))
    prompt = [11, 12, 13]

    async def main():
        c = _dist_client([port])
        try:
            await c.update_weights(target.state_dict().items(), version=1)
            return await c.generate(prompt, GREEDY)
        finally:
            await c.close()

    out = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert out.weight_version == 1 and out.output_ids == greedy_reference(target, prompt)


def test_weight_update_group_refuses_a_port_an_earlier_group_still_holds():
    """A second group on the port of a live one fails at once, instead of sharing the old group's rendezvous store
    (torch's multi-tenant store would hand it the old group's peer addresses)."""
    from datetime import timedelta

    from trl_ext.weight_sync.transport import destroy_weight_update_group, init_weight_update_group

    kwargs = dict(backend="gloo", master_address="127.0.0.1", master_port=free_port(), world_size=1, rank=0)
    first = init_weight_update_group(group_name="first", timeout=timedelta(seconds=5), **kwargs)
    try:
        started = time.perf_counter()
        with pytest.raises(Exception, match="(?i)address already in use"):
            init_weight_update_group(group_name="second", timeout=timedelta(seconds=5), **kwargs)
        assert time.perf_counter() - started < 5
    finally:
        destroy_weight_update_group(first)
