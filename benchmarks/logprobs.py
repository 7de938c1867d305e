"""Per-token log-probs and entropies of GPT-OSS's LM head on one GPU: full logits vs chunked (PyTorch ops) vs
chunked with the fused Triton kernels, side by side in one process.

GPT-OSS's head is `[201,088, 2880]` (bf16, no bias). Every variant computes what the GRPO loss needs from the
final hidden states `[S, 2880]` and the sampled tokens: the log-prob of each token and the entropy of each
position, float32, at temperature `--temperature`; `train` also runs the backward (upstream gradients on both
outputs, head frozen as with LoRA, so only the hidden states get a gradient).

- `full_logits`: what a stock TRL GRPO step computes: `lm_head(hidden)` in bf16, `.float() / T`, `log_softmax`,
  gather, and the entropy from the same logits (`[S, V]` fp32 tensors kept for the backward).
- `chunked_torch`: `hf_gptoss_rl.logprobs.chunked_logprobs` with its PyTorch-op chunk math
  (`use_backends(logprobs="torch")`): 512 tokens at a time, fp32 logits, nothing `[S, V]` kept.
- `chunked_fused`: the same with the fused Triton chunk kernels (`hf_gptoss_rl/_logprobs_triton.py`, the CUDA
  default): one read of each chunk's logits forward, one read and one write backward.

Correctness: at S=256 every variant's log-probs, entropies and hidden-state gradient against float64 (relative L2).
Times: medians of `triton.testing.do_bench`; peak = `max_memory_allocated` minus what was allocated before the call
(head weight, hidden states, targets and upstream gradients are resident and excluded).

Usage: python benchmarks/logprobs.py [--seqlens 8192 32768] [--out DIR]   (or python -m benchmarks.logprobs ...)
Writes DIR/logprobs.md, DIR/logprobs.png, DIR/logprobs.json (default DIR = docs/benchmarks).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import OUT_HELP, RATIO_RULE, output_dir, ratio, without_local_paths

VOCAB, HIDDEN = 201_088, 2880
VARIANTS = {
    "full_logits": "full logits (stock TRL path: bf16 head, fp32 log_softmax)",
    "chunked_torch": "chunked, PyTorch ops (hf_gptoss_rl, backend=torch)",
    "chunked_fused": "chunked, fused Triton kernels (hf_gptoss_rl, CUDA default)",
}


def full_logits(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logps = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def run_variant(name, hidden, weight, targets, temperature):
    from hf_gptoss_rl import use_backends
    from hf_gptoss_rl.logprobs import chunked_logprobs

    if name == "full_logits":
        return full_logits(hidden, weight, targets, temperature)
    with use_backends(logprobs="torch" if name == "chunked_torch" else "triton"):
        return chunked_logprobs(hidden, weight, targets, temperature=temperature)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def correctness(weight, temperature, device, n=256):
    torch.manual_seed(1)
    hidden0 = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, VOCAB, (n,), device=device)
    g_lp, g_h = torch.randn(n, device=device), torch.randn(n, device=device)
    h64 = hidden0.double().requires_grad_()
    w64 = weight.double()
    ref = full_logits(h64, w64, targets, temperature)
    ((ref[0] * g_lp).sum() + (ref[1] * g_h).sum()).backward()
    ref = [ref[0].detach(), ref[1].detach(), h64.grad]
    del w64, h64
    rows = []
    for name in VARIANTS:
        h = hidden0.clone().requires_grad_()
        lp, ent = run_variant(name, h, weight, targets, temperature)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        rows.append(
            {
                "variant": name,
                "log-probs": rel(lp, ref[0]),
                "entropy": rel(ent, ref[1]),
                "d hidden": rel(h.grad, ref[2]),
            }
        )
    return rows


def measure(name, hidden, weight, targets, temperature, g_lp, g_h, train):
    from triton.testing import do_bench

    h = hidden.detach().requires_grad_(train)

    def fn():
        if train:
            h.grad = None
            lp, ent = run_variant(name, h, weight, targets, temperature)
            ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        else:
            with torch.no_grad():
                run_variant(name, h, weight, targets, temperature)

    try:
        fn()
        torch.cuda.synchronize()
        h.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = do_bench(fn, warmup=2, rep=20, return_mode="median")
    except torch.OutOfMemoryError:
        h.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        return "OOM", "OOM"
    h.grad = None
    return ms, peak


def write_report(out_dir: Path, results, corr, meta):
    def cell(v, spec):
        return v if isinstance(v, str) else ("" if v is None else format(v, spec))

    lines = [
        "# Log-probs of GPT-OSS's LM head: full logits vs chunked vs chunked + fused Triton kernels",
        "",
        (
            f"Measured by `benchmarks/logprobs.py` on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}), "
            f"{meta['date']}{', commit ' + meta['commit'] if meta.get('commit') else ''}. "
            f"Command: `{meta['command']}`."
        ),
        "",
        (
            f"Head `[{VOCAB:,}, {HIDDEN}]` bf16 (frozen), hidden states `[S, {HIDDEN}]` bf16, temperature "
            f"{meta['temperature']}. Each variant returns float32 log-probs of the given tokens and entropies; `train` "
            "adds the backward to the hidden states. Times: median of `triton.testing.do_bench`; peak = "
            "`max_memory_allocated` above what was resident before the call."
        ),
        "",
        "| S | variant | no-grad ms | no-grad peak GiB | train ms | train peak GiB | train time ÷ chunked_torch's |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, variants in results.items():
        base = variants.get("chunked_torch", {}).get("train_ms")
        for name, r in variants.items():
            vs_base = ratio(r["train_ms"], base) if isinstance(base, float) and isinstance(r["train_ms"], float) else ""
            lines.append(
                f"| {s} | {name} | {cell(r['nograd_ms'], '.1f')} | {cell(r['nograd_peak'], '.2f')} | "
                f"{cell(r['train_ms'], '.1f')} | {cell(r['train_peak'], '.2f')} | {vs_base} |"
            )
    lines += [
        "",
        f"Last column: {RATIO_RULE}.",
        "",
        "## Correctness (S=256, bf16 inputs, against float64; relative L2 error)",
        "",
        "| variant | log-probs | entropy | d hidden |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['variant']} | {r['log-probs']:.1e} | {r['entropy']:.1e} | {r['d hidden']:.1e} |" for r in corr]
    lines += ["", "Variants:", ""] + [f"- `{k}`: {v}" for k, v in VARIANTS.items()]
    lines += ["", "![log-prob benchmark](logprobs.png)", ""]
    (out_dir / "logprobs.md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        seqs = list(results)
        width = 0.8 / len(VARIANTS)
        for ax, key, title in ((axes[0], "train_ms", "fwd + bwd ms"), (axes[1], "train_peak", "fwd + bwd peak GiB")):
            for j, name in enumerate(VARIANTS):
                vals = [results[s].get(name, {}).get(key) for s in seqs]
                ax.bar(
                    [i + j * width for i in range(len(seqs))],
                    [v if isinstance(v, float) else 0 for v in vals],
                    width,
                    label=name,
                )
            ax.set_xticks([i + width for i in range(len(seqs))])
            ax.set_xticklabels([str(s) for s in seqs])
            ax.set_xlabel("tokens S (bars at 0: OOM)")
            ax.set_title(title)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"GPT-OSS LM-head log-probs on {meta['device']}")
        fig.tight_layout()
        fig.savefig(out_dir / "logprobs.png", dpi=110)
    except Exception as exc:  # the table is the result
        print(f"[logprobs bench] plot failed: {exc!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--from-json", type=Path, default=None, help="no run: render this logprobs.json again")
    args = parser.parse_args()
    out_dir = output_dir(args.out, "logprobs.json", "logprobs.md", "logprobs.png")
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "logprobs.json").write_text(json.dumps(saved, indent=1))
        write_report(out_dir, saved["results"], saved["correctness"], saved["meta"])
        print((out_dir / "logprobs.md").read_text())
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/logprobs.py needs a CUDA GPU")
    import triton

    device = torch.device("cuda")
    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, device=device) * 0.02).to(torch.bfloat16)
    corr = correctness(weight, args.temperature, device)
    for row in corr:
        print(row, flush=True)
    results = {}
    for s in args.seqlens:
        hidden = torch.randn(s, HIDDEN, device=device, dtype=torch.bfloat16) * 2
        targets = torch.randint(0, VOCAB, (s,), device=device)
        g_lp, g_h = torch.randn(s, device=device), torch.randn(s, device=device)
        results[s] = {}
        for name in VARIANTS:
            r = {}
            r["nograd_ms"], r["nograd_peak"] = measure(
                name, hidden, weight, targets, args.temperature, g_lp, g_h, False
            )
            r["train_ms"], r["train_peak"] = measure(name, hidden, weight, targets, args.temperature, g_lp, g_h, True)
            results[s][name] = r
            print(s, name, r, flush=True)
        del hidden, targets, g_lp, g_h
    from benchmarks._cli import git_commit

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "temperature": args.temperature,
        "command": "python benchmarks/logprobs.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
    }
    meta = without_local_paths(meta)  # a report names no local folder
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logprobs.json").write_text(
        json.dumps({"results": results, "correctness": corr, "meta": meta}, indent=1)
    )
    write_report(out_dir, results, corr, meta)
    print((out_dir / "logprobs.md").read_text())


if __name__ == "__main__":
    main()
