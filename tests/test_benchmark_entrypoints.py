"""The benchmark scripts' command lines (CPU, no GPU needed).

- Both documented forms start: ``python benchmarks/<name>.py`` and ``python -m benchmarks.<name>``, from the
  repository root.
- A run that fails exits with a non-zero status (after writing what it measured).
- The default output folder (``docs/benchmarks/``) never replaces a report that is already there: that takes an
  explicit ``--out``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def test_the_benchmark_list_is_complete():
    assert set(SCRIPTS) >= {
        "attention", "trainer_step", "learning_run", "logprobs", "mismatch_study", "moe", "quickstart",
        "sequence_parallel", "sglang_e2e",
    }  # fmt: skip


def test_every_benchmark_starts_as_a_file_and_as_a_module():
    """``--help`` in both forms exits 0 (run a few at a time: each imports torch, some transformers)."""
    commands = [[f"benchmarks/{name}.py"] for name in SCRIPTS] + [["-m", f"benchmarks.{name}"] for name in SCRIPTS]

    def run(form):
        proc = subprocess.run([sys.executable, *form, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
        return " ".join(form), proc

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        results = list(pool.map(run, commands))
    failed = {
        cmd: f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-600:]}"
        for cmd, proc in results
        if proc.returncode != 0 or "usage" not in proc.stdout
    }
    assert not failed, json.dumps(failed, indent=1)


# --------------------------------------------------------------------------------------------------- failing runs


def test_sglang_e2e_run_as_a_file_exits_nonzero_when_it_fails(tmp_path):
    """The file form finds the `benchmarks` package at run time too, and a run whose model or server does not come
    up (here: a server command whose module does not exist) exits non-zero after writing its report."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "benchmarks/sglang_e2e.py", "--model", "tiny", "--device", "cpu", "--out", str(out),
        "--phases", "generate", "--server-cmd", f"{sys.executable} -m no_such_sglang_module",
        "--ready-timeout-s", "30", "--budget-s", "120",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert "No module named 'benchmarks'" not in log, log[-3000:]
    assert proc.returncode != 0, log[-3000:]
    results = json.loads((out / "sglang_e2e.json").read_text())
    assert results.get("model_error") or results["phases"]["generate"]["status"] == "failed", results
    assert results["meta"]["disable_cuda_graph"] is False  # CUDA graphs on unless asked


def test_sglang_e2e_run_failures():
    from benchmarks.sglang_e2e import run_failures

    ok = {"phases": {"generate": {"status": "ok"}, "trainer": {"status": "partial", "error": "tensor: x"}}}
    assert run_failures(ok) == []
    assert run_failures({**ok, "model_error": "ModuleNotFoundError: x"})[0].startswith("model build")
    failed = {"phases": {**ok["phases"], "mismatch": {"status": "failed", "error": "default: exited"}}}
    assert run_failures(failed) == ["mismatch: failed (default: exited)"]
    skipped = {"phases": {"generate": {"status": "skipped", "error": "skipped for time"}}}
    assert run_failures(skipped) == ["generate: skipped (skipped for time)"]


def test_sglang_e2e_cuda_graphs_are_on_unless_disabled(tmp_path):
    from benchmarks.sglang_e2e import E2E_LAUNCH_FLAGS, cuda_graph_disabled, parse_args
    from trl_ext.sglang_serve import ServerManager

    def command(args, flags):
        return ServerManager.from_args(args, tmp_path, tmp_path, E2E_LAUNCH_FLAGS).command(flags, 1234)

    args = parse_args(["--server-cmd", "python -m sglang.launch_server"])
    assert "--disable-cuda-graph" not in command(args, [])
    args = parse_args(["--server-cmd", "python -m sglang.launch_server", "--disable-cuda-graph"])
    assert command(args, ["--enable-lora"]).count("--disable-cuda-graph") == 1
    assert cuda_graph_disabled(args) is True
    args = parse_args(["--server-args=--disable-cuda-graph", "--disable-cuda-graph"])
    assert command(args, []).count("--disable-cuda-graph") == 1
    assert cuda_graph_disabled(parse_args(["--server-args=--disable-cuda-graph"])) is True
    assert cuda_graph_disabled(parse_args([])) is False
    assert cuda_graph_disabled(parse_args(["--url", "http://127.0.0.1:1"])) is None  # a server it did not launch


def test_sequence_parallel_exits_nonzero_when_a_point_fails(tmp_path, monkeypatch):
    """An OOM ends the search for that P (a result); a worker that crashes or times out fails the run."""
    from benchmarks import sequence_parallel

    def point(reason):
        def run_point(args, mode, gpus, seq_len):
            return dict(mode=mode, gpus=gpus, seq_len=seq_len, ok=False, reason=reason)

        return run_point

    argv = ["--device", "cpu", "--model", "tiny", "--gpus", "1", "--seq-lens", "64", "--no-stock"]
    monkeypatch.setattr(sequence_parallel, "run_point", point("OOM"))
    sequence_parallel.main([*argv, "--out", str(tmp_path / "oom")])
    monkeypatch.setattr(sequence_parallel, "run_point", point("failed"))
    with pytest.raises(SystemExit) as exc:
        sequence_parallel.main([*argv, "--out", str(tmp_path / "crash")])
    assert exc.value.code not in (0, None)
    assert json.loads((tmp_path / "crash" / "sequence_parallel.json").read_text())[0]["reason"] == "failed"


def test_learning_run_failures():
    from benchmarks.learning_run import run_failures

    good = {"steps_done": 2, "steps": [{"loss": 0.5, "reward_std": 0.1}, {"loss": 0.25}], "weight_change_rel": 1e-3}

    def arms(**runs):
        return {"arms": {name: {"runs": {"0": run}} for name, run in runs.items()}}

    assert run_failures(arms(a=good)) == []
    assert run_failures({"arms": {}}) == ["no run finished"]
    none = run_failures(arms(a=good, b={**good, "steps_done": 0, "steps": []}))
    assert none == ["b seed 0: no optimizer step finished"]
    nan = run_failures(arms(a={**good, "steps": [{"loss": float("nan"), "reward_std": 0.1}]}))
    assert nan == ["a seed 0: non-finite loss at step 1"]
    assert run_failures({"arms": {}, "check_failures": ["sink control failed"]}) == ["sink control failed"]


def test_mismatch_study_failures():
    from benchmarks.mismatch_study import run_failures

    rows = [{"attention": "eager", "k3_kl": 0.1}, {"attention": "flex", "note": "skipped: CPU"}]
    good = {"model": "tiny", "rows": rows, "exact": {"reference": "fp32"}}
    assert run_failures([good], []) == []
    broken = {**good, "rows": [*rows, {"attention": "kernel", "note": "error: RuntimeError: x"}]}
    assert run_failures([broken], []) == ["tiny, kernel: error: RuntimeError: x"]
    no_exact = {**good, "exact": {"note": "error: OOM"}}
    assert run_failures([no_exact], []) == ["tiny, exact reference: error: OOM"]
    assert run_failures([], [{"model": "20b", "error": "OOM"}]) == ["20b: OOM"]


def test_attention_failures():
    from benchmarks.attention import run_failures

    result = {
        "kernel_rows": [{"case": "S=4k causal", "errors": {"FA4": "RuntimeError: x"}}],
        "stack_rows": [],
        "layer_rows": [],
        "accuracy": [{"case": "S=4k causal"}],
        "targets": [{"target": "fast", "value": "2x", "met": False}, {"target": "n/a", "value": "-", "met": None}],
    }
    assert run_failures(result, accuracy_cases=1, gpu=False) == ["S=4k causal, FA4: RuntimeError: x"]
    assert run_failures(result, accuracy_cases=2, gpu=True) == [
        "S=4k causal, FA4: RuntimeError: x",
        "accuracy: 1 of 2 cases failed (see the log)",
        "target not met: fast (2x)",
    ]


# ------------------------------------------------------------------------------------------------- output folder


def _repo_copy(tmp_path: Path) -> Path:
    """The benchmark scripts and the committed reports in a scratch repository (the scripts write next to their
    own root: `docs/benchmarks/` there), so that a script that would overwrite a report harms nothing."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "benchmarks", root / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "notes"))
    shutil.copytree(REPO / "docs" / "benchmarks", root / "docs" / "benchmarks")
    (root / "data").symlink_to(REPO / "data")
    (root / "docs" / "benchmarks" / "sequence_parallel.json").write_text("[]\n")  # no committed one yet
    return root


REPORTS = REPO / "docs" / "benchmarks"
# per script: arguments that make it write its report quickly on a CPU (a re-render where it has one); each
# writes into the default folder, where the report is already there
DEFAULT_OUT_RUNS = {
    "attention": ["--from-json", "{reports}/attention.json"],
    "learning_run": ["--from-json", "{reports}/learning_run.json"],
    "logprobs": ["--from-json", "{reports}/logprobs.json"],
    "mismatch_study": ["--model", "tiny", "--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "2"],
    "moe": ["--from-json", "{reports}/moe.json"],
    "quickstart": ["--from-json", "{reports}/quickstart.json"],
    "sequence_parallel": [],
    "sglang_e2e": ["--from-json", "{reports}/sglang_e2e.json"],
    "routing_replay": ["--from-json", "{reports}/routing_replay.json"],
    "routing_mismatch_cost": [],  # refused before anything is measured
    "trainer_step": ["--from-json", "{reports}/trainer_step.json"],
}


def test_every_benchmark_has_a_default_out_case():
    assert set(DEFAULT_OUT_RUNS) == set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(DEFAULT_OUT_RUNS))
def test_default_out_refuses_to_overwrite_a_report(tmp_path, name):
    root = _repo_copy(tmp_path)
    reports = root / "docs" / "benchmarks"
    before = {p.name: p.read_bytes() for p in reports.iterdir()}
    args = [a.format(reports=reports) for a in DEFAULT_OUT_RUNS[name]]
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", *args], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "refusing to overwrite" in proc.stderr and "--out" in proc.stderr, proc.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in reports.iterdir()} == before  # nothing written, nothing replaced


def test_explicit_out_replaces_a_report_and_default_out_writes_a_new_one(tmp_path):
    """Naming the folder is how a committed report is replaced on purpose; with no report there yet, the default
    folder is used as before."""
    root = _repo_copy(tmp_path)
    reports = root / "docs" / "benchmarks"
    saved = tmp_path / "moe.json"
    shutil.copy(reports / "moe.json", saved)
    (reports / "moe.md").write_text("stale\n")
    cmd = [sys.executable, "benchmarks/moe.py", "--from-json", str(saved)]
    proc = subprocess.run([*cmd, "--out", "docs/benchmarks"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (reports / "moe.md").read_text() == (REPORTS / "moe.md").read_text()
    for suffix in ("json", "md", "png"):
        (reports / f"moe.{suffix}").unlink()
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (reports / "moe.md").read_text() == (REPORTS / "moe.md").read_text()


# ------------------------------------------------------------------------------------- committed reports, re-rendered

# (script, its JSON, the report it renders): every committed report is its JSON rendered by today's renderer, so a
# report holds the run it describes and nothing a renderer would not write again. (learning_run.md is rendered from a
# report of the script's earlier, one-seed layout, which today's renderer lays out differently.)
RERENDERED = [
    ("attention", "attention.json", "attention.md"),
    ("logprobs", "logprobs.json", "logprobs.md"),
    ("moe", "moe.json", "moe.md"),
    ("quickstart", "quickstart.json", "quickstart.md"),
    ("routing_replay", "routing_replay.json", "routing_replay.md"),
    ("sglang_e2e", "sglang_e2e.json", "sglang_e2e.md"),
    ("trainer_step", "trainer_step.json", "trainer_step.md"),
    ("trainer_step", "trainer_step_ragged.json", "trainer_step_ragged.md"),
]


@pytest.mark.parametrize(("script", "saved", "report"), RERENDERED, ids=[r[1] for r in RERENDERED])
def test_committed_reports_are_their_json_rendered_again(tmp_path, script, saved, report):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", "--from-json", str(REPORTS / saved), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / report).read_text() == (REPORTS / report).read_text(), (
        f"docs/benchmarks/{report} is not what `python benchmarks/{script}.py --from-json docs/benchmarks/{saved} "
        "--out docs/benchmarks` writes: re-render it instead of editing it"
    )
    assert json.loads((out / saved).read_text()) == json.loads((REPORTS / saved).read_text())


# absolute paths into a machine's scratch, work or home folders, and notes about an earlier run of a report
_MACHINE_FOLDERS = ("tmp", "var/tmp", "work", "home", "root")
_EARLIER_RUN = ("Previous run", "Previous headline")
LOCAL = re.compile(
    r"(?<![\w.])/(" + "|".join(map(re.escape, _MACHINE_FOLDERS)) + r")/|" + "|".join(map(re.escape, _EARLIER_RUN))
)


def test_reports_name_no_local_path_and_no_earlier_run():
    found = [
        f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for path in sorted(REPORTS.glob("*"))
        if path.suffix in (".json", ".md")
        for text in [path.read_text()]
        for m in LOCAL.finditer(text)
    ]
    assert not found, found


def test_without_local_paths_replaces_this_machines_folders():
    from benchmarks._cli import REPO as ROOT
    from benchmarks._cli import without_local_paths

    report = {
        "command": "python -m benchmarks.sglang_e2e --model-dir /tmp/e2e_model --out /tmp/run1",
        "server": ["env PYTHONPATH=/tmp/sgl_site python3 -m sglang.launch_server --model-path /tmp/e2e_model"],
        "log": f"{ROOT}/docs/benchmarks/logs/server.log",
        "kept": "/opt/sglang/bin/python /tmpfs/x",
        7: 1.5,
    }
    cleaned = without_local_paths(report, {"/tmp/e2e_model": "MODEL_DIR"})
    assert cleaned == {
        "command": "python -m benchmarks.sglang_e2e --model-dir MODEL_DIR --out $TMPDIR/run1",
        "server": ["env PYTHONPATH=$TMPDIR/sgl_site python3 -m sglang.launch_server --model-path MODEL_DIR"],
        "log": "./docs/benchmarks/logs/server.log",
        "kept": "/opt/sglang/bin/python /tmpfs/x",
        7: 1.5,
    }
