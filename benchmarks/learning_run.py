# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Learning run of agentic GRPO on GSM8K: sink-dropping training attention vs the project's kernel.

One small GPT-OSS (a few layers, a few experts, the real 201,088-id harmony vocabulary, fp32 weights, random init
with per-head sink logits ~ N(1, 1.5²) as in `mismatch_study.py`, so that dropping them matters as it would in a
trained model):

1. Warm-up ("cold start"): `trl_ext.cold_start.cold_start` (TRL's `SFTTrainer`) on scripted `code_interpreter`
   trajectories for up to 512 distinct training problems (the code recomputes the answer from the solution's GSM8K
   calculator annotations, one line each, then prints it; the tool's real output is shown, the model answers in
   `\\boxed{}`), with exact-sink eager attention. Done once; both variants start from it.
2. Held-out accuracy before training: greedy (temperature 0) agent rollouts on `--eval-file` with the code tool,
   scored by math-verify (`trl_ext.rewards.math_reward`), plus the share of trajectories that called the tool.
3. RL: `trl_ext.AgenticGRPOTrainer` on `--train-file` with the code tool and the ReTool reward, rolled out by an
   embedded engine that keeps **exact-sink eager attention** (as an inference server does), trained with
   - `sink_dropping`: `eager_without_sinks` (`hf_gptoss_rl.testing`, GPT-OSS eager minus the sink column), or
   - `sink_kernel`: the project's kernel, by default (`--kernel-route direct`) its sources registered through
     `AttentionInterface` as `sink_kernel_span` (below: every row's valid token span packed into one
     `flash_attn_varlen_func` call per layer, fp32 kept).
   Per optimizer step, from the trainer's own log history: reward, tool-call rate, gradient norm, clip fraction
   (`clip_ratio/region_mean`; nonzero only off-policy, hence `--num-iterations 2` by default) and the rollout/train
   mismatch (`mismatch/k3_kl`, `mismatch/prob_diff_mean|max`).
4. Held-out accuracy after training, as in 2, on the engine holding the trained weights.

Accuracy is also scored, before and after RL, on up to `--eval-limit` of the training problems the warm-up
practised ("practised"). By default (`--rl-problems practised`) RL draws its prompts from those problems: a
random-init model of this size does not solve unseen GSM8K problems after a minute of warm-up, so on unseen
problems every reward would be a format reward and the run would show no learning signal to compare.

Writes `learning_run.md`, `learning_run.png` and `learning_run.json` into `--out`.

    python benchmarks/learning_run.py                                        # GPU defaults: small model, 200 steps
    python benchmarks/learning_run.py --device cpu --model-size tiny --steps 2 --cold-start-steps 2 \
        --num-generations 2 --batch-size 2 --max-completion-length 16 --eval-limit 2 --out /tmp/lr   # CPU smoke

On a GPU machine: `pip install -e .` in a CUDA environment (the project's dependencies include TRL, datasets,
math-verify and openai-harmony), then `python benchmarks/learning_run.py --out results/learning_run`. `kernels` is not
needed: the default `--kernel-route direct` imports the kernel sources and registers `sink_kernel_span`.
(`--kernel-route hub` selects `hf-gptoss-rl/sink-flash-attn3` through `kernels`, but transformers' flash path then casts
fp32 activations to bf16, which would add bf16 error to the kernel variant's mismatch.)

Full GSM8K (7,473 train / 1,319 test rows, MIT; `openai/gsm8k` on the Hub, config `main`): export both splits as
.jsonl and pass `--train-file train.jsonl --eval-file test.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# no "flash" in the name: transformers routes attention names containing "flash" through its flash-attention
# preparation (fp32 inputs cast to half precision, its own mask handling), which is not what this function expects
SPAN_KERNEL_ATTENTION = "sink_kernel_span"
VARIANTS = ("sink_dropping", "sink_kernel")
MODEL_SIZES = {
    # the smallest GPT-OSS that learns the tool format on a CPU in seconds
    "tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
    },
    # ~110 M parameters (most of them the two 201,088-row embeddings), meant for one GPU
    "small": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
    },
}
# (log-history key, JSON/plot name) of the per-step series
STEP_METRICS = (
    ("reward", "reward"),
    ("reward_std", "reward_std"),
    ("rollout/frac_with_tool_call", "tool_call_rate"),
    ("rollout/tool_calls_mean", "tool_calls_mean"),
    ("rollout/frac_final_answer", "frac_final_answer"),
    ("grad_norm", "grad_norm"),
    ("clip_ratio/region_mean", "clip_fraction"),
    ("mismatch/k3_kl", "mismatch_k3_kl"),
    ("mismatch/prob_diff_mean", "mismatch_prob_diff_mean"),
    ("mismatch/prob_diff_max", "mismatch_prob_diff_max"),
    ("loss", "loss"),
    ("learning_rate", "learning_rate"),
)


# %% Arguments ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--train-file",
        default=str(REPO / "data" / "gsm8k_train_mini.jsonl"),
        help="GSM8K-style .jsonl",
    )
    p.add_argument(
        "--eval-file",
        default=str(REPO / "data" / "gsm8k_test_mini.jsonl"),
        help="held-out .jsonl",
    )
    p.add_argument(
        "--eval-limit",
        type=int,
        default=64,
        help="held-out problems scored before/after (and as many practised training problems)",
    )
    p.add_argument("--steps", type=int, default=200, help="GRPO optimizer steps per variant")
    p.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=120.0,
        help="wall-clock limit of each variant's RL phase",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {VARIANTS}",
    )
    p.add_argument(
        "--kernel-route",
        default="direct",
        choices=["auto", "hub", "direct"],
        help="how the project's kernel is selected: kernels hub id, or its sources (direct)",
    )
    p.add_argument("--cold-start-steps", type=int, default=800)
    p.add_argument("--cold-start-batch", type=int, default=16, help="trajectories per warm-up step")
    p.add_argument(
        "--cold-start-target-nll",
        type=float,
        default=0.015,
        help="stop the warm-up once its mean nll/token (last 10 steps) is below this; 0 = run every step. At "
        "0.015 a sampled (temperature 1) trajectory of a practised problem is right roughly a third of the time, "
        "which leaves RL a reward to raise",
    )
    p.add_argument(
        "--cold-start-problems",
        type=int,
        default=128,
        help="distinct GSM8K problems in the warm-up (and, with --rl-problems practised, in RL)",
    )
    p.add_argument("--cold-start-lr", type=float, default=3e-3)
    p.add_argument(
        "--rl-problems",
        default="practised",
        choices=["practised", "all"],
        help="RL prompts: the GSM8K problems the warm-up practised (a random-init model can reach a nonzero "
        "reward on them within minutes), or every row of --train-file",
    )
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=10,
        help="linear learning-rate warm-up of the RL phase (0 = none)",
    )
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument(
        "--batch-size", type=int, default=64, help="completions per optimizer step (8 prompts x 8 generations)"
    )
    p.add_argument(
        "--num-iterations",
        type=int,
        default=2,
        help="GRPO μ: optimizer passes per generation batch",
    )
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument(
        "--sink-mean",
        type=float,
        default=1.0,
        help="initial sink logits ~ N(mean, std²) per head, as in "
        "mismatch_study.py (transformers' init leaves them near 0, which hides what dropping them costs)",
    )
    p.add_argument("--sink-std", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    p.add_argument("--from-json", help="only rewrite learning_run.md/.png in --out from a saved learning_run.json")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        p.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    if args.steps < 1 or args.max_seconds <= 0 or args.eval_limit < 1:
        p.error("--steps, --max-seconds and --eval-limit must be positive")
    if args.batch_size % args.num_generations:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --num-generations {args.num_generations}")
    return args


# %% The project's kernel on the batch's valid tokens, packed (for machines without `kernels`) --------------------------
# (weakref to the mask's storage owner, view geometry, version) -> packing; see `_varlen_packing`
_PACKINGS: list[tuple] = []


def _varlen_packing(attention_mask):
    """`(indices, cu_seqlens, max_seqlen)` of a 2-D padding mask `[B, S]`: the flat `B*S` positions of the valid
    tokens (row by row, in order), int32 cumulative row lengths `[B + 1]` and the longest row.

    One host sync per mask (totals for the packed size); the result is cached for the mask, which transformers
    hands to every layer of a forward (the full- and sliding-attention masks are views of one tensor, hence the key
    on the storage owner and the view geometry). Rows whose valid tokens do not form one contiguous span are
    refused: packing them would close the gap and shift causal/sliding distances, which eager would not.
    """
    import weakref

    import torch

    owner = attention_mask._base if attention_mask._base is not None else attention_mask
    key = (attention_mask.storage_offset(), tuple(attention_mask.shape), attention_mask.stride(),
           attention_mask._version, attention_mask.device)  # fmt: skip
    for ref, cached_key, packing in _PACKINGS:
        if ref() is owner and cached_key == key:
            return packing
    valid = attention_mask.bool()
    lengths = valid.sum(-1, dtype=torch.int32)
    starts = valid.clone()
    starts[:, 1:] &= ~valid[:, :-1]  # a span starts where a valid token follows a pad (or the row's start)
    total, longest, broken = torch.stack(
        [lengths.sum(), lengths.max(), (starts.sum(-1) > 1).sum()]
    ).tolist()  # the one host sync
    if broken:
        raise ValueError(
            f"{SPAN_KERNEL_ATTENTION}: {broken} row(s) of the padding mask have valid tokens that are not one "
            "contiguous span"
        )
    indices = torch.nonzero_static(valid.reshape(-1), size=total).reshape(-1)  # no sync: the size is known
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    packing = (indices, cu_seqlens, longest)
    _PACKINGS[:] = [entry for entry in _PACKINGS[-3:] if entry[0]() is not None] + [(weakref.ref(owner), key, packing)]
    return packing


def varlen_sink_kernel_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    s_aux=None,
    **kwargs,
):
    """The project's kernel on every row's valid tokens in ONE `flash_attn_varlen_func` call (fp32 stays fp32).

    TRL's training batches are `[left pad | prompt | completion | right pad]`: a row's valid tokens form one
    contiguous span. They are gathered into a packed `[T, H, D]` batch delimited by `cu_seqlens` (each span its own
    sequence: causal and sliding-window distances are index differences within the span, so left padding shifts
    nothing, and RoPE was applied before attention), which is exactly what eager computes with the padding mask.
    The output is scattered back to `[B, S, H, D]` with zeros at pad positions. `attention_mask` is what the
    flash-style mask function gives: the 2-D padding mask, or None when nothing is padded.
    """
    from hf_gptoss_rl.attention import import_kernel_sources as _import_kernel_sources
    from hf_gptoss_rl.testing import direct_sink_kernel_attention

    if attention_mask is None:
        return direct_sink_kernel_attention(
            module, query, key, value, None, scaling, dropout, sliding_window=sliding_window, s_aux=s_aux
        )
    if dropout:
        raise ValueError(f"{SPAN_KERNEL_ATTENTION}: dropout is not supported")
    batch, heads, seqlen, head_dim = query.shape
    if attention_mask.dim() != 2 or key.shape[2] != seqlen or attention_mask.shape != (batch, seqlen):
        raise ValueError(
            f"{SPAN_KERNEL_ATTENTION}: needs a full-sequence forward with a 2D padding mask [B, S], got mask "
            f"{tuple(attention_mask.shape)} for query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    indices, cu_seqlens, longest = _varlen_packing(attention_mask)

    def pack(t):  # [B, H', S, D] -> [T, H', D]
        return t.transpose(1, 2).reshape(batch * seqlen, t.shape[1], head_dim).index_select(0, indices)

    window = (sliding_window - 1, sliding_window - 1) if sliding_window is not None else (-1, -1)
    out = _import_kernel_sources().flash_attn_varlen_func(
        pack(query),
        pack(key),
        pack(value),
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        softmax_scale=scaling,
        causal=True,
        window_size=window,
        s_aux=s_aux.to(query.dtype) if s_aux is not None else None,
    )
    padded = out.new_zeros(batch * seqlen, heads, head_dim).index_copy(0, indices, out)
    return padded.view(batch, seqlen, heads, head_dim), None


def project_kernel_attention(route: str) -> tuple[str, str]:
    """The attn_implementation name that runs the project's kernel here, and how it was obtained."""
    from hf_gptoss_rl.testing import setup_project_attention

    if route != "direct":
        try:
            return setup_project_attention("hub")
        except Exception as e:  # `kernels` missing / unusable
            if route == "hub":
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    else:
        reason = "--kernel-route direct"
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    setup_project_attention("direct")  # imports the kernel sources (fails early if they are broken)
    AttentionInterface.register(SPAN_KERNEL_ATTENTION, varlen_sink_kernel_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SPAN_KERNEL_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return (
        SPAN_KERNEL_ATTENTION,
        f"kernel sources via AttentionInterface, valid tokens packed into one varlen call ({reason})",
    )


# %% Held-out accuracy --------------------------------------------------------------------------------------------------
def greedy_accuracy(engine, tool, rows: list[dict], args) -> dict:
    """Greedy agent rollouts (exact-sink engine, code tool) on `rows`; math-verify accuracy and tool-call rate."""
    from hf_gptoss_rl.harmony import render_prompt
    from trl_ext.rewards import math_reward
    from trl_ext.rollout import AgentLoop, SamplingParams

    loop = AgentLoop(
        engine,
        [tool],
        sampling=SamplingParams(max_new_tokens=args.max_completion_length, temperature=0.0),
        max_turns=args.max_turns,
        max_completion_tokens=args.max_completion_length,
    )
    prompts = [render_prompt(r["prompt"], tools=[tool.spec()], reasoning_effort="low") for r in rows]
    trajectories = loop.run_batch_sync(prompts)
    correct = [math_reward(t.final_text, r["answer"]) for t, r in zip(trajectories, rows)]
    return {
        "accuracy": sum(correct) / len(rows),
        "correct": int(sum(correct)),
        "n": len(rows),
        "tool_call_rate": sum(t.num_tool_calls > 0 for t in trajectories) / len(rows),
    }


# %% One variant --------------------------------------------------------------------------------------------------------
def time_limit_callback(seconds: float):
    """A `TrainerCallback` that stops training once `seconds` of wall time have passed (the step in flight ends)."""
    from transformers import TrainerCallback

    class TimeLimit(TrainerCallback):
        def on_train_begin(self, train_args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, train_args, state, control, **kwargs):
            if time.perf_counter() - self.start > seconds:
                control.should_training_stop = True

    return TimeLimit()


def compile_warm_up(model, device) -> float:
    """One forward and backward through the training attention on a left-padded two-row batch, before the timed RL
    phase, so that Triton compiles the kernel's binaries here (fp32 on the H200: tens of seconds) and not inside
    the first RL steps, where it would eat the variant's time budget. Returns the seconds it took."""
    import torch

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=generator).to(device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :11] = 0  # a padded row: the kernel route's varlen packing runs as in training
    was_training = model.training
    model.train()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_variant(
    name: str,
    warm_state: dict,
    model_config,
    tokenizer,
    train_dataset,
    eval_rows,
    practised_rows,
    tool,
    device,
    args,
):
    import torch
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.testing import register_sink_dropping_attention
    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_ext.recipes import boxed_format_reward_func, retool_reward_func
    from trl_ext.rollout import EmbeddedEngine

    if name == "sink_dropping":
        attention, how = (
            register_sink_dropping_attention(),
            "GPT-OSS eager minus the sink column",
        )
    else:
        attention, how = project_kernel_attention(args.kernel_route)
    torch.manual_seed(args.seed)
    model = GptOssForCausalLM(model_config).to(device)
    model.load_state_dict(warm_state)
    model.config.use_cache = False
    # rollouts keep exact sinks (eager), like an inference server; only the trainer's attention changes
    engine = EmbeddedEngine.from_policy(
        model,
        attn_implementation="eager",
        pad_token_id=tokenizer.pad_token_id,
        seed=args.seed,
    )
    engine.model.config.use_cache = True
    model.set_attn_implementation(attention)
    before = greedy_accuracy(engine, tool, eval_rows, args)
    print(f"[{name}] held-out before: {before}", flush=True)
    practised_before = greedy_accuracy(engine, tool, practised_rows, args)
    print(f"[{name}] practised before: {practised_before}", flush=True)

    config = AgenticGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"learning_run_{name}_"),  # nothing is saved (save_strategy="no")
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        # constant: --max-seconds may stop the run before a decaying schedule would end; optional linear warm-up
        lr_scheduler_type="constant_with_warmup" if args.warmup_steps else "constant",
        warmup_steps=args.warmup_steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        num_iterations=args.num_iterations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_cpu=device.type == "cpu",
        bf16=False,  # fp32 end to end, like the rollout engine: only attention differs between rollout and training
        reward_weights=[1.0, 0.0],
        max_turns=args.max_turns,
        reasoning_effort="low",
        disable_tqdm=True,
    )
    warm_up_seconds = compile_warm_up(model, device)
    print(f"[{name}] training-attention warm-up (compiles): {warm_up_seconds:.1f} s", flush=True)
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=[retool_reward_func, boxed_format_reward_func],
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        tools=[tool],
        rollout_engine=engine,
        callbacks=[time_limit_callback(args.max_seconds)],
    )
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    after = greedy_accuracy(engine, tool, eval_rows, args)  # the engine holds the trained weights (synced)
    print(f"[{name}] held-out after: {after}", flush=True)
    practised_after = greedy_accuracy(engine, tool, practised_rows, args)
    print(f"[{name}] practised after: {practised_after}", flush=True)

    steps = []
    for entry in trainer.state.log_history:
        if "step" in entry and "loss" in entry:
            steps.append(
                {
                    "step": entry["step"],
                    **{out: entry.get(key) for key, out in STEP_METRICS},
                }
            )
    return {
        "attention": attention,
        "attention_how": how,
        "steps_done": trainer.state.global_step,
        "stopped_by_time_limit": trainer.state.global_step < args.steps,
        "train_seconds": train_seconds,
        "warm_up_seconds": warm_up_seconds,
        "held_out_before": before,
        "held_out_after": after,
        "practised_before": practised_before,
        "practised_after": practised_after,
        "steps": steps,
    }


# %% Report -------------------------------------------------------------------------------------------------------------
def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _window(steps: list[dict], key: str, first: bool, n: int = 10) -> float | None:
    values = [s[key] for s in steps if s.get(key) is not None]
    return _mean(values[:n] if first else values[-n:])


def _acc(score: dict | None) -> str:
    return f"{score['correct']}/{score['n']}" if score else "–"


def write_report(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_gptoss_rl.testing import fmt

    out.mkdir(parents=True, exist_ok=True)
    (out / "learning_run.json").write_text(json.dumps(result, indent=2))

    panels = [
        ("reward", "reward"),
        ("tool_call_rate", "tool-call rate"),
        ("grad_norm", "gradient norm"),
        ("clip_fraction", "clip fraction"),
        ("mismatch_k3_kl", "mismatch k3 KL"),
        ("mismatch_prob_diff_max", "mismatch max |Δp|"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (key, title) in zip(axes.flat, panels):
        for name, run in result["variants"].items():
            pts = [(s["step"], s[key]) for s in run["steps"] if s.get(key) is not None]
            if not pts:
                continue
            if key == "reward":  # 4 prompts per step: the per-step reward is mostly which problems were drawn
                line = ax.plot(*zip(*pts), marker=".", alpha=0.35, label=f"{name} (per step)")[0]
                window = 10
                ys = [y for _, y in pts]
                smooth = [
                    sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
                    for i in range(len(ys))
                ]
                ax.plot(
                    [x for x, _ in pts],
                    smooth,
                    color=line.get_color(),
                    linewidth=2.2,
                    label=f"{name} (mean of last {window})",
                )
            else:
                ax.plot(*zip(*pts), marker=".", label=name)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if key.startswith("mismatch"):
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"Agentic GRPO on GSM8K, {result['setup']['model_size']} GPT-OSS ({result['environment']['device']})")
    fig.tight_layout()
    fig.savefig(out / "learning_run.png", dpi=110)
    plt.close(fig)

    s = result["setup"]
    lines = [
        f"Command: `{result['command']}`",
        "",
        (
            f"Model: `{s['model_size']}` GPT-OSS, {s['parameters'] / 1e6:.1f} M parameters, fp32, real harmony vocabulary; "
            f"initial sinks ~ N({s['sink_init'][0]}, {s['sink_init'][1]}²); cold start ≤{s['cold_start_steps']} steps (until nll/token < {s.get('cold_start_target_nll') or 0}) x "
            f"{s.get('cold_start_batch', 4)} trajectories over {s.get('cold_start_problems', '?')} problems "
            f"({s['cold_start_seconds']:.0f} s). RL on {s.get('rl_problems', 'all')} problems: {s['num_generations']} "
            f"generations x {s['batch_size'] // s['num_generations']} prompts per step, μ={s['num_iterations']}, "
            f"lr {s['learning_rate']}, ≤{s['max_completion_length']} completion tokens, ≤{s['max_turns']} turns; "
            f"train set {s['train_rows']} rows, held-out {s['eval_rows']} rows (greedy, code tool). Rollouts: eager "
            "attention with exact sinks."
        ),
        "",
        (
            "| variant | training attention | steps | RL s (+ compile warm-up) | held-out acc. before → after | practised acc. before → "
            "after | tool-call rate before → after | reward first/last 10 | grad-norm median / max | clip frac. mean | "
            "k3 KL mean | max |Δp| mean |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in result["variants"].items():
        st = run["steps"]
        grad = sorted(x["grad_norm"] for x in st if x.get("grad_norm") is not None)
        b, a = run["held_out_before"], run["held_out_after"]
        lines.append(
            f"| {name} | `{run['attention']}` | {run['steps_done']}{' (time limit)' if run['stopped_by_time_limit'] else ''}"
            f" | {run['train_seconds']:.0f} (+{run.get('warm_up_seconds', 0.0):.0f}) | {b['correct']}/{b['n']} → {a['correct']}/{a['n']} | "
            f"{_acc(run.get('practised_before'))} → {_acc(run.get('practised_after'))} | "
            f"{fmt(b['tool_call_rate'], '.2f')} → {fmt(a['tool_call_rate'], '.2f')} | "
            f"{fmt(_window(st, 'reward', True))} / {fmt(_window(st, 'reward', False))} | "
            f"{fmt(grad[len(grad) // 2] if grad else None)} / {fmt(grad[-1] if grad else None)} | "
            f"{fmt(_mean(x.get('clip_fraction') for x in st))} | {fmt(_mean(x.get('mismatch_k3_kl') for x in st))} | "
            f"{fmt(_mean(x.get('mismatch_prob_diff_max') for x in st))} |"
        )
    lines += [
        "",
        "![learning run](learning_run.png)",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in result["environment"].items() if v is not None),
    ]
    (out / "learning_run.md").write_text("\n".join(lines) + "\n")


# %% Main ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        write_report(result, Path(args.out))
        return result
    wants_cpu = args.device == "cpu"
    if wants_cpu:  # the kernel's Triton code runs on CPU tensors only if this is set before triton.jit runs
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1" and "sink_kernel" in args.variants:
        raise RuntimeError("the kernel on CPU needs TRITON_INTERPRET=1 (pass --device cpu, or export it)")
    from transformers import GptOssForCausalLM
    from trl import SFTConfig

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from hf_gptoss_rl.testing import environment, tiny_gptoss_config
    from trl_ext.cold_start import StopAtLoss, cold_start
    from trl_ext.recipes import load_math_dataset
    from trl_ext.tools import CodeInterpreterTool

    tokenizer = load_gptoss_tokenizer()
    train_dataset = load_math_dataset(args.train_file)
    eval_rows = list(load_math_dataset(args.eval_file, limit=args.eval_limit))
    tool = CodeInterpreterTool()

    torch.manual_seed(args.seed)
    model_config = tiny_gptoss_config(**MODEL_SIZES[args.model_size])
    model_config._attn_implementation = "eager"
    model = GptOssForCausalLM(model_config).to(device)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=generator) * args.sink_std + args.sink_mean)
    start = time.perf_counter()
    sft_args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="learning_run_cold_start_"),  # nothing is saved
        max_steps=max(1, args.cold_start_steps),  # (with --cold-start-steps 0 the warm-up is skipped below)
        per_device_train_batch_size=args.cold_start_batch,
        learning_rate=args.cold_start_lr,
        # short warm-up, then cosine decay: a constant high rate plateaus before the trajectories are learnt
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.cold_start_steps // 20),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_cpu=device.type == "cpu",
        bf16=False,
        gradient_checkpointing=False,
        max_length=None,
        router_aux_loss_coef=0.0,
        disable_tqdm=True,
    )
    stop = [StopAtLoss(args.cold_start_target_nll)] if args.cold_start_target_nll else None
    practised = []
    if args.cold_start_steps > 0:
        practised = cold_start(
            model, tokenizer, train_dataset, tool, args=sft_args, max_rows=args.cold_start_problems, callbacks=stop
        )
    cold_seconds = time.perf_counter() - start
    full_train_rows = len(train_dataset)
    # "practised": training problems the warm-up saw, scored like the held-out set (memorisation vs generalisation);
    # without a warm-up, the first training problems
    practised_rows = [train_dataset[i] for i in (practised or range(full_train_rows))[: args.eval_limit]]
    if args.rl_problems == "practised" and practised:
        train_dataset = train_dataset.select(practised)
    warm_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    parameters = sum(p.numel() for p in model.parameters())
    del model

    result = {
        "command": "python benchmarks/learning_run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(),
        "setup": {
            "model_size": args.model_size,
            "parameters": parameters,
            "cold_start_steps": args.cold_start_steps,
            "cold_start_target_nll": args.cold_start_target_nll,
            "cold_start_batch": args.cold_start_batch,
            "cold_start_problems": len(practised),
            "cold_start_seconds": cold_seconds,
            "rl_problems": args.rl_problems,
            "train_file_rows": full_train_rows,
            "num_generations": args.num_generations,
            "batch_size": args.batch_size,
            "num_iterations": args.num_iterations,
            "learning_rate": args.learning_rate,
            "warmup_steps": args.warmup_steps,
            "max_completion_length": args.max_completion_length,
            "max_turns": args.max_turns,
            "train_rows": len(train_dataset),
            "eval_rows": len(eval_rows),
            "steps_requested": args.steps,
            "max_seconds": args.max_seconds,
            "seed": args.seed,
            "sink_init": [args.sink_mean, args.sink_std],
        },
        "variants": {},
    }
    for name in args.variants:
        result["variants"][name] = run_variant(
            name,
            warm_state,
            model_config,
            tokenizer,
            train_dataset,
            eval_rows,
            practised_rows,
            tool,
            device,
            args,
        )
    write_report(result, Path(args.out))
    for name, run in result["variants"].items():
        b, a = run["held_out_before"], run["held_out_after"]
        print(
            f"{name:14s} steps {run['steps_done']:4d}  held-out {b['correct']}/{b['n']} -> {a['correct']}/{a['n']}  "
            f"practised {_acc(run['practised_before'])} -> {_acc(run['practised_after'])}  "
            f"k3 KL mean {_mean(s['mismatch_k3_kl'] for s in run['steps'])}"
        )
    return result


if __name__ == "__main__":
    main()
