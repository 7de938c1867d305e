"""Rollout routing replay (hf_gptoss_rl.routing and its trainer / engine plumbing) on a tiny GPT-OSS, CPU.

Each check has its positive control: replayed indices that differ from the trainer's own change the output, a
zero or missing record is refused, a rotated engine record drops the agreement metric.
"""

from __future__ import annotations

import asyncio
import base64

import pytest
import torch
from transformers import GptOssForCausalLM

from hf_gptoss_rl.model_builders import tiny_gptoss_config
from hf_gptoss_rl.routing import (
    RoutingError,
    RoutingRecorder,
    RoutingReplay,
    check_routing,
    no_route,
    routing_shape,
)
from trl_ext.rollout import EmbeddedEngine, GenerationOutput, SamplingParams, run_sync

VOCAB = 97


def tiny(seed: int = 0, **overrides) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    config = tiny_gptoss_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, head_dim=8, **overrides)
    config._attn_implementation = "eager"
    return GptOssForCausalLM(config).eval()


def native_routing(model, ids, **kw) -> torch.Tensor:
    """`[B, T, layers, top_k]` the model's own routing of `ids`."""
    recorder = RoutingRecorder(model)
    try:
        with recorder.capture() as step, torch.no_grad():
            model(input_ids=ids, **kw)
        return step.routing().reshape(*ids.shape, *step.routing().shape[1:])
    finally:
        recorder.remove()


def rotated(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Another top-k for every token (ids + 1 mod E: still distinct, never the same set for k < E)."""
    return ((routing.long() + 1) % num_experts).to(routing.dtype)


class ExpertsSpy:
    """The expert indices every experts call receives, per layer (`routers=True`: every router call returns, after
    the replay hook, registered before it)."""

    def __init__(self, model, routers: bool = False):
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.handles = [
            (layer.mlp.router if routers else layer.mlp.experts).register_forward_hook(self._hook(i, routers))
            for i, layer in enumerate(model.model.layers)
        ]

    def _hook(self, layer, routers):
        def hook(module, args, output):
            self.calls.append((layer, (output[2] if routers else args[1]).detach().clone()))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def test_replay_uses_the_recorded_experts_and_the_router_learns():
    model = tiny()
    layers, top_k, experts = routing_shape(model)
    ids = torch.randint(0, VOCAB, (2, 12))
    own = native_routing(model, ids)
    forced = rotated(own, experts)
    replay = RoutingReplay(model)
    spy = ExpertsSpy(model)

    with torch.no_grad():
        baseline = model(input_ids=ids).logits
        replay.set_plan(own, replay=True)
        same = model(input_ids=ids).logits
    # replaying the model's own routing changes nothing, bitwise (the native order is kept where the sets agree)
    assert torch.equal(same, baseline)
    assert replay.take_agreement() == (1.0, 1.0)

    spy.calls.clear()
    replay.set_plan(forced, replay=True)
    model.train()
    out = model(input_ids=ids).logits
    for layer, used in spy.calls:
        assert torch.equal(used.sort(-1).values, forced.reshape(-1, layers, top_k)[:, layer].long().sort(-1).values)
    assert not torch.allclose(out, baseline, atol=1e-4)  # the positive control: other experts, other logits
    # layer 0 sees the native hidden states, so its own choice never equals the rotated record; later layers see
    # states the replay changed, where their own choice may happen to
    agreement, lowest = replay.take_agreement()
    assert lowest == 0.0 and agreement < 0.25
    out.float().pow(2).mean().backward()
    for layer in model.model.layers:  # gates are the softmax of the router's own logits: the router gets a gradient
        assert layer.mlp.router.weight.grad is not None and layer.mlp.router.weight.grad.abs().sum() > 0
        assert layer.mlp.router.bias.grad.abs().sum() > 0

    # replay off: the same plan is only compared with
    replay.set_plan(forced, replay=False)
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, baseline)
    assert replay.take_agreement() == (0.0, 0.0)

    # tokens without a record route natively
    partial = forced.clone()
    partial[:, 6:] = no_route(partial.dtype)
    replay.set_plan(partial, replay=True)
    spy.calls.clear()
    with torch.no_grad():
        model(input_ids=ids)
    used = spy.calls[0][1].reshape(2, 12, top_k)
    assert torch.equal(used[:, 6:].sort(-1).values, own[:, 6:, 0].long().sort(-1).values)
    assert torch.equal(used[:, :6].sort(-1).values, forced[:, :6, 0].long().sort(-1).values)

    with pytest.raises(RoutingError, match="not aligned with this forward's tokens"):
        replay.set_plan(forced[:1], replay=True)
        model(input_ids=ids)
    replay.remove()
    spy.remove()


def test_checkpoint_recompute_replays_the_same_indices():
    model = tiny()
    ids = torch.randint(0, VOCAB, (2, 10))
    forced = rotated(native_routing(model, ids), routing_shape(model)[2])

    def grads(checkpointing: bool):
        m = tiny()
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        replay = RoutingReplay(m)
        spy = ExpertsSpy(m, routers=True)
        replay.set_plan(forced, replay=True)
        m(input_ids=ids).logits.float().pow(2).mean().backward()
        replay.remove()
        spy.remove()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, spy.calls

    plain, plain_calls = grads(False)
    recomputed, calls = grads(True)
    assert len(calls) == 2 * len(plain_calls)  # the routers ran in the forward and in the backward's recompute
    for layer, used in calls:
        assert torch.equal(used.sort(-1).values, forced.reshape(-1, *forced.shape[2:])[:, layer].long().sort(-1).values)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7)


def test_memory_efficient_experts_replay_like_eager():
    import hf_gptoss_rl  # noqa: F401  (registers memory_efficient)

    ids = torch.randint(0, VOCAB, (2, 9))
    reference = tiny()
    forced = rotated(native_routing(reference, ids), routing_shape(reference)[2])
    outs = []
    for implementation in ("eager", "memory_efficient"):
        m = tiny()
        m.set_experts_implementation(implementation)
        replay = RoutingReplay(m)
        replay.set_plan(forced, replay=True)
        with torch.no_grad():
            outs.append(m(input_ids=ids).logits)
        replay.remove()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_packed_rows_keep_token_routing_alignment():
    from hf_gptoss_rl.logprobs import add_chunked_logprob_head
    from hf_gptoss_rl.packing import packed_completion_logprobs

    model = tiny()
    add_chunked_logprob_head(model)  # the head the trainer's packed pass uses
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, 8:] = 0  # right padding
    forced = rotated(native_routing(model, ids, attention_mask=mask), routing_shape(model)[2])
    replay = RoutingReplay(model)
    with torch.no_grad():
        replay.set_plan(forced, replay=True)
        padded = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        padded = padded.gather(-1, ids[:, 1:, None]).squeeze(-1)[:, -6:] * mask[:, -6:]
        replay.set_plan(forced[mask.bool()], replay=True)  # the tokens in `pack_rows` order
        packed, _, _ = packed_completion_logprobs(model, ids, mask, 6)
        replay.set_plan(forced[mask.bool()].flip(0), replay=True)  # misaligned: the positive control
        wrong, _, _ = packed_completion_logprobs(model, ids, mask, 6)
    torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(wrong, padded, atol=1e-3)
    replay.remove()


def test_sequence_parallel_shards_routing_with_its_tokens(monkeypatch):
    import hf_gptoss_rl.sequence_parallel as sp

    ids = torch.arange(2 * 7).reshape(2, 7)
    routing = torch.stack([ids, ids + 100], dim=-1).unsqueeze(2).to(torch.int16)  # [2, 7, 1, 2]: the token's id
    monkeypatch.setattr(sp, "get_sequence_parallel_group", lambda group: group)  # two ranks, without a group
    monkeypatch.setattr(sp, "_group_size", lambda group: 2)
    shards = []
    for rank in range(2):
        monkeypatch.setattr(sp, "_group_rank", lambda group, r=rank: r)
        shards.append(sp.shard_inputs({"input_ids": ids, "routed_experts": routing}, group=object()))
    for shard in shards:
        real = shard["input_ids"] != 0
        real[0, 0] = True  # token id 0 is a real token here
        assert torch.equal(shard["routed_experts"][..., 0, 0][real].long(), shard["input_ids"][real])
    assert (shards[1]["routed_experts"][:, -1] == no_route(torch.int16)).all()  # the padding has no record


def test_check_routing_refuses_what_is_not_a_top_k():
    good = torch.tensor([[[0, 3], [1, 2]]], dtype=torch.uint8)
    check_routing(good, num_layers=2, top_k=2, num_experts=4, source="t")
    with pytest.raises(RoutingError, match="repeat an expert"):
        check_routing(torch.zeros_like(good), num_layers=2, top_k=2, num_experts=4, source="t")
    with pytest.raises(RoutingError, match="outside \\[0, 4\\)"):
        check_routing(good + 3, num_layers=2, top_k=2, num_experts=4, source="t")
    with pytest.raises(RoutingError, match="expected \\(1, 3, 2\\)"):
        check_routing(good, num_layers=3, top_k=2, num_experts=4, source="t")


def test_embedded_engine_records_the_routing_of_every_token_it_read():
    model = tiny()
    engine = EmbeddedEngine(model, seed=0, record_routing=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]

    async def go():
        sampling = SamplingParams(max_new_tokens=6, stop_token_ids=())
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

    try:
        outs = run_sync(go())
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outs):
        seq = torch.tensor([prompt + out.output_ids])
        assert out.routed_experts.shape == (len(prompt) + len(out.output_ids) - 1, 2, 2)
        assert out.routed_experts.dtype == torch.uint8
        # the same experts as a forward over the whole sequence (fp32 CPU: the cache changes no choice here)
        full = native_routing(model, seq)[0, :-1]
        assert torch.equal(out.routed_experts.sort(-1).values, full.sort(-1).values)


def test_rollout_routing_plan_aligns_the_records_with_the_scoring_batch():
    """`trl_ext.mismatch.rollout_routing_plan` lays the engine's records out for the forward of
    `rollout_scoring_batch`'s right-padded rows (the prompts of unequal length): every recorded token meets the
    experts the fp32 policy chooses for it there; the same plan one position later (the positive control) does not."""
    from trl_ext.mismatch import completion_logprobs, rollout_routing_plan, rollout_scoring_batch

    model = tiny()
    engine = EmbeddedEngine(model, seed=0, record_routing=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    try:
        outs = run_sync(engine.generate_batch(prompts, SamplingParams(max_new_tokens=6, stop_token_ids=())))
    finally:
        engine.shutdown()
    ids, mask, rollout_logps, _ = rollout_scoring_batch(prompts, outs, pad_id=0)
    plan = rollout_routing_plan(outs, ids.shape[1], routing_shape(model))
    assert plan.shape == (2, ids.shape[1], 2, 2) and plan.dtype == torch.uint8
    recorded = (plan != no_route(plan.dtype)).all(-1).all(-1)
    assert recorded.sum(-1).tolist() == [len(p) + len(o.output_ids) - 1 for p, o in zip(prompts, outs)]
    shifted = torch.full_like(plan, no_route(plan.dtype))
    shifted[:, 1:] = plan[:, :-1]
    replay = RoutingReplay(model)
    try:
        agreement = {}
        for name, candidate in (("aligned", plan), ("shifted", shifted)):
            replay.set_plan(candidate, replay=False)
            completion_logprobs(model, ids, mask, [len(p) for p in prompts], rollout_logps.shape[1])
            agreement[name] = replay.take_agreement()[0]
    finally:
        replay.remove()
    assert agreement["aligned"] == 1.0 and agreement["shifted"] < 0.8, agreement
    with pytest.raises(ValueError, match="no routing record"):
        rollout_routing_plan([GenerationOutput([1], [0.0], "length")], 3, routing_shape(model))


def test_agent_loop_assembles_one_record_across_turns():
    """Turn k's record covers every token it read; the trajectory keeps, per token, the first turn's."""
    from trl_ext.rollout import AgentLoop
    from trl_ext.rollout.engine import RolloutEngine
    from trl_ext.rollout.types import Trajectory

    loop = AgentLoop.__new__(AgentLoop)  # only `_append_sampled` is exercised
    traj = Trajectory(prompt_ids=[1, 2, 3])
    first = GenerationOutput([4, 5], [0.0, 0.0], "stop", 0, torch.full((3 + 2 - 1, 1, 2), 1, dtype=torch.uint8))
    loop._append_sampled(traj, first)
    traj.completion_ids += [6, 7]  # a tool message
    traj.completion_mask += [0, 0]
    traj.rollout_logprobs += [0.0, 0.0]
    second = GenerationOutput([8], [0.0], "stop", 0, torch.full((7 + 1 - 1, 1, 2), 2, dtype=torch.uint8))
    loop._append_sampled(traj, second)
    assert traj.routed_experts[:, 0, 0].tolist() == [1, 1, 1, 1, 2, 2, 2]
    with pytest.raises(AssertionError, match="routing for 3 tokens, expected"):
        loop._append_sampled(traj, GenerationOutput([9], [0.0], "stop", 0, torch.zeros(3, 1, 2, dtype=torch.uint8)))
    assert issubclass(EmbeddedEngine, RolloutEngine)


# ---------------------------------------------------------------- SGLang's encoding (the fake server)


def _server(**kw):
    from fake_sglang_server import FakeSGLangServer

    return FakeSGLangServer(EmbeddedEngine(tiny(), seed=0, record_routing=True), **kw).start()


def _engine(url, **kw):
    from trl_ext.rollout import SGLangEngine

    return SGLangEngine(url, record_routing=(2, 2, 4), retry_deadline_s=0, ready_timeout_s=30, **kw)


def test_sglang_routed_experts_round_trip_and_refusals():
    server = _server(return_routed_experts=True)
    try:
        engine = _engine(server.url)
        engine.check_servers()
        out = run_sync(engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=5, stop_token_ids=())))
        body = [b for _, p, b in server.requests if p == "/generate"][-1]
        assert body["return_routed_experts"] is True
        assert out.routed_experts.shape == (4 + len(out.output_ids) - 1, 2, 2)
        full = native_routing(server.engine.model, torch.tensor([[5, 6, 7, 8, *out.output_ids]]))[0, :-1]
        assert torch.equal(out.routed_experts.sort(-1).values, full.sort(-1).values)
        encoded = base64.b64encode(out.routed_experts.to(torch.int32).numpy().tobytes()).decode()
        assert len(base64.b64decode(encoded)) == out.routed_experts.numel() * 4  # int32, SGLang's encoding

        from fake_sglang_server import Fault

        server.faults.append(Fault("zero_routing"))
        with pytest.raises(RoutingError, match="repeat an expert.*--moe-runner-backend triton"):
            run_sync(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=3, stop_token_ids=())))
        run_sync(engine.close())
    finally:
        server.stop()

    server = _server(return_routed_experts=False)  # the flag off: the key is absent, and nothing else says so
    try:
        from trl_ext.rollout import SGLangEngine

        plain = SGLangEngine(server.url, retry_deadline_s=0, ready_timeout_s=30)
        plain.record_routing = (2, 2, 4)  # asked without the start-up check
        with pytest.raises(RoutingError, match="without meta_info.routed_experts.*--enable-return-routed-experts"):
            run_sync(plain.generate([5, 6, 7], SamplingParams(max_new_tokens=3, stop_token_ids=())))
        with pytest.raises(RoutingError, match="runs without --enable-return-routed-experts"):
            _engine(server.url).check_servers()
        run_sync(plain.close())
    finally:
        server.stop()

    server = _server(return_routed_experts=True, moe_runner_backend="triton_kernel")  # records nothing: zeros
    try:
        with pytest.raises(RoutingError, match="triton_kernel MoE runner, which records no routing"):
            _engine(server.url).check_servers()
    finally:
        server.stop()


# ---------------------------------------------------------------- the trainer


def _trainer(tmp_path, engine=None, **kw):
    from datasets import Dataset

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer

    torch.manual_seed(0)
    config = tiny_gptoss_config(num_hidden_layers=2, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config)
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(4)]
    args = dict(
        output_dir=str(tmp_path), max_steps=1, learning_rate=1e-2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=10, max_turns=1, beta=0.0, loss_type="dapo", logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
    )  # fmt: skip
    args.update(kw)
    if engine is not None:
        engine = engine(model)
    return AgenticGRPOTrainer(
        model=model,
        reward_funcs=lambda completion_ids, **k: [float(sum(c) % 5) for c in completion_ids],
        args=AgenticGRPOConfig(**args),
        train_dataset=Dataset.from_list(rows),
        processing_class=load_gptoss_tokenizer(),
        rollout_engine=engine,
    )


class RotatingEngine(EmbeddedEngine):
    """An engine whose routing record differs from the experts it used (the positive control of the metric)."""

    async def generate(self, input_ids, sampling):
        out = await super().generate(input_ids, sampling)
        out.routed_experts = rotated(out.routed_experts, 4)
        return out


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("padding_free", [False, True])
def test_trainer_replays_the_rollout_routing(tmp_path, padding_free):
    trainer = _trainer(tmp_path / "own", routing_replay=True, padding_free=padding_free)
    trainer.train()
    assert _logged(trainer, "routing/agreement") == [1.0]  # the engine's fp32 copy routes as the trainer does

    def rotating(model):
        return RotatingEngine.from_policy(model, pad_token_id=199999, seed=0, record_routing=True)

    replayed = _trainer(tmp_path / "rot", engine=rotating, routing_replay=True, padding_free=padding_free)
    replayed.train()
    observed = _trainer(tmp_path / "obs", engine=rotating, routing_replay=False, padding_free=padding_free)
    observed.train()
    assert (
        _logged(replayed, "routing/agreement_min_layer") == [0.0] and _logged(replayed, "routing/agreement")[0] < 0.25
    )
    assert _logged(observed, "routing/agreement") == [0.0]  # measured with replay off too
    # the loss forward replayed the record: experts the engine did not use move the trainer's log-probs away from
    # the engine's; with replay off the trainer routes as the engine did, and they agree
    assert _logged(replayed, "mismatch/k3_kl")[0] > 100 * max(_logged(observed, "mismatch/k3_kl")[0], 1e-9)


def test_routing_replay_benchmark_against_the_fake_server(tmp_path):
    """The GPU benchmark's whole path on CPU: launch, record, score with and without replay, report, exit 0."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    server = f"{sys.executable} {repo / 'tests' / 'fake_sglang_server.py'}"
    cmd = [
        sys.executable, str(repo / "benchmarks" / "routing_replay.py"), "--model", "tiny", "--layers", "2",
        "--server-cmd", server, "--num-prompts", "3", "--max-new-tokens", "8", "--repeats", "1", "--rounds", "2",
        "--out", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "routing_replay.json").read_text())
    assert "--enable-return-routed-experts --moe-runner-backend triton" in report["server_command"]
    for row in report["rows"].values():  # an fp32 fake server routes as the fp32 trainer does
        assert row["agreement"] == 1.0
    assert report["cost"]["stored_bytes_per_token"] == 2 * 2  # 2 layers x top-2, uint8


def test_routing_replay_benchmark_fails_when_replay_raises_the_mismatch():
    from benchmarks.routing_replay import checks

    rounds = {"own routing": [{"k3_kl": 1e-3}] * 2, "replayed engine routing": [{"k3_kl": 5e-4}, {"k3_kl": 2e-3}]}
    assert checks({"rounds": rounds}) == ["round 1: replay raised k3: 0.002 > 0.001 without it"]
    rounds["replayed engine routing"][1] = {"k3_kl": 9e-4}
    assert checks({"rounds": rounds}) == []


def _count_policy_forwards(trainer) -> dict[str, list]:
    """Counts the policy's forwards (a hook on the trainer's model: the engine serves its own copy), with and without
    gradient, and records the inputs of each loss micro-batch (`_compute_loss`)."""
    seen: dict[str, list] = {"grad": [], "no_grad": [], "loss_inputs": []}
    trainer.model.register_forward_hook(
        lambda module, args, output: seen["grad" if torch.is_grad_enabled() else "no_grad"].append(1)
    )
    compute_loss = trainer._compute_loss

    def recording_compute_loss(model, inputs):
        seen["loss_inputs"].append(inputs)
        return compute_loss(model, inputs)

    trainer._compute_loss = recording_compute_loss
    return seen


@pytest.mark.parametrize("padding_free", [False, True])
def test_default_config_runs_one_policy_forward_per_micro_batch_with_replay(tmp_path, padding_free):
    """The on-policy promise in the default configuration, routing replay on: exactly one policy forward per loss
    micro-batch, with gradient; none without (no old log-probs, no extra diagnostic pass); the PPO ratio is 1."""
    trainer = _trainer(tmp_path, gradient_accumulation_steps=2, padding_free=padding_free)
    seen = _count_policy_forwards(trainer)
    trainer.train()
    assert trainer.routing_replay is not None and _logged(trainer, "routing/agreement") == [1.0]  # replay was on
    assert len(seen["loss_inputs"]) == 2  # two micro-batches
    assert len(seen["grad"]) == len(seen["loss_inputs"]) and seen["no_grad"] == []
    assert all("old_per_token_logps" not in inputs for inputs in seen["loss_inputs"])
    assert _logged(trainer, "clip_ratio/region_mean") == [0.0]
    assert not _logged(trainer, "routing/k3_kl_own")  # the diagnostic is off by default


def test_routing_mismatch_every_pays_one_extra_forward_on_its_steps_only(tmp_path):
    """The positive control of the count: `routing_mismatch_every=2` over three steps scores steps 1 and 3 (global
    steps 0 and 2) again under the other routing, one forward without gradient per micro-batch, and logs
    `routing/k3_kl_*` on those steps only."""
    trainer = _trainer(tmp_path, gradient_accumulation_steps=2, max_steps=3, routing_mismatch_every=2)
    seen = _count_policy_forwards(trainer)
    trainer.train()
    assert len(seen["loss_inputs"]) == 6 and len(seen["grad"]) == 6
    assert len(seen["no_grad"]) == 4  # two micro-batches on each of the two steps that pay
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [("routing/k3_kl_own" in h, "routing/k3_kl_replayed" in h) for h in logged] == [
        (True, True), (False, False), (True, True)
    ]  # fmt: skip


def test_routing_mismatch_every_refuses_a_negative_period(tmp_path):
    with pytest.raises(ValueError, match="routing_mismatch_every must be >= 0"):
        _trainer(tmp_path, routing_mismatch_every=-1)


def test_trainer_logs_the_mismatch_with_and_without_replay(tmp_path):
    """`routing_mismatch_every=1`: one run, whichever mode it trains in, logs k3 with the engine's routing replayed
    and with the trainer's own, on the same tokens; they equal the loss forwards of runs in each mode."""

    def rotating(model):
        return RotatingEngine.from_policy(model, pad_token_id=199999, seed=0, record_routing=True)

    runs = {}
    for mode in (True, False):
        runs[mode] = _trainer(tmp_path / str(mode), engine=rotating, routing_replay=mode, routing_mismatch_every=1)
        runs[mode].train()
    for trainer in runs.values():
        own, replayed = _logged(trainer, "routing/k3_kl_own")[0], _logged(trainer, "routing/k3_kl_replayed")[0]
        assert replayed > 100 * max(own, 1e-9)  # the rotated record is the wrong routing: replaying it hurts
        assert _logged(trainer, "routing/prob_diff_max_replayed")[0] > _logged(trainer, "routing/prob_diff_max_own")[0]
    # each run's own mode is its loss forward (mismatch/k3_kl); the extra pass reproduces the other run's
    for mode, name in ((True, "replayed"), (False, "own")):
        assert _logged(runs[mode], f"routing/k3_kl_{name}") == pytest.approx(_logged(runs[mode], "mismatch/k3_kl"))
        other = "own" if mode else "replayed"
        assert _logged(runs[mode], f"routing/k3_kl_{other}") == pytest.approx(
            _logged(runs[not mode], "mismatch/k3_kl"), rel=1e-4, abs=1e-9
        )
    # the agreement of record is the loss forward's, not the extra pass's
    assert _logged(runs[False], "routing/agreement") == [0.0]
    off = _trainer(tmp_path / "off", engine=rotating, routing_replay=True)  # the default: no extra forward
    off.train()
    assert not _logged(off, "routing/k3_kl_own") and _logged(off, "routing/agreement")


def test_differentiated_replayed_pass_over_several_chunks_is_refused_on_every_path():
    """A replayed forward's backward recomputes it with the plan installed last, so a differentiated pass must be one
    forward: refused before any forward on the padded path, on the packed path and on a packed chunk that runs padded
    (a hole in its mask). Without gradients the chunks run, each with its own rows' plan."""
    from types import SimpleNamespace

    from trl_ext.policy_forward import policy_logps_and_entropies

    ids = torch.ones(4, 6, dtype=torch.long)
    full, holey = torch.ones_like(ids), torch.tensor([[1, 1, 0, 1, 1, 1]] * 4)
    routing = torch.arange(4).view(4, 1, 1, 1).expand(4, 6, 2, 2).to(torch.uint8)
    plans, forwards = [], []

    def trl_forward(model, input_ids, attention_mask, logits_to_keep, **kw):
        forwards.append(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], logits_to_keep), None, None

    def fake_trainer(packed):
        return SimpleNamespace(
            resolved=SimpleNamespace(padding_free=packed), args=SimpleNamespace(routing_replay=True),
            accelerator=SimpleNamespace(device=torch.device("cpu")),
            routing_replay=SimpleNamespace(set_plan=lambda plan, **kw: plans.append(plan), clear=lambda: None),
        )  # fmt: skip

    for packed, mask in ((False, full), (True, full), (True, holey)):
        with torch.enable_grad(), pytest.raises(ValueError, match="must be one forward"):
            policy_logps_and_entropies(fake_trainer(packed), trl_forward, None, ids, mask, 3, routing, batch_size=2)
        assert not forwards and not plans
    for packed in (False, True):  # positive control: no gradient, two padded chunks with their rows' plans
        with torch.no_grad():
            logps, _, _ = policy_logps_and_entropies(
                fake_trainer(packed), trl_forward, None, ids, holey, 3, routing, batch_size=2
            )
        assert logps.shape == (4, 3) and forwards == [2, 2]
        assert [p[:, 0, 0, 0].tolist() for p in plans] == [[0, 1], [2, 3]]
        forwards.clear()
        plans.clear()
