"""CPU tests of `benchmarks/learning_run.py`: every arm and seed runs end to end on the tiniest settings, against
the embedded engine and the SGLang test double; the checks before the arms fail on a policy without reward signal,
a server without sinks and a stale server. Their numbers are not results."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("openai_harmony")

from benchmarks import learning_run
from hf_gptoss_rl.attention_variants import SPAN_KERNEL_ATTENTION

SMOKE = [
    "--device", "cpu", "--model-size", "tiny", "--steps", "2", "--cold-start-steps", "2", "--cold-start-batch", "2",
    "--warmup-steps", "2", "--num-generations", "2", "--batch-size", "2", "--max-completion-length", "8",
    "--max-turns", "2", "--eval-limit", "1", "--eval-slice", "1", "--eval-every", "1", "--control-prompts", "2",
    "--num-iterations", "1",  # every step generates: each step's served version is logged
]  # fmt: skip
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel on CPU tensors needs TRITON_INTERPRET=1 from the start",
)


@pytest.mark.timeout(600)
@needs_interpreter
def test_learning_run_cpu_smoke(tmp_path):
    """Three arms x two seeds on the embedded engine: every per-step series is logged, only the kernel arm's sinks
    move, and the kernel arms reproduce the exact-sink rollouts where dropping does not."""
    result = learning_run.main(
        SMOKE + ["--seeds", "0,1", "--no-policy-check", "--no-require-reward-signal", "--out", str(tmp_path)]
    )
    assert set(result["arms"]) == {"sink_kernel", "frozen_sinks", "sink_dropping"}
    control = result["sink_control"]  # the embedded engine runs the trainer's exact-sink eager attention
    assert control["passed"] and control["mean_abs_logp_diff_with_sinks"] < 1e-4
    assert control["mean_abs_logp_diff_without_sinks"] > 1e-2
    for name, arm in result["arms"].items():
        assert set(arm["runs"]) == {"0", "1"}
        for run in arm["runs"].values():
            assert run["steps_done"] == 2, name
            assert [s["step"] for s in run["steps"]] == [1, 2]
            first = run["steps"][0]  # a generation step: every per-step series is present and finite
            for key in ("reward", "reward_std", "tool_call_rate", "grad_norm", "clip_fraction", "mismatch_k3_kl",
                        "mismatch_prob_diff_max", "is_weight_std", "rollout_s", "step_s", "weight_sync_s",
                        "sampled_accuracy", "weight_version"):  # fmt: skip
                assert first[key] is not None and math.isfinite(first[key]), (name, key)
            assert first["weight_version"] == 0 and run["steps"][1]["weight_version"] == 1  # served = step - 1
            assert run["steps"][0]["learning_rate"] < run["steps"][1]["learning_rate"]  # --warmup-steps 2
            assert run["weight_change_rel"] > 0
            # only the kernel arm's sinks get a gradient: frozen sinks stay, dropped sinks never enter the loss
            assert (run["sink_change_max"] > 0.0) == (name == "sink_kernel"), (name, run["sink_change_max"])
    # same prompts per seed across arms; the kernel reproduces the exact-sink engine, dropping the sinks does not
    k3 = {name: arm["runs"]["0"]["steps"][0]["mismatch_k3_kl"] for name, arm in result["arms"].items()}
    assert k3["sink_kernel"] < 1e-8 < k3["sink_dropping"] and k3["frozen_sinks"] < 1e-8, k3
    assert result["arms"]["sink_kernel"]["runs"]["0"]["attention"] == SPAN_KERNEL_ATTENTION
    saved = json.loads((tmp_path / "learning_run.json").read_text())
    assert saved["arms"]["sink_kernel"]["runs"]["1"]["steps"] == result["arms"]["sink_kernel"]["runs"]["1"]["steps"]
    assert (tmp_path / "learning_run.png").stat().st_size > 0
    table = (tmp_path / "learning_run.md").read_text()
    assert all(f"| {arm} |" in table for arm in result["arms"]) and "Sink control" in table and " ± " in table


@pytest.mark.timeout(600)
@needs_interpreter
def test_learning_run_refuses_a_policy_without_reward_signal(tmp_path):
    """The policy window is a check that fails: the tiny warm-up solves nothing, so the arms never start."""
    with pytest.raises(SystemExit, match="no reward signal to compare arms on"):
        learning_run.main(SMOKE + ["--seeds", "0", "--arms", "sink_dropping", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "learning_run.json").read_text())
    assert saved["arms"] == {} and "sampled accuracy 0.00" in saved["check_failures"][0]


def _fake_server_cmd(*faults: str) -> list[str]:
    server = Path(__file__).resolve().parent / "fake_sglang_server.py"
    return ["--rollout-backend", "sglang", "--precision", "fp32", "--server-cmd", f"{sys.executable} {server}",
            f"--server-args={' '.join(faults)}", "--ready-timeout-s", "120"]  # fmt: skip


@pytest.mark.timeout(600)
def test_learning_run_against_a_server_that_honours_sinks_and_sync(tmp_path):
    """SGLang backend against the test double: control passed, every step served by the version synced after the
    previous one (verified by checksums), the next run starting from the warm weights again."""
    result = learning_run.main(
        SMOKE
        + _fake_server_cmd()
        + [
            "--arms",
            "sink_dropping",
            "--seeds",
            "0,1",
            "--no-policy-check",
            "--no-require-reward-signal",
            "--out",
            str(tmp_path),
        ]  # fmt: skip
    )
    assert result["sink_control"]["passed"]
    rollouts = result["setup"]["rollouts"]
    assert rollouts["weight_sync"] == {"mode": "disk", "verify": ["version", "checksum"]}
    assert "--dtype float32" in rollouts["server_command"] and "--attention-backend" not in rollouts["server_command"]
    for run in result["arms"]["sink_dropping"]["runs"].values():
        assert [s["weight_version"] for s in run["steps"]] == [0, 1]
        assert all(s["stale_trajectories"] == 0 for s in run["steps"])
    assert (tmp_path / "learning_run_sglang.md").exists() and not (tmp_path / "learning_run.md").exists()


@pytest.mark.timeout(600)
def test_the_grid_split_over_processes_merges_into_one_report(tmp_path):
    """`--save-warm-start` once, two processes with `--warm-start` (one seed each, a server each), `--merge`: one
    report with both runs, both processes' checks, the grid's missing run named (partial), and no reward comparison
    from runs too short for one. Refused: a warm start saved with other settings, parts that differ in a setting or
    in their warm start, and a run present in two parts."""
    warm = ["--arms", "sink_dropping", "--no-policy-check", "--no-require-reward-signal"]
    saved = learning_run.main(SMOKE + warm + ["--save-warm-start", str(tmp_path / "warm")])
    digest = saved["warm_start"]["sha256"]
    parts = []
    for seed in (0, 1):
        out = tmp_path / f"part{seed}"
        learning_run.main(
            SMOKE + _fake_server_cmd() + warm + ["--seeds", str(seed), "--warm-start", str(tmp_path / "warm"),
                                                  "--out", str(out)]
        )  # fmt: skip
        parts.append(out / "learning_run_sglang.json")
        part = json.loads(parts[-1].read_text())
        assert part["setup"]["warm_start"] == {"sha256": digest, "loaded": True} and part["missing_runs"] == []
    merged = learning_run.main(
        ["--merge", *map(str, parts), "--rollout-backend", "sglang", "--arms", "sink_dropping", "--seeds", "0,1,2",
         "--no-require-reward-signal", "--out", str(tmp_path / "merged")]
    )  # fmt: skip
    assert set(merged["arms"]["sink_dropping"]["runs"]) == {"0", "1"} and merged["missing_runs"] == ["sink_dropping 2"]
    assert [p["runs"] for p in merged["parts"]] == [["sink_dropping 0"], ["sink_dropping 1"]]
    table = (tmp_path / "merged" / "learning_run_sglang.md").read_text()
    assert "**Partial report**: 1 of the planned 3 runs are missing (sink_dropping 2)" in table
    assert "part 1 (runs sink_dropping 0): sink control" in table and "part 2 (runs sink_dropping 1)" in table
    assert "too few steps (2 logged, needs 20)" in table and digest[:16] in table

    with pytest.raises(SystemExit, match="saved with other settings .*init_seed"):
        learning_run.main(
            SMOKE + warm + ["--init-seed", "3", "--warm-start", str(tmp_path / "warm"), "--out", str(tmp_path / "x")]
        )
    other = json.loads(parts[1].read_text())
    for key, value in (("learning_rate", 1.0), ("warm_start", {"sha256": "0" * 64, "loaded": True})):
        changed = tmp_path / f"changed_{key}.json"
        changed.write_text(json.dumps({**other, "setup": {**other["setup"], key: value}}))
        with pytest.raises(SystemExit, match=f"part 2 differs from part 1 in {key}"):
            learning_run.main(["--merge", str(parts[0]), str(changed), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="sink_dropping seed 0 is in two parts"):
        learning_run.main(["--merge", str(parts[0]), str(parts[0]), "--out", str(tmp_path / "x")])


def test_reward_windows_need_twice_their_length():
    """With fewer than 20 logged steps the first and last 10 overlap: no reward comparison, the table says why."""
    short = {"steps": [{"step": i, "reward": 0.1 * i} for i in range(1, 13)], "steps_done": 12}
    summary = learning_run.run_summary(short)
    assert summary["reward_first"] is None and summary["reward_last"] is None and summary["reward_steps"] == 12
    long = {"steps": [{"step": i, "reward": float(i >= 11)} for i in range(1, 21)], "steps_done": 20}
    summary = learning_run.run_summary(long)
    assert (summary["reward_first"], summary["reward_last"]) == (0.0, 1.0)
    arm = learning_run.arm_summary({"runs": {"0": short}})
    assert learning_run._reward_cell(arm, [short]) == "too few steps (12 logged, needs 20)"


@pytest.mark.timeout(600)
def test_learning_run_sink_control_catches_a_server_without_sinks(tmp_path):
    """Positive control of the control: a server that serves attention without the sinks fails it, no arm runs."""
    with pytest.raises(SystemExit, match="sink control failed"):
        learning_run.main(
            SMOKE
            + _fake_server_cmd("--drop-sinks")
            + ["--arms", "sink_dropping", "--seeds", "0", "--out", str(tmp_path)]
        )
    saved = json.loads((tmp_path / "learning_run_sglang.json").read_text())
    control = saved["sink_control"]
    assert not control["passed"] and saved["arms"] == {}
    assert control["mean_abs_logp_diff_with_sinks"] > control["mean_abs_logp_diff_without_sinks"] / 3


@pytest.mark.timeout(600)
def test_learning_run_refuses_a_stale_server(tmp_path):
    """A server that answers weight updates with success and keeps its weights: the verified push fails."""
    from trl_ext.weight_sync import WeightSyncError

    with pytest.raises(WeightSyncError, match="unchanged"):
        learning_run.main(
            SMOKE
            + _fake_server_cmd("--stale-weights")
            + ["--arms", "sink_dropping", "--seeds", "0", "--out", str(tmp_path)]
        )


def test_run_failures_name_what_makes_a_run_worthless():
    step = {"step": 1, "loss": 0.1, "reward_std": 0.0, "stale_trajectories": 0}
    run = {"steps_done": 1, "steps": [step], "sink_change_max": 0.0, "weight_change_rel": 1e-3}
    result = {"arms": {"sink_kernel": {"runs": {"0": run}}}}
    assert learning_run.run_failures(result, require_reward_signal=False) == []
    assert "no group had reward variance" in learning_run.run_failures(result)[0]
    frozen = {"steps_done": 1, "steps": [dict(step, reward_std=0.5)], "sink_change_max": 0.1, "weight_change_rel": 0.0}
    failures = learning_run.run_failures({"arms": {"frozen_sinks": {"runs": {"0": frozen}}}})
    assert any("frozen sinks moved" in f for f in failures) and any("no weight moved" in f for f in failures)
    stale = {"steps_done": 1, "steps": [dict(step, reward_std=0.5, stale_trajectories=2)], "weight_change_rel": 1.0}
    assert "stale weight version" in learning_run.run_failures({"arms": {"sink_kernel": {"runs": {"0": stale}}}})[0]


def test_learning_run_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        learning_run.parse_args(["--arms", "flash"])
    with pytest.raises(SystemExit):
        learning_run.parse_args(["--batch-size", "6", "--num-generations", "4"])
    with pytest.raises(SystemExit):
        learning_run.parse_args(["--seeds", "0,0"])
    with pytest.raises(SystemExit):
        learning_run.parse_args(["--accuracy-window", "0.8,0.2"])
    assert learning_run.parse_args(["--rollout-backend", "sglang"]).precision == "bf16"
    assert learning_run.parse_args([]).precision == "fp32"


def test_a_warm_start_whose_weights_changed_is_refused(tmp_path):
    """The saved weights must still be the ones the digest in warm_start.json names (a positive control: one
    weight changed by 1e-3 is caught)."""
    import torch
    from safetensors.torch import load_file, save_file

    model = torch.nn.Linear(3, 2)
    key = {"model_size": "tiny"}
    learning_run.save_warm_start(model, tmp_path, key, practised=[1, 2], cold_seconds=1.5)
    assert learning_run.load_warm_start(torch.nn.Linear(3, 2), tmp_path, key) == ([1, 2], 1.5)
    state = load_file(tmp_path / learning_run.WARM_STATE)
    state["weight"][0, 0] += 1e-3
    save_file(state, tmp_path / learning_run.WARM_STATE)
    with pytest.raises(SystemExit, match="does not match the digest"):
        learning_run.load_warm_start(torch.nn.Linear(3, 2), tmp_path, key)
