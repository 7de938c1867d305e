"""Start an SGLang server set up for `AgenticGRPOTrainer`, as ``trl vllm-serve`` does for TRL's vLLM mode.

    python -m trl_ext.sglang_serve --model /checkpoints/gpt-oss-20b-bf16 --python /opt/sglang/bin/python

SGLang pins its own torch and transformers, so it runs from a Python environment of its own (``--python``; see
``docs/rollouts.md``). The command gets the flags the trainer relies on: token ids in and out
(``--skip-tokenizer-init``), weight version 0 before the first sync, deterministic inference (so that the per-request
``sampling_seed`` is honoured and log-probs do not depend on batching), routed experts with a MoE runner that records
them (routing replay), LoRA adapter sync when asked, and CUDA graphs on. It prints the exact command, waits until
``/health`` answers, prints the URL and the trainer flags that use it, then serves until interrupted (Ctrl-C stops the
server's whole process group). Flags after ``--`` go to SGLang unchanged.

`ServerProcess` is the one launcher of an SGLang server process in this project (this command, the benchmarks and
the tests use it): a session of its own that dies with its parent, SGLang's own environment, the readiness wait of
`SGLangEngine` with a deadline, an optional log file, and a stop of the whole process group. `ServerManager` keeps one
such server at a time for a run that needs several server configurations (the benchmarks against SGLang, which take
its flags from `ServerManager.add_arguments`).

The server's environment is its own: the trainer's ``PYTHONPATH`` (and ``PYTHONHOME``) are not passed on
(`server_environment`), so packages of the trainer's environment cannot shadow the versions SGLang pins. A
checkpoint is served in the dtype it is stored in; ``--dtype`` with another dtype needs ``--convert-to DIR`` (a copy
stored in that dtype is written there and served), because SGLang builds GPT-OSS's layers in ``config.json``'s dtype
(``params_dtype=config.dtype`` in sglang/srt/models/gpt_oss.py) and a ``--dtype`` that differs stops its warm-up
("mat1 and mat2 must have the same dtype").
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m trl_ext.sglang_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the checkpoint the trainer starts from (bf16 for RL)")
    p.add_argument("--python", default="python3", help="the Python of SGLang's own environment")
    p.add_argument("--server-cmd", default=None, help="the launcher instead of `PYTHON -m sglang.launch_server`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument(
        "--attention-backend",
        default=None,
        help="default: SGLang's choice for GPT-OSS (fa3 on Hopper, trtllm_mha on Blackwell)",
    )
    p.add_argument(
        "--no-deterministic-inference",
        action="store_true",
        help="drop --enable-deterministic-inference: faster, but sampling_seed is ignored and rollouts not reproducible",
    )
    p.add_argument(
        "--no-routing-replay",
        action="store_true",
        help="drop --enable-return-routed-experts and --moe-runner-backend triton (routing replay off)",
    )
    p.add_argument(
        "--moe-runner-backend", default="triton", help="with routing replay: triton (bf16) or marlin (MXFP4)"
    )
    p.add_argument(
        "--lora-rank", type=int, default=None, help="serve LoRA adapters (weight_sync_lora=True) of this rank"
    )
    p.add_argument("--lora-target-modules", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    p.add_argument("--disable-cuda-graph", action="store_true", help="faster start, slower decoding")
    p.add_argument("--dtype", default=None, help="serve in this dtype (default: the dtype the checkpoint stores)")
    p.add_argument(
        "--convert-to",
        default=None,
        help="with --dtype other than the checkpoint's: write a copy stored in --dtype into this folder and serve it",
    )
    p.add_argument("--ready-timeout-s", type=float, default=900.0, help="deadline of the start (weights, graphs)")
    args = p.parse_args(argv)
    if any(flag == "--dtype" or flag.startswith("--dtype=") for flag in extra):
        p.error("pass --dtype before `--` (it is checked against the checkpoint), not to SGLang directly")
    if args.convert_to and not args.dtype:
        p.error("--convert-to needs --dtype")
    if args.moe_runner_backend in ("triton_kernel", "flashinfer_mxfp4") and not args.no_routing_replay:
        p.error(f"--moe-runner-backend {args.moe_runner_backend} records no routing; use triton or marlin")
    return args, extra


# variables of the trainer's Python that must not reach SGLang's own environment
TRAINER_ONLY_VARIABLES = ("PYTHONPATH", "PYTHONHOME")


def server_environment(environ=None) -> dict[str, str]:
    """The environment an SGLang server is started with: this process's, without `TRAINER_ONLY_VARIABLES` (a
    trainer environment on ``PYTHONPATH`` would shadow SGLang's pinned packages), output unbuffered."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in TRAINER_ONLY_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def prepare_model(args) -> str:
    """The checkpoint folder to serve: ``--model``, or its copy in ``--dtype`` (``--convert-to``). `SystemExit` when
    ``--dtype`` differs from the dtype the checkpoint stores and no copy was asked for."""
    import torch

    from .weight_sync import checkpoint_dtypes, convert_checkpoint

    dtype = getattr(torch, args.dtype, None) if args.dtype else None
    if args.dtype and not isinstance(dtype, torch.dtype):
        raise SystemExit(f"sglang_serve: --dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float32)")
    try:
        stored = checkpoint_dtypes(args.model)
    except FileNotFoundError as exc:
        if not args.dtype:  # a folder SGLang resolves itself (a Hub id, say): nothing to check here
            return args.model
        raise SystemExit(f"sglang_serve: {exc}") from None
    if not args.dtype:
        if "float32" in stored:  # served as stored: say so, since RL usually serves bf16
            print(
                f"note: {args.model} stores float32 tensors, so SGLang serves float32; for bfloat16 serving pass "
                "--dtype bfloat16 --convert-to DIR",
                flush=True,
            )
        return args.model
    wanted = str(dtype).removeprefix("torch.")
    if set(stored) <= {wanted}:
        return args.model
    held = ", ".join(f"{n} tensors in {d}" for d, n in sorted(stored.items()))
    if not args.convert_to:
        raise SystemExit(
            f"sglang_serve: {args.model} stores {held}; SGLang serving it as --dtype {wanted} stops at its warm-up "
            f"(it builds the layers in config.json's dtype). Pass --convert-to DIR to serve a copy stored in {wanted}."
        )
    print(f"writing a copy of {args.model} in {wanted} to {args.convert_to} (it stores {held})", flush=True)
    return str(convert_checkpoint(args.model, args.convert_to, dtype))


def server_command(args, extra: list[str]) -> list[str]:
    launcher = shlex.split(args.server_cmd) if args.server_cmd else [args.python, "-m", "sglang.launch_server"]
    cmd = launcher + [
        "--model-path", args.model, "--host", args.host, "--port", str(args.port), "--skip-tokenizer-init",
        "--weight-version", "0", "--tp-size", str(args.tp_size), "--mem-fraction-static", str(args.mem_fraction_static),
    ]  # fmt: skip
    if not args.no_deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if not args.no_routing_replay:
        cmd += ["--enable-return-routed-experts", "--moe-runner-backend", args.moe_runner_backend]
    if args.attention_backend:
        cmd += ["--attention-backend", args.attention_backend]
    if args.lora_rank:
        cmd += [
            "--enable-lora",
            "--max-lora-rank",
            str(args.lora_rank),
            "--lora-target-modules",
            *args.lora_target_modules,
        ]
    if args.disable_cuda_graph:
        cmd.append("--disable-cuda-graph")
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return cmd + extra


def _own_session_dying_with_parent() -> None:  # runs in the child, between fork and exec
    """A session of its own (stopped as one process group, deaf to the terminal's Ctrl-C) and, on Linux, SIGKILL
    when the launching thread's process dies, so that a killed trainer or benchmark leaves no server behind."""
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def wait_until_ready(
    url: str, timeout_s: float, proc: subprocess.Popen | None = None, api_key: str | None = None
) -> str | None:
    """`SGLangEngine`'s readiness wait (``/health``, then ``/server_info``, which needs the server's ``--api-key``
    if it has one) on `url` within `timeout_s`; returns the SGLang version the server reports. `RuntimeError` as
    soon as `proc` (the server's process) exits first; `SGLangUnavailableError` (naming the URL and the last cause)
    at the deadline."""
    from .rollout import SGLangEngine

    engine = SGLangEngine(url, api_key=api_key, ready_timeout_s=max(timeout_s, 1.0))
    box: dict = {}

    def wait() -> None:
        try:
            engine.check_servers()
            box["version"] = engine.run(engine.weight_sync.server_states(), timeout_s=30)[0].version
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            box["error"] = exc

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
            if proc is not None and proc.poll() is not None and thread.is_alive():
                raise RuntimeError(f"the server process exited with status {proc.returncode} before it was ready")
        if "error" in box:
            raise box["error"]
        return box.get("version")
    finally:
        if not thread.is_alive():
            with contextlib.suppress(Exception):
                engine.run(engine.close(), timeout_s=10)


def log_tail(path: Path | None, lines: int = 40) -> str | None:
    """The last `lines` lines of a server's log file (None: no log written)."""
    if path is None or not path.exists():
        return None
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class ServerProcess:
    """One SGLang server process: `start` launches `command` in a session of its own that dies with this process,
    in `server_environment`, its output to `log_path` (or this process's own output when None); `wait_ready`
    blocks until `url` serves (a deadline, failing early if the process exits); `stop` ends the whole process
    group (SIGTERM, then SIGKILL for the scheduler and detokenizer children that outlive the leader)."""

    def __init__(
        self, command: list[str], url: str, *, log_path: str | os.PathLike | None = None, api_key: str | None = None
    ) -> None:
        self.command = list(command)
        self.url = url
        self.api_key = api_key
        self.log_path = Path(log_path) if log_path is not None else None
        self.proc: subprocess.Popen | None = None
        self.version: str | None = None  # what the server reports in /server_info once ready

    def start(self) -> ServerProcess:
        if self.proc is not None:
            raise RuntimeError(f"the server for {self.url} was already started")
        launch = dict(stdin=subprocess.DEVNULL, preexec_fn=_own_session_dying_with_parent, env=server_environment())
        if self.log_path is None:
            self.proc = subprocess.Popen(self.command, **launch)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as fh:
                self.proc = subprocess.Popen(self.command, stdout=fh, stderr=subprocess.STDOUT, **launch)
        return self

    def wait_ready(self, timeout_s: float) -> str | None:
        if self.proc is None:
            raise RuntimeError(f"the server for {self.url} was not started")
        self.version = wait_until_ready(self.url, timeout_s, self.proc, self.api_key)
        return self.version

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self) -> int:
        """Block until the server exits; its status."""
        return self.proc.wait()

    def log_tail(self, lines: int = 40) -> str | None:
        return log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM to the process group, SIGKILL to it after `grace_s`; the leader's status (None: never started)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the scheduler/detokenizer children too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        return proc.returncode


class ServerManager:
    """One SGLang server at a time for a run that needs several server configurations: `ensure(name, flags)` returns
    the URL of a ready server launched with ``flags``, reusing the running one when it was launched with the same
    flags (and its weights are still the checkpoint's, unless ``any_weights``), otherwise stopping it and launching
    anew as a `ServerProcess` (log in ``logs_dir``). With ``url`` nothing is launched: that server is used as it is.

    Every launch is ``server_cmd --model-path MODEL_DIR --port P --host 127.0.0.1 --skip-tokenizer-init``, then
    ``launch_flags``, ``--mem-fraction-static``, ``server_args`` (``--disable-cuda-graph`` added once when asked)
    and the configuration's own ``flags``; `launches` records each (command, log, seconds to ready). Set `dirty`
    when a trainer synced other weights into the server. ``start_lock`` names a file locked while a server starts:
    processes that share a GPU then start theirs one at a time (SGLang sizes its KV cache from the memory free
    during its own start)."""

    def __init__(
        self, server_cmd: str, model_dir, logs_dir, *, server_args: str = "", launch_flags=(), url: str | None = None,
        port: int | None = None, mem_fraction_static: float = 0.4, disable_cuda_graph: bool = False, log=print,
        start_lock: str | os.PathLike | None = None,
    ) -> None:  # fmt: skip
        self.server_cmd, self.server_args, self.launch_flags = server_cmd, server_args, list(launch_flags)
        self.model_dir, self.logs_dir = Path(model_dir), Path(logs_dir)
        self.port, self.mem_fraction_static, self.disable_cuda_graph = port, mem_fraction_static, disable_cuda_graph
        self.url, self.external, self.log, self.start_lock = url, url is not None, log, start_lock
        self.process: ServerProcess | None = None
        self.flags: list[str] | None = None
        self.launches: list[dict] = []
        self.version: str | None = None  # the SGLang version the server reports (/server_info)
        self.dirty = False  # the server's weights differ from model_dir's (a trainer synced into it)

    @staticmethod
    def add_arguments(parser, *, server_cmd: str = "python3 -m sglang.launch_server", mem_fraction_static: float = 0.4,
                      ready_timeout_s: float = 180.0) -> None:  # fmt: skip
        """The flags of a `from_args` manager, as the group "SGLang server" of ``parser`` (a benchmark's command line;
        ``--ready-timeout-s`` is for the caller's `ensure` calls)."""
        group = parser.add_argument_group("SGLang server")
        group.add_argument("--server-cmd", default=server_cmd, help="how to start SGLang (its own environment)")
        group.add_argument(
            "--server-args", default="", help='extra flags for every server, e.g. "--chunked-prefill-size 8192"'
        )
        group.add_argument("--disable-cuda-graph", action="store_true", help="launch with SGLang's --disable-cuda-graph "
                           "(faster starts, slower decoding; recorded); default: CUDA graphs on, as served")  # fmt: skip
        group.add_argument(
            "--mem-fraction-static", type=float, default=mem_fraction_static, help="SGLang's GPU memory share"
        )
        group.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
        group.add_argument(
            "--ready-timeout-s", type=float, default=ready_timeout_s, help="deadline of one server start"
        )

    @classmethod
    def from_args(cls, args, model_dir, logs_dir, launch_flags=(), log=print) -> ServerManager:
        """The manager of `add_arguments`' flags (and of ``--url`` and ``--server-start-lock`` where ``args`` has them)."""
        return cls(
            args.server_cmd, model_dir, logs_dir, server_args=args.server_args, launch_flags=launch_flags,
            url=getattr(args, "url", None), port=args.port, mem_fraction_static=args.mem_fraction_static,
            disable_cuda_graph=args.disable_cuda_graph, log=log, start_lock=getattr(args, "server_start_lock", None),
        )  # fmt: skip

    def command(self, flags: list[str], port: int) -> list[str]:
        extra = shlex.split(self.server_args)
        if self.disable_cuda_graph and "--disable-cuda-graph" not in extra:
            extra.append("--disable-cuda-graph")
        return shlex.split(self.server_cmd) + [
            "--model-path", str(self.model_dir), "--port", str(port), "--host", "127.0.0.1", "--skip-tokenizer-init",
            *self.launch_flags, "--mem-fraction-static", str(self.mem_fraction_static), *extra, *flags,
        ]  # fmt: skip

    def ensure(self, name: str, flags: list[str], timeout_s: float, *, flags_required: bool = True,
               any_weights: bool = False) -> str:  # fmt: skip
        """A ready server launched with ``flags``; raises (the server's log has the cause) when it does not come
        up. With ``url`` the flags cannot be applied: an error when ``flags_required``, else the server is used as
        it is (e.g. LoRA on a server the user launched with ``--enable-lora``)."""
        if self.external:
            if flags and flags_required:
                raise RuntimeError(f"server flags {flags} need a launched server; --url was given (not relaunched)")
            self.version = wait_until_ready(self.url, timeout_s)
            return self.url
        reusable = self.process is not None and self.process.running() and (any_weights or not self.dirty)
        if reusable and self.flags == flags:
            return self.url
        self.stop()
        self.dirty = False
        from .weight_sync.transport import free_port

        port = self.port or free_port()
        self.url, self.flags = f"http://127.0.0.1:{port}", list(flags)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        log_path = self.logs_dir / f"server_{len(self.launches) + 1}_{safe}.log"
        self.process = ServerProcess(self.command(flags, port), self.url, log_path=log_path)
        record = {"name": name, "command": shlex.join(self.process.command), "log": str(log_path), "ready": False}
        self.launches.append(record)
        self.log(f"launching server ({name}): {record['command']}")
        start = time.monotonic()
        with open(self.start_lock, "a") if self.start_lock else contextlib.nullcontext() as lock:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self.process.start()
            self.version = self.process.wait_ready(timeout_s)
        record.update(ready=True, ready_s=round(time.monotonic() - start, 1))
        self.log(f"server ready in {record['ready_s']} s")
        return self.url

    def log_tail(self, lines: int = 40) -> str | None:
        """The last launch's log (also once it stopped)."""
        return log_tail(Path(self.launches[-1]["log"]), lines) if self.launches else None

    def stop(self) -> None:
        """Stop the launched server (`ServerProcess.stop`); nothing with ``url``."""
        process, self.process, self.flags = self.process, None, None
        if process is not None:
            self.log(f"server stopped (status {process.stop(grace_s=15)})")


def _api_key(extra: list[str]) -> str | None:
    """The ``--api-key`` passed on to SGLang after ``--`` (the readiness wait's ``/server_info`` needs it)."""
    for i, flag in enumerate(extra):
        if flag == "--api-key" and i + 1 < len(extra):
            return extra[i + 1]
        if flag.startswith("--api-key="):
            return flag.split("=", 1)[1]
    return None


def main(argv=None) -> int:
    from .rollout import SGLangUnavailableError

    args, extra = parse_args(argv)
    args.model = prepare_model(args)
    server = ServerProcess(server_command(args, extra), f"http://{args.host}:{args.port}", api_key=_api_key(extra))
    print(f"launching: {shlex.join(server.command)}", flush=True)
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(grace_s=30), sys.exit(143)))
    try:
        server.wait_ready(args.ready_timeout_s)
        print(f"SGLang is ready at {server.url}", flush=True)
        print(f"trainer flags: --rollout_backend sglang --sglang_urls {server.url}", flush=True)
        return server.wait()
    except KeyboardInterrupt:
        print("interrupted: stopping the server", flush=True)
        return 130
    except (RuntimeError, SGLangUnavailableError) as exc:
        print(f"sglang_serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.stop(grace_s=30)


if __name__ == "__main__":
    sys.exit(main())
