"""Routing replay against a real SGLang server: how often the trainer's experts differ from the engine's, what
replaying the engine's routing does to the rollout/training mismatch, and what recording it costs.

One server is launched on a GPT-OSS model with the flags routing replay needs (``--enable-return-routed-experts
--moe-runner-backend triton``; ``E2E_LAUNCH_FLAGS`` of `benchmarks.sglang_e2e` otherwise). Prompts are sampled
once with ``return_routed_experts``; on those same sampled tokens the trainer's bf16 policy then scores the
completions twice, with its own routing and with the engine's replayed (`hf_gptoss_rl.routing.RoutingReplay`):

* ``routing/agreement``: (token, layer) top-k sets of the trainer equal to the engine's, overall and worst layer;
* the mismatch metrics of `trl_ext.mismatch` (k3, max |Δp|, ...) without and with replay;
* the cost: the same prompts generated with and without ``return_routed_experts`` (median of ``--repeats``
  wall times each), the bytes of ``meta_info.routed_experts`` per token, and the trainer's log-prob pass with and
  without the replay hooks.

    python benchmarks/routing_replay.py --server-cmd "/opt/sglang/bin/python -m sglang.launch_server" --out DIR

Writes ``routing_replay.{json,md,png}``; exits non-zero when the run fails or replay raises k3 (replaying the
routing the engine sampled with can only bring the trainer closer to it).
"""

from __future__ import annotations

if __package__ in (None, ""):
    import _bootstrap  # noqa: F401  (python benchmarks/routing_replay.py: the repository root on sys.path)

import argparse
import base64
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._cli import (
    OUT_HELP,
    exit_if_failed,
    figure,
    md_table,
    output_dir,
    without_local_paths,
)
from trl_ext.sglang_serve import ServerManager

NAMES = ("routing_replay.json", "routing_replay.md", "routing_replay.png")
ROUTING_FLAGS = ["--enable-return-routed-experts", "--moe-runner-backend", "triton"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--model", choices=("20b", "tiny"), default="20b", help="20b: gpt-oss-20b layer shapes; tiny: tests")
    p.add_argument("--layers", type=int, default=4, help="layers of the model (of gpt-oss-20b's 24)")
    ServerManager.add_arguments(p, ready_timeout_s=300.0)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed generations with and without the routing, each")
    p.add_argument("--rounds", type=int, default=3, help="independently sampled batches, each scored both ways")
    p.add_argument("--threshold", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sink-mean", type=float, default=1.0)
    p.add_argument("--sink-std", type=float, default=1.5)
    p.add_argument("--logit-std", type=float, default=3.0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--from-json", type=Path, default=None, help="no run: render this routing_replay.json again")
    return p.parse_args(argv)


def generate_all(engine, prompts, sampling) -> list:
    from trl_ext.rollout import run_sync

    return run_sync(engine.generate_batch(prompts, sampling))


def timed_generation(engine, prompts, sampling, record, repeats: int) -> list[float]:
    engine.record_routing = record
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate_all(engine, prompts, sampling)
        times.append(time.perf_counter() - start)
    return times


def run(args, work: Path) -> dict:
    from benchmarks.mismatch_study import METRIC_KEYS, load_prompts
    from benchmarks.sglang_e2e import E2E_LAUNCH_FLAGS, build_model, load_policy
    from hf_gptoss_rl.routing import RoutingReplay, routing_shape
    from trl_ext.mismatch import completion_logprobs, mismatch_metrics, rollout_routing_plan, rollout_scoring_batch
    from trl_ext.rollout import SamplingParams, SGLangEngine, run_sync

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.model_dir = work / "model"
    result: dict = {"model": build_model(args, device, work)}
    policy = load_policy(args.model_dir, device, attn="eager")
    shape = routing_shape(policy)
    result["routing_shape"] = dict(zip(("layers", "top_k", "experts"), shape))
    result["policy_dtype"] = str(next(policy.parameters()).dtype).removeprefix("torch.")
    server = ServerManager.from_args(args, args.model_dir, work / "logs", E2E_LAUNCH_FLAGS)
    try:
        url = server.ensure("routing", ROUTING_FLAGS, args.ready_timeout_s)
        result["server_command"] = server.launches[-1]["command"]  # its local paths go in main()
        result["sglang_version"] = server.version
        engine = SGLangEngine(url, ready_timeout_s=args.ready_timeout_s, timeout_s=300.0, record_routing=shape)
        engine.check_servers()  # refuses a server without the flag or with a runner that records nothing
        prompts, result["prompts_how"] = load_prompts(args.num_prompts)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
        rounds = [generate_all(engine, prompts, sampling) for _ in range(args.rounds)]
        outs = rounds[0]
        # cost: the same prompts with and without the record (the order alternates the warm-up effects away)
        without = timed_generation(engine, prompts, sampling, None, args.repeats)
        with_routing = timed_generation(engine, prompts, sampling, shape, args.repeats)
        run_sync(engine.close())
    finally:
        server.stop()
    tokens = sum(len(p) + len(o.output_ids) - 1 for p, o in zip(prompts, outs))
    encoded = sum(len(base64.b64encode(o.routed_experts.to(torch.int32).numpy().tobytes())) for o in outs)
    result["cost"] = {
        "generate_s_without": statistics.median(without),
        "generate_s_with": statistics.median(with_routing),
        "generate_ratio": statistics.median(with_routing) / statistics.median(without),
        "repeats": args.repeats,
        "routed_tokens": tokens,
        "response_bytes_per_token": encoded / tokens,
        "stored_bytes_per_token": outs[0].routed_experts[0].numel() * outs[0].routed_experts.element_size(),
    }

    prompt_lens = [len(p) for p in prompts]
    replay = RoutingReplay(policy)
    per_round: dict[str, list[dict]] = {"own routing": [], "replayed engine routing": []}
    tokens_scored = 0
    for outs_r in rounds:
        ids, mask, rollout_lp, cmask = rollout_scoring_batch(prompts, outs_r, policy.config.pad_token_id or 0, device)
        plan = rollout_routing_plan(outs_r, ids.shape[1], shape)
        tokens_scored += int(cmask.sum())
        completion_logprobs(policy, ids, mask, prompt_lens, rollout_lp.shape[1], 1.0)  # warm-up, untimed
        for name, replayed in (("own routing", False), ("replayed engine routing", True)):
            replay.set_plan(plan, replay=replayed, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            logps = completion_logprobs(policy, ids, mask, prompt_lens, rollout_lp.shape[1], 1.0)
            elapsed = time.perf_counter() - start
            agreement = replay.take_agreement()
            stats = mismatch_metrics(logps, rollout_lp, cmask, threshold=args.threshold)
            per_round[name].append(
                {k: float(stats[k]) for k in METRIC_KEYS}
                | {"agreement": agreement[0], "agreement_min_layer": agreement[1], "logprob_pass_s": elapsed}
            )
        replay.clear()
    replay.remove()
    result["rounds"] = per_round
    result["rows"] = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in per_round.items()
    }
    result["completion_tokens"] = tokens_scored
    result["num_prompts"] = len(prompts)
    return result


def checks(result: dict) -> list[str]:
    """Replay may not raise k3, in any round (a round: one batch sampled by the server, scored both ways)."""
    rounds, failures = result["rounds"], []
    for i, (own, replayed) in enumerate(zip(rounds["own routing"], rounds["replayed engine routing"])):
        if not replayed["k3_kl"] <= own["k3_kl"]:
            failures.append(f"round {i}: replay raised k3: {replayed['k3_kl']:.3g} > {own['k3_kl']:.3g} without it")
    return failures


def render(result: dict) -> str:
    rows, rounds, cost, shape = result["rows"], result["rounds"], result["cost"], result["routing_shape"]
    own, replayed = rows["own routing"], rows["replayed engine routing"]

    def cell(name, key, spec):
        values = [r[key] for r in rounds[name]]
        return f"{rows[name][key]:{spec}} [{min(values):{spec}}, {max(values):{spec}}]"

    ratios = [r["k3_kl"] / o["k3_kl"] for o, r in zip(rounds["own routing"], rounds["replayed engine routing"])]
    cells = (("agreement", ".4f"), ("agreement_min_layer", ".4f"), ("k3_kl", ".3g"), ("prob_diff_max", ".3g"),
             ("prob_diff_mean", ".3g"))  # fmt: skip
    table = md_table(
        ["trainer forward", "routing agreement", "worst layer", "k3", "max abs dp", "mean abs dp"],
        [[name, *(cell(name, key, spec) for key, spec in cells)] for name in rows],
    )
    lines = [
        "# Routing replay against SGLang",
        "",
        f"Model: {result['model']['num_hidden_layers']} layers of gpt-oss-20b's shapes, {shape['experts']} experts, "
        f"top-{shape['top_k']}, random weights; {result['completion_tokens']} sampled completion tokens. "
        f"SGLang {result.get('sglang_version')}, launched as:",
        "",
        f"    {result['server_command']}",
        "",
        f"The trainer ({result['policy_dtype']}, eager attention) scores the tokens the server sampled, with its own "
        "routing and with the server's replayed. Agreement is measured against the trainer's own choice in that "
        f"forward. Rounds: {len(rounds['own routing'])}, each a batch of the {result['num_prompts']} prompts sampled "
        "anew and scored both ways; the table gives the median of the rounds and, in brackets, their range.",
        "",
        *table,
        "",
        "k3 with replay / without, per round: " + ", ".join(f"{x:.3f}" for x in ratios) + ".",
        "",
        "## Cost",
        "",
        f"- Generation of the same {result['num_prompts']} prompts: "
        f"{cost['generate_s_with']:.3f} s with `return_routed_experts`, {cost['generate_s_without']:.3f} s "
        f"without (median of {cost['repeats']}; ratio {cost['generate_ratio']:.3f}).",
        f"- `meta_info.routed_experts`: {cost['response_bytes_per_token']:.0f} bytes per token in the answer "
        f"(base64 of int32), {cost['stored_bytes_per_token']} bytes per token as the trainer stores it.",
        f"- The trainer's log-prob pass (median over rounds, after a warm-up pass): {replayed['logprob_pass_s']:.3f} s "
        f"replayed, {own['logprob_pass_s']:.3f} s with its own routing (the hooks compare in both).",
    ]
    return "\n".join(lines) + "\n"


def plot(path: Path, result: dict) -> None:
    names = list(result["rows"])
    with figure(path, 1, 2, figsize=(9, 3.2), dpi=120) as (_, axes):
        for ax, key, label in zip(axes, ("agreement", "k3_kl"), ("routing agreement", "k3 KL (engine vs trainer)")):
            ax.bar(names, [result["rows"][n][key] for n in names], color=["#888", "#2a7"])
            ax.set_ylabel(label)
            ax.tick_params(axis="x", labelsize=8)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = output_dir(args.out, *NAMES)
    failures: list[str] = []
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="routing_replay_") as tmp:
            try:
                result = run(args, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - reported, then a non-zero exit
                raise SystemExit(f"routing_replay: {type(exc).__name__}: {exc}") from exc
    # the run's temporary model folder is no reader's: the report names it by its role
    model_dir = (result.get("model") or {}).pop("model_dir", None)
    result = without_local_paths(result, {model_dir: "MODEL_DIR"} if model_dir else None)
    failures += checks(result)
    result["failures"] = failures
    out.mkdir(parents=True, exist_ok=True)
    (out / NAMES[0]).write_text(json.dumps(result, indent=2, default=str))
    (out / NAMES[1]).write_text(render(result))
    with contextlib.suppress(ImportError):
        plot(out / NAMES[2], result)
    print(render(result))
    exit_if_failed("routing_replay", failures, out)


if __name__ == "__main__":
    main()
