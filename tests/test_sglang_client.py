"""SGLangEngine against a real local HTTP server speaking SGLang's native API (backed by the embedded engine).

Faults are injected by the server: 5xx, slow answers (client timeouts), dropped connections, a server that
starts late, ``abort`` finish reasons, log-prob/ids length mismatches. Weight sync is checked end to end:
after ``update_weights`` the served greedy outputs equal those of a model holding the new weights.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from transformers import GptOssForCausalLM

from hf_gptoss_rl.testing import tiny_gptoss_config
from trl_ext.rollout import EmbeddedEngine, SamplingParams, SGLangEngine, SGLangError
from trl_ext.rollout.distributed import free_port
from trl_ext.rollout.protocol_server import Fault, SGLangProtocolServer

VOCAB = 128
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(200 % VOCAB,))


def make_model(seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    return GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB)).float().eval()


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture
def server(model):
    engine = EmbeddedEngine(make_model(0), seed=0)
    srv = SGLangProtocolServer(engine).start()
    yield srv
    srv.stop()
    engine.shutdown()


def client(url, **kwargs) -> SGLangEngine:
    kwargs.setdefault("backoff_s", 0.01)
    kwargs.setdefault("timeout_s", 60.0)
    kwargs.setdefault("ready_timeout_s", 30.0)
    return SGLangEngine(url, **kwargs)


def greedy_reference(model, prompt, n=GREEDY.max_new_tokens):
    engine = EmbeddedEngine(model)
    out = engine.submit(prompt, GREEDY).result(timeout=60)
    engine.shutdown()
    return out.output_ids


def perturbed_state(model, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def test_generate_speaks_the_native_api(server, model):
    async def main():
        engine = client(server.url)
        outs = await asyncio.gather(*(engine.generate([1, 2, 3 + i], GREEDY) for i in range(6)))
        await engine.close()
        return outs

    outs = asyncio.run(main())
    payload = server.last_generate_payload
    assert payload["return_logprob"] is True and payload["logprob_start_len"] == -1
    assert payload["sampling_params"] == {
        "max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [200 % VOCAB],
        "skip_special_tokens": False, "no_stop_trim": True,
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


def test_server_rejects_what_sglang_rejects(server):
    r = httpx.post(server.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 400 and "unknown keys" in r.text
    r = httpx.post(server.url + "/generate", json={"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}})
    assert r.status_code == 400 and "not supported" in r.text

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
        Fault("delay", delay_s=5.0),  # longer than the client timeout
    )

    async def main():
        engine = client(server.url, timeout_s=2.0, max_retries=5)
        out = await engine.generate([4, 5, 6], GREEDY)
        stats = dict(engine.stats)
        await engine.close()
        return out, stats

    out, stats = asyncio.run(main())
    assert out.output_ids == greedy_reference(model, [4, 5, 6])
    assert stats["retries"] == 4 and not server.faults


def test_gives_up_after_max_retries(server):
    server.inject(*[Fault("status", status=500)] * 3)

    async def main():
        engine = client(server.url, max_retries=2)
        try:
            with pytest.raises(SGLangError, match="after 3 attempts.*HTTP 500"):
                await engine.generate([1], GREEDY)
        finally:
            await engine.close()

    asyncio.run(main())


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


def test_refused_then_recovered_and_readiness_deadline(model):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = EmbeddedEngine(make_model(0))
    srv = SGLangProtocolServer(engine, port=port)
    timer = threading.Timer(0.8, srv.start)  # connections are refused until then

    async def main():
        c = client(url)
        timer.start()
        out = await c.generate([1, 2, 3], GREEDY)
        await c.close()
        late = client(f"http://127.0.0.1:{free_port()}", ready_timeout_s=0.3)
        with pytest.raises(TimeoutError, match="not ready"):
            await late.generate([1], GREEDY)
        assert not await late.health()
        await late.close()
        return out

    try:
        out = asyncio.run(main())
    finally:
        timer.join()
        srv.stop()
        engine.shutdown()
    assert out.output_ids == greedy_reference(model, [1, 2, 3])
    assert srv.request_counts.get("/health", 0) >= 1


def test_connection_lost_mid_run_is_retried(model):
    engine = EmbeddedEngine(make_model(0))
    srv = SGLangProtocolServer(engine).start()
    port = srv.port

    async def main():
        c = client(srv.url, backoff_s=0.3, max_retries=5)
        first = await c.generate([1, 2], GREEDY)
        srv.stop()  # the server goes away ...
        restart = threading.Timer(0.4, lambda: SGLangProtocolServer.start(srv))  # ... and comes back on its port
        srv.port = port
        restart.start()
        second = await c.generate([1, 2], GREEDY)
        restart.join()
        await c.close()
        return first, second, dict(c.stats)

    try:
        first, second, stats = asyncio.run(main())
    finally:
        srv.stop()
        engine.shutdown()
    assert first.output_ids == second.output_ids and stats["retries"] >= 1


def test_load_balancing_over_servers(model):
    engines = [EmbeddedEngine(make_model(0)) for _ in range(2)]
    servers = [SGLangProtocolServer(e).start() for e in engines]

    async def main():
        c = client([s.url for s in servers], max_concurrency=4)
        outs = await asyncio.gather(*(c.generate([1, 2, i], GREEDY) for i in range(12)))
        await c.close()
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        for s, e in zip(servers, engines):
            s.stop()
            e.shutdown()
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


@pytest.mark.parametrize("sync_mode", ["disk", "tensor"])
def test_weight_sync_changes_outputs(server, model, sync_mode, tmp_path):
    new_state = perturbed_state(model)
    target = make_model(0)
    target.load_state_dict(new_state)
    prompt = [9, 8, 7]

    async def main():
        c = client(server.url, sync_mode=sync_mode, weight_dir=str(tmp_path / "w"), model_config=model.config,
                   max_shard_size=200_000)
        before = await c.generate(prompt, GREEDY)
        await c.update_weights(new_state.items(), version=5)
        after = await c.generate(prompt, GREEDY)
        await c.close()
        return before, after, c.weight_version

    before, after, version = asyncio.run(main())
    assert before.output_ids == greedy_reference(model, prompt)
    assert after.output_ids == greedy_reference(target, prompt) != before.output_ids
    assert after.weight_version == 5 == version
    assert server.request_counts["/pause_generation"] == 1 == server.request_counts["/continue_generation"]
    if sync_mode == "disk":
        files = os.listdir(tmp_path / "w")
        assert "config.json" in files and "model.safetensors.index.json" in files  # sharded at 200 kB


def test_sync_with_pause_mode_abort_aborts_running_requests(server, model):
    async def main():
        c = client(server.url, sync_mode="tensor", pause_mode="abort")
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


def test_weight_sync_rejects_unknown_names(server):
    async def main():
        c = client(server.url, sync_mode="tensor")
        with pytest.raises(SGLangError, match="unknown parameter"):
            await c.update_weights([("nope", torch.zeros(2))], version=1)
        await c.close()

    asyncio.run(main())
    assert server.request_counts["/continue_generation"] == 1  # never left paused


@pytest.mark.multiprocess
def test_weight_sync_distributed_gloo(model, tmp_path):
    """The trainer broadcasts from rank 0 of a fresh gloo group to a server in another process."""
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    port = free_port()
    repo_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trl_ext.rollout.protocol_server", "--model-path", str(model_dir), "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    new_state = perturbed_state(model, seed=2)
    target = make_model(0)
    target.load_state_dict(new_state)
    prompt = [11, 12, 13]

    async def main():
        c = client(f"http://127.0.0.1:{port}", sync_mode="distributed", dist_backend="gloo", bucket_bytes=100_000,
                   ready_timeout_s=120)
        before = await c.generate(prompt, GREEDY)
        await c.update_weights(new_state.items(), version=3)
        after = await c.generate(prompt, GREEDY)
        await c.update_weights(model.state_dict().items(), version=4)  # the group is reused
        back = await c.generate(prompt, GREEDY)
        await c.close()
        return before, after, back

    try:
        before, after, back = asyncio.run(asyncio.wait_for(main(), timeout=180))
    except BaseException:
        print((tmp_path / "server.log").read_text()[-3000:])  # the server's side of the story
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert before.weight_version is None  # SGLang's "default" before any sync
    assert after.output_ids == greedy_reference(target, prompt) != before.output_ids
    assert after.weight_version == 3 and back.weight_version == 4
    assert back.output_ids == before.output_ids
