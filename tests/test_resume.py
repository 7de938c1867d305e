"""Exact resume: a run resumed from a checkpoint (after a clean stop or a SIGKILL) samples the same completions and
ends with the same weights as the straight run; `resume_from_checkpoint` True / "last" picks the latest complete
checkpoint; the example keeps its practised rows on resume; seeded sampling does not depend on batching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_ext.checkpoints import checkpoint_problem, latest_checkpoint, resolve_resume_checkpoint
from trl_ext.rollout import EmbeddedEngine, SamplingParams, run_sync

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from resume_worker import STEPS, build_trainer, tiny_model  # noqa: E402

# Parameters of a resumed run against the straight run's, after 2 resumed steps at lr 1e-2. On the same tokens the runs
# differ by CPU float32 rounding only: the max |diff| over all tensors ranged from 0.0 to 1.6e-7 in 7 measured runs
# (6 in one process, 1 after a SIGKILL). The tolerance is 12x the largest. Without the seeded rollouts no completion of steps 3-4 was equal
# and the parameters differed by 2.9e-2.
WEIGHT_ATOL = 2e-6


def _after(record, step):
    return [(p, c) for s, p, c in record if s >= step]


def _straight(tmp_path):
    record: list = []
    trainer = build_trainer(str(tmp_path / "straight"), record=record)
    trainer.train()
    return trainer, record


def _assert_same_run(resumed, record, straight, straight_record):
    expected = _after(straight_record, 2)  # the trajectories of steps 3 and 4 (sampled at global steps 2 and 3)
    got = _after(record, 2)
    assert len(expected) == 2 * 4 and [p for p, _ in got] == [p for p, _ in expected]
    same = sum(a == b for (_, a), (_, b) in zip(got, expected))
    assert same == len(expected), f"{same} of {len(expected)} completions equal after resume"
    for name, tensor in straight.model.state_dict().items():
        diff = (resumed.model.state_dict()[name] - tensor).abs().max().item()
        assert diff <= WEIGHT_ATOL, f"{name}: max |diff| {diff}"


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    return _straight(tmp_path_factory.mktemp("resume"))


def test_resume_after_a_clean_stop_samples_the_straight_runs_completions(tmp_path, straight_run):
    straight, straight_record = straight_run
    build_trainer(str(tmp_path), max_steps=2, save_strategy="steps", save_steps=2).train()
    record: list = []
    resumed = build_trainer(str(tmp_path), record=record)
    resumed.train(resume_from_checkpoint="last")
    assert resumed.state.global_step == STEPS
    _assert_same_run(resumed, record, straight, straight_record)
    # the engine's shared generator went into the checkpoint
    assert (tmp_path / "checkpoint-2" / "rollout_rng_state.pth").is_file()


def test_resume_after_sigkill_inside_a_step(tmp_path, straight_run):
    straight, straight_record = straight_run
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("resume_worker.py")), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == -9, child.stdout[-2000:] + child.stderr[-2000:]
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    record: list = []
    resumed = build_trainer(str(tmp_path), record=record)
    resumed.train(resume_from_checkpoint=True)
    _assert_same_run(resumed, record, straight, straight_record)


def test_resume_against_an_sglang_server(tmp_path, straight_run, caplog):
    """The same through SGLang's HTTP API (the fake server samples seeded requests like the embedded engine): every
    /generate carries its own sampling_seed, and the resumed run samples the straight run's completions."""
    from fake_sglang_server import FakeSGLangServer

    def served_run(folder, record=None, resume=None, deterministic=True, **kw):
        server = FakeSGLangServer(EmbeddedEngine(tiny_model(), seed=0), deterministic_inference=deterministic).start()
        try:
            trainer = build_trainer(
                str(folder), record=record, rollout_backend="sglang", sglang_urls=[server.url], **kw
            )
            trainer.train(resume_from_checkpoint=resume)
        finally:
            server.stop()
        return trainer, [b["sampling_params"].get("sampling_seed") for _, p, b in server.requests if p == "/generate"]

    straight_record: list = []
    straight, seeds = served_run(tmp_path / "a", straight_record)
    assert len(seeds) == STEPS * 4 and None not in seeds and len(set(seeds)) == len(seeds)
    served_run(tmp_path / "b", max_steps=2, save_strategy="steps", save_steps=2)
    record: list = []
    with caplog.at_level("WARNING", logger="trl_ext.rollout.sglang"):
        resumed, _ = served_run(tmp_path / "b", record, resume="last", deterministic=False)
    _assert_same_run(resumed, record, straight, straight_record)
    # a server without --enable-deterministic-inference ignores the seeds: the trainer says so at start-up
    assert "without --enable-deterministic-inference" in caplog.text


def test_seeded_sampling_does_not_depend_on_batching():
    """A request with a sampling_seed gets the same tokens alone or batched with others; without seeds the shared
    generator's draws are split across the batch, so the tokens depend on the batch (the positive control)."""
    torch.manual_seed(0)
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.model_builders import tiny_gptoss_config

    config = tiny_gptoss_config(num_hidden_layers=2, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config)
    prompts = [[200006, 1428 + i, 200008] for i in range(6)]

    def sample(prompts, seeds, batch_wait_s):
        engine = EmbeddedEngine(model, seed=0, batch_wait_s=batch_wait_s)
        try:

            async def go():
                import asyncio

                calls = [
                    engine.generate(p, SamplingParams(max_new_tokens=16, stop_token_ids=(), sampling_seed=s))
                    for p, s in zip(prompts, seeds)
                ]
                return [out.output_ids for out in await asyncio.gather(*calls)]

            return run_sync(go()), engine.max_batch_seen
        finally:
            engine.shutdown()

    def alone(seeds):  # each request in a batch of its own, on a fresh engine
        return [sample([p], [s], 0.0)[0][0] for p, s in zip(prompts, seeds)]

    seeds = [11, 12, 13, 14, 15, 16]
    batched, widest = sample(prompts, seeds, batch_wait_s=0.5)
    assert widest == 6 and batched == alone(seeds)
    unseeded, widest = sample(prompts, [None] * 6, batch_wait_s=0.5)
    assert widest == 6 and unseeded != alone([None] * 6)  # the shared generator's draws are split across the batch
    assert sample(prompts, [None] * 6, 0.5)[0] == unseeded  # and that generator is itself seeded


def _write_checkpoint(folder: Path, step: int, *, state=True, weights=True):
    folder.mkdir(parents=True)
    if weights:
        (folder / "model.safetensors").write_bytes(b"x")
    if state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_resume_true_and_last_skip_a_half_written_checkpoint(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    _write_checkpoint(tmp_path / "checkpoint-2", 2)
    _write_checkpoint(tmp_path / "checkpoint-3", 3, state=False)  # killed during the save: no trainer_state.json
    _write_checkpoint(tmp_path / "checkpoint-4", 4, weights=False)
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text('{"global_st')  # truncated
    # transformers' choice (the positive control): the highest number, half-written or not
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-5")
    for value in (True, "True", "true", "last", "latest"):
        assert resolve_resume_checkpoint(value, str(tmp_path)) == str(tmp_path / "checkpoint-2")
    for value in (None, False, "", "false", "None"):
        assert resolve_resume_checkpoint(value, str(tmp_path)) is None
    assert "no trainer_state.json" in checkpoint_problem(str(tmp_path / "checkpoint-3"))
    assert "no weights" in checkpoint_problem(str(tmp_path / "checkpoint-4"))
    assert "unreadable" in checkpoint_problem(str(tmp_path / "checkpoint-5"))
    with pytest.raises(ValueError, match="checkpoint-3.*not a complete checkpoint: no trainer_state.json"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-3"), str(tmp_path))
    with pytest.raises(ValueError, match="no complete checkpoint-N folder"):
        resolve_resume_checkpoint("last", str(tmp_path / "empty"))


def test_trainer_resolves_resume_true_from_a_command_line(tmp_path):
    trainer = build_trainer(str(tmp_path), max_steps=1)
    with pytest.raises(ValueError, match="no complete checkpoint-N folder"):
        trainer.train(resume_from_checkpoint="True")  # transformers would look for a folder named "True"


@pytest.mark.slow
def test_example_resumed_after_its_cold_start_trains_on_the_practised_rows(tmp_path):
    """examples/grpo_retool.py: the cold start picks the practised rows; a resumed run trains on those rows, not on the
    whole dataset."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_grpo_retool_resume", REPO / "examples" / "grpo_retool.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)

    def run(*argv):
        script_args, training_args, model_args = module.make_parser().parse_args_and_config(
            ["--output_dir", str(tmp_path), "--report_to", "none", "--cold_start_steps", "5", "--eval_problems", "0",
             "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "24",
             "--save_strategy", "steps", "--save_steps", "1", "--disable_tqdm", "true", *argv]
        )  # fmt: skip
        return module.main(script_args, training_args, model_args)

    first = run("--max_steps", "1")
    rows = json.loads((tmp_path / "cold_start" / "practised_rows.json").read_text())["rows"]
    assert 0 < len(first.train_dataset) == len(rows) < 64
    resumed = run("--max_steps", "2", "--resume_from_checkpoint", "last")
    assert resumed.state.global_step == 2
    assert list(resumed.train_dataset["prompt"]) == list(first.train_dataset["prompt"])


def test_ctrl_c_during_rollouts_exits_with_keyboard_interrupt(tmp_path):
    """SIGINT mid-rollout: the embedded engine stops generating and the process exits by KeyboardInterrupt (before,
    its worker thread was still decoding at interpreter exit and the process died of SIGABRT, exit -6)."""
    import signal
    import time

    marker = tmp_path / "rolling"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("resume_worker.py")), str(tmp_path / "out"), str(marker)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the rollouts never started"
        time.sleep(1.0)  # well inside the first rollout (2,000 tokens per trajectory)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGINT, err[-3000:]
    assert "KeyboardInterrupt" in err and "terminate called" not in err
    assert time.monotonic() - sent < 60
