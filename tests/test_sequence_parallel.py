"""Ulysses sequence parallelism == one process (logits, loss, every parameter gradient incl. sinks), gloo on CPU.

One spawn per world size (2 and 4 ranks) runs every scenario (tests/sequence_parallel_worker.py); the references are
computed here, single-process, from the same weights. Model: tiny GPT-OSS, fp32, eager, sliding_window 8 < S, random
non-zero sinks, 4 query / 2 KV heads (fewer KV heads than ranks at P = 4). Scenarios: one long sequence (S=37,
padding to a multiple of P), three packed sequences (position_ids restarting; reference: each run alone), a
left/right-padded batch of 2 through `sequence_parallel_logprobs` (GRPO path), and at P = 4 a dp=2 x sp=2 mesh.
"""

from __future__ import annotations

import time

import pytest

# pytest puts tests/ on sys.path (no __init__.py here), and spawned ranks inherit the parent's sys.path, so they
# import the worker by this same module name.
import sequence_parallel_worker as sp_worker
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.multiprocess

ATOL, RTOL = 2e-5, 1e-4
RANK_TIMEOUT_S = 420


def _spawn(world: int, tmp_path) -> list[dict]:
    model = sp_worker.build_model()
    state_path = str(tmp_path / "state.pt")
    torch.save(model.state_dict(), state_path)
    ctx = mp.start_processes(
        sp_worker.run,
        args=(world, str(tmp_path / "init"), state_path, str(tmp_path)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    try:
        # join() returns True once every rank exited, False while some still run; it raises if one failed.
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} SP ranks still running after {RANK_TIMEOUT_S}s (a collective hung?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, world - 1)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def sp_run(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, tmp_path_factory.mktemp(f"sp{world}"))


@pytest.fixture(scope="module")
def reference():
    """Single-process eager results for every scenario."""
    torch.manual_seed(0)
    inputs = sp_worker.make_inputs()
    ref = {}

    model = sp_worker.build_model(sp_worker.build_model().state_dict())
    ids = inputs["single"]["input_ids"]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    ref["single"] = {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }
    model.zero_grad(set_to_none=True)

    # Packed: the reference is each sequence on its own (no attention across the boundary).
    packed = inputs["packed"]
    logits, total, count = [], 0.0, 0
    start = 0
    for n in packed["lengths"]:
        seq = packed["input_ids"][:, start : start + n]
        lg = model(input_ids=seq).logits
        logits.append(lg.detach())
        total = total + torch.nn.functional.cross_entropy(lg[0, :-1], seq[0, 1:], reduction="sum")
        count += n - 1
        start += n
    loss = total / count
    loss.backward()
    ref["packed"] = {
        "logits": torch.cat(logits, dim=1),
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }
    model.zero_grad(set_to_none=True)

    padded = inputs["padded"]
    lg = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits[:, :-1] / 0.7
    logps = torch.log_softmax(lg.float(), -1).gather(-1, padded["input_ids"][:, 1:, None]).squeeze(-1)
    (logps * padded["attention_mask"][:, 1:]).sum().backward()
    probs = torch.softmax(lg.float(), -1)
    entropy = -(probs * torch.log_softmax(lg.float(), -1)).sum(-1)
    ref["padded"] = {
        "logps": logps.detach(),
        "entropy": entropy.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }
    return ref


def _assert_grads(got: dict, want: dict):
    assert got.keys() == want.keys()
    sinks = [n for n in want if n.endswith("sinks")]
    assert sinks and all(want[n].abs().max() > 0 for n in sinks), "reference sink gradients must be non-zero"
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("scenario", ["single", "packed"])
def test_logits_loss_grads_match_single_process(sp_run, reference, scenario):
    world, results = sp_run
    for res in results:  # first and last rank both hold the gathered logits and the group-summed gradients
        got, want = res[scenario], reference[scenario]
        torch.testing.assert_close(got["logits"], want["logits"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["loss"], want["loss"], atol=ATOL, rtol=RTOL)
        _assert_grads(got["grads"], want["grads"])


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_under_ddp_and_fsdp2(sp_run, reference, wrapper):
    """The documented recipe: log-probs through the wrapper's forward, loss x sp_size, the wrapper reduces."""
    world, results = sp_run
    for res in results:
        _assert_grads(res["wrapped"][wrapper], reference["padded"]["grads"])


def test_gradient_checkpointing(sp_run, reference):
    world, results = sp_run
    for res in results:
        torch.testing.assert_close(res["single_ckpt"]["logits"], reference["single"]["logits"], atol=ATOL, rtol=RTOL)
        _assert_grads(res["single_ckpt"]["grads"], reference["single"]["grads"])


@pytest.mark.parametrize("scenario", ["single", "packed", "padded"])
def test_sink_kernel_as_inner_attention(sp_run, reference, scenario):
    """Inner attention = hf-gptoss-rl/sink-flash-attn3 through transformers' flash path (CPU: its torch path)."""
    world, results = sp_run
    kernel = results[0]["kernel"]
    assert "error" not in kernel, kernel["error"]
    assert kernel["inner"] == "hf-gptoss-rl/sink-flash-attn3"
    assert kernel["derivations_from_position_ids"] == 0  # varlen arguments computed once per forward, passed in
    got, want = kernel[scenario], reference[scenario]
    if scenario == "padded":
        mask = sp_worker.make_inputs()["padded"]["attention_mask"][:, 1:].bool()
        torch.testing.assert_close(got["logps"][mask], want["logps"][mask], atol=ATOL, rtol=RTOL)
    else:
        torch.testing.assert_close(got["logits"], want["logits"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["loss"], want["loss"], atol=ATOL, rtol=RTOL)
    _assert_grads(got["grads"], want["grads"])


def test_packed_sequences_are_isolated(sp_run, reference):
    """Guard against a vacuous packed test: attending across the boundaries must change the logits."""
    world, results = sp_run
    model = sp_worker.build_model(sp_worker.build_model().state_dict())
    packed = sp_worker.make_inputs()["packed"]
    # transformers' eager GPT-OSS does not isolate packed rows (its mask ignores position_ids): a leaky reference.
    leaky = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits.detach()
    assert (leaky - results[0]["packed"]["logits"]).abs().max() > 1e-3


def test_logprobs_padded_batch(sp_run, reference):
    world, results = sp_run
    want = reference["padded"]
    mask = sp_worker.make_inputs()["padded"]["attention_mask"][:, 1:].bool()
    for res in results:
        got = res["padded"]
        assert got["logps"].shape == want["logps"].shape == (2, 29)
        torch.testing.assert_close(got["logps"][mask], want["logps"][mask], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["logps_keep9"], want["logps"][:, -9:], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["entropy_keep9"], want["entropy"][:, -9:], atol=ATOL, rtol=RTOL)
        _assert_grads(got["grads"], want["grads"])


def test_api_state_and_errors(sp_run, reference):
    world, results = sp_run
    res = results[0]
    assert res["attn_implementation"] == "ulysses_sp"
    assert res["after_disable"] == "eager"
    assert res["twin_after_disable"] == ("eager", "ulysses_sp")
    assert res["disabled_block"]["attn_implementation"] == "eager" and res["after_block"] == "ulysses_sp"
    torch.testing.assert_close(res["disabled_block"]["logits"], reference["single"]["logits"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(res["twin_single"]["logits"], reference["single"]["logits"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(res["after_disable_logits"], reference["single"]["logits"], atol=ATOL, rtol=RTOL)
    assert "position_ids" in res["missing_position_ids_error"]
    assert res["mask_cache_entries"] == 2  # positions/mask gathered once per forward, not once per layer


def test_mesh_group_dp2_sp2(sp_run, reference):
    world, results = sp_run
    if world != 4:
        pytest.skip("needs 4 ranks")
    first, last = results
    assert first["mesh"]["sp_ranks"] == [0, 1] and last["mesh"]["sp_ranks"] == [2, 3]
    assert first["mesh"]["dp_ranks"] == [0, 2] and last["mesh"]["dp_ranks"] == [1, 3]
    assert first["mesh"]["fsdp_ranks"] == [0, 1, 2, 3]
    for res, sp_ranks in ((first, [0, 1]), (last, [2, 3])):
        from_pc = res["mesh"]["from_parallelism_config"]
        assert from_pc == {"sp_ranks": sp_ranks, "mesh_dims": ["dp_shard", "sp"], "reused": True}
    for res in results:
        torch.testing.assert_close(res["mesh_single"]["logits"], reference["single"]["logits"], atol=ATOL, rtol=RTOL)
        _assert_grads(res["mesh_single"]["grads"], reference["single"]["grads"])


def test_shard_inputs_layout():
    """shard_inputs without a process group: positions computed before the split, padding, shift labels."""
    from hf_gptoss_rl.sequence_parallel import shard_inputs

    class FakeGroup:  # shard_inputs only asks the group for its size and this rank
        pass

    import hf_gptoss_rl.sequence_parallel as sp

    ids = torch.arange(10).unsqueeze(0)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    orig = (sp.get_sequence_parallel_group, sp._group_size, sp._group_rank)
    try:
        sp.get_sequence_parallel_group = lambda g: g
        sp._group_size = lambda g: 4
        shards = []
        for rank in range(4):
            sp._group_rank = lambda g, r=rank: r
            shards.append(shard_inputs({"input_ids": ids, "position_ids": pos, "labels": ids}, FakeGroup()))
    finally:
        sp.get_sequence_parallel_group, sp._group_size, sp._group_rank = orig
    assert all(s["input_ids"].shape == (1, 3) for s in shards)
    assert torch.cat([s["position_ids"] for s in shards], 1).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert torch.cat([s["shift_labels"] for s in shards], 1).tolist() == [list(range(1, 10)) + [-100] * 3]
    assert int(shards[0]["num_items_in_batch"]) == 9
    assert torch.cat([s["input_ids"] for s in shards], 1).tolist() == [list(range(10)) + [0, 0]]
