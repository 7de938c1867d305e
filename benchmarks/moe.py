"""One gpt-oss-20b MoE layer on one GPU: `eager`, `grouped_mm` and `memory_efficient` experts side by side.

One process, same weights, same routing (random router weights with a per-expert bias, so the load is uneven as in
a trained model):

1. Correctness at T=2048: every implementation, bf16, against an fp64 copy of the layer (relative L2 error of the
   output, the input, routing-weight and expert weight/bias gradients); the memory-efficient experts also with their
   PyTorch gate path (`use_backends(experts="torch")`) to cross-check the Triton kernels.
2. Time, TFLOP/s and peak memory of the experts module for T in {4096, 32768, 65536}, `train` (forward + backward)
   and `no-grad`; the report says how each is measured.

Usage: python benchmarks/moe.py [--out DIR] [--tokens 4096 32768 65536] [--profile]   (or python -m benchmarks.moe)
       python benchmarks/moe.py --from-json DIR/moe.json --out DIR   (re-render the table and plot, no GPU)
Writes DIR/moe.md, DIR/moe.png, DIR/moe.json (default DIR = docs/benchmarks).
"""

from __future__ import annotations

import argparse
import copy
import gc
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

VARIANTS = {
    # label: (experts_implementation, module attributes)
    "eager": ("eager", {}),
    "grouped_mm": ("grouped_mm", {}),
    "memory_efficient": ("memory_efficient", {}),
    "memory_efficient (recompute)": ("memory_efficient", {"experts_recompute_gate_up": True}),
}


def build_layer(device):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from hf_gptoss_rl.model_builders import gptoss_20b_config

    config = gptoss_20b_config()
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        mlp = GptOssMLP(config)
    h, i = config.hidden_size, config.intermediate_size
    with torch.no_grad():
        e = mlp.experts
        e.gate_up_proj.normal_(0, h**-0.5)  # pre-activations ~ N(0, 1): some gates reach the clamp
        e.gate_up_proj_bias.normal_(0, 0.1)
        e.down_proj.normal_(0, i**-0.5)
        e.down_proj_bias.normal_(0, 0.1)
        mlp.router.weight.normal_(0, 1.5 * h**-0.5)
        mlp.router.bias.normal_(0, 0.5)  # uneven expert load, as trained routers have
    return mlp.to(torch.bfloat16), config


def make_inputs(mlp, tokens: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, mlp.experts.hidden_size, device=device, dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        _, scores, index = mlp.router(x)
    grad_out = torch.randn(tokens, mlp.experts.hidden_size, device=device, dtype=torch.bfloat16, generator=g)
    return x, scores, index, grad_out


def train_step(module, x, scores, index, grad_out):
    xr = x.detach().requires_grad_()
    wr = scores.detach().requires_grad_()
    out = module(xr, index, wr)
    out.backward(grad_out)
    return out, xr.grad, wr.grad


def configure(module, variant: str, chunk_rows: int | None = None):
    impl, attrs = VARIANTS[variant]
    module.config._experts_implementation = impl
    for attr in ("experts_recompute_gate_up", "experts_chunk_rows"):
        if hasattr(module, attr):
            delattr(module, attr)
    for k, v in attrs.items():
        setattr(module, k, v)
    if chunk_rows is not None:
        module.experts_chunk_rows = chunk_rows


def correctness(mlp, device, tokens=2048):
    from hf_gptoss_rl import use_backends

    experts = mlp.experts
    ref = copy.deepcopy(experts).double()
    ref.config._experts_implementation = "eager"
    x, scores, index, grad_out = make_inputs(mlp, tokens, device, seed=1)
    out_ref, dx_ref, dw_ref = train_step(ref, x.double(), scores.double(), index, grad_out.double())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    rows = []
    for variant, backend in [(v, None) for v in VARIANTS] + [("memory_efficient", "torch")]:
        configure(experts, variant)
        experts.zero_grad(set_to_none=True)
        with use_backends(**({"experts": backend} if backend else {})):
            out, dx, dw = train_step(experts, x, scores, index, grad_out)
            with torch.no_grad():
                out_ng = experts(x, index, scores)
        row = {
            "variant": variant + (" [torch gate]" if backend else ""),
            "out": rel_error(out, out_ref),
            "out_no_grad": rel_error(out_ng, out_ref),
            "dx": rel_error(dx, dx_ref),
            "d_routing_w": rel_error(dw, dw_ref),
        }
        row.update({"d_" + n: rel_error(p.grad, ref_grads[n]) for n, p in experts.named_parameters()})
        rows.append(row)
        print("  " + "  ".join(f"{k}={v:.2e}" if isinstance(v, float) else str(v) for k, v in row.items()), flush=True)
    experts.zero_grad(set_to_none=True)
    return rows


def measure(module, x, scores, index, grad_out, mode):
    """(ms, peak GiB) of the experts module, ``mode`` "train" (forward + backward) or "no-grad"."""
    params = list(module.parameters())
    xr = x.detach().requires_grad_()
    wr = scores.detach().requires_grad_()

    def reset():
        for t in (*params, xr, wr):
            t.grad = None

    def run_train():
        reset()
        module(xr, index, wr).backward(grad_out)

    def run_no_grad():
        with torch.no_grad():
            module(x, index, scores)

    return gpu_time_and_peak(run_train if mode == "train" else run_no_grad, reset, warmup=30, rep=150)


def profile_top(module, x, scores, index, grad_out, n=14):
    """The top CUDA kernels of one forward + backward of ``module`` (after two warm-up steps), as a table."""
    from torch.profiler import ProfilerActivity, profile

    xr, wr = x.detach().requires_grad_(), scores.detach().requires_grad_()
    for _ in range(2):
        module(xr, index, wr).backward(grad_out)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        module(xr, index, wr).backward(grad_out)
        torch.cuda.synchronize()
    for p in module.parameters():
        p.grad = None
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60)


def write_report(out_dir: Path, results, corr, meta):
    meta = without_local_paths(meta)  # a report names no local folder

    def cells(t, name, r, base):
        def fmt(key, spec):
            v = r.get(key)
            return "OOM" if v == "OOM" else ("" if v is None else format(v, spec))

        def vs_base(key):
            a, b = r.get(key), base.get(key)
            return ratio(a, b) if isinstance(a, float) and isinstance(b, float) else ""

        return [t, name, fmt("train_ms", ".1f"), fmt("train_tflops", ".0f"), fmt("train_peak", ".2f"),
                fmt("nograd_ms", ".1f"), fmt("nograd_tflops", ".0f"), fmt("nograd_peak", ".2f"),
                vs_base("train_ms"), vs_base("nograd_ms")]  # fmt: skip

    table = md_table(
        ["T", "implementation", "train ms", "train TFLOP/s", "train peak GiB", "no-grad ms", "no-grad TFLOP/s",
         "no-grad peak GiB", "train time ÷ grouped_mm's", "no-grad time ÷ grouped_mm's"],
        [cells(t, name, r, v.get("grouped_mm", {})) for t, v in results.items() for name, r in v.items()],
    )  # fmt: skip
    lines = [
        "# MoE experts: one gpt-oss-20b layer (32 experts, top-4, H = I = 2880, bf16)",
        "",
        f"Measured by `benchmarks/moe.py` on {meta['device']} (torch {meta['torch']}, transformers "
        f"{meta['transformers']}, triton {meta['triton']}), {meta['date']}"
        + (f", commit {meta['commit']}." if meta.get("commit") else "."),
        "",
        "The experts module (`GptOssExperts`, dispatched through transformers' `ALL_EXPERTS_FUNCTIONS`) is called with "
        "fixed routing from the layer's router on random inputs (router bias spread for an uneven load). "
        "`train` = forward + backward (input, routing-weight and all expert weight/bias gradients); `no-grad` = "
        "forward under `torch.no_grad()`. Times: median of `triton.testing.do_bench`. **Peak** = "
        "`max_memory_allocated` minus what was allocated just before the call (weights, inputs, routing and the "
        "upstream gradient are resident and excluded); `.grad` is None before the call, so train peaks include the "
        "newly allocated expert gradients (1.48 GiB). TFLOP/s counts the layer's matmul FLOPs (fwd 6·S·H·I, "
        "S = T·top_k; train 3× fwd) for every implementation alike.",
        "",
        *table,
        "",
        f"The last two columns: {RATIO_RULE}.",
        "",
    ]
    at32 = results.get(32768, {})
    g, m = at32.get("grouped_mm", {}), at32.get("memory_efficient", {})
    if all(isinstance(d.get(k), float) for d in (g, m) for k in ("train_ms", "train_peak", "nograd_ms", "nograd_peak")):
        checks = [
            ("training time ≤ grouped_mm's / 1.3", ratio(m["train_ms"], g["train_ms"]), m["train_ms"] * 1.3 <= g["train_ms"]),
            ("training peak ≤ ½ of grouped_mm's", f"{m['train_peak']:.2f} / {g['train_peak']:.2f} GiB = {m['train_peak'] / g['train_peak']:.2f}", m["train_peak"] <= g["train_peak"] / 2),
            ("no-grad peak ≤ 1 GiB", f"{m['nograd_peak']:.2f} GiB (grouped_mm {g['nograd_peak']:.2f})", m["nograd_peak"] <= 1.0),
            ("no-grad not slower than grouped_mm", f"{m['nograd_ms']:.1f} vs {g['nograd_ms']:.1f} ms", m["nograd_ms"] <= g["nograd_ms"]),
        ]  # fmt: skip
        lines += [f"## Targets at T=32768 (default `memory_efficient`, chunk {meta['default_chunk_rows']} pairs)", ""]
        lines += md_table(["target", "measured", "met"], [[n, v, "yes" if ok else "NO"] for n, v, ok in checks])
        lines.append("")
    keys = [k for k in corr[0] if k != "variant"]
    lines += [
        f"Command: `{meta['command']}`",
        "",
        f"Expert load at T=32768: max/mean tokens per expert = {meta.get('load_imbalance', 'n/a')}.",
        "",
        "## Correctness (T=2048, bf16 vs an fp64 copy of the layer, same routing; relative L2 error)",
        "",
        *md_table(["implementation", *keys], [[row["variant"], *(f"{row[k]:.1e}" for k in keys)] for row in corr]),
        "",
        "![MoE benchmark](moe.png)",
        "",
    ]
    (out_dir / "moe.md").write_text("\n".join(lines))
    panels = [("train_ms", "train fwd+bwd ms"), ("train_peak", "train peak GiB"),
              ("nograd_ms", "no-grad fwd ms"), ("nograd_peak", "no-grad peak GiB")]  # fmt: skip
    names = [n for n in VARIANTS if any(n in v for v in results.values())]
    try:
        with figure(out_dir / "moe.png", 1, 4, figsize=(20, 4.5)) as (fig, axes):
            for ax, (key, title) in zip(axes, panels):
                grouped_bars(ax, list(results), {n: [results[t].get(n, {}).get(key) for t in results] for n in names})
                ax.set_xlabel("tokens T")
                ax.set_title(title)
            axes[0].legend(fontsize=8)
            fig.suptitle("gpt-oss-20b MoE layer on " + meta["device"])
    except ImportError as exc:  # the table is the result; the plot is a convenience
        print(f"[moe bench] plot not written: {exc!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 65536])
    parser.add_argument(
        "--chunk-sweep", type=int, nargs="*", default=[4096, 16384, 32768], help="extra chunk sizes at 32k"
    )
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of memory_efficient train")
    parser.add_argument("--from-json", help="no run: re-render moe.md / moe.png from a moe.json")
    args = parser.parse_args(argv)
    out_dir = output_dir(args.out, "moe.json", "moe.md", "moe.png")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results = {int(t): v for t, v in saved["results"].items()}
        write_report(out_dir, results, saved["correctness"], saved["meta"])
        (out_dir / "moe.json").write_text(json.dumps(saved, indent=1))
        print((out_dir / "moe.md").read_text())
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe.py needs a CUDA GPU")
    device = torch.device("cuda")

    import hf_gptoss_rl.experts as experts_mod

    meta = {
        **environment(),  # the device, the versions and the source commit
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command_line("moe", argv),
        "default_chunk_rows": experts_mod.DEFAULT_CHUNK_ROWS,
    }
    print(meta, flush=True)
    mlp, config = build_layer(device)
    experts = mlp.experts

    t0 = time.time()
    print("correctness (T=2048) vs fp64:", flush=True)
    corr = correctness(mlp, device)
    print(f"  [{time.time() - t0:.0f}s]", flush=True)

    results: dict[int, dict[str, dict]] = {}
    top_k = config.num_experts_per_tok
    for t in args.tokens:
        x, scores, index, grad_out = make_inputs(mlp, t, device, seed=t)
        if t == 32768:
            counts = torch.bincount(index.reshape(-1), minlength=config.num_local_experts).float()
            meta["load_imbalance"] = (
                f"{(counts.max() / counts.mean()).item():.2f} (min/mean {(counts.min() / counts.mean()).item():.2f})"
            )
        fwd_flops = 6 * t * top_k * config.hidden_size * config.intermediate_size
        results[t] = {}
        variants = [(v, None) for v in VARIANTS]
        if t == 32768:
            variants += [("memory_efficient", c) for c in args.chunk_sweep]
        for variant, chunk in variants:
            label = variant if chunk is None else f"memory_efficient (chunk {chunk})"
            configure(experts, variant, chunk)
            r = {}
            for mode, key in (("train", "train"), ("no-grad", "nograd")):
                r[f"{key}_ms"], r[f"{key}_peak"] = measure(experts, x, scores, index, grad_out, mode)
                if r[f"{key}_ms"] != "OOM":
                    r[f"{key}_tflops"] = (3 if mode == "train" else 1) * fwd_flops / r[f"{key}_ms"] / 1e9
            results[t][label] = r
            print(f"T={t:6d} {label:34s} " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in r.items()), flush=True)  # fmt: skip
        if args.profile and t == 32768:
            configure(experts, "memory_efficient")
            print(profile_top(experts, x, scores, index, grad_out), flush=True)
        del x, scores, index, grad_out
        gc.collect()
        torch.cuda.empty_cache()

    saved = {"meta": without_local_paths(meta), "results": results, "correctness": corr}
    (out_dir / "moe.json").write_text(json.dumps(saved, indent=1))
    write_report(out_dir, results, corr, meta)
    print((out_dir / "moe.md").read_text())


if __name__ == "__main__":
    main()
