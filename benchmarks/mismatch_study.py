"""Rollout/training mismatch of GPT-OSS by training attention.

One random-weight policy (`hf_gptoss_rl.model_builders.build_random_gptoss`: sinks ~ N(--sink-mean, --sink-std),
logits with std ~ --logit-std), one set of sampled trajectories, several ways of scoring them (docs/results.md,
section 1, says why and how to read the tables):

1. Rollouts: `trl_ext.rollout.EmbeddedEngine` samples completions (temperature 1) for GSM8K prompts
   (`data/gsm8k_train_mini.jsonl`, rendered in harmony) with transformers' eager attention, i.e. exact sinks, batched
   and KV-cached like an inference server; its per-token log-probs are the "rollout" distribution.
2. Scoring: the trainer's log-prob path (`trl_ext.mismatch.completion_logprobs`) with the training attention
   switched to `eager`, `eager_without_sinks` (what a sink-dropping kernel computes), `flex_attention` (CUDA only:
   flex refuses sinks on CPU) and the project's kernel (`hf_gptoss_rl.attention_variants.setup_project_attention`).
   Experts, weights, dtype and tokens are identical across rows: only attention changes.
3. Metrics: `trl_ext.mismatch.mismatch_metrics`, the trainer's own numbers.
4. Exact reference (skip with `--no-exact`): `trl_ext.mismatch.exact_completion_logprobs`, the same policy upcast to
   fp32 in place, scores the same tokens with eager attention and TF32 off; every row, the rollout's own log-probs
   included, is compared with it too.

Models: a tiny GPT-OSS (real 201,088-id vocabulary) and a gpt-oss-20b-shaped one (`--layers` keeps fewer of its 24).

    python benchmarks/mismatch_study.py --out docs/benchmarks   # GPU: tiny + 20b-shaped, replaces the report
    python -m benchmarks.mismatch_study --model tiny --device cpu --num-prompts 2 --max-new-tokens 8 --out /tmp/x

Writes `mismatch_study.md`, `mismatch_study.png`, `mismatch_study.json` into `--out` (default `docs/benchmarks/`, only
while no report is there: name the folder to replace one). The exit status is non-zero when a model, a row or the
exact reference failed.
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
    command_line,
    environment,
    exit_if_failed,
    figure,
    fmt,
    md_table,
    output_dir,
    without_local_paths,
)
from hf_gptoss_rl.attention_variants import (
    SINK_DROPPING_ATTENTION,
    register_sink_dropping_attention,
    set_project_attention,
    setup_project_attention,
)
from hf_gptoss_rl.model_builders import build_random_gptoss, gptoss_config
from trl_ext.mismatch import (
    completion_logprobs,
    exact_completion_logprobs,
    mismatch_metrics,
    rollout_scoring_batch,
)

REPO = Path(__file__).resolve().parents[1]
PROMPTS_SOURCE = REPO / "data" / "gsm8k_train_mini.jsonl"
INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."
FLEX_CPU_NOTE = "skipped: flex refuses sinks on CPU"
METRIC_KEYS = ("prob_diff_mean", "prob_diff_max", "k3_kl", "log_ppl_diff", "frac_tokens_over_threshold")
EXACT_KEYS = ("prob_diff_mean", "prob_diff_max", "k3_kl", "log_ppl_diff")  # stored as exact_<key>
ROLLOUT_LABEL = "rollout itself (eager, KV-cached decode)"
RECORDED_ARGS = ("temperature", "max_new_tokens", "threshold", "sink_mean", "sink_std", "logit_std", "seed")
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_local_experts",
               "sliding_window", "vocab_size")  # fmt: skip


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
    """`render_gsm8k_prompts(n)` and how they were made (for the report)."""
    return render_gsm8k_prompts(n), "rendered with hf_gptoss_rl.harmony.render_prompt"


def rollout(model, prompts: list[list[int]], args) -> list:
    """Sample one completion per prompt with the embedded engine (exact eager sink attention)."""
    from trl_ext.rollout import EmbeddedEngine, SamplingParams, run_sync

    model.set_attn_implementation("eager")
    engine = EmbeddedEngine(model, max_batch_size=len(prompts), seed=args.seed)
    try:
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        return run_sync(engine.generate_batch(prompts, sampling))
    finally:
        engine.shutdown()


def score_by_attention(model, variants, batch, prompt_lens, *, temperature, threshold, project):
    """The sampled tokens of ``batch`` (`rollout_scoring_batch`'s ids, attention mask, rollout log-probs, completion
    mask) scored by ``model`` under each training attention of ``variants`` (label, attn_implementation, reason to
    skip it or None); ``project`` is (the project kernel's id among them, its ``--project-attn`` mode). One row per
    variant: its mismatch metrics against the rollout, or why it has none (skipped, or the error, and the other rows
    go on). Returns (rows, {label: [B, T] log-probs} of the rows scored)."""
    ids, attention_mask, rollout_logps, completion_mask = batch
    rows, scored = [], {}
    for label, impl, skip in variants:
        row = {"attention": label, "attn_implementation": impl}
        rows.append(row)
        if skip:
            row["note"] = skip
            continue
        t0 = time.perf_counter()
        try:
            if impl == project[0]:
                row["attn_implementation"], row["attention_how"] = set_project_attention(model, project[1])
            else:
                model.set_attn_implementation(impl)
            lt = completion_logprobs(model, ids, attention_mask, prompt_lens, rollout_logps.shape[1], temperature)
        except Exception as e:  # report, keep the other rows
            row["note"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            continue
        stats = mismatch_metrics(lt, rollout_logps, completion_mask, threshold=threshold)
        row.update({k: float(stats[k]) for k in METRIC_KEYS})
        row.update(num_tokens=int(stats["num_tokens"]), score_s=time.perf_counter() - t0)
        scored[label] = lt
    return rows, scored


def study_model(kind: str, args, device, prompts, project_attn: str) -> dict:
    config = gptoss_config(kind, args.layers if kind == "20b" else None)
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
    ids, attention_mask, rollout_logps, completion_mask = rollout_scoring_batch(
        prompts, outputs, config.pad_token_id, device
    )
    prompt_lens = [len(p) for p in prompts]

    variants = [
        ("eager (exact sinks; the rollout's attention)", "eager", None),
        ("sinks dropped (eager math without the sink column)", SINK_DROPPING_ATTENTION, None),
        ("flex_attention + sinks", "flex_attention", None if device.type == "cuda" else FLEX_CPU_NOTE),
        ("project kernel (sink-flash-attn3)", project_attn, None),
    ]
    rows, scored = score_by_attention(
        model, variants, (ids, attention_mask, rollout_logps, completion_mask), prompt_lens,
        temperature=args.temperature, threshold=args.threshold, project=(project_attn, args.project_attn),
    )  # fmt: skip
    valid = completion_mask.bool()
    diffs = {label: (lt.exp() - rollout_logps.exp()).abs()[valid].tolist() for label, lt in scored.items()}
    exact = None
    if args.exact:
        exact = {"reference": "same weights upcast to float32, eager attention, TF32 off"}
        t0 = time.perf_counter()
        try:
            ref = exact_completion_logprobs(
                model, ids, attention_mask, prompt_lens, rollout_logps.shape[1], args.temperature
            )  # upcasts the model in place: the last use of it
        except Exception as e:  # keep the rows already measured
            exact["note"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
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
        "config": {key: getattr(config, key) for key in CONFIG_KEYS},
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
        table = md_table(
            ["training attention", "mean abs Δp", "max abs Δp", "k3 KL(rollout‖train)", "log-PPL diff",
             "tokens over threshold", "note"],
            [[row["attention"], fmt(row.get("prob_diff_mean")), fmt(row.get("prob_diff_max")), fmt(row.get("k3_kl")),
              fmt(row.get("log_ppl_diff"), "+.3g"), fmt(row.get("frac_tokens_over_threshold"), ".2%"),
              row.get("note", "")] for row in res["rows"]],
        )  # fmt: skip
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
            *table,
            "",
        ]
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
    entries = [(ROLLOUT_LABEL, {f"exact_{k}": v for k, v in exact["rollout"].items()})] + [
        (row["attention"], row) for row in res["rows"] if "exact_k3_kl" in row
    ]
    table = md_table(
        ["scored by", "mean abs Δp vs exact", "max abs Δp vs exact", "k3 KL(exact‖row)", "log-PPL diff vs exact"],
        [[label, fmt(vals["exact_prob_diff_mean"]), fmt(vals["exact_prob_diff_max"]), fmt(vals["exact_k3_kl"]),
          fmt(vals["exact_log_ppl_diff"], "+.3g")] for label, vals in entries],
    )  # fmt: skip
    return head + table + ["", f"Exact scoring took {exact['score_s']:.1f} s.", ""]


def plot(path: Path, results: list[dict]) -> None:
    import numpy as np

    panels = max(len(results), 1)
    with figure(path, 1, panels, figsize=(6.5 * panels, 4.2), dpi=120, squeeze=False) as (_, axes):
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
    p.add_argument("--no-exact", dest="exact", action="store_false", help="skip the fp32 exact reference")
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
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
        "command": command_line("mismatch_study", argv),
        "dtype": str(args.dtype).replace("torch.", ""),
        "project_attention": project_attn,
        "project_attention_how": how,
        "prompts_how": prompts_how,
        **{key: getattr(args, key) for key in RECORDED_ARGS},
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
