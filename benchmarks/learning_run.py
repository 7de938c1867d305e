# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Learning run of agentic GRPO on GSM8K: the trainer's attention with and without the sinks, over several seeds.

`docs/results.md` (section 2) describes the run, its checks and how to read the report. One small GPT-OSS (random
init, per-head sink logits ~ N(1, 1.5²)) is warmed up once (`trl_ext.cold_start` on scripted `code_interpreter`
trajectories); every arm (`--arms`: `sink_kernel`, `frozen_sinks`, `sink_dropping`, which differ only in the
trainer's attention) then runs for every seed of `--seeds` from those weights, with rollouts on `--rollout-backend`
(`embedded`, or an SGLang server launched here and synced after every optimizer step). Before the arms, the sink
control (the engine must follow the trainer with sinks, not without) and the policy window (`--policy-check`) must
pass. Writes `learning_run.{md,png,json}` (`learning_run_sglang.*` with SGLang) into `--out` after every run (a
stopped script leaves a partial report) and exits non-zero when a check or a run fails. `--save-warm-start`,
`--warm-start` and `--merge` split the grid over processes (`scripts/learning_run_sglang.sh`).

    python benchmarks/learning_run.py --out results                              # GPU, embedded engine
    python benchmarks/learning_run.py --rollout-backend sglang \\
        --server-cmd "/opt/sglang/bin/python -m sglang.launch_server" --out results  # GPU, real SGLang server
    python benchmarks/learning_run.py --merge part_*/learning_run_sglang.json --rollout-backend sglang --out results
    python benchmarks/learning_run.py --device cpu --model-size tiny --steps 2 --cold-start-steps 2 \\
        --num-generations 2 --batch-size 2 --max-completion-length 16 --eval-limit 2 --seeds 0 \\
        --no-policy-check --no-require-reward-signal --out /tmp/lr                    # CPU smoke

Full GSM8K (7,473 train / 1,319 test rows, MIT; `openai/gsm8k` on the Hub, config `main`): export both splits as
.jsonl and pass `--train-file train.jsonl --eval-file test.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import (
    OUT_HELP,
    command_line,
    exit_if_failed,
    figure,
    fmt,
    md_table,
    output_dir,
    without_local_paths,
)
from trl_ext.sglang_serve import ServerManager

REPO = Path(__file__).resolve().parents[1]
# the reward columns compare the mean of the first and of the last REWARD_WINDOW logged steps: with fewer than twice
# that many steps the two windows overlap and the comparison says nothing
REWARD_WINDOW = 10

# arm -> what the trainer's attention does with the sinks
ARMS = {
    "sink_kernel": "the project's kernel: sinks in the forward, sink gradient",
    "frozen_sinks": "the project's kernel with the sinks frozen: sinks in the forward, no sink gradient",
    "sink_dropping": "GPT-OSS eager attention without the sink column",
}
BACKENDS = ("embedded", "sglang")
MODEL_SIZES = {
    # the smallest GPT-OSS that learns the tool format on a CPU in seconds
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    # ~110 M parameters (most of them the two 201,088-row embeddings), meant for one GPU
    "small": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=256, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=128),
}  # fmt: skip
SAMPLED_ACCURACY = "learning_run/sampled_accuracy"  # logged by `ToolUseAccuracyCallback` into the trainer's metrics
# (log-history key, JSON/plot name) of the per-step series
STEP_METRICS = (
    ("reward", "reward"),
    ("reward_std", "reward_std"),
    ("rollout/frac_with_tool_call", "tool_call_rate"),
    ("rollout/tool_calls_mean", "tool_calls_mean"),
    ("rollout/frac_final_answer", "frac_final_answer"),
    ("rollout/weight_version", "weight_version"),
    ("rollout/stale_trajectories", "stale_trajectories"),
    ("grad_norm", "grad_norm"),
    ("clip_ratio/region_mean", "clip_fraction"),
    ("mismatch/k3_kl", "mismatch_k3_kl"),
    ("mismatch/prob_diff_mean", "mismatch_prob_diff_mean"),
    ("mismatch/prob_diff_max", "mismatch_prob_diff_max"),
    ("mismatch/is_weight_std", "is_weight_std"),
    ("timing/rollout_s", "rollout_s"),
    ("timing/step_s", "step_s"),
    ("timing/weight_sync_s", "weight_sync_s"),
    ("timing/weight_sync_verify_s", "weight_sync_verify_s"),
    (SAMPLED_ACCURACY, "sampled_accuracy"),
    ("loss", "loss"),
    ("learning_rate", "learning_rate"),
)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _window(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    return float(lo), float(hi)


# %% Arguments ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-file", default=str(REPO / "data" / "gsm8k_train_mini.jsonl"), help="GSM8K-style .jsonl")
    p.add_argument("--eval-file", default=str(REPO / "data" / "gsm8k_test_mini.jsonl"), help="held-out .jsonl")
    p.add_argument("--eval-limit", type=int, default=64,
                   help="held-out problems scored greedily before/after (and as many practised training problems)")  # fmt: skip
    p.add_argument("--steps", type=int, default=200, help="GRPO optimizer steps per run")
    p.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--max-seconds", type=float, default=120.0, help="wall-clock limit of each run's RL phase")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {tuple(ARMS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds; every arm runs each")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the random init and the warm-up")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16"],
                   help="fp32 end to end, or fp32 master weights under bf16 autocast with a bf16 engine (default: fp32 "
                   "with the embedded engine, bf16 with SGLang)")  # fmt: skip
    p.add_argument("--cold-start-steps", type=int, default=800)
    p.add_argument("--cold-start-batch", type=int, default=16, help="trajectories per warm-up step")
    p.add_argument("--cold-start-target-nll", type=float, default=0.015,
                   help="stop the warm-up once its mean nll/token (last 10 steps) is below this; 0 = run every step. At "
                   "0.015 a sampled (temperature 1) trajectory of a practised problem is right roughly a third of the "
                   "time, which leaves RL a reward to raise")  # fmt: skip
    p.add_argument("--cold-start-problems", type=int, default=128,
                   help="distinct GSM8K problems in the warm-up (and, with --rl-problems practised, in RL)")  # fmt: skip
    p.add_argument("--cold-start-lr", type=float, default=3e-3)
    p.add_argument("--rl-problems", default="practised", choices=["practised", "all"],
                   help="RL prompts: the GSM8K problems the warm-up practised (a random-init model can reach a nonzero "
                   "reward on them within minutes), or every row of --train-file")  # fmt: skip
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=10, help="linear learning-rate warm-up of RL (0 = none)")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="completions per step (8 prompts x 8 generations)")
    p.add_argument("--num-iterations", type=int, default=2, help="GRPO μ: optimizer passes per generation batch")
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=5, help="sampled accuracy on the slice every N steps (0 = off)")
    p.add_argument("--eval-slice", type=int, default=32, help="practised problems in the sampled-accuracy slice")
    p.add_argument("--sink-mean", type=float, default=1.0,
                   help="initial sink logits ~ N(mean, std²) per head, as in mismatch_study.py (transformers' init "
                   "leaves them near 0, which hides what dropping them costs)")  # fmt: skip
    p.add_argument("--sink-std", type=float, default=1.5)
    p.add_argument("--control-sink-shift", type=float, default=6.0, help="sink control: added to every sink logit")
    p.add_argument("--control-margin", type=float, default=3.0,
                   help="sink control: the engine must be this many times closer to the trainer with sinks than without")  # fmt: skip
    p.add_argument("--control-prompts", type=int, default=8, help="sink control: prompts sampled (32 tokens each)")
    p.add_argument("--policy-check", action=argparse.BooleanOptionalAction, default=True,
                   help="refuse to run the arms unless the warm policy's sampled accuracy and tool-call rate are in "
                   "their windows")  # fmt: skip
    p.add_argument("--accuracy-window", type=_window, default=(0.2, 0.8), help="LO,HI sampled accuracy at step 0")
    p.add_argument("--tool-rate-window", type=_window, default=(0.2, 0.9), help="LO,HI tool-call rate at step 0")
    p.add_argument("--require-reward-signal", action=argparse.BooleanOptionalAction, default=True,
                   help="fail a run in which no group ever had reward variance (every advantage zero: nothing to learn)")  # fmt: skip
    p.add_argument("--rollout-backend", default="embedded", choices=BACKENDS)
    ServerManager.add_arguments(p, server_cmd="/opt/sglang/bin/python -m sglang.launch_server", mem_fraction_static=0.5,
                    ready_timeout_s=600.0)  # fmt: skip
    p.add_argument("--server-start-lock", default=None,
                   help="a file locked while this script's server starts: processes that share a GPU start their "
                   "servers one at a time (SGLang sizes its KV cache from the memory free during its own start)")  # fmt: skip
    p.add_argument("--note", default="", help="a sentence for the report's setup (e.g. how the runs shared a GPU)")
    # splitting the grid
    p.add_argument("--save-warm-start", default=None, help="run the warm-up, save it into DIR and exit")
    p.add_argument("--warm-start", default=None, help="start every run from the warm-up saved in DIR")
    p.add_argument("--merge", nargs="+", default=None, help="render one report into --out from these reports, and exit")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--from-json", help="only rewrite the report's .md/.png in --out from a saved .json")
    args = p.parse_args(argv)
    if args.save_warm_start and args.warm_start:
        p.error("--save-warm-start and --warm-start exclude each other")
    args.arms = _csv(args.arms)
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown or not args.arms:
        p.error(f"--arms: unknown {unknown}; choose from {tuple(ARMS)}")
    try:
        args.seeds = [int(s) for s in _csv(args.seeds)]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must name distinct seeds, got {args.seeds}")
    if args.steps < 1 or args.max_seconds <= 0 or args.eval_limit < 1 or args.eval_slice < 1:
        p.error("--steps, --max-seconds, --eval-limit and --eval-slice must be positive")
    if args.batch_size % args.num_generations:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --num-generations {args.num_generations}")
    for name in ("accuracy_window", "tool_rate_window"):
        lo, hi = getattr(args, name)
        if not 0.0 <= lo <= hi <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be LO,HI with 0 <= LO <= HI <= 1, got {lo},{hi}")
    if args.precision is None:
        args.precision = "bf16" if args.rollout_backend == "sglang" else "fp32"
    return args


# %% Rollout engines ----------------------------------------------------------------------------------------------------
class Rollouts:
    """The rollout side of the whole script: an embedded engine per run, or one SGLang server (and one
    `SGLangEngine`, whose weight-sync state then spans the runs) for all of them.

    Every run starts from the warm-up's weights: the embedded engine is a fresh copy of them; the server gets them
    pushed (version 0, verified against what it held, i.e. the previous run's last sync) before the run starts.
    """

    def __init__(self, args, device, work_dir: Path) -> None:
        import torch

        self.args, self.device, self.work_dir = args, device, work_dir
        self.dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        self.server = self.engine = None  # the SGLang server and its engine (shared by every run)
        self.pad_token_id: int | None = None
        self.info: dict = {"backend": args.rollout_backend}

    def start(self, warm_model) -> None:
        if self.args.rollout_backend != "sglang":
            self.info["engine"] = f"EmbeddedEngine, eager attention with exact sinks, {str(self.dtype)[6:]}"
            return
        from trl_ext.rollout import SGLangEngine
        from trl_ext.weight_sync import WeightSyncConfig, write_served_model
        from trl_ext.weight_sync.settings import DEFAULT_SGLANG_VERIFY

        model_dir = self.work_dir / "served_model"
        write_served_model(warm_model, model_dir, self.dtype)  # SGLang builds its layers in config.json's dtype
        dtype = str(self.dtype).removeprefix("torch.")
        self.server = ServerManager.from_args(self.args, model_dir, self.work_dir / "logs", ["--dtype", dtype])
        url = self.server.ensure("learning_run", [], self.args.ready_timeout_s)
        launch = self.server.launches[-1]
        self.info.update(
            server_command=launch["command"], server_ready_s=launch.get("ready_s"), sglang_version=self.server.version,
            disable_cuda_graph=bool(self.args.disable_cuda_graph), served_dtype=dtype,
            weight_sync={"mode": "disk", "verify": list(DEFAULT_SGLANG_VERIFY)},
        )  # fmt: skip
        sync = WeightSyncConfig(
            mode="disk", verify=DEFAULT_SGLANG_VERIFY, checkpoint_path=str(model_dir),
            weight_dir=str(self.work_dir / "rollout_weights"), model_config=warm_model.config,
        )  # fmt: skip
        self.engine = SGLangEngine(url, weight_sync=sync, ready_timeout_s=self.args.ready_timeout_s)
        self.engine.check_servers()

    def engine_with(self, model, seed: int):
        """An engine serving ``model``'s weights now: an embedded copy, or the server after a verified push."""
        if self.engine is None:
            from trl_ext.rollout import EmbeddedEngine

            engine = EmbeddedEngine.from_policy(
                model, attn_implementation="eager", pad_token_id=self.pad_token_id, seed=seed
            )
            engine.model.to(self.dtype)
            engine.model.config.use_cache = True
            return engine
        from trl_ext.weight_sync import push_policy_weights

        push_policy_weights(self.engine, model, version=0)  # verified against what the server held
        return self.engine

    def trainer_fields(self, run_dir: Path) -> dict:
        """`AgenticGRPOConfig` fields of the rollout backend."""
        if self.engine is None:
            return {"rollout_backend": "embedded"}
        return {
            "rollout_backend": "sglang", "sglang_urls": [self.server.url], "weight_sync_mode": "disk",
            "weight_sync_dir": str(run_dir / "rollout_weights"), "weight_sync_checkpoint": str(self.server.model_dir),
        }  # fmt: skip

    def stop(self) -> None:
        if self.engine is not None:
            from trl_ext.rollout import run_sync

            run_sync(self.engine.close())
        if self.server is not None:
            self.server.stop()


# %% Accuracy -----------------------------------------------------------------------------------------------------------
def agent_accuracy(engine, tool, rows: list[dict], args, *, temperature: float = 0.0) -> dict:
    """Agent rollouts (code tool) of ``rows`` on ``engine`` (`trl_ext.recipes.evaluate_tool_use`): math-verify
    accuracy and tool-call rate (greedy by default; ``temperature=1`` samples, as training does)."""
    from trl_ext.recipes import evaluate_tool_use

    score = evaluate_tool_use(engine, [tool], rows, max_completion_length=args.max_completion_length,
                              max_turns=args.max_turns, temperature=temperature)  # fmt: skip
    return {**score, "temperature": temperature}


# %% Checks before the arms ---------------------------------------------------------------------------------------------
def policy_window(score: dict, args) -> list[str]:
    """Why the warm policy gives GRPO no signal to learn from (empty: it does)."""
    problems = []
    lo, hi = args.accuracy_window
    if not lo <= score["accuracy"] <= hi:
        problems.append(f"sampled accuracy {score['accuracy']:.2f} on the practised slice is outside [{lo}, {hi}]")
    lo, hi = args.tool_rate_window
    if not lo <= score["tool_call_rate"] <= hi:
        problems.append(f"tool-call rate {score['tool_call_rate']:.2f} is outside [{lo}, {hi}]")
    return problems


# %% Warm start shared by several processes ----------------------------------------------------------------------------
# the settings that decide the warm-up's weights: a saved warm start is only used where they are the same
WARM_STATE = "warm_state.safetensors"  # the weights, next to warm_start.json (settings, practised rows, digest)
WARM_START_KEYS = (
    "model_size", "init_seed", "sink_mean", "sink_std", "cold_start_steps", "cold_start_batch",
    "cold_start_target_nll", "cold_start_problems", "cold_start_lr", "train_file",
)  # fmt: skip


def warm_start_key(args) -> dict:
    return {k: (Path(v).name if k == "train_file" else v) for k, v in vars(args).items() if k in WARM_START_KEYS}


def state_digest(state: dict) -> str:
    """SHA-256 of a state dict as safetensors serializes it (names, dtypes, shapes, bytes): equal digests, equal
    weights."""
    import hashlib

    from safetensors.torch import save

    return hashlib.sha256(save({k: v.detach().to("cpu").contiguous() for k, v in state.items()})).hexdigest()


def save_warm_start(model, folder: Path, key: dict, practised: list[int], cold_seconds: float) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    digest = state_digest(state)
    save_file(state, folder / WARM_STATE)
    meta = {"key": key, "practised": list(practised), "cold_start_seconds": cold_seconds, "sha256": digest}
    (folder / "warm_start.json").write_text(json.dumps(meta, indent=2))
    return digest


def load_warm_start(model, folder: Path, key: dict) -> tuple[list[int], float]:
    """Load the warm-up saved by ``--save-warm-start`` into ``model``; SystemExit naming the first setting that
    differs from this command's, or a file whose weights no longer match their recorded digest."""
    from safetensors.torch import load_file

    meta_path = folder / "warm_start.json"
    if not meta_path.is_file():
        raise SystemExit(f"--warm-start {folder}: no warm_start.json there (write it with --save-warm-start)")
    meta = json.loads(meta_path.read_text())
    differing = {k: (meta["key"].get(k), v) for k, v in key.items() if meta["key"].get(k) != v}
    if differing:
        shown = ", ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in differing.items())
        raise SystemExit(f"--warm-start {folder} was saved with other settings ({shown})")
    state = load_file(folder / WARM_STATE)
    if state_digest(state) != meta["sha256"]:
        raise SystemExit(f"--warm-start {folder}: {WARM_STATE} does not match the digest in warm_start.json")
    model.load_state_dict(state)
    return list(meta["practised"]), float(meta["cold_start_seconds"])


def mark_missing_runs(result: dict, arms: list[str], seeds: list[int]) -> None:
    """``result["missing_runs"]``: the ``arm seed`` pairs of the planned grid that have no run (yet)."""
    have = {(name, str(seed)) for name, arm in result.get("arms", {}).items() for seed in arm.get("runs", {})}
    result["planned"] = {"arms": list(arms), "seeds": list(seeds)}
    result["missing_runs"] = [f"{a} {s}" for s in seeds for a in arms if (a, str(s)) not in have]


# settings every part of a merged report must share (the warm start's digest included)
MERGE_SAME = (
    "model_size", "parameters", "precision", "rollout_backend", "num_generations", "batch_size", "num_iterations",
    "learning_rate", "warmup_steps", "max_completion_length", "max_turns", "steps_requested", "max_seconds",
    "sink_init", "rl_problems", "train_rows", "eval_rows", "eval_every", "eval_slice",
)  # fmt: skip


def merge_reports(parts: list[dict], args) -> dict:
    """One report from the reports of processes that ran parts of the grid from one warm start: the runs of every
    part, each part's checks (sink control, warm policy) kept with it; `SystemExit` when the parts differ in a
    setting of `MERGE_SAME` or in the warm start, or two parts hold the same run."""
    parts = [upgrade_result(part) for part in parts]
    if not parts:
        raise SystemExit("--merge needs at least one report")
    first = parts[0]["setup"]
    for i, part in enumerate(parts[1:], 2):
        for key in MERGE_SAME + ("warm_start",):
            a, b = first.get(key), part["setup"].get(key)
            if key == "warm_start":
                a, b = (a or {}).get("sha256"), (b or {}).get("sha256")
            if a != b:
                raise SystemExit(f"--merge: part {i} differs from part 1 in {key} ({b!r} vs {a!r})")
    arms: dict = {}
    for i, part in enumerate(parts, 1):
        for name, arm in part["arms"].items():
            entry = arms.setdefault(name, {"description": arm["description"], "runs": {}})
            for seed, run in arm["runs"].items():
                if seed in entry["runs"]:
                    raise SystemExit(f"--merge: {name} seed {seed} is in two parts (part {i} and an earlier one)")
                entry["runs"][seed] = {**run, "part": i}
    order = [a for a in ARMS if a in arms]
    merged = {
        "command": "python benchmarks/learning_run.py "
        + " ".join(["--merge", *(str(Path(Path(p).parent.name) / Path(p).name) for p in args.merge)]),
        "environment": parts[0]["environment"],
        "setup": {**first, "arms": order, "seeds": sorted({int(s) for a in arms.values() for s in a["runs"]})},
        "arms": {name: arms[name] for name in order},
        "check_failures": [f for part in parts for f in part.get("check_failures", [])],
        "parts": [
            {"part": i, "command": part["command"], "environment": part["environment"],
             "rollouts": part["setup"].get("rollouts"), "sink_control": part.get("sink_control"),
             "before": part.get("before"), "runs": [f"{a} {s}" for a, arm in part["arms"].items() for s in arm["runs"]]}
            for i, part in enumerate(parts, 1)
        ],
    }  # fmt: skip
    # the first part's checks head the report; every part's are listed with it
    merged.update({key: parts[0][key] for key in ("sink_control", "before") if parts[0].get(key) is not None})
    mark_missing_runs(merged, args.arms, args.seeds)
    return merged


# %% One run ------------------------------------------------------------------------------------------------------------
def compile_warm_up(model, device) -> float:
    """One forward and backward through the training attention on a left-padded two-row batch, before the timed RL
    phase, so that Triton compiles the kernel's binaries here (fp32 on the H200: tens of seconds) and not inside
    the first RL steps, where it would eat the run's time budget. Returns the seconds it took."""
    import torch

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=generator).to(device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :11] = 0  # a padded row: the kernel route's varlen packing runs as in training
    was_training = model.training
    model.train()
    model(input_ids=input_ids, attention_mask=attention_mask).logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _sinks(model) -> dict:
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters() if name.endswith("sinks")}


def run_arm(arm: str, seed: int, ctx: dict) -> dict:
    """One RL run from the warm weights: ``arm``'s training attention, ``seed`` for the prompt order and sampling."""
    import torch
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.attention_variants import register_sink_dropping_attention
    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_ext.recipes import ToolUseAccuracyCallback, WallClockLimit, boxed_format_reward_func, retool_reward_func

    args, device, rollouts, tool = ctx["args"], ctx["device"], ctx["rollouts"], ctx["tool"]
    torch.manual_seed(seed)
    model = GptOssForCausalLM(ctx["model_config"]).to(device)
    model.load_state_dict(ctx["warm_state"])
    model.config.use_cache = False
    if arm == "frozen_sinks":
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.requires_grad_(False)
    sinks_before = _sinks(model)
    weights_before = [p.detach().float().cpu().clone() for p in model.parameters()]
    engine = rollouts.engine_with(model, seed)  # the engine serves exact-sink eager attention, whatever the arm
    attention = register_sink_dropping_attention() if arm == "sink_dropping" else ctx["kernel_attention"]
    model.set_attn_implementation(attention)
    slice_rows = ctx["slice_rows"]
    start_accuracy = agent_accuracy(engine, tool, slice_rows, args, temperature=1.0)
    print(f"[{arm} seed {seed}] sampled accuracy at step 0: {start_accuracy}", flush=True)

    run_dir = Path(tempfile.mkdtemp(prefix=f"learning_run_{arm}_{seed}_"))  # nothing is saved (save_strategy="no")
    config = AgenticGRPOConfig(
        output_dir=str(run_dir), max_steps=args.steps, learning_rate=args.learning_rate,
        # constant: --max-seconds may stop the run before a decaying schedule would end; optional linear warm-up
        lr_scheduler_type="constant_with_warmup" if args.warmup_steps else "constant", warmup_steps=args.warmup_steps,
        per_device_train_batch_size=args.batch_size, num_generations=args.num_generations,
        num_iterations=args.num_iterations, max_completion_length=args.max_completion_length, temperature=1.0,
        beta=0.0, loss_type="dapo", logging_steps=1, save_strategy="no", report_to="none", seed=seed,
        use_cpu=device.type == "cpu",
        bf16=args.precision == "bf16",  # fp32 master weights under bf16 autocast, or fp32 throughout
        reward_weights=[1.0, 0.0], max_turns=args.max_turns, reasoning_effort="low", disable_tqdm=True,
        **rollouts.trainer_fields(run_dir),
    )  # fmt: skip
    warm_up_seconds = compile_warm_up(model, device)
    print(f"[{arm} seed {seed}] training-attention warm-up (compiles): {warm_up_seconds:.1f} s", flush=True)
    trainer = AgenticGRPOTrainer(
        model=model, reward_funcs=[retool_reward_func, boxed_format_reward_func], args=config,
        train_dataset=ctx["train_dataset"], processing_class=ctx["tokenizer"], tools=[tool], rollout_engine=engine,
        callbacks=[WallClockLimit(args.max_seconds)],
    )  # fmt: skip
    if args.eval_every:  # added after the trainer's own callbacks: it measures after the step's weight sync
        trainer.add_callback(
            ToolUseAccuracyCallback(trainer, slice_rows, every=args.eval_every, temperature=1.0, name=SAMPLED_ACCURACY)
        )
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    after = agent_accuracy(engine, tool, ctx["eval_rows"], args)  # the engine holds the trained weights (synced)
    practised_after = agent_accuracy(engine, tool, ctx["practised_rows"], args)
    print(f"[{arm} seed {seed}] held-out after: {after}; practised after: {practised_after}", flush=True)
    if rollouts.engine is None:
        engine.shutdown()

    sinks_after = _sinks(model)
    sink_change = max(((sinks_after[k] - v).abs().max().item() for k, v in sinks_before.items()), default=0.0)
    moved = sum(
        (p.detach().float().cpu() - w).norm().item() ** 2 for p, w in zip(model.parameters(), weights_before)
    ) ** 0.5 / max(sum(w.norm().item() ** 2 for w in weights_before) ** 0.5, 1e-30)
    steps = [
        {"step": entry["step"], **{out: entry.get(key) for key, out in STEP_METRICS}}
        for entry in trainer.state.log_history
        if "step" in entry and "loss" in entry
    ]
    return {
        "seed": seed, "attention": attention, "steps_done": trainer.state.global_step,
        "stopped_by_time_limit": trainer.state.global_step < args.steps, "train_seconds": train_seconds,
        "warm_up_seconds": warm_up_seconds, "sampled_accuracy_start": start_accuracy, "held_out_after": after,
        "practised_after": practised_after, "sink_change_max": sink_change, "weight_change_rel": moved, "steps": steps,
    }  # fmt: skip


# %% Report -------------------------------------------------------------------------------------------------------------
def report_names(backend: str) -> tuple[str, str, str]:
    stem = "learning_run" if backend == "embedded" else f"learning_run_{backend}"
    return f"{stem}.json", f"{stem}.md", f"{stem}.png"


def upgrade_result(result: dict) -> dict:
    """A report written before arms and seeds (one seed, ``variants``) in today's layout, for ``--from-json``."""
    if "arms" in result:
        return result
    seed = result.setdefault("setup", {}).get("seed", 0)
    result["arms"] = {
        name: {"description": ARMS.get(name, name), "runs": {str(seed): {"seed": seed, **run}}}
        for name, run in result.pop("variants").items()
    }
    for key, value in (("seeds", [seed]), ("precision", "fp32"), ("rollout_backend", "embedded")):
        result["setup"].setdefault(key, value)
    return result


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(values) -> float | None:
    values = _finite(values)
    return sum(values) / len(values) if values else None


def _median(values) -> float | None:
    values = _finite(values)
    return statistics.median(values) if values else None


def _series(run: dict, key: str) -> list[tuple[int, float]]:
    return [(s["step"], s[key]) for s in run["steps"] if s.get(key) is not None and math.isfinite(s[key])]


def run_summary(run: dict) -> dict:
    """One run's numbers for the table: reward over its first / last `REWARD_WINDOW` logged steps (None for both
    when the two windows would overlap), the last sampled accuracy, the peak pre-clip gradient norm, the mean
    mismatch, the median time split."""
    rewards = [v for _, v in _series(run, "reward")]
    enough = len(rewards) >= 2 * REWARD_WINDOW
    sampled = [v for _, v in _series(run, "sampled_accuracy")]
    start = (run.get("sampled_accuracy_start") or {}).get("accuracy")
    grad = _finite(s.get("grad_norm") for s in run["steps"])
    signal = [v for _, v in _series(run, "reward_std")]
    per_step = lambda key: [s.get(key) for s in run["steps"]]  # noqa: E731
    return {
        "reward_steps": len(rewards),
        "reward_first": _mean(rewards[:REWARD_WINDOW]) if enough else None,
        "reward_last": _mean(rewards[-REWARD_WINDOW:]) if enough else None,
        "sampled_accuracy_start": start,
        "sampled_accuracy_last": sampled[-1] if sampled else start,
        "practised_after": (run.get("practised_after") or {}).get("accuracy"),
        "held_out_after": (run.get("held_out_after") or {}).get("accuracy"),
        "tool_call_rate_last": _mean([v for _, v in _series(run, "tool_call_rate")][-10:]),
        "grad_norm_peak": max(grad) if grad else None,
        "grad_norm_median": _median(grad),
        "k3_mean": _mean(per_step("mismatch_k3_kl")),
        "prob_diff_mean": _mean(per_step("mismatch_prob_diff_mean")),
        "prob_diff_max_mean": _mean(per_step("mismatch_prob_diff_max")),
        "is_weight_std_mean": _mean(per_step("is_weight_std")),
        "frac_steps_with_reward_variance": sum(v > 0 for v in signal) / len(signal) if signal else None,
        **{
            f"{key}_median": _median(per_step(key))
            for key in ("rollout_s", "step_s", "weight_sync_s", "weight_sync_verify_s")
        },
    }


def arm_summary(arm: dict) -> dict:
    """Per metric of `run_summary`: mean, sample standard deviation (None with one seed), min and max over seeds."""
    per_run = [run_summary(run) for run in arm["runs"].values()]
    out = {}
    for key in per_run[0] if per_run else ():
        values = _finite(r[key] for r in per_run)
        out[key] = {
            "mean": _mean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values) if values else None, "max": max(values) if values else None, "n": len(values),
        }  # fmt: skip
    return out


def separation(summaries: dict, key: str, reference: str = "sink_kernel") -> dict:
    """For each other arm: do its seeds' values of ``key`` lie entirely on one side of the reference arm's seeds
    (``separated``), or do the ranges overlap? With 3 seeds per arm, disjoint ranges is the least a difference
    must show before anyone calls it one."""
    ref = summaries.get(reference, {}).get(key)
    out = {}
    if not ref or ref["n"] == 0:
        return out
    for name, summary in summaries.items():
        other = summary.get(key)
        if name == reference or not other or other["n"] == 0:
            continue
        disjoint = other["max"] < ref["min"] or other["min"] > ref["max"]
        out[name] = "separated" if disjoint else "overlap"
    return out


def _reward_cell(summary: dict, runs: list[dict]) -> str:
    """The reward column: first → last window, or why there is none."""
    first, last = summary.get("reward_first"), summary.get("reward_last")
    if first and first["n"]:
        return f"{_pm(first)} → {_pm(last)}"
    logged = sorted({run_summary(r)["reward_steps"] for r in runs})
    return f"too few steps ({'/'.join(map(str, logged)) or 0} logged, needs {2 * REWARD_WINDOW})"


def _pm(stat: dict | None, spec: str = ".3g") -> str:
    if not stat or stat["mean"] is None:
        return "–"
    text = fmt(stat["mean"], spec)
    return f"{text} ± {fmt(stat['std'], spec)}" if stat["std"] is not None else text


ARM_COLOURS = {"sink_kernel": "tab:green", "frozen_sinks": "tab:orange", "sink_dropping": "tab:red"}
PANELS = (  # (series, title, log scale)
    ("reward", "reward (mean of the last 5 logged steps)", False),
    ("sampled_accuracy", "sampled accuracy, practised slice", False),
    ("tool_call_rate", "tool-call rate", False),
    ("grad_norm", "pre-clip gradient norm", True),
    ("mismatch_k3_kl", "mismatch k3 KL", True),
    ("mismatch_prob_diff_max", "mismatch max |Δp|", False),
)


def _curve(run: dict, key: str) -> list[tuple[int, float]]:
    pts = _series(run, key)
    if key == "sampled_accuracy" and run.get("sampled_accuracy_start"):
        pts = [(0, run["sampled_accuracy_start"]["accuracy"])] + pts
    if key == "reward":  # few prompts per step: smooth, or the curve shows which problems were drawn
        ys = [y for _, y in pts]
        pts = [(x, sum(ys[max(0, i - 4) : i + 1]) / len(ys[max(0, i - 4) : i + 1])) for i, (x, _) in enumerate(pts)]
    return pts


def plot(result: dict, path: Path) -> None:
    with figure(path, 2, 3, figsize=(15, 7.5)) as (fig, axes):
        for ax, (key, title, log_scale) in zip(axes.flat, PANELS):
            for name, arm in result["arms"].items():
                colour, curves = ARM_COLOURS.get(name), []
                for pts in filter(None, (_curve(run, key) for run in arm["runs"].values())):
                    ax.plot(*zip(*pts), color=colour, alpha=0.3, linewidth=1)
                    curves.append(dict(pts))
                mean = [(x, _mean(c.get(x) for c in curves)) for x in sorted({x for c in curves for x in c})]
                if mean:
                    ax.plot(*zip(*mean), color=colour, linewidth=2.2, label=f"{name} (mean of {len(curves)} seeds)")
            ax.set_title(title)
            ax.set_xlabel("optimizer step")
            if log_scale:
                ax.set_yscale("log")
            ax.legend(fontsize=8)
        s = result["setup"]
        fig.suptitle(
            f"Agentic GRPO on GSM8K, {s['model_size']} GPT-OSS, rollouts: {s['rollout_backend']} "
            f"({result['environment'].get('device')}); thin lines: seeds"
        )


def _checks_text(c: dict | None, b: dict | None) -> str:
    """One process's checks before the arms, as a merged report lists them."""
    text = ""
    if c:
        text += (
            f"sink control {fmt(c['mean_abs_logp_diff_with_sinks'])} with sinks vs "
            f"{fmt(c['mean_abs_logp_diff_without_sinks'])} without ({c['tokens']} tokens, shift "
            f"{c['sink_shift']:+g}): {'passed' if c['passed'] else 'FAILED'}"
        )
    if b:
        text += (
            f"; warm policy sampled accuracy {fmt(b['sampled_slice']['accuracy'], '.2f')}, tool-call rate "
            f"{fmt(b['sampled_slice']['tool_call_rate'], '.2f')}, greedy {b['practised']['correct']}/"
            f"{b['practised']['n']} practised, {b['held_out']['correct']}/{b['held_out']['n']} held out"
        )
    return text


def write_report(result: dict, out: Path) -> None:
    result = without_local_paths(upgrade_result(result))  # a report names no local folder
    json_name, md_name, png_name = report_names(result["setup"].get("rollout_backend", "embedded"))
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps(result, indent=2))
    plot(result, out / png_name)

    s = result["setup"]
    summaries = {name: arm_summary(arm) for name, arm in result["arms"].items()}
    rollout = s.get("rollouts") or {"backend": s.get("rollout_backend", "embedded")}
    if rollout.get("server_command"):
        engine = (
            f"SGLang {rollout.get('sglang_version')} served {rollout.get('served_dtype')} "
            f"(`{rollout['server_command']}`; CUDA graphs {'off' if rollout.get('disable_cuda_graph') else 'on'}), "
            f"synced after every optimizer step ({rollout['weight_sync']['mode']}, verified: "
            f"{', '.join(rollout['weight_sync']['verify'])})"
        )
    else:
        engine = rollout.get("engine", "EmbeddedEngine, eager attention with exact sinks")
    precision = {"fp32": "fp32 weights and compute", "bf16": "fp32 master weights, bf16 autocast"}.get(
        s.get("precision", "fp32")
    )
    lines = [
        f"Command: `{result['command']}`",
        "",
        f"Model: `{s['model_size']}` GPT-OSS, {s['parameters'] / 1e6:.1f} M parameters, real harmony vocabulary; "
        f"initial sinks ~ N({s['sink_init'][0]}, {s['sink_init'][1]}²); cold start ≤{s['cold_start_steps']} steps "
        f"(until nll/token < {s.get('cold_start_target_nll') or 0}) x {s.get('cold_start_batch', 4)} trajectories "
        f"over {s.get('cold_start_problems', '?')} problems ({s['cold_start_seconds']:.0f} s). RL on "
        f"{s.get('rl_problems', 'all')} problems: {s['num_generations']} generations x "
        f"{s['batch_size'] // s['num_generations']} prompts per step, μ={s['num_iterations']}, lr "
        f"{s['learning_rate']}, ≤{s['max_completion_length']} completion tokens, ≤{s['max_turns']} turns; trainer "
        f"precision: {precision}. Seeds {', '.join(map(str, s['seeds']))} (prompt order"
        f"{' and sampling' if s.get('rollout_backend', 'embedded') == 'embedded' else ''}). Rollouts: {engine}.",
        "",
    ]
    if s.get("note"):
        lines += [s["note"], ""]
    if s.get("warm_start"):
        ws = s["warm_start"]
        lines += [
            f"Every run starts from the same warm-up weights (SHA-256 `{ws['sha256'][:16]}…`"
            f"{', saved once and loaded by each process' if ws.get('loaded') else ''}).",
            "",
        ]
    if result.get("missing_runs"):
        lines += [
            f"**Partial report**: {len(result['missing_runs'])} of the planned "
            f"{len(result['planned']['arms']) * len(result['planned']['seeds'])} runs are missing "
            f"({', '.join(result['missing_runs'])}).",
            "",
        ]
    control, before = result.get("sink_control"), result.get("before")
    if control and result.get("parts"):
        lines += ["Checks before the arms, per process (each against its own server):", ""]
        lines += [
            f"- part {part['part']} (runs {', '.join(part['runs']) or 'none'}): "
            + _checks_text(part.get("sink_control"), part.get("before"))
            for part in result["parts"]
        ] + [""]
        control = None
    if result.get("parts"):
        before = None
    if control:
        lines += [
            f"Sink control (before the arms): sinks shifted by {control['sink_shift']:+g}, {control['tokens']} "
            f"sampled tokens; engine vs trainer with sinks {fmt(control['mean_abs_logp_diff_with_sinks'])}, "
            f"without sinks {fmt(control['mean_abs_logp_diff_without_sinks'])} mean |Δ log p| (margin "
            f"{control['margin']:g}x): **{'passed' if control['passed'] else 'FAILED'}**.",
            "",
        ]
    if before:
        lines += [
            f"Warm policy: sampled accuracy {fmt(before['sampled_slice']['accuracy'], '.2f')} and tool-call rate "
            f"{fmt(before['sampled_slice']['tool_call_rate'], '.2f')} on the practised slice "
            f"({before['sampled_slice']['n']} problems, temperature 1); greedy "
            f"{before['practised']['correct']}/{before['practised']['n']} practised, "
            f"{before['held_out']['correct']}/{before['held_out']['n']} held out.",
            "",
        ]
    lines += [
        f"Mean ± standard deviation over seeds (no ± with one seed). Reward: mean of the first / last {REWARD_WINDOW} "
        f"logged steps (runs with fewer than {2 * REWARD_WINDOW} logged steps have none: the windows would overlap). "
        "Sampled accuracy: temperature 1, practised slice, at step 0 and at the last measurement. Greedy "
        "accuracy after RL: practised and held-out problems.",
        "",
    ]
    rows = []
    for name, arm in result["arms"].items():
        m, runs = summaries[name], list(arm["runs"].values())
        rows.append([
            name, f"{arm['description']} (`{runs[0]['attention'] if runs else '–'}`)", len(runs),
            "/".join(map(str, sorted({r["steps_done"] for r in runs}))), _reward_cell(m, runs),
            f"{_pm(m.get('sampled_accuracy_start'), '.2f')} → {_pm(m.get('sampled_accuracy_last'), '.2f')}",
            f"{_pm(m.get('practised_after'), '.2f')} / {_pm(m.get('held_out_after'), '.2f')}",
            _pm(m.get("tool_call_rate_last"), ".2f"), _pm(m.get("grad_norm_peak")), _pm(m.get("k3_mean")),
            f"{_pm(m.get('prob_diff_mean'))} / {_pm(m.get('prob_diff_max_mean'))}", _pm(m.get("is_weight_std_mean")),
            _pm(m.get("frac_steps_with_reward_variance"), ".2f"),
        ])  # fmt: skip
    lines += md_table(
        ["arm", "trainer attention", "seeds", "steps", "reward first → last 10", "sampled acc. start → last",
         "greedy practised / held-out after", "tool-call rate (last 10)", "peak grad norm", "k3 KL", "mean / max |Δp|",
         "IS weight std", "steps with reward variance"], rows,
    )  # fmt: skip
    verdicts = {key: separation(summaries, key) for key in ("reward_last", "sampled_accuracy_last", "k3_mean")}
    if any(verdicts.values()):
        lines += ["", "Against `sink_kernel`, by the range of each arm's seeds (disjoint = separated):", ""]
        labels = {"reward_last": "reward (last 10)", "sampled_accuracy_last": "sampled accuracy", "k3_mean": "k3 KL"}
        lines += [
            f"- {labels[key]}: " + ", ".join(f"{arm} {v}" for arm, v in verdict.items())
            for key, verdict in verdicts.items()
            if verdict
        ]
    lines += [
        "",
        "Time per optimizer step, median over steps then mean over seeds (s): rollout (generation steps only), whole "
        "step before the sync (rollout, log-probs, forward, backward, update), weight sync (export, load, checks), "
        "and of the sync its verification (served version and `/weights_checker` checksums).",
        "",
    ]
    times = ("rollout_s_median", "step_s_median", "weight_sync_s_median", "weight_sync_verify_s_median")
    lines += md_table(
        ["arm", "rollout", "step", "weight sync", "of which verification"],
        [[name, *(_pm(summaries[name].get(key)) for key in times)] for name in result["arms"]],
    )
    lines += ["", f"![learning run]({png_name})", "",
              "Environment: " + ", ".join(f"{k} {v}" for k, v in result["environment"].items() if v is not None)]  # fmt: skip
    (out / md_name).write_text("\n".join(lines) + "\n")


# %% Main ---------------------------------------------------------------------------------------------------------------
def run_failures(result: dict, *, require_reward_signal: bool = True) -> list[str]:
    """What fails a learning run: a failed check before the arms, no run, a run that finished no optimizer step,
    a non-finite loss, stale trajectories, frozen sinks that moved, weights that did not move, and (unless
    disabled) a run in which no group ever had reward variance."""
    failures = list(result.get("check_failures", []))
    arms = upgrade_result(dict(result))["arms"]
    if not failures and not any(arm["runs"] for arm in arms.values()):
        return ["no run finished"]
    for name, arm in arms.items():
        for seed, run in arm["runs"].items():
            label = f"{name} seed {seed}"
            if not run["steps_done"]:
                failures.append(f"{label}: no optimizer step finished")
            bad = [s.get("step", i) for i, s in enumerate(run["steps"], 1) if not math.isfinite(s.get("loss") or 0.0)]
            if bad:
                failures.append(f"{label}: non-finite loss at step {bad[0]}")
            stale = sum(s.get("stale_trajectories") or 0 for s in run["steps"])
            if stale:
                failures.append(f"{label}: {stale:g} trajectories served on a stale weight version")
            if name == "frozen_sinks" and run.get("sink_change_max"):
                failures.append(f"{label}: the frozen sinks moved by {run['sink_change_max']:.3g}")
            if run["steps_done"] and run.get("weight_change_rel") == 0.0:
                failures.append(f"{label}: no weight moved in {run['steps_done']} optimizer steps")
            stds = [s.get("reward_std") for s in run["steps"] if s.get("reward_std") is not None]
            if require_reward_signal and run["steps_done"] and not any(v > 0 for v in stds):
                failures.append(
                    f"{label}: no group had reward variance at any step: every advantage was zero, nothing was learnt"
                )
    return failures


def warm_up(args, device, tokenizer, train_dataset, tool):
    """The random model with its sinks drawn from ``--sink-mean``/``--sink-std``, then the cold start (or the one
    ``--warm-start`` saved). Returns ``(model, practised rows, seconds)``."""
    import torch
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from trl_ext.cold_start import StopAtLoss, cold_start, cosine_cold_start_config

    torch.manual_seed(args.init_seed)
    model_config = tiny_gptoss_config(**MODEL_SIZES[args.model_size])
    model_config._attn_implementation = "eager"
    model = GptOssForCausalLM(model_config).to(device)
    generator = torch.Generator().manual_seed(args.init_seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=generator) * args.sink_std + args.sink_mean)
    if args.warm_start:
        return model, *load_warm_start(model, Path(args.warm_start), warm_start_key(args))
    start = time.perf_counter()
    practised = []
    if args.cold_start_steps > 0:
        sft_args = cosine_cold_start_config(
            tempfile.mkdtemp(prefix="learning_run_cold_start_"), max_steps=args.cold_start_steps,  # nothing is saved
            batch_size=args.cold_start_batch, learning_rate=args.cold_start_lr, seed=args.init_seed,
            use_cpu=device.type == "cpu",
        )  # fmt: skip
        stop = [StopAtLoss(args.cold_start_target_nll)] if args.cold_start_target_nll else None
        practised = cold_start(model, tokenizer, train_dataset, tool, args=sft_args, max_rows=args.cold_start_problems,
                               callbacks=stop)  # fmt: skip
    return model, practised, time.perf_counter() - start


def checks_before_the_arms(result: dict, rollouts: Rollouts, model, tool, rows: dict, args) -> None:
    """The sink control, then (if it passed) the warm policy's accuracy and its window; failures go into
    ``result["check_failures"]``."""
    from hf_gptoss_rl.harmony import render_prompt
    from trl_ext.mismatch import sink_control

    prompts = [
        render_prompt(r["prompt"], tools=[tool.spec()], reasoning_effort="low")
        for r in rows["slice"][: args.control_prompts]
    ]
    # the server (which holds the warm weights), or an embedded copy of them, dropped after the check
    engine = rollouts.engine if rollouts.engine is not None else rollouts.engine_with(model, seed=0)
    control = result["sink_control"] = sink_control(
        engine, model, prompts, sink_shift=args.control_sink_shift, margin=args.control_margin
    )
    if rollouts.engine is None:
        engine.shutdown()
    print(f"sink control: {control}", flush=True)
    if not control["passed"]:
        result["check_failures"].append(
            f"sink control failed: the engine's log-probs are {control['mean_abs_logp_diff_with_sinks']:.3g} "
            f"from the trainer with sinks and {control['mean_abs_logp_diff_without_sinks']:.3g} from the trainer "
            f"without them (needs a {args.control_margin:g}x gap): the engine ignores the sinks or the sync"
        )
        return
    engine = rollouts.engine_with(model, args.init_seed)
    result["before"] = {
        "sampled_slice": agent_accuracy(engine, tool, rows["slice"], args, temperature=1.0),
        "practised": agent_accuracy(engine, tool, rows["practised"], args),
        "held_out": agent_accuracy(engine, tool, rows["eval"], args),
    }
    if rollouts.engine is None:
        engine.shutdown()
    print(f"warm policy: {result['before']}", flush=True)
    problems = policy_window(result["before"]["sampled_slice"], args)
    if problems and args.policy_check:
        result["check_failures"].append(
            "the warm policy gives GRPO no reward signal to compare arms on: " + "; ".join(problems)
            + " (train the warm-up longer or shorter, or pass --no-policy-check)"
        )  # fmt: skip


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.save_warm_start:  # that writes no report
        args.out = output_dir(args.out, *report_names(args.rollout_backend))
    if args.from_json:
        result = upgrade_result(json.loads(Path(args.from_json).read_text()))
        write_report(result, args.out)
        return result
    if args.merge:
        result = merge_reports([json.loads(Path(path).read_text()) for path in args.merge], args)
        write_report(result, args.out)
        failures = run_failures(result, require_reward_signal=args.require_reward_signal)
        exit_if_failed("benchmarks/learning_run.py", failures, args.out)
        return result
    if args.device == "cpu":  # the kernel's Triton code runs on CPU tensors only if this is set before triton.jit runs
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    kernel_arms = {"sink_kernel", "frozen_sinks"} & set(args.arms)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1" and kernel_arms:
        raise RuntimeError("the kernel on CPU needs TRITON_INTERPRET=1 (pass --device cpu, or export it)")
    if device.type == "cpu" and args.precision == "bf16" and args.rollout_backend == "embedded":
        raise SystemExit("--precision bf16 with the embedded engine needs a GPU (bf16 rollouts on CPU crawl)")
    from benchmarks._cli import environment
    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from trl_ext.recipes import load_math_dataset
    from trl_ext.tools import CodeInterpreterTool

    tokenizer = load_gptoss_tokenizer()
    train_dataset = load_math_dataset(args.train_file)
    eval_rows = list(load_math_dataset(args.eval_file, limit=args.eval_limit))
    tool = CodeInterpreterTool()
    model, practised, cold_seconds = warm_up(args, device, tokenizer, train_dataset, tool)
    if args.save_warm_start:
        digest = save_warm_start(model, Path(args.save_warm_start), warm_start_key(args), practised, cold_seconds)
        print(f"warm start saved in {args.save_warm_start} (sha256 {digest[:16]}, {cold_seconds:.0f} s)", flush=True)
        return {"warm_start": {"sha256": digest, "cold_start_seconds": cold_seconds, "practised": len(practised)}}
    full_train_rows = len(train_dataset)
    # "practised": training problems the warm-up saw, scored like the held-out set (memorisation vs generalisation);
    # without a warm-up, the first training problems
    practised_ids = list(practised or range(full_train_rows))
    rows = {
        "practised": [train_dataset[i] for i in practised_ids[: args.eval_limit]],
        "slice": [train_dataset[i] for i in practised_ids[: args.eval_slice]],
        "eval": eval_rows,
    }
    if args.rl_problems == "practised" and practised:
        train_dataset = train_dataset.select(practised)
    model.config.use_cache = True
    warm_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    setup = {
        "model_size": args.model_size, "parameters": sum(p.numel() for p in model.parameters()),
        "precision": args.precision, "rollout_backend": args.rollout_backend, "arms": args.arms, "seeds": args.seeds,
        "init_seed": args.init_seed, "cold_start_steps": args.cold_start_steps,
        "cold_start_target_nll": args.cold_start_target_nll, "cold_start_batch": args.cold_start_batch,
        "cold_start_problems": len(practised), "cold_start_seconds": cold_seconds, "rl_problems": args.rl_problems,
        "train_file_rows": full_train_rows, "num_generations": args.num_generations, "batch_size": args.batch_size,
        "num_iterations": args.num_iterations, "learning_rate": args.learning_rate, "warmup_steps": args.warmup_steps,
        "max_completion_length": args.max_completion_length, "max_turns": args.max_turns,
        "train_rows": len(train_dataset), "eval_rows": len(eval_rows), "eval_every": args.eval_every,
        "eval_slice": len(rows["slice"]), "steps_requested": args.steps, "max_seconds": args.max_seconds,
        "sink_init": [args.sink_mean, args.sink_std],
        "warm_start": {"sha256": state_digest(warm_state), "loaded": bool(args.warm_start)}, "note": args.note,
    }  # fmt: skip
    result = {"command": command_line("learning_run", argv), "environment": environment(), "setup": setup, "arms": {},
              "check_failures": []}  # fmt: skip
    mark_missing_runs(result, args.arms, args.seeds)
    rollouts = Rollouts(args, device, Path(tempfile.mkdtemp(prefix="learning_run_rollouts_")))
    rollouts.pad_token_id = tokenizer.pad_token_id
    try:
        rollouts.start(model)
        result["setup"]["rollouts"] = rollouts.info
        checks_before_the_arms(result, rollouts, model, tool, rows, args)
        model_config = model.config
        del model
        if not result["check_failures"]:
            kernel_attention = None
            if kernel_arms:  # the kernel's sources on every row's valid tokens, packed (fp32 stays fp32)
                from hf_gptoss_rl.attention_variants import register_span_kernel_attention

                kernel_attention = register_span_kernel_attention()
                result["setup"]["kernel_route"] = (
                    "kernel sources via AttentionInterface, valid tokens packed into one varlen call"
                )
            ctx = {
                "args": args, "device": device, "rollouts": rollouts, "tool": tool, "tokenizer": tokenizer,
                "model_config": model_config, "warm_state": warm_state, "kernel_attention": kernel_attention,
                "train_dataset": train_dataset, "eval_rows": eval_rows, "practised_rows": rows["practised"],
                "slice_rows": rows["slice"],
            }  # fmt: skip
            for seed in args.seeds:  # seed-major: an interrupted run still has every arm for the first seeds
                for arm in args.arms:
                    entry = result["arms"].setdefault(arm, {"description": ARMS[arm], "runs": {}})
                    entry["runs"][str(seed)] = run_arm(arm, seed, ctx)
                    mark_missing_runs(result, args.arms, args.seeds)
                    write_report(result, args.out)  # a script stopped later still leaves this run's numbers
    finally:
        rollouts.stop()
    mark_missing_runs(result, args.arms, args.seeds)
    write_report(result, args.out)
    for name, arm in result["arms"].items():
        summary = arm_summary(arm)
        print(
            f"{name:14s} reward last 10 {_pm(summary['reward_last'])}  sampled acc. {_pm(summary['sampled_accuracy_last'])}"
            f"  k3 {_pm(summary['k3_mean'])}  peak grad norm {_pm(summary['grad_norm_peak'])}"
        )
    exit_if_failed(
        "benchmarks/learning_run.py", run_failures(result, require_reward_signal=args.require_reward_signal), args.out
    )
    return result


if __name__ == "__main__":
    main()
