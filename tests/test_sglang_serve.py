"""`python -m trl_ext.sglang_serve`: the command it launches, the readiness wait, Ctrl-C stopping the server."""

from __future__ import annotations

import os
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
