"""The whole product against a real SGLang server: rollouts, training with weight sync, rollout/training mismatch.

`docs/results.md` (section 4) describes the setup and how to read the report. Four phases, each with a deadline;
a phase that fails is recorded (its error and the tail of the server's log), the next one runs, and the report is
rewritten after every phase:

1. ``generate``: ``/generate`` with log-probs through `trl_ext.rollout.SGLangEngine`, a repeated batch (radix
   cache), then multi-turn rollouts of `trl_ext.rollout.AgentLoop` with the sandboxed `code_interpreter` tool;
2. ``trainer``: `trl_ext.AgenticGRPOTrainer` with ``rollout_backend="sglang"`` for weight sync ``disk``,
   ``tensor`` and LoRA, every sync verified (version, checksum, log-prob probe) and timed apart from the steps;
3. ``mismatch``: server samples scored by the trainer's log-prob path with four training attentions, once per
   server configuration of `MISMATCH_CONFIGS`;
4. ``sync_timing``: the median sync time per mode and its extrapolation to gpt-oss-20b by bytes.

The model has gpt-oss-20b's layer shapes (``--layers`` of its 24), random weights as in `benchmarks.mismatch_study`,
saved in bf16; ``--cold-start-steps N`` first fine-tunes it on ``code_interpreter`` demonstrations
(`trl_ext.cold_start`, the CPU demo's settings) so that it calls the tool. SGLang runs from an environment of its
own (``--server-cmd``), one server per configuration (`trl_ext.sglang_serve.ServerManager`) with `E2E_LAUNCH_FLAGS`,
``--server-args`` and the phase's flags; CUDA graphs stay on unless ``--disable-cuda-graph`` (recorded)::

    python -m benchmarks.sglang_e2e --server-cmd "/opt/sglang/bin/python -m sglang.launch_server" \\
        --cold-start-steps 40 --budget-s 900
    python -m benchmarks.sglang_e2e --url http://127.0.0.1:30000   # a server you started (flags not changed)
    python -m benchmarks.sglang_e2e --merge run1/sglang_e2e.json run2/sglang_e2e.json --out DIR   # one report

Writes ``sglang_e2e.{md,json,png}`` into ``--out`` (server logs under ``--out/logs``). The exit status is non-zero
when the model could not be built or a phase failed or was skipped; a phase only some of whose weight sync modes or
server configurations failed is "partial": the report has each failure, and the run still exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shlex
import shutil
import signal
import statistics
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import OUT_HELP, command_line, exit_if_failed, figure, md_table, output_dir, without_local_paths
from trl_ext.sglang_serve import ServerManager

REPO = Path(__file__).resolve().parents[1]
TRAIN_DATA = REPO / "data" / "gsm8k_train_mini.jsonl"
PHASES = ("generate", "trainer", "mismatch", "sync_timing")

TRAINER_MODES = ("disk", "tensor", "lora")
# server configurations of the mismatch phase: name -> extra launch flags
MISMATCH_CONFIGS = {
    "default": [],
    "deterministic": ["--enable-deterministic-inference"],
    "fp32_lm_head": ["--enable-fp32-lm-head"],
    "deterministic+fp32_lm_head": ["--enable-deterministic-inference", "--enable-fp32-lm-head"],
}
# The flags every server of this script gets: the portable Triton attention backend (SGLang's own default for GPT-OSS
# is fa3 on Hopper and trtllm_mha on Blackwell: `_gpt_oss_overrides` in sglang/srt/arg_groups/overrides.py),
# PyTorch sampling, no grammar backend.
E2E_LAUNCH_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
GPTOSS_20B_LAYERS = 24
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[sglang_e2e {time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


class PhaseTimeout(Exception):
    """A phase ran past its deadline (raised in the main thread by SIGALRM)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Raise `PhaseTimeout` in the main thread after ``seconds`` (SIGALRM; blocking waits are interrupted)."""
    if seconds <= 0:
        raise PhaseTimeout(f"{what}: no time left in the budget")

    def fire(signum, frame):
        raise PhaseTimeout(f"{what}: deadline of {seconds:.0f} s passed")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def free_memory(device: torch.device) -> None:
    """Collect what was dropped and, on CUDA, hand the cached blocks back: the server shares the GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------------ model


def sink_stats(model) -> list[dict]:
    """Per layer: the mean and standard deviation over heads of the attention sinks (one learnt logit per head)."""
    return [
        {"param": name, "mean": p.detach().float().mean().item(), "std": p.detach().float().std().item()}
        for name, p in model.named_parameters()
        if name.endswith("sinks")
    ]


def run_cold_start(model, args, device: torch.device, work_dir: Path) -> dict:
    """``--cold-start-steps`` of `trl_ext.cold_start.cold_start` on ``model`` (in place): the CPU demo's
    (`examples/grpo_retool.py`) data, tool, tokenizer and SFT settings, with this script's step count, learning rate,
    batch size and problem count; bf16 mixed precision on CUDA. Returns what it did and measured."""
    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from trl_ext.cold_start import LossHistory, cold_start, cosine_cold_start_config
    from trl_ext.recipes import load_math_dataset
    from trl_ext.tools import CodeInterpreterTool

    steps, cuda = args.cold_start_steps, device.type == "cuda"
    # use_cpu: the first trainer fixes accelerate's process state; the trainer phase uses the same
    sft_args = cosine_cold_start_config(str(work_dir / "cold_start"), max_steps=steps, batch_size=args.cold_start_batch,
                                        learning_rate=args.cold_start_lr, seed=args.seed, use_cpu=not cuda, bf16=cuda)  # fmt: skip
    recorder = LossHistory()  # logging_steps=1: one entry per step
    model.set_attn_implementation("eager")  # exact sink attention: the sinks get their gradient
    model.train()
    t0 = time.perf_counter()
    practised = cold_start(
        model, load_gptoss_tokenizer(), load_math_dataset(str(TRAIN_DATA)), CodeInterpreterTool(), args=sft_args,
        max_rows=args.cold_start_problems, reasoning_effort="low", callbacks=[recorder],
    )  # fmt: skip
    wall = time.perf_counter() - t0
    losses = [h["loss"] for h in recorder.history]
    first, last = (losses[0], losses[-1]) if losses else (None, None)
    log(
        f"cold start: {len(losses)} SFT steps in {wall:.1f} s, loss {first} -> {last}; {len(practised)} problems practised"
    )
    return {
        "steps": steps, "steps_logged": len(losses), "batch_size": args.cold_start_batch,
        "learning_rate": args.cold_start_lr, "problems": args.cold_start_problems,
        "precision": "bf16 mixed precision (bf16 weights)" if cuda else "float32",
        "data": f"{TRAIN_DATA.relative_to(REPO)}, code_interpreter demonstrations (trl_ext.cold_start)",
        "rows_practised": practised, "first_loss": first, "last_loss": last, "history": recorder.history,
        "wall_s": wall,
    }  # fmt: skip


def build_model(args, device: torch.device, work_dir: Path | None = None) -> dict:
    """Build the random GPT-OSS, cold-start it (``--cold-start-steps``) and save it in bf16 into ``args.model_dir``
    as SGLang reads it (`trl_ext.weight_sync.write_served_model`)."""
    from hf_gptoss_rl.model_builders import build_random_gptoss, gptoss_config
    from trl_ext.weight_sync import write_served_model

    steps = getattr(args, "cold_start_steps", 0)
    model = build_random_gptoss(
        gptoss_config(args.model, args.layers), device=device,
        # the cold start on a CPU trains in float32 (as the CPU demo does); saved in bf16 in any case
        dtype=torch.float32 if steps and device.type != "cuda" else torch.bfloat16,
        seed=args.seed, sink_mean=args.sink_mean, sink_std=args.sink_std, logit_std=args.logit_std,
    )  # fmt: skip
    sinks = {"initial": sink_stats(model)}
    cold = None
    if steps:
        cold = run_cold_start(model, args, device, Path(work_dir or tempfile.mkdtemp(prefix="sglang_e2e_")))
        sinks["after_cold_start"] = sink_stats(model)
    model.config.use_cache = True
    write_served_model(model, args.model_dir, torch.bfloat16)
    cfg, n_params = model.config, sum(p.numel() for p in model.parameters())
    del model  # the server shares the GPU: the model and (after a cold start) the optimizer state must be gone
    free_memory(device)
    if cold is not None and device.type == "cuda":
        cold["cuda_allocated_after_free_bytes"] = torch.cuda.memory_allocated(device)
    return {
        "model_dir": str(args.model_dir), "params": n_params, "bytes_bf16": 2 * n_params,
        "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        "heads": f"{cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv, head_dim {cfg.head_dim}",
        "num_local_experts": cfg.num_local_experts, "sliding_window": cfg.sliding_window,
        "vocab_size": cfg.vocab_size, "cold_start": cold, "sinks": sinks,
    }  # fmt: skip


def load_policy(model_dir, device: torch.device, attn: str = "eager"):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


def params_of_20b() -> int:
    """Parameters of gpt-oss-20b's layer shapes at full depth (counted on the meta device)."""
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.model_builders import gptoss_20b_config

    with torch.device("meta"):
        model = GptOssForCausalLM(gptoss_20b_config(num_hidden_layers=GPTOSS_20B_LAYERS))
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------------ phases


class Context:
    def __init__(self, args, device, server, work_dir):
        self.args, self.device, self.server, self.work_dir = args, device, server, work_dir
        self.results: dict = {}
        self.t0 = time.monotonic()

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def checkpoint(self) -> None:
        if self.server.version:
            self.results["meta"]["sglang_version"] = self.server.version
        write_outputs(self.args.out, self.results)


def run_part(ctx: Context, rec: dict, label: str, fn) -> None:
    """``fn()`` as one recorded part of the run (a phase, a weight sync mode, a server configuration): skipped when
    the budget is spent; ``rec`` gets its status ("ok" unless ``fn`` set one), and on a failure the error, the
    traceback and the server's log tail; the next part runs either way. Its wall time is recorded and the report
    rewritten."""
    if ctx.left() <= 0:
        rec.update(status="skipped", error=f"skipped for time: budget of {ctx.args.budget_s:.0f} s spent")
        log(f"{label}: skipped for time")
        ctx.checkpoint()
        return
    t0 = time.monotonic()
    try:
        fn()
        rec.setdefault("status", "ok")
    except BaseException as exc:  # noqa: BLE001 - recorded; the next part runs
        if isinstance(exc, KeyboardInterrupt):
            raise
        rec.update(status="failed", error=error_text(exc), traceback=traceback.format_exc()[-3000:],
                   server_log_tail=ctx.server.log_tail())  # fmt: skip
    free_memory(ctx.device)
    rec["wall_s"] = time.monotonic() - t0
    log(f"{label}: {rec['status']} in {rec['wall_s']:.1f} s" + (f" ({rec['error'][:300]})" if "error" in rec else ""))
    ctx.checkpoint()


def sglang_engine(url: str, args, **kwargs):
    from trl_ext.rollout import SGLangEngine

    return SGLangEngine(url, ready_timeout_s=args.ready_timeout_s, timeout_s=120.0, retry_deadline_s=20.0, **kwargs)


def close_engine(engine) -> None:
    with contextlib.suppress(Exception):
        engine.run(engine.close(), timeout_s=10)


def phase_generate(ctx, result: dict) -> None:
    from benchmarks.mismatch_study import load_prompts
    from trl_ext.rollout import AgentLoop, SamplingParams, run_sync
    from trl_ext.tools import CodeInterpreterTool

    args = ctx.args
    url = ctx.server.ensure("default", [], args.ready_timeout_s)
    prompts, prompts_how = load_prompts(args.num_prompts)
    engine = sglang_engine(url, args)
    result.update(prompts_how=prompts_how, num_prompts=len(prompts))
    try:
        t0 = time.perf_counter()
        outs = run_sync(
            engine.generate_batch(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0))
        )
        wall = time.perf_counter() - t0
        n_tokens = sum(len(o.output_ids) for o in outs)
        logps = [lp for o in outs for lp in o.logprobs]
        first = dict(engine.stats)
        result["generate"] = {
            "wall_s": wall, "output_tokens": n_tokens, "tokens_per_s": n_tokens / wall if wall > 0 else None,
            "logprobs_finite": all(math.isfinite(x) for x in logps), "num_logprobs": len(logps),
            "mean_logprob": sum(logps) / len(logps) if logps else None,
            "finish_reasons": _count(o.finish_reason for o in outs),
            "weight_versions": sorted({str(o.weight_version) for o in outs}),
            "prompt_tokens": first["prompt_tokens"], "cached_tokens": first["cached_tokens"],
        }  # fmt: skip
        # the same prompts again: SGLang's radix cache should serve their prefixes
        run_sync(engine.generate_batch(prompts, SamplingParams(max_new_tokens=1, temperature=1.0)))
        result["repeat"] = {k: engine.stats[k] - first[k] for k in ("prompt_tokens", "cached_tokens")}
        log(
            f"generate: {n_tokens} tokens in {wall:.2f} s; repeat batch cached "
            f"{result['repeat']['cached_tokens']}/{result['repeat']['prompt_tokens']} prompt tokens"
        )
        ctx.checkpoint()
        result["generate"]["status"] = "ok"
        try:  # multi-turn agent rollouts with the sandboxed code tool, recorded apart from the token-level results
            tool = CodeInterpreterTool(timeout_s=10.0)
            practised = ((ctx.results.get("model") or {}).get("cold_start") or {}).get("rows_practised")
            agent_prompts, agent_how = tool_prompts(args.agent_prompts, tool, practised)
            loop = AgentLoop(
                engine, [tool], sampling=SamplingParams(max_new_tokens=args.agent_turn_tokens, temperature=1.0),
                max_turns=args.agent_max_turns, max_completion_tokens=args.agent_max_turns * args.agent_turn_tokens,
                tool_timeout_s=15.0,
            )  # fmt: skip
            t0 = time.perf_counter()
            trajs = loop.run_batch_sync(agent_prompts)
            calls = [c for t in trajs for c in t.tool_calls]
            result["agent"] = {
                "prompts_how": agent_how, "num_trajectories": len(trajs), "wall_s": time.perf_counter() - t0,
                "turns": [t.num_turns for t in trajs], "tool_calls": len(calls),
                "tool_calls_executed": sum(1 for c in calls if c.result is not None and c.error is None),
                "tool_call_errors": [f"{c.name}: {c.error}"[:200] for c in calls if c.error][:5],
                "finish_reasons": _count(t.finish_reason for t in trajs),
                "trajectory_errors": [e[:200] for t in trajs for e in t.errors][:8],
                "completion_tokens": [len(t.completion_ids) for t in trajs], "status": "ok",
            }  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            result["agent"] = {
                "status": "failed",
                "error": error_text(exc),
                "traceback": traceback.format_exc()[-3000:],
            }
            log(f"agent loop failed: {error_text(exc)[:300]}")
        result["engine_stats"] = dict(engine.stats)
    finally:
        close_engine(engine)


def tool_prompts(n: int, tool, practised: list[int] | None = None) -> tuple[list[list[int]], str]:
    """The first ``n`` GSM8K problems of the training file, rendered exactly as the cold start's demonstrations'
    prompts (`trl_ext.recipes.load_math_dataset`'s prompt, the tool, reasoning effort low); after a cold start
    (``practised``: the rows its demonstrations solved) the practised problems come first, so that the agent loop
    samples from the distribution the policy was fine-tuned on."""
    from hf_gptoss_rl.harmony import render_prompt
    from trl_ext.recipes import load_math_dataset

    dataset = load_math_dataset(str(TRAIN_DATA))
    seen = set(practised or [])
    order = (list(practised or []) + [i for i in range(len(dataset)) if i not in seen])[:n]
    ids = [render_prompt(dataset[i]["prompt"], tools=[tool.spec()], reasoning_effort="low") for i in order]
    cold = f" ({min(n, len(practised))} practised in the cold start)" if practised else ""
    return ids, (
        f"rows {order} of {TRAIN_DATA.name}{cold}, rendered as the cold start's demonstrations "
        "(hf_gptoss_rl.harmony.render_prompt, code_interpreter in the tools)"
    )


def _count(items) -> dict:
    return dict(Counter(str(x) for x in items))


def start_trainer_server(ctx, mode: str, out: dict) -> str:
    """The server a trainer mode runs against (LoRA: relaunched with ``--enable-lora``); returns its URL."""
    args, lora = ctx.args, mode == "lora"
    flags = (
        ["--enable-lora", "--max-lora-rank", str(args.lora_rank), "--lora-target-modules", *LORA_TARGETS]
        if lora
        else []
    )
    out.update(server_flags=flags, syncs=[], steps=[])
    if lora:
        out["lora_sync_mode"] = args.lora_sync_mode
    url = ctx.server.ensure(
        mode if lora else "default", flags, args.ready_timeout_s, flags_required=False, any_weights=True
    )
    if ctx.server.external and flags:
        out["note"] = f"--url: flags {flags} not applied by this script (the server must have been launched with them)"
    return url


def run_trainer(ctx, mode: str, out: dict, url: str) -> None:
    """One trainer run against the server at ``url``; fills ``out`` (a failure keeps the syncs and steps measured
    before it)."""
    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_ext.recipes import load_math_dataset, retool_reward_func
    from trl_ext.tools import CodeInterpreterTool

    args, device, lora = ctx.args, ctx.device, mode == "lora"
    model = load_policy(args.model_dir, device, attn="eager")
    cuda = device.type == "cuda"
    config = AgenticGRPOConfig(
        output_dir=str(ctx.work_dir / f"trainer_{mode}"), max_steps=args.train_steps, learning_rate=1e-5,
        per_device_train_batch_size=args.num_generations, num_generations=args.num_generations,
        max_completion_length=args.train_completion_tokens, max_turns=2, beta=0.0, loss_type="dapo", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=not cuda, bf16=cuda, seed=args.seed, rollout_concurrency=8,
        disable_tqdm=True, rollout_backend="sglang", sglang_urls=[url], sglang_ready_timeout_s=args.ready_timeout_s,
        sglang_timeout_s=120.0, sglang_retry_deadline_s=20.0, weight_sync_mode=args.lora_sync_mode if lora else mode,
        weight_sync_lora=lora, weight_sync_verify=["version", "checksum", "logprobs"],
        weight_sync_dir=str(ctx.work_dir / f"weights_{mode}"),
    )  # fmt: skip
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS)

    trainer = AgenticGRPOTrainer(
        model=model, reward_funcs=[retool_reward_func], args=config,
        train_dataset=load_math_dataset(str(TRAIN_DATA), limit=args.train_rows), peft_config=peft_config,
        tools=[CodeInterpreterTool(timeout_s=10.0)],
    )  # fmt: skip
    engine = trainer.rollout_engine
    ctx.server.dirty = True
    out["attn_implementation"] = trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation
    try:
        trainer.sync_rollout_weights()  # version 0: the server gets the trainer's starting weights (the first sync)
        t0 = time.perf_counter()
        train_out = trainer.train()
        out["train_s"], out["train_loss"] = time.perf_counter() - t0, train_out.training_loss
        kept = ("step", "loss", "reward", "num_tokens", "rollout/weight_version")
        out["log_history"] = [
            {k: v for k, v in h.items() if k in kept or k.startswith(("sampling/", "tools/", "rollout/"))}
            for h in trainer.state.log_history
        ]
        out["served_weight_version"] = engine.weight_version
        out["engine_stats"] = dict(engine.stats)
    finally:
        # each sync as the weight sync recorded it (`trl_ext.weight_sync.SyncRecord`: bytes, outcome, transfer, the
        # log-prob probe, the trainer's whole push), and each step's time before its sync (`timing/step_s`)
        out["syncs"] = [record.as_dict() for record in engine.weight_sync.sync_history]
        out["steps"] = [
            {"step": h["step"], "step_s_without_sync": h["timing/step_s"]}
            for h in trainer.state.log_history
            if "timing/step_s" in h
        ]
        close_engine(engine)
        del trainer, model
        free_memory(device)


def phase_trainer(ctx, results: dict) -> None:
    for mode in ctx.args.trainer_modes:
        rec = results[mode] = {}

        def train(mode=mode, rec=rec):
            # the server start has its own deadline (--ready-timeout-s); the mode's starts once it is up
            url = start_trainer_server(ctx, mode, rec)
            with deadline(min(ctx.args.trainer_timeout_s, ctx.left()), f"trainer {mode}"):
                run_trainer(ctx, mode, rec, url)

        run_part(ctx, rec, f"trainer {mode}", train)


def phase_mismatch(ctx, result: dict) -> None:
    from benchmarks.mismatch_study import FLEX_CPU_NOTE, load_prompts, score_by_attention
    from hf_gptoss_rl.attention_variants import (
        SINK_DROPPING_ATTENTION,
        register_sink_dropping_attention,
        setup_project_attention,
    )  # fmt: skip
    from trl_ext.mismatch import rollout_scoring_batch
    from trl_ext.rollout import SamplingParams, run_sync
    from trl_ext.weight_sync import WeightSyncConfig

    args, device = ctx.args, ctx.device
    register_sink_dropping_attention()
    project_attn, project_how = setup_project_attention(args.project_attn)
    prompts, prompts_how = load_prompts(args.num_prompts)
    model = load_policy(args.model_dir, device, attn="eager")
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    result.update(prompts_how=prompts_how, project_attention_how=project_how, configs={})
    variants = [
        ("eager (sinks)", "eager", None),
        ("eager without sinks", SINK_DROPPING_ATTENTION, None),
        ("flex_attention + sinks", "flex_attention", None if device.type == "cuda" else FLEX_CPU_NOTE),
        ("project kernel (sink-flash-attn3)", project_attn, None),
    ]

    def measure(name: str, rec: dict) -> None:
        # the server start has its own deadline (--ready-timeout-s); the configuration's starts once it is up
        url = ctx.server.ensure(f"mismatch_{name}", rec["server_flags"], args.ready_timeout_s)
        with deadline(min(args.mismatch_timeout_s, ctx.left()), f"mismatch {name}"):
            engine = sglang_engine(url, args, weight_sync=WeightSyncConfig(mode="disk", model_config=model.config))
            try:
                if ctx.server.dirty:  # --url server a trainer synced into: back to --model-dir's weights
                    run_sync(engine.update_weights(list(model.state_dict().items()), version=0))
                    ctx.server.dirty = False
                    rec["note"] = "the server's weights were reset to --model-dir by a disk sync first"
                sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
                outs = run_sync(engine.generate_batch(prompts, sampling))
            finally:
                close_engine(engine)
            if not all(o.output_ids for o in outs):
                raise RuntimeError("a completion came back empty (aborted?)")
            batch = rollout_scoring_batch(prompts, outs, pad_id, device)
            rec["completion_tokens"] = int(batch[3].sum())
            rec["finish_reasons"] = _count(o.finish_reason for o in outs)
            rec["rows"], _ = score_by_attention(
                model, variants, batch, [len(p) for p in prompts], temperature=1.0, threshold=args.threshold,
                project=(project_attn, args.project_attn),
            )  # fmt: skip

    try:
        for name in args.mismatch_configs:
            rec = result["configs"][name] = {"server_flags": MISMATCH_CONFIGS[name]}
            run_part(ctx, rec, f"mismatch {name}", lambda name=name, rec=rec: measure(name, rec))
    finally:
        model = None  # the server shares the GPU
        free_memory(device)


def phase_sync_timing(ctx, out: dict) -> None:
    """Median sync time per mode from the trainer phase, GB/s, and the extrapolation to gpt-oss-20b."""
    trainer = ctx.results["phases"].get("trainer", {}).get("result") or {}
    layers = (ctx.results.get("model") or {}).get("num_hidden_layers")
    out.update(params_20b=params_of_20b() if ctx.args.model == "20b" else None, modes={})
    if out["params_20b"]:
        out["bytes_20b_merged_bf16"] = 2 * out["params_20b"]
    for mode in TRAINER_MODES:
        syncs = [s for s in (trainer.get(mode) or {}).get("syncs", []) if s.get("ok")]
        if not syncs:
            out["modes"][mode] = {"note": "no successful sync measured in the trainer phase"}
            continue
        times = [s["transfer_s"] for s in syncs]
        nbytes, med = syncs[-1]["bytes"], statistics.median(times)
        rec = {
            "repeats": len(times), "transfer_s": times, "median_transfer_s": med,
            "median_sync_total_s": statistics.median([s.get("sync_total_s", float("nan")) for s in syncs]),
            "bytes": nbytes, "gb_per_s": nbytes / med / 1e9 if med > 0 else None,
        }  # fmt: skip
        if ctx.args.model == "20b" and layers:
            # LoRA: q/k/v/o adapters only, the same shapes in every layer, so the size scales with depth
            rec["bytes_20b"] = nbytes * GPTOSS_20B_LAYERS / layers if mode == "lora" else out["bytes_20b_merged_bf16"]
            rec["extrapolated_20b_s"] = rec["bytes_20b"] / (rec["gb_per_s"] * 1e9) if rec["gb_per_s"] else None
        out["modes"][mode] = rec


# ------------------------------------------------------------------------------------------------------------ report


def fmt(v, spec=".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def report_paths(results: dict) -> dict[str, str]:
    """This run's own folders, by role: the model directory and the work directory (the rest of a report's local
    paths, `benchmarks._cli.without_local_paths` finds by location)."""
    named = {}
    model_dir = (results.get("model") or {}).get("model_dir")
    if model_dir and model_dir != "MODEL_DIR":
        named[model_dir] = "MODEL_DIR"
    work_dir = str((results.get("meta") or {}).get("work_dir") or "").split(" (", 1)[0]
    if work_dir.startswith("/"):
        named[work_dir] = "WORK_DIR"
    return named


def write_outputs(out: Path, results: dict) -> None:
    """The report (JSON, markdown, plot) of ``results``, without this machine's paths: the run itself keeps them."""
    results = without_local_paths(results, report_paths(results))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sglang_e2e.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "sglang_e2e.md").write_text(render_markdown(results))
    with contextlib.suppress(Exception):
        plot(out / "sglang_e2e.png", results)


def _status_block(ph: dict) -> list[str]:
    lines = [f"Status: **{ph.get('status')}**" + (f" ({ph['wall_s']:.1f} s)" if "wall_s" in ph else "")]
    if ph.get("error"):
        lines += ["", f"`{ph['error'][:1000]}`"]
    if ph.get("server_log_tail"):
        lines += ["", "Server log tail:", "", "```", ph["server_log_tail"][-4000:], "```"]
    return lines + [""]


def _cold_start_lines(m: dict) -> list[str]:
    cold, sinks = m.get("cold_start"), m.get("sinks") or {}
    lines = []
    if cold:
        lines += [
            "## Cold start",
            "",
            f"`trl_ext.cold_start.cold_start` (TRL's `SFTTrainer`) on {cold.get('data')}: {cold.get('steps')} steps "
            f"of {cold.get('batch_size')} demonstrations, AdamW at {fmt(cold.get('learning_rate'))} with a cosine "
            f"schedule, {cold.get('precision')}. Loss (negative log-likelihood per assistant token) "
            f"{fmt(cold.get('first_loss'), '.4g')} at the first step, {fmt(cold.get('last_loss'), '.4g')} at the last; "
            f"{fmt(cold.get('wall_s'), '.1f')} s (demonstrations built in the sandbox, then trained). "
            f"{len(cold.get('rows_practised') or [])} problems practised: rows {cold.get('rows_practised') or []} of the file.",
            "",
        ]
    if sinks.get("initial"):
        after = {s["param"]: s for s in sinks.get("after_cold_start") or []}
        cell = lambda s: f"{s['mean']:.4g} ± {s['std']:.4g}" if s else "-"  # noqa: E731
        rows = [[s["param"], cell(s), cell(after.get(s["param"]))] for s in sinks["initial"]]
        lines += ["Attention sinks, mean ± std over heads:", ""]
        lines += md_table(["parameter", "initial", "after the cold start"], rows) + [""]
    return lines


def _section(phases: dict, name: str, title: str) -> tuple[list[str], dict | None]:
    """The heading and status of a phase's section, and its result (None: the phase is not in the report)."""
    ph = phases.get(name)
    if not ph:
        return [], None
    return [f"## {title}", ""] + _status_block(ph), ph.get("result") or {}


def render_markdown(r: dict) -> str:
    meta, m, phases = r.get("meta", {}), r.get("model") or {}, r.get("phases", {})
    runs = meta.get("merged_from")
    how = (
        f"Command: `{meta.get('command')}`."
        if not runs
        else f"Merged from {len(runs)} runs of the same model (`--merge`, in this order; a later run's phase, weight "
        "sync mode or server configuration replaces an earlier one): "
        + "; ".join(f"{x.get('started')}: `{x.get('command')}`" for x in runs)
        + "."
    )
    started = [] if runs else [f"Started {meta.get('started')}, budget {meta.get('budget_s')} s"]
    if "server_flags_checked" in meta:  # reports of the script's earlier versions
        started.append(f"server flags checked: {meta['server_flags_checked']}")
    lines = [
        "# GPT-OSS RL against a real SGLang server (`benchmarks/sglang_e2e.py`)",
        "",
        f"{how} Device: {meta.get('env', {}).get('device')}; "
        f"sglang {meta.get('sglang_version', '?')} (`{meta.get('server_cmd')}`, extra `{meta.get('server_args')}`; "
        f"{_cuda_graph_text(_reported_cuda_graph_disabled(meta))}).",
        f"Model: {'cold-started' if m.get('cold_start') else 'random'} GPT-OSS, {m.get('num_hidden_layers')} layers, "
        f"hidden {m.get('hidden_size')}, {m.get('heads')}, {m.get('num_local_experts')} experts, window "
        f"{m.get('sliding_window')}, {fmt(m.get('params'), ',')} parameters, bf16; random init (sinks and logits as "
        "in `benchmarks/mismatch_study.py`)" + (", then the SFT cold start below." if m.get("cold_start") else "."),
        *(["; ".join(started) + "."] if started else []),
        "",
    ]
    status = [phases.get(name, {"status": "not run"}) for name in PHASES]
    lines += md_table(["phase", "status", "seconds", "note"], [
        [name, ph.get("status"), fmt(ph.get("wall_s"), ".1f"), (ph.get("error") or "")[:160]]
        for name, ph in zip(PHASES, status)
    ]) + [""]  # fmt: skip
    if "model_error" in r:
        lines += ["## Model build failed", "", f"`{r['model_error']}`", ""]
    lines += _cold_start_lines(m)

    section, res = _section(phases, "generate", "1. generate")
    lines += section
    if res is not None and res.get("generate"):
        g, rep = res["generate"], res.get("repeat") or {}
        lines += [f"Prompts: {res.get('prompts_how')}.", ""]
        lines += md_table(
            ["prompts", "output tokens", "wall s", "tokens/s", "log-probs finite", "finish reasons",
             "cached prompt tokens (first batch)", "cached prompt tokens (same prompts again)"],
            [[res.get("num_prompts"), g["output_tokens"], fmt(g["wall_s"], ".2f"), fmt(g["tokens_per_s"], ".1f"),
              f"{g['logprobs_finite']} ({g['num_logprobs']})", g["finish_reasons"],
              f"{g['cached_tokens']}/{g['prompt_tokens']}", f"{rep.get('cached_tokens')}/{rep.get('prompt_tokens')}"]],
        ) + [""]  # fmt: skip
    a = (res or {}).get("agent")
    if a and a.get("status") != "ok":
        lines += [f"Agent loop with `code_interpreter`: **{a.get('status')}**: `{a.get('error')}`", ""]
    elif a:
        lines += [f"Agent loop with `code_interpreter` ({a['prompts_how']}):", ""]
        lines += md_table(
            ["trajectories", "turns each", "tool calls", "executed without error", "finish reasons", "completion tokens"],
            [[a["num_trajectories"], a["turns"], a["tool_calls"], a["tool_calls_executed"], a["finish_reasons"],
              a["completion_tokens"]]],
        ) + [""]  # fmt: skip
        if a["trajectory_errors"] or a["tool_call_errors"]:
            lines += ["Parse outcomes (first few):", ""]
            lines += [f"- {e}" for e in a["tool_call_errors"] + a["trajectory_errors"]] + [""]

    section, res = _section(phases, "trainer", "2. trainer (AgenticGRPOTrainer, rollout_backend='sglang')")
    lines += section
    if res is not None:
        modes = [(mode, res[mode]) for mode in TRAINER_MODES if res.get(mode)]
        lines += [
            "One sync before training (version 0), then one after each step. `transfer` = the engine's "
            "`update_weights`/`update_lora_adapter` (pause, load, continue, version check); `total` = the trainer's "
            "whole sync (export, transfer, probe reference, log-prob check).",
            "",
        ]
        lines += md_table(
            ["mode", "version", "bytes", "sync", "transfer s", "total s", "probe mean abs Δlogp", "probe max abs Δlogp",
             "probe mean abs logp (trainer)", "tolerance", "probe"],
            [[mode, s["version"], fmt(s["bytes"], ","), "ok" if s.get("ok") else "FAILED",
              fmt(s.get("transfer_s"), ".3f"), fmt(s.get("sync_total_s"), ".3f"), fmt(s.get("probe_dlogp_mean")),
              fmt(s.get("probe_dlogp_max")), fmt(s.get("probe_mean_abs_logp")), fmt(s.get("probe_tolerance")),
              {True: "pass", False: "FAIL"}.get(s.get("probe_pass"), "-")]
             for mode, rec in modes for s in rec.get("syncs", [])],
        ) + [""]  # fmt: skip
        for mode, rec in modes:
            steps = ", ".join(f"{s['step_s_without_sync']:.2f}" for s in rec.get("steps", []))
            lines.append(
                f"- **{mode}**: {rec.get('status')}; server flags `{' '.join(rec.get('server_flags', []))}`; "
                + (f"adapter sent by `{rec['lora_sync_mode']}`; " if "lora_sync_mode" in rec else "")
                + f"policy attention `{rec.get('attn_implementation')}`; step seconds without sync: [{steps}]"
                + (f"; error `{rec['error'][:600]}`" if rec.get("error") else "")
            )
            if rec.get("server_log_tail") and rec.get("status") != "ok":
                lines += ["", "  ```", *("  " + x for x in rec["server_log_tail"][-3000:].splitlines()), "  ```"]
        lines.append("")

    section, res = _section(phases, "mismatch", "3. mismatch (SGLang rollouts, trainer-side scoring)")
    lines += section
    if res is not None:
        configs = res.get("configs") or {}
        rows = []
        for rec in configs.values():
            label = " ".join(rec.get("server_flags") or []) or "(default)"
            if rec.get("status") != "ok":
                rows.append([label, *["-"] * 7, f"{rec.get('status')}: {(rec.get('error') or '')[:200]}"])
            rows += [
                [label, fmt(rec.get("completion_tokens")), row["attention"], fmt(row.get("prob_diff_mean")),
                 fmt(row.get("prob_diff_max")), fmt(row.get("k3_kl")), fmt(row.get("log_ppl_diff"), "+.3g"),
                 fmt(row.get("frac_tokens_over_threshold"), ".2%"), row.get("note", "")]
                for row in (rec.get("rows", []) if rec.get("status") == "ok" else [])
            ]  # fmt: skip
        lines += [
            f"Prompts: {res.get('prompts_how')}; temperature 1; project kernel via {res.get('project_attention_how')}.",
            "",
        ]
        lines += md_table(
            ["server flags", "sampled tokens", "training attention", "mean abs Δp", "max abs Δp",
             "k3 KL(rollout‖train)", "log-PPL diff", "tokens over threshold", "note"], rows,
        ) + [""]  # fmt: skip
        for name, rec in configs.items():
            if rec.get("status") != "ok" and rec.get("server_log_tail"):
                lines += [f"Server log tail ({name}):", "", "```", rec["server_log_tail"][-3000:], "```", ""]

    section, res = _section(phases, "sync_timing", "4. sync_timing")
    lines += section
    if res is not None:
        modes = res.get("modes") or {}
        lines += md_table(
            ["mode", "repeats", "median transfer s", "median total s", "bytes", "GB/s", "bytes at gpt-oss-20b",
             "extrapolated s at 20b"],
            [[mode, *["-"] * 6, rec["note"]] if "note" in rec else
             [mode, rec["repeats"], fmt(rec["median_transfer_s"], ".3f"), fmt(rec["median_sync_total_s"], ".3f"),
              fmt(rec["bytes"], ","), fmt(rec["gb_per_s"], ".2f"), fmt(rec.get("bytes_20b"), ",.0f"),
              fmt(rec.get("extrapolated_20b_s"), ".1f")] for mode, rec in modes.items()],
        ) + [""]  # fmt: skip
        if res.get("params_20b"):
            lines += [
                "Arithmetic: time at 20b = bytes at 20b / (bytes measured / median transfer time).",
                f"Merged weights at 20b: {res['params_20b']:,} parameters (gpt-oss-20b's layer shapes at 24 layers, "
                f"counted on the meta device) x 2 bytes (bf16) = {res['bytes_20b_merged_bf16'] / 1e9:.1f} GB.",
            ]
            lines += [
                f"- {mode}: {rec['bytes'] / 1e9:.4g} GB / {rec['median_transfer_s']:.3f} s = {rec['gb_per_s']:.3g} GB/s; "
                f"{rec['bytes_20b'] / 1e9:.4g} GB / {rec['gb_per_s']:.3g} GB/s = {rec['extrapolated_20b_s']:.2f} s"
                for mode, rec in modes.items()
                if rec.get("extrapolated_20b_s") is not None
            ]
            lines += [
                "",
                "Assumption: disk and tensor sync scale with the bytes moved (write + read of safetensors; CUDA IPC "
                "handles + the server's copy into its weights), at the rate measured here; the fixed per-sync cost "
                "(pause, version check, cache flush) is counted in the rate, so small models overstate the time "
                "per byte. The LoRA adapter targets q/k/v/o only, whose shapes are the same in every layer: its size "
                f"scales with depth (x {GPTOSS_20B_LAYERS} / {m.get('num_hidden_layers')}).",
                "",
            ]
    if r.get("launches"):
        lines += ["## Server launches", ""]
        lines += md_table(
            ["name", "ready", "ready s", "command"],
            [[ln["name"], ln.get("ready"), fmt(ln.get("ready_s")), f"`{ln['command']}`"] for ln in r["launches"]],
        ) + [""]  # fmt: skip
    lines.append("![sglang_e2e](sglang_e2e.png)")
    return "\n".join(lines) + "\n"


def plot(path: Path, r: dict) -> None:
    configs = ((r.get("phases", {}).get("mismatch") or {}).get("result") or {}).get("configs") or {}
    timing = ((r.get("phases", {}).get("sync_timing") or {}).get("result") or {}).get("modes") or {}
    with figure(path, 1, 2, figsize=(13, 4.2)) as (_, (ax, ax_sync)):
        bars = [
            (f"{name}\n{row['attention'].split(' (')[0]}", max(row["k3_kl"], 1e-12))
            for name, rec in configs.items()
            for row in rec.get("rows", [])
            if row.get("k3_kl") is not None
        ]
        if bars:
            ax.barh(range(len(bars)), [v for _, v in bars])
            ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=6)
            ax.set_xscale("log")
        ax.set_xlabel("k3 KL(rollout ‖ train)")
        ax.set_title("mismatch: SGLang rollout vs trainer attention")
        modes = [m for m, rec in timing.items() if "median_transfer_s" in rec]
        if modes:
            ax_sync.bar(modes, [timing[m]["median_transfer_s"] for m in modes])
        ax_sync.set_ylabel("median weight sync (s)")
        ax_sync.set_title("weight sync per mode (this model size)")


# ------------------------------------------------------------------------------------------------------------ merge


_MODEL_KEYS = ("params", "num_hidden_layers", "hidden_size", "heads", "num_local_experts", "vocab_size")
_COLD_START_KEYS = ("steps", "batch_size", "learning_rate", "problems")


def _model_identity(model: dict) -> dict:
    """What makes two runs measure the same model: its shapes and how (whether) it was cold-started."""
    cold = model.get("cold_start") or {}
    return {
        **{k: model.get(k) for k in _MODEL_KEYS},
        "cold_start": {k: cold.get(k) for k in _COLD_START_KEYS} if cold else None,
    }


def _parts(name: str, result: dict) -> dict:
    """The records a phase's status is made of: its sub-runs, weight sync modes or server configurations."""
    if name == "generate":
        return {k: result[k] for k in ("generate", "agent") if k in result}
    return result if name == "trainer" else (result.get("configs") or {}) if name == "mismatch" else {}


def _phase_status(name: str, result: dict) -> dict:
    """``status`` ok (every part ok), partial or failed, and ``error`` naming each part that is not ok."""
    parts = _parts(name, result)
    statuses = [v.get("status") for v in parts.values()]
    status = "ok" if all(x == "ok" for x in statuses) else "partial" if "ok" in statuses else "failed"
    if status == "ok":
        return {"status": status}
    errors = "; ".join(f"{k}: {v.get('error', '')[:150]}" for k, v in parts.items() if v.get("status") != "ok")
    return {"status": status, "error": errors}


def merge_runs(paths: list[Path]) -> dict:
    """One report from several runs of the same model (e.g. ``--phases generate,trainer`` then ``--phases
    mismatch``): later runs win phase by phase, weight sync modes and mismatch server configurations one by one, a
    skipped phase never hides one that ran, and the sync timing is recomputed from the merged trainer phase."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    first = runs[0].get("model") or {}
    mine = _model_identity(first)
    for path, run in zip(paths[1:], runs[1:]):
        other = _model_identity(run.get("model") or {})
        differ = {k: (mine[k], other[k]) for k in mine if mine[k] != other[k]}
        if differ:
            raise ValueError(f"--merge: {path} measured another model than {paths[0]}: {differ}")
    merged_from = [
        {"json": str(p), "command": (r.get("meta") or {}).get("command"), "started": (r.get("meta") or {}).get("started"),
         "disable_cuda_graph": _reported_cuda_graph_disabled(r.get("meta") or {})}
        for p, r in zip(paths, runs)
    ]  # fmt: skip
    disabled = {m["disable_cuda_graph"] for m in merged_from}
    meta = {
        **(runs[-1].get("meta") or {}), "merged_from": merged_from,
        "disable_cuda_graph": disabled.pop() if len(disabled) == 1 else "mixed",
        "command": "; ".join(str(m["command"]) for m in merged_from),
    }  # fmt: skip
    merged: dict = {
        "meta": meta, "model": first, "phases": {},
        "launches": [launch for run in runs for launch in run.get("launches", [])],
    }  # fmt: skip
    for run in runs:
        for name, phase in (run.get("phases") or {}).items():
            have = merged["phases"].get(name)
            if phase.get("status") in ("skipped", "not run") and have:
                continue
            if name in ("mismatch", "trainer") and (have or {}).get("result") and "result" in phase:
                # server configurations / weight sync modes one by one: a later run's wins unless it was skipped
                parts = dict(_parts(name, have.get("result") or {}))
                for key, rec in _parts(name, phase["result"]).items():
                    if rec.get("status") != "skipped" or key not in parts:
                        parts[key] = rec
                result = {**phase["result"], "configs": parts} if name == "mismatch" else parts
                phase = {k: v for k, v in phase.items() if k not in ("error", "traceback", "server_log_tail")}
                phase.update(result=result, **_phase_status(name, result))
                phase["wall_s"] = sum(rec.get("wall_s") or 0.0 for rec in parts.values())  # of the parts shown
            merged["phases"][name] = phase
    timing: dict = {}
    args = argparse.Namespace(model=merged["meta"].get("model_kind", "20b"))
    phase_sync_timing(argparse.Namespace(results=merged, args=args), timing)
    merged["phases"]["sync_timing"] = {"status": "ok", "result": timing, "wall_s": 0.0}
    return merged


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--model", choices=("20b", "tiny"), default="20b", help="20b: gpt-oss-20b layer shapes; tiny: tests")
    p.add_argument("--layers", type=int, default=2, help="layers of the model (of gpt-oss-20b's 24)")
    p.add_argument("--model-dir", type=Path, default=None, help="where to save the model (default: in the work dir)")
    p.add_argument("--keep-work-dir", action="store_true", help="keep the temporary work dir (default model dir, "
                   "synced weights, cold-start output); removed otherwise")  # fmt: skip
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ServerManager.add_arguments(p)
    p.add_argument("--url", default=None, help="use this running server instead of launching one")
    p.add_argument("--merge", nargs="+", type=Path, default=None,
                   help="no run: merge the sglang_e2e.json of earlier runs (same model) into one report in --out")  # fmt: skip
    p.add_argument("--from-json", type=Path, default=None, help="no run: render this sglang_e2e.json again")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--trainer-modes", default=",".join(TRAINER_MODES))
    p.add_argument("--mismatch-configs", default=",".join(MISMATCH_CONFIGS))
    p.add_argument("--budget-s", type=float, default=540.0, help="no phase starts after this many seconds")
    p.add_argument("--generate-timeout-s", type=float, default=240.0, help="includes the first server start")
    p.add_argument("--trainer-timeout-s", type=float, default=200.0, help="per sync mode, once the server is ready")
    p.add_argument(
        "--mismatch-timeout-s", type=float, default=180.0, help="per configuration, once the server is ready"
    )
    for name, default in (("num-prompts", 8), ("max-new-tokens", 128), ("agent-prompts", 4), ("agent-max-turns", 3),
                          ("agent-turn-tokens", 128), ("train-rows", 4), ("train-steps", 2), ("num-generations", 2),
                          ("train-completion-tokens", 32), ("lora-rank", 8), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lora-sync-mode", choices=("tensor", "disk"), default="tensor",
                   help="how the LoRA adapter travels: tensor (CUDA IPC, same machine) or disk (a shared directory)")  # fmt: skip
    for name, default in (("threshold", 0.1), ("sink-mean", 1.0), ("sink-std", 1.5), ("logit-std", 3.0)):
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--cold-start-steps", type=int, default=0, help="SFT steps (trl_ext.cold_start) on code_interpreter "
                   "demonstrations before the model is saved for the server; 0: the random weights as built")  # fmt: skip
    p.add_argument("--cold-start-lr", type=float, default=5e-2, help="cold-start learning rate (the CPU demo's)")
    p.add_argument("--cold-start-batch", type=int, default=4, help="demonstrations per cold-start step")
    p.add_argument("--cold-start-problems", type=int, default=4, help="distinct GSM8K problems in the cold start")
    p.add_argument("--cold-start-timeout-s", type=float, default=300.0, help="deadline of the cold start")
    p.add_argument("--project-attn", choices=("auto", "hub", "direct"), default="auto")
    args = p.parse_args(argv)
    for name, allowed in (("phases", PHASES), ("trainer_modes", TRAINER_MODES), ("mismatch_configs", MISMATCH_CONFIGS)):
        values = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {list(allowed)}")
        setattr(args, name, values)
    if args.cold_start_steps < 0:
        p.error(f"--cold-start-steps must be >= 0, got {args.cold_start_steps}")
    for name in ("cold_start_batch", "cold_start_problems"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.cold_start_lr > 0 and math.isfinite(args.cold_start_lr)):
        p.error(f"--cold-start-lr must be a positive number, got {args.cold_start_lr}")
    return args


def cuda_graph_disabled(args) -> bool | None:
    """Whether the servers this run launches get ``--disable-cuda-graph`` (the flag, or in ``--server-args``); None
    with ``--url``: that server was started elsewhere, with its own flags."""
    if args.url is not None:
        return None
    return bool(args.disable_cuda_graph) or "--disable-cuda-graph" in shlex.split(args.server_args)


def _reported_cuda_graph_disabled(meta: dict) -> bool | str | None:
    """``meta.disable_cuda_graph``, or for a report written before that field, what its server flags say."""
    if "disable_cuda_graph" in meta:
        return meta["disable_cuda_graph"]
    if str(meta.get("server_cmd", "")).startswith("--url"):
        return None
    return "--disable-cuda-graph" in shlex.split(meta.get("server_args") or "")


def _cuda_graph_text(disabled: bool | str | None) -> str:
    return {
        True: "CUDA graphs off (`--disable-cuda-graph`)",
        False: "CUDA graphs on",
        None: "CUDA graphs as the `--url` server was started",
    }.get(disabled, "CUDA graphs on in some of the merged runs, off in others")


def run_failures(results: dict) -> list[str]:
    """What fails a run (a non-zero exit status): the model build, a phase that failed or was skipped (for time, or
    because the model build failed). A partial phase is in the report and does not fail the run."""
    failures = [f"model build: {results['model_error']}"] if results.get("model_error") else []
    for name, ph in (results.get("phases") or {}).items():
        if ph.get("status") in ("failed", "skipped"):
            failures.append(f"{name}: {ph['status']} ({ph.get('error', '')})")
    return failures


def build_or_record(ctx: Context) -> None:
    """`build_model` under its deadline; a failure is recorded (``model_error``), and every phase is then skipped."""
    args, results = ctx.args, ctx.results
    t0 = time.monotonic()
    try:
        limit = 300.0 + (args.cold_start_timeout_s if args.cold_start_steps else 0.0)
        with deadline(min(limit, ctx.left()), "model build" + (" and cold start" if args.cold_start_steps else "")):
            results["model"] = build_model(args, ctx.device, ctx.work_dir)
        params = results["model"]["params"]
        log(f"model saved to {args.model_dir} in {time.monotonic() - t0:.1f} s ({params:,} params)")
    except Exception as exc:  # noqa: BLE001
        results["model_error"] = error_text(exc)
        results["model_traceback"] = traceback.format_exc()[-3000:]
        log(f"model build failed: {results['model_error']}")
        free_memory(ctx.device)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out = output_dir(args.out, "sglang_e2e.json", "sglang_e2e.md", "sglang_e2e.png")
    if args.from_json is not None or args.merge:
        results = json.loads(args.from_json.read_text()) if args.from_json is not None else merge_runs(args.merge)
        write_outputs(args.out, results)
        log(f"wrote {args.out / 'sglang_e2e.md'}, .json, .png from {args.from_json or args.merge}")
        return results
    from benchmarks._cli import environment

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    work = Path(tempfile.mkdtemp(prefix="sglang_e2e_"))
    if args.model_dir is None:
        args.model_dir = work / "model"
    server = ServerManager.from_args(args, Path(args.model_dir), args.out / "logs", E2E_LAUNCH_FLAGS, log=log)
    ctx = Context(args, device, server, work)
    results = ctx.results
    results["meta"] = {
        "command": command_line("sglang_e2e", argv), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": environment(), "server_cmd": args.server_cmd if args.url is None else f"--url {args.url}",
        "server_args": args.server_args, "disable_cuda_graph": cuda_graph_disabled(args), "budget_s": args.budget_s,
        "device": str(device), "model_kind": args.model,
    }  # fmt: skip
    results["phases"] = {}
    results["launches"] = server.launches

    def on_term(signum, frame):  # never leave a server behind
        server.stop()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        build_or_record(ctx)
        ctx.checkpoint()
        runners = {
            "generate": (phase_generate, args.generate_timeout_s),
            "trainer": (phase_trainer, None),  # deadlines per mode inside
            "mismatch": (phase_mismatch, None),  # deadlines per configuration inside
            "sync_timing": (phase_sync_timing, 60.0),
        }
        # in the order given (e.g. mismatch before trainer reuses the first server), sync_timing last: it reads trainer
        for name in sorted(args.phases, key=lambda n: (n == "sync_timing", args.phases.index(n))):
            ph = results["phases"][name] = {}
            if "model_error" in results and name != "sync_timing":
                ph.update(status="skipped", error="model build failed")
                continue
            fn, limit = runners[name]

            def phase(fn=fn, limit=limit, ph=ph, name=name):
                log(f"{name}: start ({ctx.left():.0f} s of budget left)")
                ph["result"] = {}  # filled as the phase goes: a checkpoint in the middle of it shows what it has
                with deadline(min(limit, ctx.left()), name) if limit else contextlib.nullcontext():
                    fn(ctx, ph["result"])
                ph.update(_phase_status(name, ph["result"]))

            run_part(ctx, ph, name, phase)
    finally:
        server.stop()
        results["meta"]["total_s"] = time.monotonic() - ctx.t0
        if not args.keep_work_dir:  # the default model dir, trainer weight dirs, cold-start output: 100s of MB
            shutil.rmtree(work, ignore_errors=True)
        results["meta"]["work_dir"] = str(work) if args.keep_work_dir else f"{work} (removed; --keep-work-dir keeps it)"
        ctx.checkpoint()
        log(f"wrote {args.out / 'sglang_e2e.md'}, .json, .png")
    partial = [name for name, ph in results["phases"].items() if ph.get("status") == "partial"]
    if partial:
        log(f"partial phases (the failed parts are in the report): {', '.join(partial)}")
    exit_if_failed("benchmarks/sglang_e2e.py", run_failures(results), args.out)
    return results


if __name__ == "__main__":
    main()
