"""What a long run meets: SIGKILL at any moment, a rollout server that dies and comes back (or does not), a full disk.

Every fault is injected on this machine only (127.0.0.1), every wait is bounded, and every random choice is seeded,
so a failure replays from the seed in its message. The run is `resume_worker.build_trainer`'s tiny GPT-OSS; the fake
SGLang server runs in its own process (`fake_sglang_server.py --die-on PATH:N`) where a server's death matters.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from trl_ext.checkpoints import CheckpointDiskFullError, checkpoint_problem, latest_checkpoint
from trl_ext.rollout import EmbeddedEngine, RolloutServerLostError, run_sync
from trl_ext.weight_sync.transport import free_port

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from resume_worker import build_trainer, tiny_model  # noqa: E402
from test_sglang_client import stop_process  # noqa: E402  (SIGTERM, then SIGKILL after 20 s)

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
# parameters of a recovered or resumed run against the straight run's: CPU float32 rounding only (tests/test_resume.py
# measured at most 1.6e-7 in 7 runs; the tolerance is its WEIGHT_ATOL)
WEIGHT_ATOL = 2e-6


def _batches(record) -> dict[int, list]:
    """{global step: [(prompt, completion ids), ...]} of a reward record."""
    out: dict[int, list] = {}
    for step, prompt, ids in record:
        out.setdefault(step, []).append((prompt, list(ids)))
    return out


def _assert_same_weights(state: dict, reference: dict, atol: float = WEIGHT_ATOL) -> None:
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        diff = (state[name].float() - tensor.float()).abs().max().item()
        assert diff <= atol, f"{name}: max |diff| {diff}"


# ---------------------------------------------------------------------------------------------- servers


class ServerProcesses:
    """The fake SGLang server in processes of its own, on fixed ports, launched from a saved model, with a supervisor
    that starts a dead server again (launch weights, its next launch arguments) as a process supervisor would."""

    def __init__(self, tmp_path: Path):
        self.model_dir = tmp_path / "served_model"
        tiny_model().save_pretrained(self.model_dir)
        self.log = open(tmp_path / "servers.log", "a")
        self.procs: list[subprocess.Popen] = []
        self.restarts = 0

    def start(self, port: int, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(TESTS / "fake_sglang_server.py"), "--model-path", str(self.model_dir),
             "--port", str(port), "--enable-deterministic-inference", *args],
            env=ENV, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        self.procs.append(proc)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=90)
        if not (line and line[0].startswith("serving")):
            raise AssertionError(f"fake server did not start: {line}; see {self.log.name}")
        return proc

    def supervise(self, proc: subprocess.Popen, port: int, relaunches: list[tuple[str, ...]], down_s: float):
        """Start the server again, ``down_s`` after each death, with the next arguments of ``relaunches``."""

        def watch(proc=proc):
            for args in relaunches:
                if proc.wait(timeout=300) != -signal.SIGKILL:
                    return  # stopped by the test, not by a crash
                time.sleep(down_s)
                proc = self.start(port, *args)
                self.restarts += 1

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread

    def close(self):
        for proc in self.procs:
            stop_process(proc)
            proc.stdout.close()
        self.log.close()


@pytest.fixture
def servers(tmp_path):
    made = ServerProcesses(tmp_path)
    yield made
    made.close()


def _served_in_process(model_dir: Path):
    """The straight run's server: the fake server in this process, on the weights the server processes load."""
    from fake_sglang_server import FakeSGLangServer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return FakeSGLangServer(EmbeddedEngine(model, initial_version=None), deterministic_inference=True).start()


# ---------------------------------------------------------------------------------------------- 1. preemption

KILL_SEED = 20240611


def _kill_plan(seed: int, kills: int, mid_write: int) -> list[str]:
    """``kills`` moments ``KIND:N`` (see `resume_worker.kill_at`), ``mid_write`` of them while a checkpoint file is
    being written; N is drawn within about one step of a process's start (12 moments a step: 4 trajectories, a sync,
    7 checkpoint files), so that every kill lands."""
    rng = random.Random(seed)
    kinds = ["write"] * mid_write + [rng.choice(["any", "rollout", "sync"]) for _ in range(kills - mid_write)]
    rng.shuffle(kinds)
    return [
        f"{k}:{rng.randint(1, 7 if k == 'write' else 4 if k == 'rollout' else 2 if k == 'sync' else 14)}" for k in kinds
    ]


def _run_with_kills(out: Path, plan: list[str], max_steps: int, url: str | None) -> tuple[list, list, list]:
    """The worker killed at each moment of ``plan``, resumed with ``latest`` each time, then run to the end. Returns
    the exit codes, the half-written checkpoints seen after the kills and the reward record of every process."""
    record_file = out.parent / f"{out.name}.record.jsonl"
    codes, half_written = [], []
    for moment in [*plan, "any:0"]:
        cmd = [sys.executable, str(TESTS / "resume_worker.py"), "--kill-at", moment, str(out), str(max_steps),
               str(record_file), *([url] if url else [])]  # fmt: skip
        child = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        codes.append(child.returncode)
        if child.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(f"{moment}: exit {child.returncode}\n{child.stderr[-3000:]}")
        half_written += [p.name for p in out.glob("checkpoint-*") if checkpoint_problem(str(p)) is not None]
    record = [json.loads(line) for line in record_file.read_text().splitlines()]
    return codes, half_written, record


@pytest.mark.parametrize(("backend", "kills", "mid_write"), [("embedded", 6, 3), ("sglang", 3, 2)])
def test_sigkill_at_seeded_random_moments_resumes_exactly(tmp_path, servers, backend, kills, mid_write):
    """The run killed with SIGKILL at seeded random moments (some while a checkpoint file is half-written, with
    save_total_limit=2) and resumed with ``resume_from_checkpoint="latest"`` each time samples, at every step and
    in every process, the straight run's completions, and ends with its weights. The fake server runs in its own
    process and outlives the trainer's deaths."""
    max_steps = 5
    plan = _kill_plan(KILL_SEED + kills, kills, mid_write)
    url = None
    straight_kw = {}
    if backend == "sglang":
        port = free_port()
        servers.start(port)
        url = f"http://127.0.0.1:{port}"
        reference_server = _served_in_process(servers.model_dir)
        straight_kw = dict(rollout_backend="sglang", sglang_urls=[reference_server.url])
    straight_record: list = []
    try:
        straight = build_trainer(str(tmp_path / "straight"), max_steps=max_steps, record=straight_record, **straight_kw)
        straight.train()
    finally:
        if backend == "sglang":
            reference_server.stop()
    out = tmp_path / "killed"
    codes, half_written, record = _run_with_kills(out, plan, max_steps, url)
    replay = f"kill plan {plan} (seed {KILL_SEED + kills})"
    assert codes == [-signal.SIGKILL] * kills + [0], f"{replay}: exit codes {codes}"
    assert len(half_written) >= mid_write, f"{replay}: half-written checkpoints seen {half_written}"
    expected = _batches(straight_record)
    for step, batch in _batches(record).items():  # every process, killed or not, sampled the straight run's batch
        assert sorted(batch) == sorted(expected[step] * (len(batch) // len(expected[step]))), f"{replay}: step {step}"
    final = latest_checkpoint(str(out))
    assert final == str(out / f"checkpoint-{max_steps}"), replay
    from safetensors.torch import load_file

    _assert_same_weights(load_file(os.path.join(final, "model.safetensors")), straight.model.state_dict())
    assert len(list(out.glob("checkpoint-*"))) <= 2  # save_total_limit held through the kills


# ---------------------------------------------------------------------------------------------- 2. a server dies

STEPS = 4


@pytest.fixture(scope="module")
def served_straight_run(tmp_path_factory):
    """The straight run against the fake server, served from the weights the server processes load: its reward
    record and its trainer."""
    folder = tmp_path_factory.mktemp("served_straight")
    model_dir = folder / "served_model"
    tiny_model().save_pretrained(model_dir)
    server = _served_in_process(model_dir)
    record: list = []
    try:
        trainer = build_trainer(str(folder / "out"), record=record, rollout_backend="sglang", sglang_urls=[server.url])
        trainer.train()
    finally:
        server.stop()
    return trainer, record


def _recording_served_versions(trainer) -> list:
    """The served versions of every trajectory of every batch the trainer used (`_check_served_versions`' input)."""
    seen: list = []
    check = trainer._check_served_versions

    def recording(trajectories):
        seen.append((trainer.state.global_step, [list(t.weight_versions) for t in trajectories]))
        return check(trajectories)

    trainer._check_served_versions = recording
    return seen


def _assert_straight_run(trainer, record, straight_run, from_step: int = 0) -> None:
    straight, straight_record = straight_run
    expected, got = _batches(straight_record), _batches(record)
    assert sorted(got) == [s for s in sorted(expected) if s >= from_step]
    for step, batch in got.items():
        assert batch == expected[step], f"step {step}: other completions than the straight run's"
    _assert_same_weights(trainer.model.state_dict(), straight.model.state_dict())


def test_rollout_server_dies_mid_batch_and_mid_sync_and_comes_back(tmp_path, servers, served_straight_run, caplog):
    """The server (its own process) dies in the middle of the third step's generation batch; a supervisor starts it
    again with its launch weights, and it dies again in the middle of the next weight sync's broadcast, and is
    started again. The trainer waits and retries, notices the restart (turns served on the launch weights), pushes
    the current weights again and verifies them, samples the batch again, and sends the interrupted sync again: the
    run trains on exactly the straight run's trajectories and ends with its weights; no trajectory it used was served
    on the launch weights (`rollout/stale_trajectories` 0 at every step)."""
    from trl_ext.weight_sync.transport import plan_buckets

    bucket_mb = 16
    buckets = len(plan_buckets(list(tiny_model().state_dict().items()), bucket_mb << 20))
    assert buckets >= 3
    port = free_port()
    # 4 trajectories of one turn per step: /generate 9-12 are the third step's batch
    first = servers.start(port, "--die-on", "/generate:10")
    # relaunched: the resync (version 2) and the batch again, then the sync to version 3 dies at its second bucket
    servers.supervise(first, port, [("--die-on", f"/update_weights_from_distributed:{buckets + 2}"), ()], down_s=1.0)
    record: list = []
    trainer = build_trainer(
        str(tmp_path / "out"), record=record, rollout_backend="sglang", sglang_urls=[f"http://127.0.0.1:{port}"],
        weight_sync_mode="distributed", weight_sync_bucket_mb=bucket_mb, sglang_retry_deadline_s=60.0,
    )  # fmt: skip
    served = _recording_served_versions(trainer)
    try:
        with caplog.at_level("WARNING"):
            trainer.train()
    finally:  # the client leaves its weight-update group: the group's name is free again for later tests
        run_sync(trainer.rollout_engine.close())
    assert servers.restarts == 2
    assert "a server restarted. Pushing the weights again and sampling the batch again" in caplog.text
    assert "sending the weights again (attempt 2 of 3)" in caplog.text
    _assert_straight_run(trainer, record, served_straight_run)
    stale = [e["rollout/stale_trajectories"] for e in trainer.state.log_history if "rollout/stale_trajectories" in e]
    assert stale == [0] * STEPS
    # every turn of every batch used was served on the trainer's version (None: the launch weights, before any sync)
    assert [step for step, _ in served] == list(range(STEPS))
    for step, versions in served:
        assert versions == [[None if step == 0 else step]] * 4, (step, versions)


def test_rollout_server_that_does_not_come_back_stops_training_with_the_checkpoint(
    tmp_path, servers, served_straight_run
):
    """The server dies in the third step's batch and nobody starts it again: after ``sglang_retry_deadline_s`` the
    trainer stops with `RolloutServerLostError`, naming the server and the checkpoint to resume from, before it trains
    on that batch. That checkpoint is intact: resumed against a server started again, the run ends as the straight
    run does."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers.start(port, "--die-on", "/generate:10")
    out = str(tmp_path / "out")
    kw = dict(rollout_backend="sglang", sglang_urls=[url], save_strategy="steps", save_steps=1)
    trainer = build_trainer(out, sglang_retry_deadline_s=3.0, **kw)
    started = time.perf_counter()
    with pytest.raises(RolloutServerLostError) as failed:
        trainer.train()
    assert time.perf_counter() - started < 60
    message = str(failed.value)
    assert f"{url} ({url}/generate failed after" in message, message
    assert "did not answer again within sglang_retry_deadline_s=3 s" in message, message
    assert f"resume from {out}/checkpoint-2 (resume_from_checkpoint='latest' picks it)" in message, message
    assert trainer.state.global_step == 2 and latest_checkpoint(out) == f"{out}/checkpoint-2"
    assert sorted(p.name for p in Path(out).glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    servers.start(port)  # started again, on its launch weights
    record: list = []
    resumed = build_trainer(out, record=record, **kw)
    resumed.train(resume_from_checkpoint="latest")
    _assert_straight_run(resumed, record, served_straight_run, from_step=2)


def test_rollout_server_lost_during_a_weight_sync_names_it_and_the_checkpoint(tmp_path):
    """The server stops answering between a step's rollouts and its weight sync, for good: the sync waits
    ``sglang_retry_deadline_s``, then training stops with `RolloutServerLostError` naming the server, the sync and
    the checkpoint to resume from."""
    server = _served_in_process_model(tiny_model())

    class StopServerInStep2(list):  # the reward record: the server goes away after the second step's rollouts
        def extend(self, items):
            items = list(items)
            if items and items[0][0] == 1:
                server.stop()
            super().extend(items)

    out = str(tmp_path / "out")
    trainer = build_trainer(
        out, record=StopServerInStep2(), rollout_backend="sglang", sglang_urls=[server.url],
        sglang_retry_deadline_s=2.0, save_strategy="steps", save_steps=1,
    )  # fmt: skip
    try:
        with pytest.raises(RolloutServerLostError) as failed:
            trainer.train()
    finally:
        server.stop()
    message = str(failed.value)
    assert f"weight sync to version 2: {server.url} did not answer within retry_deadline_s=2 s" in message, message
    assert f"resume from {out}/checkpoint-1" in message, message


def _served_in_process_model(model):
    from fake_sglang_server import FakeSGLangServer

    return FakeSGLangServer(EmbeddedEngine(model, initial_version=None), deterministic_inference=True).start()


# ---------------------------------------------------------------------------------------------- 3. a full disk


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    record: list = []
    trainer = build_trainer(str(tmp_path_factory.mktemp("straight") / "out"), record=record)
    trainer.train()
    return trainer, record


@pytest.fixture
def small_disk(tmp_path):
    """A 400 MiB tmpfs (two checkpoints of the tiny run, 175 MB each, fit; a third does not), or a skip where this
    process may not mount one."""
    folder = tmp_path / "small_disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(params=["tmpfs", "injected"])
def full_disk(request, tmp_path, monkeypatch):
    """An output folder whose disk fills up during the save of checkpoint-3: a real one (a small tmpfs: torch's writer
    then fails with "unexpected pos", no errno), or ENOSPC raised by the writer of checkpoint-3's optimizer state
    after it wrote half of the file."""
    if request.param == "tmpfs":
        return request.getfixturevalue("small_disk") / "out"
    save = torch.save

    def filling(obj, f, *args, **kwargs):
        if isinstance(f, str) and f.endswith(os.path.join("checkpoint-3", "optimizer.pt")):
            import io

            buffer = io.BytesIO()
            save(obj, buffer)
            with open(f, "wb") as partial:
                partial.write(buffer.getvalue()[: buffer.tell() // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f)
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", filling)
    return tmp_path / "out"


def test_a_full_disk_while_saving_says_so_and_the_previous_checkpoint_resumes_exactly(full_disk, straight_run, caplog):
    """Saving checkpoint-3 fills the disk: training stops with `CheckpointDiskFullError`, which says the disk is full
    and names the half-written checkpoint and the one to resume from; resuming skips the half-written one, with a
    warning, and the previous one resumes exactly."""
    out = str(full_disk)
    with pytest.raises(CheckpointDiskFullError) as failed:
        build_trainer(out, save_strategy="steps", save_steps=1).train()
    message = str(failed.value)
    assert failed.value.errno == errno.ENOSPC
    assert f"saving {out}/checkpoint-3 failed: the disk is full" in message, message
    assert f"{out}/checkpoint-3 is incomplete: resuming skips it, with a warning" in message, message
    assert f"resume from {out}/checkpoint-2" in message, message
    assert checkpoint_problem(f"{out}/checkpoint-3") is not None
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_ext.checkpoints"):
        assert latest_checkpoint(out) == f"{out}/checkpoint-2"
    assert f"skipping {out}/checkpoint-3" in caplog.text
    record: list = []
    resumed = build_trainer(out, record=record, save_strategy="no")  # the disk stays full: no more saves
    resumed.train(resume_from_checkpoint="latest")
    straight, straight_record = straight_run
    assert _batches(record) == {s: b for s, b in _batches(straight_record).items() if s >= 2}
    _assert_same_weights(resumed.model.state_dict(), straight.model.state_dict())
