"""One generation's rollouts on their way through TRL's hooks: sampled, laid out for TRL, measured.

TRL's `GRPOTrainer._generate` calls the `rollout_func` and takes its dict (ids, masks, rollout log-probs, extra
columns for the reward functions); what else the trainer needs from the same rollouts travels in a `RolloutBatch`:
the reward functions' `completions` (put in place of TRL's decoding by `AgenticGRPOTrainer._generate`) and the
routing records (added to TRL's batch by `_generate_and_score_completions`, then split and shuffled with it).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger(__name__)

# the reward functions' per-trajectory columns beyond TRL's (`AgenticGRPOTrainer` documents them)
TRAJECTORY_COLUMNS = ("final_text", "num_turns", "num_tool_calls", "tool_errors", "format_errors", "finish_reason")


@dataclasses.dataclass
class RolloutBatch:
    """The rollouts of one generation, as the trainer's hooks take them."""

    fields: dict[str, list]
    """TRL's `rollout_func` output: `prompt_ids`, `completion_ids`, `logprobs`, `env_mask` and `TRAJECTORY_COLUMNS`."""
    completions: list | None = None
    """What reward functions get as `completions`, in TRL's layouts; None: TRL's own decoding."""
    routing: dict[str, torch.Tensor] | None = None
    """`prompt_routed_experts` / `completion_routed_experts` in TRL's padded layout; None: no record."""


def rollout_fields(trajectories: list, tokenizer, harmony: bool) -> dict[str, list]:
    """The trajectories as TRL's `rollout_func` returns them (sampled ids exactly as sampled; tool tokens with
    `env_mask = 0`), plus the per-trajectory columns for the reward functions."""
    pad_id = tokenizer.pad_token_id
    out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    for key in TRAJECTORY_COLUMNS:
        out[key] = []
    for traj in trajectories:
        traj.check_alignment()
        ids, mask, logps = list(traj.completion_ids), list(traj.completion_mask), list(traj.rollout_logprobs)
        if not ids:  # an aborted request can return nothing; TRL needs one token: a pad that is never trained
            ids, mask, logps = [pad_id], [0], [0.0]
        out["prompt_ids"].append(list(traj.prompt_ids))
        out["completion_ids"].append(ids)
        out["env_mask"].append(mask)
        out["logprobs"].append(logps)
        if not harmony and traj.finish_reason == "final":  # one plain turn: its text is the answer
            traj.final_text = tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
        out["final_text"].append(traj.final_text or "")
        out["num_turns"].append(traj.num_turns)
        out["num_tool_calls"].append(traj.num_tool_calls)
        out["tool_errors"].append(sum(1 for c in traj.tool_calls if c.error))
        out["format_errors"].append(len(traj.errors))
        out["finish_reason"].append(traj.finish_reason)
    return out


def run_rollout_batch(trainer, prompt_ids: list, seeds: list) -> list:
    """The agent loop on one batch, which a server's restart or loss never lets through (`trl_ext.rollout.recovery`).

    A batch with turns served on a restarted server's launch weights is sampled again, with the same seeds, once
    the current weights were pushed to the servers again and verified. A server that a request gave up on (no
    answer within `sglang_retry_deadline_s`) stops training with `RolloutServerLostError`, naming it and the
    checkpoint to resume from. Every process takes the same branch (the counts are summed over processes).
    """
    from .rollout import run_sync
    from .rollout.recovery import RESTART_RECOVERIES, RolloutServerLostError, served_on_launch_weights

    engine = trainer.rollout_engine
    attempt = 0
    while True:
        trajectories = run_sync(trainer.agent_loop.run_batch(prompt_ids, seeds))
        lost = engine.take_unreachable() if hasattr(engine, "take_unreachable") else {}
        restarted = served_on_launch_weights(trajectories, trainer.synced_weight_version)
        counts = torch.tensor([len(lost), restarted], dtype=torch.float64, device=trainer.accelerator.device)
        if trainer.accelerator.num_processes > 1:
            counts = trainer.accelerator.gather(counts).reshape(-1, 2).sum(0)
        if counts[0] > 0:
            from accelerate.utils import gather_object

            from .checkpoints import resume_hint

            gone = dict(gather_object(sorted(lost.items()))) if trainer.accelerator.num_processes > 1 else lost
            raise RolloutServerLostError(
                "rollout server(s) stopped answering and did not answer again within sglang_retry_deadline_s="
                f"{trainer.args.sglang_retry_deadline_s:g} s: "
                + "; ".join(f"{url} ({error})" for url, error in sorted(gone.items()))
                + f". Training stops before this batch is used; {resume_hint(trainer.args.output_dir)} once the "
                "server serves again."
            )
        if counts[1] == 0 or attempt == RESTART_RECOVERIES:
            return trajectories  # still on launch weights after the last attempt: the stale check stops it
        logger.warning(
            "%d trajectories of this batch had turns served on a server's launch weights (no weight version) while "
            "the trainer is at version %s: a server restarted. Pushing the weights again and sampling the batch "
            "again (attempt %d of %d)",
            int(counts[1]),
            trainer.synced_weight_version,
            attempt + 2,
            RESTART_RECOVERIES + 1,
        )
        trainer.sync_rollout_weights()
        attempt += 1


def reward_completions(prompts: list, trajectories: list) -> list | None:
    """The `completions` TRL would hand reward functions for these harmony trajectories.

    Chat prompts: the completion's messages, as TRL's tool loop builds them (`GRPOTrainer._tool_call_loop` with
    `parse_response`): each assistant turn with its `thinking` (analysis), `tool_calls` and `content` (final
    answer, partial when cut off), each tool result as a `tool` message (`Trajectory.messages`). Text prompts:
    None, i.e. TRL's own decoding (`processing_class.batch_decode(completion_ids, skip_special_tokens=True)`),
    which is never empty when the model sampled a token; the final answer alone is the `final_text` keyword.
    """
    from trl.data_utils import is_conversational

    # TRL decides per batch, from the first prompt (`GRPOTrainer._generate`)
    if not is_conversational({"prompt": prompts[0]}):
        return None
    # a trajectory that sampled nothing (an aborted request) gets what TRL parses from an empty completion
    return [list(traj.messages) or [{"role": "assistant", "content": ""}] for traj in trajectories]


def routing_layout(trainer, trajectories: list, out: dict[str, list]) -> dict[str, torch.Tensor] | None:
    """The trajectories' routing records in TRL's layout: `prompt_routed_experts` `[B, P, layers, top_k]` (left
    padded, as `prompt_ids`) and `completion_routed_experts` `[B, C, layers, top_k]` (right padded); tokens without a
    record hold `no_route`. None when no trajectory has one (an engine that does not record routing)."""
    from hf_gptoss_rl.routing import check_routing, no_route, routing_dtype

    records = [t.routed_experts for t in trajectories]
    if all(r is None for r in records):
        if trainer.args.routing_replay:
            raise ValueError(
                "routing_replay=True but the rollout engine returned no routing: build it with "
                "record_routing (EmbeddedEngine(record_routing=True), SGLangEngine(record_routing=...))"
            )
        return None
    layers, top_k, experts = trainer.resolved.routing_shape
    dtype = routing_dtype(experts)
    prompt_width = max(len(p) for p in out["prompt_ids"])
    completion_width = max(len(c) for c in out["completion_ids"])
    prompt = torch.full((len(records), prompt_width, layers, top_k), no_route(dtype), dtype=dtype)
    completion = torch.full((len(records), completion_width, layers, top_k), no_route(dtype), dtype=dtype)
    for i, (record, prompt_ids) in enumerate(zip(records, out["prompt_ids"])):
        if record is None:
            continue
        n = len(prompt_ids)
        check_routing(record, num_layers=layers, top_k=top_k, num_experts=experts, source=f"trajectory {i}")
        if record.shape[0] > n + len(out["completion_ids"][i]):
            raise ValueError(f"trajectory {i}: routing for {record.shape[0]} tokens, more than it has")
        prompt[i, prompt_width - n :] = record[:n].to(dtype)
        completion[i, : record.shape[0] - n] = record[n:].to(dtype)
    device = trainer.accelerator.device
    return {"prompt_routed_experts": prompt.to(device), "completion_routed_experts": completion.to(device)}


def log_rollout_metrics(trainer, out: dict[str, list]) -> None:
    mode = "train" if trainer.model.training else "eval"
    device = trainer.accelerator.device
    n = len(out["num_turns"])
    local = torch.tensor(
        [
            n,
            sum(out["num_turns"]),
            sum(out["num_tool_calls"]),
            sum(1 for c in out["num_tool_calls"] if c > 0),
            sum(out["tool_errors"]),
            sum(1 for t in out["final_text"] if t),
            sum(1 for r in out["finish_reason"] if r == "length"),
            sum(1 for r in out["finish_reason"] if r == "abort"),
            sum(out["format_errors"]),
        ],
        dtype=torch.float64,
        device=device,
    )
    total = trainer.accelerator.reduce(local, reduction="sum").tolist()
    count = max(total[0], 1.0)
    metrics = trainer._metrics[mode]
    metrics["rollout/turns_mean"].append(total[1] / count)
    metrics["rollout/tool_calls_mean"].append(total[2] / count)
    metrics["rollout/frac_with_tool_call"].append(total[3] / count)
    metrics["rollout/tool_errors_per_call"].append(total[4] / max(total[2], 1.0))
    if trainer.agent_tools:  # TRL's names for the same two numbers (GRPOTrainer logs them when it has tools)
        metrics["tools/call_frequency"].append(total[2] / count)
        metrics["tools/failure_frequency"].append(total[4] / total[2] if total[2] > 0 else 0.0)
    metrics["rollout/frac_final_answer"].append(total[5] / count)
    metrics["rollout/frac_truncated"].append(total[6] / count)
    metrics["rollout/frac_aborted"].append(total[7] / count)
    metrics["rollout/format_errors_mean"].append(total[8] / count)
