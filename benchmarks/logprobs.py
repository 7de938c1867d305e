"""Per-token log-probs and entropies of GPT-OSS's LM head on one GPU: full logits vs chunked (PyTorch ops) vs
chunked with the fused Triton kernels, side by side in one process.

GPT-OSS's head is `[201,088, 2880]` (bf16, no bias). Every variant computes what the GRPO loss needs from the
final hidden states `[S, 2880]` and the sampled tokens: the log-prob of each token and the entropy of each
position, float32, at temperature `--temperature`; `train` also runs the backward (upstream gradients on both
outputs, head frozen as with LoRA, so only the hidden states get a gradient). The variants (`VARIANTS`):

- `full_logits`: what a stock TRL GRPO step computes: `lm_head(hidden)` in bf16, `.float() / T`, `log_softmax`,
  gather, and the entropy from the same logits (`[S, V]` fp32 tensors kept for the backward);
- `chunked_torch`: `hf_gptoss_rl.logprobs.chunked_logprobs` with its PyTorch-op chunk math, 512 tokens at a time;
- `chunked_fused`: the same with the fused Triton chunk kernels (`hf_gptoss_rl/_logprobs_triton.py`, the CUDA
  default): one read of each chunk's logits forward, one read and one write backward.

Correctness: at S=256 every variant's log-probs, entropies and hidden-state gradient against float64 (relative L2).

Usage: python benchmarks/logprobs.py [--seqlens 8192 32768] [--out DIR]   (or python -m benchmarks.logprobs ...)
       python benchmarks/logprobs.py --from-json DIR/logprobs.json --out DIR   (re-render, no GPU)
Writes DIR/logprobs.md, DIR/logprobs.png, DIR/logprobs.json (default DIR = docs/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import (
    OUT_HELP,
    RATIO_RULE,
    command_line,
    environment,
    figure,
    gpu_time_and_peak,
    grouped_bars,
    md_table,
    output_dir,
    ratio,
    rel_error,
    without_local_paths,
)

VOCAB, HIDDEN = 201_088, 2880
COLUMNS = [
    "S",
    "variant",
    "no-grad ms",
    "no-grad peak GiB",
    "train ms",
    "train peak GiB",
    "train time ÷ chunked_torch's",
]
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


def backward(lp, ent, g_lp, g_h):
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()


def correctness(weight, temperature, device, n=256):
    torch.manual_seed(1)
    hidden0 = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, VOCAB, (n,), device=device)
    g_lp, g_h = torch.randn(n, device=device), torch.randn(n, device=device)
    h64 = hidden0.double().requires_grad_()
    ref = full_logits(h64, weight.double(), targets, temperature)
    backward(*ref, g_lp, g_h)
    ref = [ref[0].detach(), ref[1].detach(), h64.grad]
    rows = []
    for name in VARIANTS:
        h = hidden0.clone().requires_grad_()
        lp, ent = run_variant(name, h, weight, targets, temperature)
        backward(lp, ent, g_lp, g_h)
        errors = [rel_error(lp, ref[0]), rel_error(ent, ref[1]), rel_error(h.grad, ref[2])]
        rows.append({"variant": name, **dict(zip(("log-probs", "entropy", "d hidden"), errors))})
    return rows


def measure(name, hidden, weight, targets, temperature, g_lp, g_h, train):
    h = hidden.detach().requires_grad_(train)

    def reset():
        h.grad = None

    def fn():
        if train:
            reset()
            backward(*run_variant(name, h, weight, targets, temperature), g_lp, g_h)
        else:
            with torch.no_grad():
                run_variant(name, h, weight, targets, temperature)

    return gpu_time_and_peak(fn, reset, warmup=2, rep=20)


def write_report(out_dir: Path, results, corr, meta):
    def cell(v, spec):
        return v if isinstance(v, str) else ("" if v is None else format(v, spec))

    rows = []
    for s, variants in results.items():
        base = variants.get("chunked_torch", {}).get("train_ms")
        for name, r in variants.items():
            vs_base = ratio(r["train_ms"], base) if isinstance(base, float) and isinstance(r["train_ms"], float) else ""
            rows.append([s, name, cell(r["nograd_ms"], ".1f"), cell(r["nograd_peak"], ".2f"),
                         cell(r["train_ms"], ".1f"), cell(r["train_peak"], ".2f"), vs_base])  # fmt: skip
    lines = [
        "# Log-probs of GPT-OSS's LM head: full logits vs chunked vs chunked + fused Triton kernels",
        "",
        f"Measured by `benchmarks/logprobs.py` on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}), "
        f"{meta['date']}{', commit ' + meta['commit'] if meta.get('commit') else ''}. Command: `{meta['command']}`.",
        "",
        f"Head `[{VOCAB:,}, {HIDDEN}]` bf16 (frozen), hidden states `[S, {HIDDEN}]` bf16, temperature "
        f"{meta['temperature']}. Each variant returns float32 log-probs of the given tokens and entropies; `train` "
        "adds the backward to the hidden states. Times: median of `triton.testing.do_bench`; peak = "
        "`max_memory_allocated` above what was resident before the call.",
        "",
        *md_table(COLUMNS, rows),
        "",
        f"Last column: {RATIO_RULE}.",
        "",
        "## Correctness (S=256, bf16 inputs, against float64; relative L2 error)",
        "",
        *md_table(
            ["variant", "log-probs", "entropy", "d hidden"],
            [[r["variant"], f"{r['log-probs']:.1e}", f"{r['entropy']:.1e}", f"{r['d hidden']:.1e}"] for r in corr],
        ),
        "",
        "Variants:",
        "",
        *(f"- `{k}`: {v}" for k, v in VARIANTS.items()),
        "",
        "![log-prob benchmark](logprobs.png)",
        "",
    ]
    (out_dir / "logprobs.md").write_text("\n".join(lines))
    try:
        with figure(out_dir / "logprobs.png", 1, 2, figsize=(11, 4)) as (fig, axes):
            for ax, key, title in (
                (axes[0], "train_ms", "fwd + bwd ms"),
                (axes[1], "train_peak", "fwd + bwd peak GiB"),
            ):
                grouped_bars(
                    ax, list(results), {n: [results[s].get(n, {}).get(key) for s in results] for n in VARIANTS}
                )
                ax.set_xlabel("tokens S (bars at 0: OOM)")
                ax.set_title(title)
            axes[0].legend(fontsize=8)
            fig.suptitle(f"GPT-OSS LM-head log-probs on {meta['device']}")
    except ImportError as exc:  # the table is the result
        print(f"[logprobs bench] plot not written: {exc!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--from-json", type=Path, default=None, help="no run: render this logprobs.json again")
    args = parser.parse_args(argv)
    out_dir = output_dir(args.out, "logprobs.json", "logprobs.md", "logprobs.png")
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/logprobs.py needs a CUDA GPU")
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
                for key, train in (("nograd", False), ("train", True)):
                    r[f"{key}_ms"], r[f"{key}_peak"] = measure(
                        name, hidden, weight, targets, args.temperature, g_lp, g_h, train
                    )
                results[s][name] = r
                print(s, name, r, flush=True)
            del hidden, targets, g_lp, g_h
        meta = {
            **environment(),  # the device, the versions and the source commit
            "date": time.strftime("%Y-%m-%d"),
            "temperature": args.temperature,
            "command": command_line("logprobs", argv),
        }
        saved = {"results": results, "correctness": corr, "meta": without_local_paths(meta)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logprobs.json").write_text(json.dumps(saved, indent=1))
    write_report(out_dir, saved["results"], saved["correctness"], saved["meta"])
    print((out_dir / "logprobs.md").read_text())


if __name__ == "__main__":
    main()
