"""Sink-aware Ulysses sequence parallelism on 1/2/4/8 GPUs: the longest GPT-OSS-20B training sequence, and step time.

A GPT-OSS-20B-shaped model with random bf16 weights, LoRA r=16 on q/k/v/o, gradient checkpointing, one sequence of S
tokens; one training step = forward + backward of the mean token NLL. Peers: ``stock`` (P=1 only:
``model(input_ids, labels=input_ids)``, full-vocabulary logits) and ``sp`` (P=1,2,4,8: ``enable_sequence_parallel`` +
``sequence_parallel_logprobs``, the LM head chunked over tokens; P=1 isolates what the chunked head alone buys). Inner
attention: the project's sink kernel on GPUs, eager on CPU (``--attn`` forces another). For each P, S doubles from the
largest S the previous P fitted until a run fails (OOM or ``--timeout``); every (P, S) is its own ``torchrun`` job, so
an OOM on one rank cannot hang the others. Results: median step time of ``--steps`` steps after one warm-up, tokens/s,
peak memory (max over ranks).

    python benchmarks/sequence_parallel.py                       # every GPU count the machine has (1, 2, 4, 8)
    python benchmarks/sequence_parallel.py --gpus 8 --seq-lens 65536,131072,262144
    python -m benchmarks.sequence_parallel --device cpu --model tiny --gpus 1,2 --seq-lens 256,512 --out /tmp/sp
        # CPU/gloo dry run of the whole pipeline (no memory numbers)

Writes OUT/sequence_parallel.md, .png and .json (``--out OUT``; by default docs/benchmarks/, only while no report is
there). The exit status is non-zero when a run failed otherwise than by an OOM or the timeout (which end the search
for that P).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import (
    OUT_HELP,
    RATIO_RULE,
    exit_if_failed,
    figure,
    md_table,
    output_dir,
    ratio,
    without_local_paths,
)

RESULT_TAG = "SP_BENCH_RESULT "


# ----------------------------------------------------------------------------------------------------------------------
# Worker: one (P, S, mode) training-step measurement, run under torchrun
# ----------------------------------------------------------------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from hf_gptoss_rl.attention import ATTN_IMPLEMENTATION
    from hf_gptoss_rl.model_builders import build_random_gptoss, gptoss_20b_config, tiny_gptoss_config
    from hf_gptoss_rl.sequence_parallel import enable_sequence_parallel, sequence_parallel_logprobs

    on_gpu = args.device == "cuda"
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    config = gptoss_20b_config() if args.model == "20b" else tiny_gptoss_config(vocab_size=1024)
    # auto: the project's sink kernel on GPUs, eager on CPU (the CPU run only checks the pipeline)
    attn = args.attn if args.attn != "auto" else ATTN_IMPLEMENTATION if torch.cuda.is_available() else "eager"
    # made on the device in its dtype (a float32 copy of gpt-oss-20b first would not fit an 80 GB GPU)
    model = build_random_gptoss(config, device=device, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.set_attn_implementation(attn)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    model.train()
    if args.mode == "sp":
        enable_sequence_parallel(model, None)
    elif world != 1:
        raise ValueError("the stock peer runs on one GPU")
    input_ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(device)

    def step():
        if args.mode == "sp":
            loss = -sequence_parallel_logprobs(model, {"input_ids": input_ids}, None).mean()
        else:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    times = []
    for i in range(1 + args.steps):
        if on_gpu:
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        if on_gpu:
            torch.cuda.synchronize()
        dist.barrier()
        if i > 0:
            times.append(time.perf_counter() - start)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        median = statistics.median(times)
        result = dict(mode=args.mode, gpus=world, seq_len=args.seq_len, attn=attn, step_s=median,
                      tokens_per_s=args.seq_len / median, peak_gib=peak.item(), loss=loss.item())  # fmt: skip
        print(RESULT_TAG + json.dumps(result), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# Driver: the (P, S) search, one torchrun job per point
# ----------------------------------------------------------------------------------------------------------------------


def run_point(args, mode: str, gpus: int, seq_len: int) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
        str(Path(__file__).resolve()), "--worker", f"--mode={mode}", f"--seq-len={seq_len}",
        f"--device={args.device}", f"--model={args.model}", f"--attn={args.attn}", f"--steps={args.steps}",
    ]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        output, reason = proc.stdout + proc.stderr, "failed"
    except subprocess.TimeoutExpired as err:
        output, reason = f"timeout after {args.timeout}s\n{err.stdout or ''}{err.stderr or ''}", "timeout"
    for line in output.splitlines():
        if line.startswith(RESULT_TAG):
            return {**json.loads(line[len(RESULT_TAG) :]), "ok": True, "wall_s": time.perf_counter() - start}
    if reason == "failed" and ("OutOfMemoryError" in output or "out of memory" in output):
        reason = "OOM"
    tail = "\n".join(output.strip().splitlines()[-6:])
    print(f"  [{mode} P={gpus} S={seq_len}] {reason}:\n{tail}", flush=True)
    return dict(mode=mode, gpus=gpus, seq_len=seq_len, ok=False, reason=reason)


def search(args) -> list[dict]:
    results, start_len = [], args.seq_lens[0]
    plan = [("stock", 1)] if 1 in args.gpus and not args.no_stock else []
    for mode, gpus in plan + [("sp", g) for g in args.gpus]:
        for seq_len in [s for s in args.seq_lens if s >= (start_len if mode == "sp" else args.seq_lens[0])]:
            res = run_point(args, mode, gpus, seq_len)
            results.append(res)
            if not res["ok"]:
                break
            print(f"{mode:5s} P={gpus} S={seq_len:7d}: {res['step_s']:.2f} s/step  {res['tokens_per_s']:9.0f} tok/s  "
                  f"peak {res['peak_gib']:.1f} GiB  ({res['attn']})", flush=True)  # fmt: skip
        fitted = [r["seq_len"] for r in results if r["mode"] == mode and r["gpus"] == gpus and r["ok"]]
        if mode == "sp" and fitted:
            start_len = max(fitted)  # more GPUs fit at least as long a sequence: skip the short ones
    return results


def write_report(results: list[dict], args) -> None:
    results = without_local_paths(results)  # a report names no local folder
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sequence_parallel.json").write_text(json.dumps(results, indent=1))
    peers = sorted({(r["mode"], r["gpus"]) for r in results}, key=lambda p: (p[0] != "stock", p[1]))
    ok = [r for r in results if r["ok"]]
    fits = []
    for mode, gpus in peers:
        runs = [r for r in results if r["mode"] == mode and r["gpus"] == gpus]
        fail = [f"{r['seq_len']} ({r['reason']})" for r in runs if not r["ok"]]
        fits.append([mode, gpus, max((r["seq_len"] for r in runs if r["ok"]), default="none tried fit"),
                     fail[0] if fail else "not reached"])  # fmt: skip
    common = {}
    for r in ok:
        common.setdefault(r["seq_len"], {})[(r["mode"], r["gpus"])] = r["step_s"]
    ratio_rows = []
    for seq_len, by_peer in sorted(common.items()):
        base = by_peer.get(("sp", 1)) or by_peer.get(("stock", 1))
        if base and len(by_peer) > 1:
            ordered = sorted(by_peer.items(), key=lambda item: item[0][1])
            ratio_rows.append([seq_len, ", ".join(f"{m} P={g}: {ratio(t, base)}" for (m, g), t in ordered)])
    runs = [[r["mode"], r["gpus"], r["seq_len"], r["attn"], f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}",
             f"{r['peak_gib']:.1f}"] for r in ok]  # fmt: skip
    lines = [
        "# Sequence parallelism: longest GPT-OSS-20B training sequence and step time",
        "",
        f"Generated by `benchmarks/sequence_parallel.py` (device {args.device}, model {args.model}). One training step"
        " = forward + backward, LoRA r=16 on q/k/v/o, gradient checkpointing, batch 1; median of"
        f" {args.steps} steps after one warm-up; peak = max over ranks of `torch.cuda.max_memory_allocated`.",
        "",
        *md_table(["peer", "GPUs", "max S that fits", "first S that failed"], fits),
        "",
        *md_table(["peer", "GPUs", "S", "attention", "step s", "tokens/s", "peak GiB"], runs),
    ]
    if ratio_rows:
        lines += [
            "",
            f"Step time ÷ one GPU's at the same S ({RATIO_RULE}):",
            "",
            *md_table(["S", "time ratio"], ratio_rows),
        ]
    (out / "sequence_parallel.md").write_text("\n".join(lines) + "\n")
    try:
        with figure(out / "sequence_parallel.png", 1, 2, figsize=(11, 4), dpi=120) as (fig, (ax1, ax2)):
            for mode, gpus in peers:
                runs = [r for r in ok if r["mode"] == mode and r["gpus"] == gpus]
                if runs:
                    xs = [r["seq_len"] for r in runs]
                    ax1.plot(xs, [r["step_s"] for r in runs], "o-", label=f"{mode} P={gpus}")
                    ax2.plot(xs, [r["peak_gib"] for r in runs], "o-", label=f"{mode} P={gpus}")
            for ax, label in ((ax1, "step time (s)"), (ax2, "peak memory per GPU (GiB)")):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("sequence length S (tokens)")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
                ax.legend()
            fig.suptitle(f"GPT-OSS-{args.model} training step, Ulysses SP ({args.device})")
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
    print(f"wrote {out / 'sequence_parallel.md'}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default=None, help="comma list of GPU counts (default: 1,2,4,8 up to the machine's)")
    p.add_argument("--seq-lens", default="16384,32768,65536,131072,262144,524288", help="comma list, ascending")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point (after one warm-up)")
    p.add_argument("--attn", default="auto", help="inner attention: auto | flex_attention | eager | a kernel id")
    p.add_argument("--model", choices=("20b", "tiny"), default="20b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout", type=int, default=600, help="seconds per (P, S) run")
    p.add_argument("--no-stock", action="store_true", help="skip the stock single-GPU peer")
    p.add_argument("--out", default=None, help=OUT_HELP)
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("sp", "stock"), default="sp", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.seq_lens = sorted(int(s) for s in args.seq_lens.split(","))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    args.out = output_dir(args.out, "sequence_parallel.json", "sequence_parallel.md", "sequence_parallel.png")
    if args.gpus is None:
        import torch

        available = torch.cuda.device_count() if args.device == "cuda" else 2
        args.gpus = [g for g in (1, 2, 4, 8) if g <= available]
    else:
        args.gpus = sorted(int(g) for g in str(args.gpus).split(","))
    if not args.gpus:
        raise SystemExit("no GPU found (use --device cpu for a dry run)")
    print(f"GPU counts {args.gpus}, sequence lengths {args.seq_lens}", flush=True)
    results = search(args)
    write_report(results, args)
    failures = [
        f"{r['mode']} P={r['gpus']} S={r['seq_len']}: worker failed" for r in results if r.get("reason") == "failed"
    ]
    exit_if_failed("benchmarks/sequence_parallel.py", failures, args.out)


if __name__ == "__main__":
    main()
