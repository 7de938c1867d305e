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

    from hf_gptoss_rl.model_builders import tiny_gptoss_config
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

    from hf_gptoss_rl.model_builders import tiny_gptoss_config

    torch.manual_seed(0)
    GptOssForCausalLM(tiny_gptoss_config(vocab_size=256)).to(dtype).save_pretrained(folder)
    return str(folder)


def test_a_dtype_the_checkpoint_does_not_store_is_refused_or_converted(tmp_path, capsys):
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
    assert "stores float32 tensors, so SGLang serves float32" in capsys.readouterr().out
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie (exited, not yet reaped by its new parent) is gone too
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_server_process_serves_logs_and_stops_its_whole_group(tmp_path):
    """`ServerProcess` (the one launcher: this command, the benchmarks, the tests): the test double answers the
    readiness wait with its version, writes the log file, and `stop` ends the leader and a child it left running in
    its process group (SGLang's scheduler and detokenizer are such children)."""
    import torch
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from trl_ext.sglang_serve import ServerProcess
    from trl_ext.weight_sync.transport import free_port

    torch.manual_seed(0)
    GptOssForCausalLM(tiny_gptoss_config(vocab_size=256)).save_pretrained(tmp_path / "model")
    port, child_pid = free_port(), tmp_path / "child.pid"
    fake = (
        f"{sys.executable} {REPO / 'tests' / 'fake_sglang_server.py'} --model-path {tmp_path / 'model'} --port {port}"
    )
    command = ["sh", "-c", f"sleep 300 & echo $! > {child_pid}; exec {fake}"]
    server = ServerProcess(command, f"http://127.0.0.1:{port}", log_path=tmp_path / "logs" / "server.log")
    server.start()
    try:
        assert server.wait_ready(120) and server.version == server.wait_ready(120)
        assert server.running() and "serving" in server.log_tail()
        child = int(child_pid.read_text())
        assert _alive(child)
    finally:
        status = server.stop(grace_s=10)
    assert status is not None and not server.running()
    assert _wait_gone(child), "the child left in the server's process group outlived stop()"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_server_process_readiness_has_a_deadline(tmp_path):
    """A server that never answers: the wait ends at its deadline with an error naming the URL."""
    from trl_ext.rollout import SGLangUnavailableError
    from trl_ext.sglang_serve import ServerProcess
    from trl_ext.weight_sync.transport import free_port

    url = f"http://127.0.0.1:{free_port()}"
    server = ServerProcess(["sleep", "300"], url, log_path=tmp_path / "server.log").start()
    t0 = time.monotonic()
    try:
        with pytest.raises(SGLangUnavailableError, match=url):
            server.wait_ready(2)
    finally:
        server.stop(grace_s=5)
    assert time.monotonic() - t0 < 30


def test_server_process_dies_with_the_process_that_launched_it(tmp_path):
    """A launcher killed without cleaning up (SIGKILL) leaves no server behind (PR_SET_PDEATHSIG on Linux)."""
    pid_file = tmp_path / "server.pid"
    code = (
        "import sys, time; from trl_ext.sglang_serve import ServerProcess; "
        f"s = ServerProcess(['sleep', '300'], 'http://127.0.0.1:9').start(); open({str(pid_file)!r}, 'w').write("
        "str(s.proc.pid)); time.sleep(300)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        server_pid = int(pid_file.read_text())
        assert _alive(server_pid)
    finally:
        launcher.kill()
        launcher.wait()
    gone = _wait_gone(server_pid)
    if not gone:
        os.kill(server_pid, signal.SIGKILL)
    assert gone, "the server outlived the process that launched it"


def test_server_manager_starts_a_server_only_while_it_holds_the_start_lock(tmp_path):
    """`ServerManager(start_lock=PATH)`: a server starts only once the lock is free (processes sharing a GPU start
    theirs one at a time), and the command it launches is the documented one."""
    import fcntl
    import threading

    from trl_ext.sglang_serve import ServerManager

    lock = tmp_path / "start.lock"
    manager = ServerManager(f"{sys.executable} -c 'import sys; sys.exit(3)'", tmp_path / "model", tmp_path / "logs",
                            server_args="--x 1", launch_flags=["--dtype", "float32"], start_lock=lock)  # fmt: skip
    failures = []

    def start():
        try:
            manager.ensure("locked", ["--y"], timeout_s=30)
        except RuntimeError as exc:
            failures.append(str(exc))

    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        thread = threading.Thread(target=start)
        thread.start()
        time.sleep(1.0)
        assert manager.process is not None and manager.process.proc is None  # waiting for the lock, not started
    thread.join(60)
    assert not thread.is_alive() and failures and "exited with status 3" in failures[0], failures
    command = shlex.split(manager.launches[0]["command"])
    assert command[command.index("--model-path") + 1] == str(tmp_path / "model") and "--skip-tokenizer-init" in command
    assert command[-7:] == ["--dtype", "float32", "--mem-fraction-static", "0.4", "--x", "1", "--y"]
    assert manager.launches[0]["ready"] is False
