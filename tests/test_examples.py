"""The examples and the notebook run end to end on CPU (shortened: fewer steps than their defaults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_grpo_retool_under_accelerate_launch(tmp_path):
    """The README's main job (`accelerate launch examples/grpo_retool.py`), with 2 RL steps and a shorter cold start."""
    out = tmp_path / "retool"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
        str(EXAMPLES / "grpo_retool.py"), "--max-steps", "2", "--cold-start-steps", "20", "--output-dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "done: 2 steps" in result.stdout
    metrics = _read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("reward", "rollout/tool_calls_mean", "mismatch/k3_kl", "mismatch/prob_diff_max", "loss"):
            assert key in m and m[key] == m[key]  # logged and not NaN
        assert m["clip_ratio/region_mean"] == 0.0  # on-policy: ratio exactly 1
        assert m["rollout/weight_version"] == m["step"]  # the engine follows every optimizer step


@pytest.mark.slow
def test_grpo_gsm8k_single_turn(tmp_path):
    out = tmp_path / "gsm8k"
    cmd = [
        sys.executable, str(EXAMPLES / "grpo_gsm8k.py"), "--max-steps", "1", "--cold-start-steps", "5",
        "--max-completion-length", "48", "--output-dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (metrics,) = _read_metrics(out / "metrics.jsonl")
    assert metrics["rollout/tool_calls_mean"] == 0.0 and metrics["rollout/turns_mean"] == 1.0
    assert "mismatch/k3_kl" in metrics


@pytest.mark.slow
def test_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook_dir = EXAMPLES / "notebooks"
    nb = nbformat.read(notebook_dir / "agentic_grpo.ipynb", as_version=4)
    # run from a copy of the folder layout so outputs land in tmp_path; the notebook finds examples/ via ".."
    work = tmp_path / "examples" / "notebooks"
    work.mkdir(parents=True)
    (tmp_path / "examples" / "grpo_retool.py").write_text((EXAMPLES / "grpo_retool.py").read_text())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gsm8k_train_mini.jsonl").write_text((REPO / "data" / "gsm8k_train_mini.jsonl").read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    old_pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    try:
        client = nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}}
        )
        client.execute()
    finally:
        if old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pythonpath
    outputs = "".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert "global_step=2" in outputs
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_grpo_retool_ddp_two_cpu_processes(tmp_path):
    """`torchrun --nproc_per_node 2` (DDP over gloo): rewards/metrics gathered, each rank's engine synced."""
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        str(EXAMPLES / "grpo_retool.py"), "--max-steps", "2", "--cold-start-steps", "5",
        "--per-device-train-batch-size", "4", "--max-completion-length", "48", "--output-dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("done: 2 steps") == 1  # printed by the main process of the 2
    assert "world size 2" in result.stdout
    metrics = _read_metrics(out / "metrics.jsonl")  # written by the main process only
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/weight_version"] == m["step"] for m in metrics)
