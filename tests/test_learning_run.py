"""CPU smoke test of `benchmarks/learning_run.py`: both variants run end to end on the tiniest
settings and the report files hold what the trainer logged. Its numbers are not results."""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("openai_harmony")

from benchmarks import learning_run


@pytest.mark.timeout(300)  # ~10 s on 2 cores (conftest routes the kernel to its PyTorch path on CPU)
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel on CPU tensors needs TRITON_INTERPRET=1 from the start",
)
def test_learning_run_cpu_smoke(tmp_path):
    result = learning_run.main(
        [
            "--device",
            "cpu",
            "--model-size",
            "tiny",
            "--steps",
            "2",
            "--cold-start-steps",
            "2",
            "--cold-start-batch",
            "2",
            "--warmup-steps",
            "2",
            "--num-generations",
            "2",
            "--batch-size",
            "2",
            "--max-completion-length",
            "8",
            "--max-turns",
            "2",
            "--eval-limit",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert set(result["variants"]) == {"sink_dropping", "sink_kernel"}
    for name, run in result["variants"].items():
        assert run["steps_done"] == 2, name
        assert [s["step"] for s in run["steps"]] == [1, 2]
        first = run["steps"][0]  # a generation step: every per-step series is present and finite
        for key in (
            "reward",
            "tool_call_rate",
            "grad_norm",
            "clip_fraction",
            "mismatch_k3_kl",
            "mismatch_prob_diff_max",
        ):
            assert first[key] is not None and math.isfinite(first[key]), (name, key)
        assert 0.0 <= run["held_out_before"]["accuracy"] <= 1.0 and run["held_out_after"]["n"] == 1
        assert run["practised_after"]["n"] == 1
        # --warmup-steps 2: the first step runs at half the learning rate
        assert run["steps"][0]["learning_rate"] < run["steps"][1]["learning_rate"]
    # RL draws its prompts from the problems the warm-up practised (a subset of the training file)
    setup = result["setup"]
    assert setup["rl_problems"] == "practised"
    assert 0 < setup["cold_start_problems"] == setup["train_rows"] <= setup["train_file_rows"]
    # rollouts use exact sinks: the kernel reproduces them to fp32 rounding, dropping the sinks does not
    kernel_kl = result["variants"]["sink_kernel"]["steps"][0]["mismatch_k3_kl"]
    dropping_kl = result["variants"]["sink_dropping"]["steps"][0]["mismatch_k3_kl"]
    assert result["variants"]["sink_kernel"]["attention"] == learning_run.SPAN_KERNEL_ATTENTION
    assert kernel_kl < 1e-8 < dropping_kl, (kernel_kl, dropping_kl)
    saved = json.loads((tmp_path / "learning_run.json").read_text())
    assert saved["variants"]["sink_kernel"]["steps"] == result["variants"]["sink_kernel"]["steps"]
    assert (tmp_path / "learning_run.png").stat().st_size > 0
    table = (tmp_path / "learning_run.md").read_text()
    assert "| sink_dropping |" in table and "| sink_kernel |" in table


def test_learning_run_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        learning_run.parse_args(["--variants", "flash"])
    with pytest.raises(SystemExit):
        learning_run.parse_args(["--batch-size", "6", "--num-generations", "4"])
