"""Start an SGLang server set up for `AgenticGRPOTrainer`, as ``trl vllm-serve`` does for TRL's vLLM mode.

    python -m trl_ext.sglang_serve --model /checkpoints/gpt-oss-20b-bf16 --python /opt/sglang/bin/python

SGLang pins its own torch and transformers, so it runs from a Python environment of its own (``--python``; see
``docs/rollouts.md``). The command gets the flags the trainer relies on: token ids in and out
(``--skip-tokenizer-init``), weight version 0 before the first sync, deterministic inference (so that the per-request
``sampling_seed`` is honoured and log-probs do not depend on batching), routed experts with a MoE runner that records
them (routing replay), LoRA adapter sync when asked, and CUDA graphs on. It prints the exact command, waits until
``/health`` answers, prints the URL and the trainer flags that use it, then serves until interrupted (Ctrl-C stops the
server's whole process group). Flags after ``--`` go to SGLang unchanged.

The server's environment is its own: the trainer's ``PYTHONPATH`` (and ``PYTHONHOME``) are not passed on
(`server_environment`), so packages of the trainer's environment cannot shadow the versions SGLang pins. A
checkpoint is served in the dtype it is stored in; ``--dtype`` with another dtype needs ``--convert-to DIR`` (a copy
stored in that dtype is written there and served), because SGLang builds GPT-OSS's layers in ``config.json``'s dtype
(``params_dtype=config.dtype`` in sglang/srt/models/gpt_oss.py) and a ``--dtype`` that differs stops its warm-up
("mat1 and mat2 must have the same dtype").
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


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

    if not args.dtype:
        return args.model
    try:
        stored = checkpoint_dtypes(args.model)
    except FileNotFoundError as exc:
        raise SystemExit(f"sglang_serve: {exc}") from None
    wanted = str(getattr(torch, args.dtype, args.dtype)).removeprefix("torch.")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        raise SystemExit(f"sglang_serve: --dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float32)")
    if set(stored) <= {wanted}:
        return args.model
    held = ", ".join(f"{n} tensors in {d}" for d, n in sorted(stored.items()))
    if not args.convert_to:
        raise SystemExit(
            f"sglang_serve: {args.model} stores {held}; SGLang serving it as --dtype {wanted} stops at its warm-up "
            f"(it builds the layers in config.json's dtype). Pass --convert-to DIR to serve a copy stored in {wanted}."
        )
    print(f"writing a copy of {args.model} in {wanted} to {args.convert_to} (it stores {held})", flush=True)
    return str(convert_checkpoint(args.model, args.convert_to, getattr(torch, wanted)))


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


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``GET /health`` until 200; `RuntimeError` when the server exits first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(1.0)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f} s (last: {last})")


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    args.model = prepare_model(args)
    cmd = server_command(args, extra)
    url = f"http://{args.host}:{args.port}"
    print(f"launching: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, env=server_environment())  # own group: stopped as a whole

    def stop(*_):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))
    try:
        wait_healthy(url, proc, args.ready_timeout_s)
        print(f"SGLang is ready at {url}", flush=True)
        print(f"trainer flags: --rollout_backend sglang --sglang_urls {url}", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        print("interrupted: stopping the server", flush=True)
        return 130
    except RuntimeError as exc:
        print(f"sglang_serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop()


if __name__ == "__main__":
    sys.exit(main())
