"""`benchmarks/sglang_e2e.py` end to end on CPU, against the SGLang test double (`fake_sglang_server`).

The script launches its server with ``--server-cmd``; here that command is this file run as a script: it accepts
the launch flags the benchmark passes to ``sglang.launch_server`` (and the LoRA ones), serves the model directory
with `FakeSGLangServer`, and exits with argparse's error on any other flag, as a server without that flag does.
The numbers are whatever the test double returns; the test checks the structure of the results, that every phase
is recorded, and that a server that does not come up is recorded with its cause and its log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def serve(argv: list[str] | None = None) -> None:
    """``sglang.launch_server``'s flags that the benchmark sends, served by `FakeSGLangServer` (0.5.17 routes)."""
    import torch
    from fake_sglang_server import FakeSGLangServer
    from transformers import AutoModelForCausalLM

    from trl_ext.rollout.embedded import EmbeddedEngine

    p = argparse.ArgumentParser(prog="fake launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--attention-backend")
    p.add_argument("--sampling-backend")
    p.add_argument("--grammar-backend")
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*")
    args = p.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    engine = EmbeddedEngine(model, seed=0, initial_version=None)
    server = FakeSGLangServer(
        engine,
        host=args.host,
        port=args.port,
        model_path=args.model_path,
        version="0.5.17",
        enable_lora=args.enable_lora,
    ).start()
    print(f"serving {args.model_path} at {server.url}", flush=True)
    while True:
        time.sleep(3600)


def run_script(cmd: list[str], out: Path, timeout: float) -> tuple[dict, str]:
    """Run the benchmark as users do (``python -m``); its results JSON and its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return json.loads((out / "sglang_e2e.json").read_text()), log


def test_sglang_e2e_records_every_phase(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "benchmarks.sglang_e2e",
        "--model", "tiny", "--layers", "2", "--device", "cpu", "--out", str(out),
        "--server-cmd", f"{sys.executable} {Path(__file__).resolve()}",
        "--num-prompts", "1", "--max-new-tokens", "4",
        "--agent-prompts", "1", "--agent-max-turns", "2", "--agent-turn-tokens", "4",
        "--train-rows", "2", "--train-steps", "1", "--num-generations", "2", "--train-completion-tokens", "4",
        "--trainer-modes", "disk,tensor,lora", "--lora-sync-mode", "disk", "--mismatch-configs", "default,deterministic",
        "--ready-timeout-s", "60", "--budget-s", "300",
    ]  # fmt: skip
    results, log = run_script(cmd, out, timeout=240)
    phases = results["phases"]
    assert set(phases) == {"generate", "trainer", "mismatch", "sync_timing"}, log[-3000:]
    for name, ph in phases.items():
        assert ph["status"] in ("ok", "partial", "failed", "skipped"), (name, ph)
        if ph["status"] != "ok":
            assert ph.get("error"), (name, ph)

    gen = phases["generate"]
    assert gen["status"] == "ok", gen
    assert gen["result"]["generate"]["output_tokens"] >= 1
    assert gen["result"]["generate"]["logprobs_finite"] is True
    assert gen["result"]["agent"]["num_trajectories"] == 1

    trainer = phases["trainer"]["result"]
    assert trainer["disk"]["status"] == "ok" and trainer["lora"]["status"] == "ok", trainer
    for mode in ("disk", "tensor", "lora"):  # tensor: CPU tensors through shared memory, may fail between processes
        rec = trainer[mode]
        assert rec["status"] in ("ok", "failed"), rec
        if rec["status"] == "ok":
            versions = [s["version"] for s in rec["syncs"]]
            assert versions == [0, 1], rec["syncs"]
            assert all("transfer_s" in s and "probe_dlogp_mean" in s and s["probe_pass"] for s in rec["syncs"])
            # the weight sync's records (`trl_ext.weight_sync.SyncRecord`), the trainer's whole push included
            assert all(s["sync_total_s"] >= s["transfer_s"] + s["verify_s"] for s in rec["syncs"]), rec["syncs"]
            assert {s["kind"] for s in rec["syncs"]} == {"lora" if mode == "lora" else "merged"}
            assert [s["step"] for s in rec["steps"]] == [1] and rec["steps"][0]["step_s_without_sync"] > 0
        else:
            assert rec["error"] and rec["server_log_tail"]
    assert trainer["lora"]["server_flags"][:1] == ["--enable-lora"]

    configs = phases["mismatch"]["result"]["configs"]
    default = configs["default"]
    assert default["status"] == "ok", default
    rows = {r["attention"]: r for r in default["rows"]}
    assert "k3_kl" in rows["eager (sinks)"] and "prob_diff_max" in rows["eager (sinks)"]
    assert rows["flex_attention + sinks"]["note"].startswith("skipped")  # CPU: flex refuses sinks
    # the test double has no --enable-deterministic-inference: the server exits, and that is recorded with its log
    det = configs["deterministic"]
    assert det["status"] == "failed" and "exited" in det["error"], det
    assert "unrecognized arguments: --enable-deterministic-inference" in det["server_log_tail"]

    timing = phases["sync_timing"]["result"]["modes"]
    assert set(timing) == {"disk", "tensor", "lora"}
    assert timing["disk"]["repeats"] == 2 and timing["disk"]["gb_per_s"] > 0
    assert timing["lora"]["bytes"] < timing["disk"]["bytes"]

    md = (out / "sglang_e2e.md").read_text()
    for heading in ("## 1. generate", "## 2. trainer", "## 3. mismatch", "## 4. sync_timing", "## Server launches"):
        assert heading in md
    assert "| server flags | sampled tokens | training attention |" in md and "--enable-deterministic-inference" in md
    assert (out / "sglang_e2e.png").stat().st_size > 0
    assert results["meta"]["total_s"] < 200

    # --merge: two partial runs of the same model give back the whole report, sync timing recomputed
    import pytest

    from benchmarks.sglang_e2e import main

    first = {**results, "phases": {k: phases[k] for k in ("generate", "trainer")}}
    first["phases"]["mismatch"] = {"status": "skipped", "error": "skipped for time"}
    second = {**results, "phases": {"mismatch": phases["mismatch"]}, "launches": []}
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(second))
    merged_out = tmp_path / "merged"
    merged = main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(merged_out)])
    assert {k: merged["phases"][k] for k in ("generate", "trainer", "mismatch")} == {
        k: phases[k] for k in ("generate", "trainer", "mismatch")
    }
    assert merged["phases"]["sync_timing"]["result"]["modes"] == json.loads(json.dumps(timing))
    assert [m["json"] for m in merged["meta"]["merged_from"]] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert "## 3. mismatch" in (merged_out / "sglang_e2e.md").read_text()
    # weight sync modes merge one by one: a later run of one mode replaces only that mode, and the status follows
    failed_disk = {**phases["trainer"]["result"]["disk"], "status": "failed", "error": "WeightSyncError: probe"}
    third = {**results, "phases": {"trainer": {"status": "failed", "result": {"disk": failed_disk}}}, "launches": []}
    (tmp_path / "t.json").write_text(json.dumps(third))
    paths = [str(tmp_path / n) for n in ("a.json", "t.json")]
    remerged = main(["--merge", *paths, "--out", str(tmp_path / "remerged")])["phases"]["trainer"]
    assert remerged["result"]["disk"] == failed_disk
    assert remerged["result"]["tensor"] == phases["trainer"]["result"]["tensor"]
    assert remerged["status"] == "partial" and remerged["error"].startswith("disk: WeightSyncError")
    merged_again = main(["--merge", *paths, str(tmp_path / "a.json"), "--out", str(tmp_path / "remerged")])
    assert merged_again["phases"]["trainer"]["status"] == phases["trainer"]["status"]
    assert "Merged from 3 runs" in (tmp_path / "remerged" / "sglang_e2e.md").read_text()
    other = {**second, "model": {**results["model"], "num_hidden_layers": 3}}
    (tmp_path / "c.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="another model"):
        main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--out", str(merged_out)])


def test_sglang_e2e_cold_start_trains_the_served_model(tmp_path):
    """``--cold-start-steps``: the model is fine-tuned on the tool-calling demonstrations before it is saved, the
    record has the SFT steps, losses, practised rows and the sinks before/after, the saved weights are the trained
    ones, and the agent loop runs on the practised problems."""
    import torch
    from safetensors.torch import load_file

    out, model_dir = tmp_path / "out", tmp_path / "model"
    cmd = [
        sys.executable, "-m", "benchmarks.sglang_e2e",
        "--model", "tiny", "--device", "cpu", "--out", str(out), "--model-dir", str(model_dir),
        "--server-cmd", f"{sys.executable} {Path(__file__).resolve()}", "--phases", "generate",
        "--cold-start-steps", "2", "--cold-start-problems", "2", "--cold-start-batch", "2",
        "--num-prompts", "1", "--max-new-tokens", "4",
        "--agent-prompts", "2", "--agent-max-turns", "2", "--agent-turn-tokens", "16",
        "--ready-timeout-s", "60", "--budget-s", "200",
    ]  # fmt: skip
    results, _ = run_script(cmd, out, timeout=180)
    assert "model_error" not in results, results.get("model_traceback")
    cold = results["model"]["cold_start"]
    assert cold["steps"] == 2 and cold["steps_logged"] == 2, cold
    assert [h["step"] for h in cold["history"]] == [1, 2]
    assert cold["first_loss"] == cold["history"][0]["loss"] and cold["last_loss"] == cold["history"][1]["loss"]
    assert all(torch.isfinite(torch.tensor(h["loss"])) and h["loss"] > 0 for h in cold["history"])
    assert cold["wall_s"] > 0 and cold["precision"] == "float32"
    practised = cold["rows_practised"]
    assert len(practised) == 2 and len(set(practised)) == 2 and all(0 <= i < 64 for i in practised), practised

    # the sinks moved (step 1 is the warm-up at learning rate 0; step 2 moves every sink by about the learning rate,
    # up or down, so a layer's mean may stay put but not its mean and std together) and the saved bf16 weights are
    # the trained ones
    sinks = results["model"]["sinks"]
    assert [s["param"] for s in sinks["initial"]] == [s["param"] for s in sinks["after_cold_start"]]
    moved = [
        abs(a["mean"] - b["mean"]) + abs(a["std"] - b["std"])
        for a, b in zip(sinks["initial"], sinks["after_cold_start"])
    ]
    assert max(moved) > 1e-2, sinks
    saved = load_file(str(model_dir / "model.safetensors"))
    for s in sinks["after_cold_start"]:
        assert saved[s["param"]].dtype == torch.bfloat16
        assert abs(saved[s["param"]].float().mean().item() - s["mean"]) < 2e-2, (s, saved[s["param"]])

    gen = results["phases"]["generate"]
    assert gen["status"] == "ok", gen
    agent = gen["result"]["agent"]
    assert agent["status"] == "ok" and agent["num_trajectories"] == 2, agent
    assert f"rows {practised}" in agent["prompts_how"] and "practised" in agent["prompts_how"]
    md = (out / "sglang_e2e.md").read_text()
    assert "## Cold start" in md and "Model: cold-started GPT-OSS" in md and "after the cold start" in md
    work_dir = results["meta"]["work_dir"]
    assert work_dir.endswith("(removed; --keep-work-dir keeps it)") and not Path(work_dir.split(" (")[0]).exists()

    # --merge refuses to put a cold-started run and a random-weights run of the same shapes into one report
    import pytest

    from benchmarks.sglang_e2e import main

    random_run = {**results, "model": {**results["model"], "cold_start": None}}
    (tmp_path / "random.json").write_text(json.dumps(random_run))
    with pytest.raises(ValueError, match="another model.*cold_start"):
        main(["--merge", str(out / "sglang_e2e.json"), str(tmp_path / "random.json"), "--out", str(tmp_path / "m")])


def test_sglang_e2e_with_url_resets_the_servers_weights_before_the_mismatch(tmp_path):
    """``--url``: the script does not launch anything; the trainer syncs into that server, so the mismatch phase
    first puts --model-dir's weights back (a disk sync), and the launch-only configurations are recorded as such."""
    import torch
    from fake_sglang_server import FakeSGLangServer
    from transformers import AutoModelForCausalLM

    from benchmarks.sglang_e2e import build_model, parse_args
    from trl_ext.rollout.embedded import EmbeddedEngine

    model_dir = tmp_path / "model"
    build_model(parse_args(["--model", "tiny", "--model-dir", str(model_dir)]), torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    server = FakeSGLangServer(EmbeddedEngine(model, seed=0, initial_version=None), version="0.5.17").start()
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "benchmarks.sglang_e2e", "--url", server.url,
        "--model", "tiny", "--model-dir", str(model_dir), "--device", "cpu", "--out", str(out),
        "--phases", "trainer,mismatch", "--trainer-modes", "disk", "--mismatch-configs", "default,fp32_lm_head",
        "--num-prompts", "1", "--max-new-tokens", "4",
        "--train-rows", "2", "--train-steps", "1", "--num-generations", "2", "--train-completion-tokens", "4",
    ]  # fmt: skip
    try:
        results, _ = run_script(cmd, out, timeout=180)
        assert server.request_counts["/update_weights_from_disk"] == 3  # trainer: versions 0 and 1; then the reset
        assert server.served_version == "0"
        assert not results["launches"]
    finally:
        server.stop()
        server.engine.shutdown()
    assert results["phases"]["trainer"]["result"]["disk"]["status"] == "ok"
    configs = results["phases"]["mismatch"]["result"]["configs"]
    assert configs["default"]["status"] == "ok" and "reset" in configs["default"]["note"]
    assert configs["fp32_lm_head"]["status"] == "failed" and "--url was given" in configs["fp32_lm_head"]["error"]


if __name__ == "__main__":  # launched by the benchmark as its SGLang server (fake_sglang_server sits next to it)
    serve()
