"""Render every measured number in README.md and docs/*.md from the benchmark JSON files in `docs/benchmarks/`.

The JSON files written by `benchmarks/*.py` are the one source of every measurement the documentation quotes. A
page holds generated regions, inline or over several lines:

    <!-- generated:NAME -->text rendered from the JSON<!-- /generated -->

and this script replaces the text of each region with what the renderer ``NAME`` (in `RENDERERS` below) makes of
the JSON. `tests/test_doc_numbers.py` fails when a page differs from its rendering, and when a number that looks
measured (a time, a size, a ratio, a fraction, a decimal) stands outside a generated region without being listed
there as a setting, a version or arithmetic; so a number can only change by re-running a benchmark.

    python scripts/render_docs.py           # rewrite the regions of README.md and docs/*.md
    python scripts/render_docs.py --check   # exit 1 naming each region that is out of date

Ratios follow one direction everywhere (`benchmarks._cli.RATIO_RULE`): this project's time or memory ÷ the peer's.
Stdlib only: it runs without torch or a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python scripts/render_docs.py` from anywhere: benchmarks._cli is stdlib only
    sys.path.insert(0, str(REPO))
from benchmarks._cli import ratio  # noqa: E402

BENCHMARKS = REPO / "docs" / "benchmarks"
REGION = re.compile(r"<!-- generated:(?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /generated -->", re.S)
OPENING = re.compile(r"<!-- generated:([\w.-]+) -->")
CLOSING = "<!-- /generated -->"


def doc_files(root: Path = REPO) -> list[Path]:
    """The pages whose numbers are rendered: the README and the user documentation (the reports in
    `docs/benchmarks/` are rendered by their own benchmark scripts)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


class Data:
    """The JSON files of one folder, loaded once each; a missing file or entry is an error naming it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._cache: dict[str, dict] = {}

    def __call__(self, name: str):
        if name not in self._cache:
            path = self.folder / f"{name}.json"
            try:
                self._cache[name] = json.loads(path.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(f"{path} is missing: run benchmarks/{name}.py first") from None
        return self._cache[name]


def _need(mapping, key, where: str):
    """``mapping[key]``, or an error naming the JSON entry that is missing."""
    try:
        return mapping[key]
    except (KeyError, IndexError, TypeError):
        raise KeyError(f"{where}: no entry {key!r}") from None


def _ms(value: float) -> str:
    digits = 2 if value < 10 else (1 if value < 100 else 0)
    return f"{value:.{digits}f} ms"


def _sci(value: float, digits: int = 1) -> str:
    """``2.5e-09`` -> ``2.5e-9``: scientific notation without the zero padding of the exponent."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{value:.{digits}e}")


def _order(value: float) -> str:
    """The power of ten of ``value``: ``1.3e-11`` -> ``1e-11``."""
    return _sci(10 ** round(math.log10(value)), 0)


def _errors(acc: dict) -> str:
    return " / ".join(_sci(acc[k]) for k in ("out", "dq", "dk", "dv", "dsink"))


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _command(command: str) -> str:
    """The JSON's command as a user runs it: `python benchmarks/<script> <args>` without the output folder."""
    command = re.sub(r"\s--out\s+\S+", "", command).strip()
    command = re.sub(r"^(python3?\s+)?(-m\s+benchmarks\.|benchmarks/)?", "", command)
    return f"python benchmarks/{command}"


# ---------------------------------------------------------------------------------------------- README: the table

# column names written by benchmarks/attention.py
ATTN_OURS = "sink-flash-attn3"
ATTN_FA4 = "FA4 (flash_attention_4)"
ATTN_FLEX = "flex_attention"


def attention_kernel_row(data: Data, seqlen: int, window) -> dict:
    where = "docs/benchmarks/attention.json"
    found = [
        r for r in _need(data("attention"), "kernel_rows", where) if r["S"] == seqlen and r.get("window") == window
    ]
    if not found:
        raise KeyError(f"{where}: no kernel row at S={seqlen}, window {window}")
    return found[0]


def attention_rows(data: Data) -> list[str]:
    where = "docs/benchmarks/attention.json"
    attention = data("attention")
    link = "([attention](docs/benchmarks/attention.md))"
    out = []
    for seqlen, window, label in ((16384, None, "causal"), (16384, 128, "window 128"), (32768, None, "causal")):
        row = attention_kernel_row(data, seqlen, window)
        fa4 = row.get("fa4_ms")
        peer = f"FA4 + `learnable_sink` {_ms(fa4)} ({ratio(row['public_ms'], fa4)})" if fa4 else "—"
        out.append(
            f"| attention fwd+bwd through `flash_attn_func`, S={seqlen // 1024}k {label}, GPT-OSS heads, bf16 {link} "
            f"| {_ms(row['public_ms'])}, sink gradient included | {peer} |"
        )
    layers = [  # the plain causal row: not sliding, and not packed or deterministic (older reports have no "mode")
        r
        for r in _need(attention, "layer_rows", where)
        if r["S"] == 16384 and not r.get("sliding") and r.get("mode", "causal") == "causal"
    ]
    if not layers:
        raise KeyError(f"{where}: no layer row at S=16384 (full attention)")
    layer = layers[0]
    peers = [
        f"{name} {_ms(layer[key])} ({ratio(layer[ATTN_OURS], layer[key])})"
        for name, key in (("FA4", ATTN_FA4), ("flex", ATTN_FLEX))
        if layer.get(key) is not None
    ]
    out.append(
        "| one transformers `GptOssAttention` layer (projections, RoPE, attention), S=16k full, fwd+bwd "
        f"| {_ms(layer[ATTN_OURS])} | {'; '.join(peers) or '—'} |"
    )
    accuracy = [r for r in _need(attention, "accuracy", where) if r.get("case") == "S=16k causal"]
    if not accuracy:
        raise KeyError(f"{where}: no accuracy entry for 'S=16k causal'")
    acc = accuracy[0]
    fa4 = acc.get("fa4")
    out.append(
        "| attention bf16 error vs fp64, S=16k causal (out / dq / dk / dv / dsink) "
        f"| {_errors(acc['ours'])} | {'FA4 on the same inputs ' + _errors(fa4) if fa4 else '—'} |"
    )
    return out


def _trainer_step_pair(data: Data, name: str) -> tuple[dict, dict, dict]:
    """(meta, the default stack's row, the stock row it is compared with) of `trainer_step[_ragged].json`."""
    where = f"docs/benchmarks/{name}.json"
    report = data(name)
    rows = {r["variant"]: r for r in _need(report, "results", where) if r.get("summary")}
    peer = next((rows[v] for v in ("stock_fa4", "stock_flex") if v in rows), None)
    if "project_default" not in rows or peer is None:
        raise KeyError(f"{where}: needs project_default and stock_fa4 (or stock_flex) measured")
    return report["meta"], rows["project_default"], peer


def _step_cell(row: dict) -> str:
    s = row["summary"]
    mfu = f", MFU {100 * s['mfu']:.0f}%" if "mfu" in s else ""
    peak = f", {s['peak_gib']:.1f} GiB" if s.get("peak_gib") is not None else ""
    return f"{s['seconds']:.2f} s, {s['tokens_per_s']:,.0f} tokens/s{peak}{mfu}"


def trainer_step_rows(data: Data) -> list[str]:
    """The trainer's own optimizer step, the default stack against the same trainer as stock TRL runs it."""
    rows = []
    for name in ("trainer_step", "trainer_step_ragged"):
        meta, ours, peer = _trainer_step_pair(data, name)
        what = (
            f"{meta['trajectories']} trajectories (log-normal lengths, median {meta['ragged_median']:,}, up to "
            f"{meta['seq_len']:,}), micro-batches of {meta['micro_batch']}"
            if meta["ragged"]
            else f"{meta['trajectories']} trajectories of {meta['seq_len']:,} tokens"
        )
        stock = "FA4" if peer["variant"] == "stock_fa4" else "flex_attention"
        shape = "gpt-oss-20b shape" if meta["model"] == "20b" else f"a {meta['model']} GPT-OSS"
        rows.append(
            f"| `AgenticGRPOTrainer` optimizer step (rollouts not timed), {shape}, LoRA, {what} "
            f"([trainer step](docs/benchmarks/{name}.md)) | default configuration: {_step_cell(ours)} "
            f"| the same trainer as stock TRL runs it ({stock} + `grouped_mm` + TRL's fused LM head"
            f"{', padded' if meta['ragged'] else ''}): {_step_cell(peer)}: "
            f"**{ratio(ours['summary']['seconds'], peer['summary']['seconds'])}** |"
        )
    return rows


def moe_rows(data: Data) -> list[str]:
    where = "docs/benchmarks/moe.json"
    at32 = _need(_need(data("moe"), "results", where), "32768", where + " results")
    ours, base = _need(at32, "memory_efficient", where), _need(at32, "grouped_mm", where)
    return [
        "| one gpt-oss-20b MoE layer, T=32k, train fwd+bwd ([MoE](docs/benchmarks/moe.md)) "
        f"| {_ms(ours['train_ms'])}, {ours['train_peak']:.2f} GiB "
        f"| `grouped_mm` {_ms(base['train_ms'])}, {base['train_peak']:.2f} GiB "
        f"({ratio(ours['train_ms'], base['train_ms'])} the time, {ratio(ours['train_peak'], base['train_peak'])} "
        "the memory) |",
        f"| same layer, no-grad (log-prob pass) | {_ms(ours['nograd_ms'])}, {ours['nograd_peak']:.2f} GiB "
        f"| `grouped_mm` {_ms(base['nograd_ms'])}, {base['nograd_peak']:.2f} GiB "
        f"({ratio(ours['nograd_ms'], base['nograd_ms'])} the time) |",
    ]


def logprobs_rows(data: Data) -> list[str]:
    where = "docs/benchmarks/logprobs.json"
    at32 = _need(_need(data("logprobs"), "results", where), "32768", where + " results")
    fused, full, torch_ops = (_need(at32, k, where) for k in ("chunked_fused", "full_logits", "chunked_torch"))
    return [
        "| log-probs + entropies of the 201k-vocabulary head, S=32k, fwd+bwd "
        "([log-probs](docs/benchmarks/logprobs.md)) "
        f"| {_ms(fused['train_ms'])}, {fused['train_peak']:.1f} GiB (fused chunk kernels) "
        f"| full logits {_ms(full['train_ms'])}, {full['train_peak']:.1f} GiB "
        f"({ratio(fused['train_ms'], full['train_ms'])} the time); chunked PyTorch ops "
        f"{_ms(torch_ops['train_ms'])} ({ratio(fused['train_ms'], torch_ops['train_ms'])}) |"
    ]


def sources(data: Data) -> list[str]:
    """One line per JSON: the GPU, the versions, the date where recorded, and the command."""

    def env_text(env: dict, keys) -> str:
        return ", ".join(f"{k} {env[k]}" for k in keys if env.get(k))

    attention = data("attention")
    a_env = attention.get("env", {})
    m, lp = data("moe")["meta"], data("logprobs")["meta"]
    moe_extra = f", default chunk {m.get('default_chunk_rows', 8192)} pairs"
    lines = [
        f"- `attention.json`: {a_env.get('gpu', '?')} "
        f"({env_text(a_env, ('torch', 'triton', 'transformers', 'flash_attn_4', 'commit'))}); "
        f"`{_command(attention.get('command', 'attention.py'))}`",
    ]
    for name in ("trainer_step", "trainer_step_ragged"):
        meta = data(name)["meta"]
        env = meta["environment"]
        lines.append(
            f"- `{name}.json`: {env['device']} "
            f"({env_text(env, ('torch', 'transformers', 'trl', 'peft', 'triton', 'flash_attn_4', 'liger_kernel', 'commit'))}); "
            f"`{_command(meta['command'])}`"
        )
    return lines + [
        f"- `moe.json`: {m['device']} ({env_text(m, ('torch', 'transformers', 'triton', 'commit'))}), {m['date']}{moe_extra}; "
        f"`{_command(m['command'])}`",
        f"- `logprobs.json`: {lp['device']} ({env_text(lp, ('torch', 'triton', 'commit'))}), {lp['date']}; "
        f"`{_command(lp['command'])}`",
    ]


def readme_table(data: Data) -> str:
    lines = [
        "",
        "| what | this project | peer (ratio = this project ÷ peer) |",
        "|---|---|---|",
        *attention_rows(data),
        *trainer_step_rows(data),
        *moe_rows(data),
        *logprobs_rows(data),
        "",
        "Sources (in `docs/benchmarks/`; each `.md` there has the full table, the method and the plot):",
        "",
        *sources(data),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- docs/quickstart.md (CPU run)


def _quickstart(data: Data) -> dict:
    result = data("quickstart")
    if result.get("failures"):
        raise ValueError(f"docs/benchmarks/quickstart.json records a failed run: {result['failures']}")
    return result


def _quickstart_score(data: Data, stage: str) -> dict:
    return _need(_quickstart(data)["scores"], stage, "docs/benchmarks/quickstart.json scores")


def quickstart_log(data: Data) -> str:
    q = _quickstart(data)
    return "\n".join(["", "```", *q["lines"][:1], *q["cold_start_log"], *q["lines"][1:], "```", ""])


def quickstart_timing(data: Data) -> str:  # a block: a paragraph of its own
    q = _quickstart(data)
    m = q["machine"]
    # the cold start's step count and step time, from TRL's summary dict (train_runtime x steps per second)
    summary = next((d for d in q["cold_start_log"] if d.startswith("{'train_runtime'")), None)
    cold = ""
    if summary:
        fields = dict(re.findall(r"'(\w+)': '([^']*)'", summary))
        runtime, per_s = float(fields["train_runtime"]), float(fields["train_steps_per_second"])
        steps = round(runtime * per_s)
        cold = f" ({steps} steps of {runtime / steps:.1f} s before its loss reached the target)"
    grpo = q["done_s"] - q["cold_start_s"]
    return (
        f"\nMeasured wall time of `{q['command']}` with the defaults (setup excluded) on {m['cores']} cores of "
        f"{m['cpu']} (load average {q['load_before']:.2f} at the start; torch {m['torch']}, transformers "
        f"{m['transformers']}, trl {m['trl']}): **{_minutes(q['wall_s'])}** ({_minutes(q['cpu_s'])} of user + "
        f"system CPU time). The cold start took {q['cold_start_s']:.0f} s of it{cold}, and the "
        f"{q['grpo_steps']} GRPO steps with the scoring before and after them {grpo:.0f} s. "
        "`python benchmarks/quickstart.py --out docs/benchmarks` measures it again and rewrites "
        "`docs/benchmarks/quickstart.json`, from which this page's numbers are rendered.\n"
    )


def quickstart_accuracy(data: Data) -> str:
    s = _quickstart_score(data, "before GRPO")
    return f"{s['correct']}/{s['n']}"


def quickstart_tool_rate(data: Data) -> str:
    return f"{_quickstart_score(data, 'before GRPO')['tool_call_rate']:.2f}"


def quickstart_k3_max(data: Data) -> str:
    steps = _quickstart(data)["steps"]
    if not steps:
        raise KeyError("docs/benchmarks/quickstart.json: no GRPO step")
    return _sci(max(s["k3_kl"] for s in steps))


# ----------------------------------------------------------------------------------------------- docs/results.md


def _mismatch_rows(data: Data, name: str, model: str) -> dict:
    where = f"docs/benchmarks/{name}.json"
    found = [r for r in _need(data(name), "results", where) if r.get("model") == model]
    if not found:
        raise KeyError(f"{where}: no results for model {model!r}")
    return {row["attn_implementation"]: row for row in found[0]["rows"]}


def results_mismatch_fp32(data: Data) -> str:
    rows = _mismatch_rows(data, "mismatch_study_tiny_fp32", "tiny")
    exact = [rows[k]["k3_kl"] for k in ("eager", "flex_attention", "hf-gptoss-rl/sink-flash-attn3") if k in rows]
    dropped = _need(rows, "eager_without_sinks", "docs/benchmarks/mismatch_study_tiny_fp32.json rows")["k3_kl"]
    orders = math.floor(math.log10(dropped / max(exact)))
    return (
        f"k3 at most {_sci(max(exact))}, while dropping the sinks moves k3 to {_sci(dropped)}, more than {orders} orders "
        "of magnitude higher"
    )


def _learning_steps(data: Data, variant: str) -> list[dict]:
    where = "docs/benchmarks/learning_run.json"
    run = _need(_need(data("learning_run"), "variants", where), variant, where)
    return [s for s in run["steps"] if s.get("mismatch_k3_kl") is not None]


def results_learning_k3(data: Data) -> str:
    kernel, dropping = _learning_steps(data, "sink_kernel"), _learning_steps(data, "sink_dropping")
    return (
        f"median k3 over the steps {_sci(statistics.median(s['mismatch_k3_kl'] for s in kernel))} with the kernel "
        f"against {_sci(statistics.median(s['mismatch_k3_kl'] for s in dropping))} with sink-dropping training "
        f"attention, whose per-step max |Δp| reaches {max(s['mismatch_prob_diff_max'] for s in dropping):.2f}"
    )


def results_learning_sglang(data: Data) -> str:  # a block: what was run against SGLang, and per arm its numbers
    where = "docs/benchmarks/learning_run_sglang.json"
    from benchmarks.learning_run import arm_summary

    result = data("learning_run_sglang")
    setup, arms = _need(result, "setup", where), _need(result, "arms", where)
    rollouts = setup.get("rollouts") or {}
    runs = {name: ", ".join(sorted(arm["runs"], key=int)) for name, arm in arms.items()}
    missing = result.get("missing_runs") or []
    steps = sorted({r["steps_done"] for arm in arms.values() for r in arm["runs"].values()})

    def stat(summary: dict, key: str, spec: str) -> str:
        value = summary.get(key) or {}
        if value.get("mean") is None:
            return "–"
        std = f" ± {value['std']:{spec}}" if value.get("std") is not None else ""
        return f"{value['mean']:{spec}}{std}"

    lines = [
        "",
        f"Report: [learning_run_sglang.md](benchmarks/learning_run_sglang.md) (numbers in `learning_run_sglang.json`): "
        f"{result['environment'].get('device')}, SGLang {rollouts.get('sglang_version', '?')} serving "
        f"{rollouts.get('served_dtype', '?')}, {sum(len(arm['runs']) for arm in arms.values())} runs "
        f"({'; '.join(f'{n}: seeds {r}' for n, r in runs.items())}), "
        f"{'/'.join(map(str, steps))} optimizer steps per run."
        + (f" **Partial**: missing {', '.join(missing)}." if missing else ""),
        "",
        "| arm | seeds | reward first → last 10 | sampled accuracy start → last | peak grad norm | k3 vs the server | "
        "stale trajectories |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arm in arms.items():
        m = arm_summary(arm)
        stale = sum(s.get("stale_trajectories") or 0 for r in arm["runs"].values() for s in r["steps"])
        reward = (
            f"{stat(m, 'reward_first', '.3f')} → {stat(m, 'reward_last', '.3f')}"
            if (m.get("reward_first") or {}).get("mean") is not None
            else "too few steps"
        )
        lines.append(
            f"| {name} | {len(arm['runs'])} | {reward} | {stat(m, 'sampled_accuracy_start', '.2f')} → "
            f"{stat(m, 'sampled_accuracy_last', '.2f')} | {stat(m, 'grad_norm_peak', '.3g')} | "
            f"{stat(m, 'k3_mean', '.2g')} | {stale:g} |"
        )
    lines.append("")
    return "\n".join(lines)


def results_trainer_step(data: Data) -> str:
    meta, ours, peer = _trainer_step_pair(data, "trainer_step")
    _, r_ours, r_peer = _trainer_step_pair(data, "trainer_step_ragged")
    o, p = ours["summary"], peer["summary"]
    return (
        f"the default configuration's optimizer step took {ratio(o['seconds'], p['seconds'])} of the stock stack's "
        f"time on {meta['trajectories']} trajectories of {meta['seq_len']:,} tokens ({o['seconds']:.2f} s against "
        f"{p['seconds']:.2f} s, median of {meta['repeats']} each, same run; MFU {100 * o['mfu']:.0f}% against "
        f"{100 * p['mfu']:.0f}%) and {ratio(r_ours['summary']['seconds'], r_peer['summary']['seconds'])} on the "
        f"ragged batch ({r_ours['summary']['seconds']:.2f} s against {r_peer['summary']['seconds']:.2f} s)"
    )


def results_attention_vs_fa4(data: Data) -> str:
    row = attention_kernel_row(data, 16384, None)
    return ratio(row["public_ms"], row["fa4_ms"])


def results_sglang_probe(data: Data) -> str:
    where = "docs/benchmarks/sglang_e2e.json"
    syncs = [
        s
        for mode in _need(_need(_need(data("sglang_e2e"), "phases", where), "trainer", where), "result", where).values()
        if isinstance(mode, dict)
        for s in mode.get("syncs", [])
        if s.get("kind") == "merged" and s.get("probe_tolerance") is not None
    ]
    if not syncs:
        raise KeyError(f"{where}: no merged sync with a log-prob probe")
    bound = statistics.median(s["probe_tolerance"] for s in syncs)
    means = [s["probe_dlogp_mean"] for s in syncs]
    return (
        f"{bound:.2f} nats in this run, several times the probe's own mean deviation ({min(means):.3f} to "
        f"{max(means):.3f} nats over the {len(syncs)} merged syncs)"
    )


def results_routing_replay(data: Data) -> str:  # a block: the run's summary and its three measured bullets
    where = "docs/benchmarks/routing_replay.json"
    result = data("routing_replay")
    rows, cost, shape = (_need(result, key, where) for key in ("rows", "cost", "routing_shape"))
    own, rep = _need(rows, "own routing", where), _need(rows, "replayed engine routing", where)
    rounds = result.get("rounds") or {name: [row] for name, row in rows.items()}
    cuts = [r["k3_kl"] / o["k3_kl"] for o, r in zip(rounds["own routing"], rounds["replayed engine routing"])]
    disjoint = max(r["k3_kl"] for r in rounds["replayed engine routing"]) < min(
        o["k3_kl"] for o in rounds["own routing"]
    )
    n, k = len(cuts), shape["top_k"]
    span = f"{min(cuts):.2f}–{max(cuts):.2f}" if n > 1 else f"{cuts[0]:.2f}"
    return "\n".join([
        "",
        "Report: [routing_replay.md](benchmarks/routing_replay.md) (numbers in `routing_replay.json`), one run on one "
        f"H100 with SGLang {result.get('sglang_version', '?')}: a {shape['layers']}-layer model of gpt-oss-20b's "
        f"shapes with random weights, {result['num_prompts']} prompts, {n} round{'s' if n > 1 else ''}, each sampled "
        f"anew and scored both ways ({result['completion_tokens']:,} sampled tokens in all).",
        "",
        f"- **Agreement.** About {round(100 * (1 - own['agreement']))} % of the (token, layer) top-{k} sets of the "
        f"bf16 trainer differ from SGLang's (median agreement {own['agreement']:.3f}, worst layer "
        f"{own['agreement_min_layer']:.3f}): the same order as the R3 paper's 10 % of router decisions on "
        "Qwen3-30B-A3B. Agreement counts the trainer's own choice, which replay leaves as it is within a layer; it "
        f"is {rep['agreement']:.3f} with replay, because replaying the earlier layers brings the hidden states "
        "closer to the server's.",
        f"- **Mismatch.** Replaying the server's routing cuts k3 to {span} of its value with the trainer's own "
        f"routing in {'every one of the ' + str(n) + ' rounds' if n > 1 else 'the round'} ({own['k3_kl']:.3g} → "
        f"{rep['k3_kl']:.3g}, medians{'; the two ranges are disjoint' if disjoint and n > 1 else ''}), and the largest "
        f"|Δp| from {own['prob_diff_max']:.2g} to {rep['prob_diff_max']:.2g}. One random-weight model: the size of "
        "the effect on a trained gpt-oss-20b, and on learning, is not measured.",
        f"- **Cost.** Generation with `return_routed_experts` took {cost['generate_ratio']:.2f}x the time without "
        f"(median of {cost['repeats']}); the answer carries {cost['response_bytes_per_token']:.0f} bytes per routed "
        f"token (base64 of int32), the trainer stores {cost['stored_bytes_per_token']} (uint8, {shape['layers']} "
        f"layers x top-{k}; {24 * k} for gpt-oss-20b's 24 layers). The replayed log-prob pass took "
        f"{rep['logprob_pass_s']:.3f} s against {own['logprob_pass_s']:.3f} s with the trainer's own routing, after a "
        "warm-up.",
        "",
    ])  # fmt: skip


# -------------------------------------------------------------------------------- trainer.md, sequence_parallel.md


def routing_replay_cost(data: Data) -> str:
    cost = _need(data("routing_replay"), "cost", "docs/benchmarks/routing_replay.json")
    return f"{cost['generate_ratio']:.2f}x"


def routing_mismatch_cost(data: Data) -> str:
    report = data("routing_mismatch_cost")
    summary = _need(report, "summary", "docs/benchmarks/routing_mismatch_cost.json")
    config, machine = report["config"], report["machine"]
    return (
        f"{summary['extra_over_forward_backward']:.0%} of the loss forward and backward it rides on, "
        f"{summary['extra_over_step']:.0%} of the whole step with generation (median of {summary['steps_measured']} "
        f"steps, CPU: {machine['cpu']}, {machine['cores']} cores; a random GPT-OSS of {config['layers']} layers, "
        f"hidden {config['hidden']}, {config['experts']} experts, {config['batch']} trajectories of "
        f"{config['completion_length']} tokens; `{report['command']}`)"
    )


def _stock_step(data: Data) -> tuple[dict, dict]:
    """(meta, the stock row) of `trainer_step.json`: the same trainer as stock TRL runs it."""
    meta, _, peer = _trainer_step_pair(data, "trainer_step")
    if peer["summary"].get("peak_gib") is None or peer.get("resident_gib") is None:
        raise KeyError("docs/benchmarks/trainer_step.json: the stock row has no peak or resident memory")
    return meta, peer


def sp_stock_peak_32k(data: Data) -> str:
    _, peer = _stock_step(data)
    return f"{peer['summary']['peak_gib']:.1f} GiB"


def sp_stock_slope(data: Data) -> str:
    """The stock step's peak above its resident weights, per token of a micro-batch."""
    meta, peer = _stock_step(data)
    tokens = meta["seq_len"] * meta["micro_batch"]
    return f"{(peer['summary']['peak_gib'] - peer['resident_gib']) * 2**10 / tokens:.2f} MiB"


RENDERERS = {
    "readme.table": readme_table,
    "quickstart.log": quickstart_log,
    "quickstart.timing": quickstart_timing,
    "quickstart.accuracy": quickstart_accuracy,
    "quickstart.tool_rate": quickstart_tool_rate,
    "quickstart.k3_max": quickstart_k3_max,
    "results.mismatch_fp32": results_mismatch_fp32,
    "results.learning_k3": results_learning_k3,
    "results.learning_sglang": results_learning_sglang,
    "results.trainer_step": results_trainer_step,
    "results.attention_vs_fa4": results_attention_vs_fa4,
    "results.sglang_probe": results_sglang_probe,
    "results.routing_replay": results_routing_replay,
    "routing_replay.cost": routing_replay_cost,
    "routing_mismatch.cost": routing_mismatch_cost,
    "sp.stock_peak_32k": sp_stock_peak_32k,
    "sp.stock_slope": sp_stock_slope,
}


# ------------------------------------------------------------------------------------------------------- rendering


def check_markers(text: str, where: str) -> None:
    """Every opening marker has its closing one, in order, none nested; every name has a renderer."""
    depth, last = 0, None
    for m in re.finditer(rf"{OPENING.pattern}|{re.escape(CLOSING)}", text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group(0) == CLOSING:
            if depth == 0:
                raise ValueError(f"{where}:{line}: {CLOSING} without an opening <!-- generated:NAME -->")
            depth = 0
            continue
        if depth:
            raise ValueError(f"{where}:{line}: <!-- generated:{m.group(1)} --> inside the region {last!r}")
        if m.group(1) not in RENDERERS:
            raise ValueError(f"{where}:{line}: no renderer named {m.group(1)!r}; known: {sorted(RENDERERS)}")
        depth, last = 1, m.group(1)
    if depth:
        raise ValueError(f"{where}: the region {last!r} is not closed with {CLOSING}")


def check_layout(text: str, where: str) -> None:
    """A region is a block (its markers alone on their lines) or inline (inside a line, never at its start, on one
    line): CommonMark reads a line that starts with ``<!--`` as raw HTML, so an inline region there would stop the
    markdown of the rest of its line from rendering."""
    for m in REGION.finditer(text):
        line_start = m.start() == 0 or text[m.start() - 1] == "\n"
        line = text.count("\n", 0, m.start()) + 1
        after = text[m.end() : m.end() + 1]
        if line_start and not (m["body"].startswith("\n") and m["body"].endswith("\n") and after in ("", "\n")):
            raise ValueError(f"{where}:{line}: the region {m['name']!r} starts a line, so it must be a block: its "
                             "markers alone on their lines and its text between them")  # fmt: skip
        if not line_start and "\n" in m["body"]:
            raise ValueError(f"{where}:{line}: the inline region {m['name']!r} spans lines; make it a block")


def render_text(text: str, data: Data, where: str) -> str:
    check_markers(text, where)
    rendered = REGION.sub(lambda m: f"<!-- generated:{m['name']} -->{RENDERERS[m['name']](data)}{CLOSING}", text)
    check_layout(rendered, where)
    return rendered


def stale_regions(before: str, after: str) -> list[str]:
    old = [(m["name"], m["body"]) for m in REGION.finditer(before)]
    new = [(m["name"], m["body"]) for m in REGION.finditer(after)]
    return [name for (name, a), (_, b) in zip(old, new) if a != b]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from its rendering")
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout whose README.md and docs/*.md to render")
    parser.add_argument("--benchmarks", type=Path, default=None, help="folder of the JSON files (default: ROOT's)")
    args = parser.parse_args(argv)
    data = Data(args.benchmarks or args.root / "docs" / "benchmarks")
    stale = []
    for path in doc_files(args.root):
        current = path.read_text()
        try:
            updated = render_text(current, data, str(path.relative_to(args.root)))
        except (KeyError, ValueError, FileNotFoundError) as e:
            print(f"{path.relative_to(args.root)}: {e.args[0] if e.args else e}", file=sys.stderr)
            return 2
        if updated != current:
            stale.append(f"{path.relative_to(args.root)}: {', '.join(stale_regions(current, updated))}")
            if not args.check:
                path.write_text(updated)
    if args.check and stale:
        print("out of date (run python scripts/render_docs.py):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
