"""`python -m trl_ext.sglang_serve`: the command it launches, the readiness wait, Ctrl-C stopping the server."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trl_ext.sglang_serve import parse_args, server_command

REPO = Path(__file__).resolve().parents[1]


def test_the_command_has_what_the_trainer_needs():
    args, extra = parse_args(["--model", "/ckpt", "--python", "/opt/sglang/bin/python", "--lora-rank", "8", "--",
                              "--chunked-prefill-size", "8192"])  # fmt: skip
    cmd = server_command(args, extra)
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for flag in ("--model-path /ckpt", "--skip-tokenizer-init", "--weight-version 0", "--enable-deterministic-inference",
                 "--enable-return-routed-experts --moe-runner-backend triton", "--enable-lora --max-lora-rank 8",
                 "--chunked-prefill-size 8192"):  # fmt: skip
        assert flag in joined
    assert "--disable-cuda-graph" not in cmd  # CUDA graphs on, as served
    bare = " ".join(
        server_command(*parse_args(["--model", "m", "--no-routing-replay", "--no-deterministic-inference"]))
    )
    assert "--enable-return-routed-experts" not in bare and "--enable-deterministic-inference" not in bare
    with pytest.raises(SystemExit):  # a runner that records no routing, with replay on
        parse_args(["--model", "m", "--moe-runner-backend", "triton_kernel"])


def test_serves_until_ctrl_c(tmp_path):
    import torch
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.testing import tiny_gptoss_config
    from trl_ext.weight_sync.transport import free_port

    torch.manual_seed(0)
    GptOssForCausalLM(tiny_gptoss_config(vocab_size=256)).save_pretrained(tmp_path / "model")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trl_ext.sglang_serve", "--model", str(tmp_path / "model"), "--port", str(port),
         "--server-cmd", f"{sys.executable} {REPO / 'tests' / 'fake_sglang_server.py'}", "--ready-timeout-s", "120"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "SGLang is ready" in line:
                break
        lines.append(proc.stdout.readline())  # the trainer flags
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as resp:
            assert b'"enable_return_routed_experts": true' in resp.read().replace(b'":true', b'": true')
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    text = "".join(lines) + out
    assert "launching: " in text and "--enable-return-routed-experts" in text
    assert f"trainer flags: --rollout_backend sglang --sglang_urls http://127.0.0.1:{port}" in text
    assert proc.returncode == 130
    time.sleep(0.5)
    with pytest.raises(OSError):  # the server went with it
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def _saved_model(folder, dtype):
    import torch
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.testing import tiny_gptoss_config

    torch.manual_seed(0)
    GptOssForCausalLM(tiny_gptoss_config(vocab_size=256)).to(dtype).save_pretrained(folder)
    return str(folder)


def test_a_dtype_the_checkpoint_does_not_store_is_refused_or_converted(tmp_path):
    """A checkpoint the trainer saved from fp32 weights, served as bfloat16: refused with the way out (SGLang would
    stop at its warm-up), or served from a bfloat16 copy with --convert-to. A checkpoint already stored in the served
    dtype is served as it is, and --dtype after `--` (unchecked) is refused."""
    import torch

    from trl_ext.sglang_serve import prepare_model
    from trl_ext.weight_sync import checkpoint_dtypes

    fp32 = _saved_model(tmp_path / "fp32", torch.float32)
    with pytest.raises(SystemExit, match="stores .* in float32.*--convert-to"):
        prepare_model(parse_args(["--model", fp32, "--dtype", "bfloat16"])[0])
    args, extra = parse_args(["--model", fp32, "--dtype", "bfloat16", "--convert-to", str(tmp_path / "copy")])
    served = prepare_model(args)
    assert served == str(tmp_path / "copy") and set(checkpoint_dtypes(served)) == {"bfloat16"}
    args.model = served
    assert "--dtype bfloat16" in " ".join(server_command(args, extra))
    assert prepare_model(parse_args(["--model", fp32])[0]) == fp32  # no --dtype: SGLang serves what is stored
    bf16 = _saved_model(tmp_path / "bf16", torch.bfloat16)
    assert prepare_model(parse_args(["--model", bf16, "--dtype", "bfloat16"])[0]) == bf16
    with pytest.raises(SystemExit):
        parse_args(["--model", fp32, "--", "--dtype", "bfloat16"])
    with pytest.raises(SystemExit, match="not a torch dtype"):
        prepare_model(parse_args(["--model", fp32, "--dtype", "bf16x"])[0])


def test_the_server_does_not_inherit_the_trainers_python_path(tmp_path):
    """The launched server sees neither the caller's PYTHONPATH nor PYTHONHOME (a trainer environment there would
    shadow SGLang's pinned packages); the rest of the environment passes. The server command here only writes the
    environment it got and exits."""
    import json

    from trl_ext.sglang_serve import server_environment

    assert server_environment({"PYTHONPATH": "/trainer", "PYTHONHOME": "/h", "CUDA_VISIBLE_DEVICES": "0"}) == {
        "CUDA_VISIBLE_DEVICES": "0",
        "PYTHONUNBUFFERED": "1",
    }
    seen = tmp_path / "env.json"
    probe = f"import json, os; json.dump(dict(os.environ), open({str(seen)!r}, 'w'))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), "/trainer/site-packages"]), MARKER="kept")
    proc = subprocess.run(
        [sys.executable, "-m", "trl_ext.sglang_serve", "--model", str(tmp_path), "--port", "9",
         "--server-cmd", f"{sys.executable} -c {shlex.quote(probe)}", "--ready-timeout-s", "30"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 1 and "exited with status 0 before it was ready" in proc.stderr, proc.stderr
    got = json.loads(seen.read_text())
    assert "PYTHONPATH" not in got and got["MARKER"] == "kept"


def test_the_offline_installs_python_replaces_the_callers_python_path(tmp_path):
    """``sglang_offline.sh``'s ``TARGET/bin/python`` puts the SGLang install alone on the path: a caller's PYTHONPATH
    (the trainer's environment) does not reach the server."""
    target = tmp_path / "sglang"
    subprocess.run(["bash", str(REPO / "scripts" / "sglang_offline.sh"), "wrapper", str(target)], check=True)
    out = subprocess.run(
        [str(target / "bin" / "python"), "-c", "import os, sys; print(os.environ['PYTHONPATH']); print(sys.path)"],
        env=dict(os.environ, PYTHONPATH="/trainer/site-packages"), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.splitlines()[0] == str(target) and "/trainer/site-packages" not in out
