"""CPU checks of `benchmarks/trainer_step.py`: it times the trainer's own step on the trajectories it asked for, the
same ones for every stack, and its checks catch a stack that adds a policy forward or a step that does not train."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _spec(tmp_path, variant, **overrides):
    spec = {
        "model": "tiny", "layers": 1, "device": "cpu", "seq_len": 128, "trajectories": 2, "micro_batch": 1,
        "ragged": False, "ragged_median": 64, "ragged_sigma": 1.0, "warmup": 1, "repeats": 1, "profile": False,
        "variant": variant, "tmp": str(tmp_path),
    }  # fmt: skip
    return spec | overrides


def test_trainer_step_runs_both_stacks_on_the_same_trajectories(tmp_path):
    cmd = [
        sys.executable, "benchmarks/trainer_step.py", "--model", "tiny", "--device", "cpu", "--layers", "1",
        "--seq-len", "192", "--variants", "project_default,stock_eager", "--repeats", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "trainer_step.json").read_text())
    ours, stock = report["results"]
    assert [r["variant"] for r in report["results"]] == ["project_default", "stock_eager"]
    assert ours["padding_free"] and not stock["padding_free"]
    for r in (ours, stock):
        assert len(r["steps"]) == 2  # warm-up + one timed step
        # every trajectory totals the length asked for; both stacks trained on the same ones
        assert all(p + c == 192 for s in r["steps"] for p, c in s["trajectories"])
        assert r["lora_tensors_moved"].split("/")[0] == r["lora_tensors_moved"].split("/")[1]
        s = r["summary"]
        assert (s["grad_forwards_per_micro_batch"], s["no_grad_forwards_per_micro_batch"]) == (1, 0)
        assert s["tokens"] == 2 * 192 and s["seconds"] > 0 and s["rollout_s"] >= 0
    assert [s["trajectories"] for s in ours["steps"]] == [s["trajectories"] for s in stock["steps"]]
    assert ours["losses"] == pytest.approx(stock["losses"], rel=1e-4)
    md = (tmp_path / "trainer_step.md").read_text()
    assert "step time" in md and "of stock: eager" in md
    assert (tmp_path / "trainer_step.png").stat().st_size > 0


def test_ragged_lengths_come_from_each_request_seed():
    from benchmarks.trainer_step import trajectory_length

    spec = {"ragged": True, "seq_len": 8192, "ragged_median": 1024, "ragged_sigma": 1.0}
    lengths = [trajectory_length(seed, spec) for seed in range(200)]
    assert lengths == [trajectory_length(seed, spec) for seed in range(200)]
    assert min(lengths) >= 256 and max(lengths) <= 8192 and len(set(lengths)) > 100
    assert trajectory_length(7, {**spec, "ragged": False}) == 8192


def test_checks_catch_an_extra_policy_forward_and_a_step_that_does_not_train(tmp_path, monkeypatch):
    """Positive controls of `failures_of`: a reference model pass (`beta > 0`: one more forward without gradient per
    micro-batch) and a zero learning rate (no LoRA weight moves) each fail the default stack's row."""
    from benchmarks import trainer_step
    from hf_gptoss_rl.model_builders import tiny_gptoss_config

    rows = []
    for name, overrides in (("beta", {"beta": 0.04}), ("frozen", {"learning_rate": 0.0})):
        monkeypatch.setitem(
            trainer_step.VARIANTS,
            "project_default",
            {**trainer_step.VARIANTS["project_default"], "config": overrides},
        )
        result = trainer_step.worker(_spec(tmp_path / name, "project_default"))
        result["micro_batches_per_step"] = 2
        result["summary"] = trainer_step.summarize(result, tiny_gptoss_config(num_hidden_layers=1), 1, None)
        rows.append(result)
    beta, frozen = (trainer_step.failures_of([r]) for r in rows)
    assert any("1 forward(s) with grad and 1 without" in f for f in beta), beta
    assert any("LoRA tensors moved" in f for f in frozen), frozen
    assert rows[0]["lora_tensors_moved"].split("/")[0] != "0"  # the beta run did train: only its forward count fails


def test_mfu_uses_the_recorded_gpu_peak():
    """MFU = the step's model FLOPs (summed over its trajectories) / step time / the dense bf16 peak of the GPU the run
    recorded, by NVIDIA's datasheet table; none for a device without a known peak."""
    from benchmarks.trainer_step import dense_bf16_peak, grpo_step_flops, summarize
    from hf_gptoss_rl.model_builders import gptoss_20b_config

    config = gptoss_20b_config(num_hidden_layers=2)
    step = {"seconds": 2.0, "rollout_s": 0.1, "peak_gib": 50.0, "forwards": {"grad": 2, "no_grad": 0}}
    result = {"micro_batches_per_step": 2, "steps": [{**step, "trajectories": [[64, 4032], [64, 2000]]}] * 2}
    flops = grpo_step_flops(config, 4096, 64)["total"] + grpo_step_flops(config, 2064, 64)["total"]
    summary = summarize(result, config, 1, "NVIDIA H100 80GB HBM3")
    assert summary["mfu"] == pytest.approx(flops / 2.0 / 989.5e12)
    assert summary["tokens"] == 4096 + 2064 and summary["grad_forwards_per_micro_batch"] == 1
    assert dense_bf16_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756.5)
    assert "mfu" not in summarize(result, config, 1, None) and dense_bf16_peak("cpu") is None


def test_a_crashing_stack_is_reported_and_fails_the_run_an_oom_does_not(tmp_path, monkeypatch):
    import types

    from benchmarks import trainer_step

    def fake_run(stderr):
        return lambda *a, **k: types.SimpleNamespace(returncode=1, stdout="", stderr=stderr)

    argv = ["--model", "tiny", "--device", "cpu", "--variants", "project_default"]
    monkeypatch.setattr(trainer_step.subprocess, "run", fake_run("Traceback\nRuntimeError: boom"))
    with pytest.raises(SystemExit) as exc:
        trainer_step.main([*argv, "--out", str(tmp_path / "crash")])
    assert "project_default: exited with 1" in str(exc.value)
    (row,) = json.loads((tmp_path / "crash" / "trainer_step.json").read_text())["results"]
    assert row["error"] == "exited with 1" and "RuntimeError: boom" in row["tail"][-1]
    monkeypatch.setattr(trainer_step.subprocess, "run", fake_run("torch.OutOfMemoryError: CUDA out of memory"))
    trainer_step.main([*argv, "--out", str(tmp_path / "oom")])  # an OOM is a result: no failure
    assert "| project, default configuration | OOM |" in (tmp_path / "oom" / "trainer_step.md").read_text()
