"""The policy's log-prob forward: one strategy for every path a batch takes in `AgenticGRPOTrainer`.

TRL's `GRPOTrainer._get_per_token_logps_and_entropies` runs the padded rows chunk by chunk (`batch_size`). Here the
same chunk loop has options: each chunk packed into one row without padding (`padding_free`,
`hf_gptoss_rl.packing`), each chunk's forward with its rows' recorded MoE routing replayed (`routing`,
`hf_gptoss_rl.routing`), or, for the loss forward of a sequence-parallel group, one forward over 1/P of every
sequence of the group's pooled batch (`hf_gptoss_rl.sequence_parallel`). Without an option the pass is TRL's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# `_get_per_token_logps_and_entropies` keyword arguments the packed path takes (the others are multimodal inputs)
PACKED_KWARGS = frozenset({"batch_size", "compute_entropy", "compute_aux_loss"})


def policy_logps_and_entropies(
    trainer, trl_forward: Callable, model, input_ids, attention_mask, logits_to_keep, routing, *a,
    sequence_parallel: bool = False, flip_replay: bool = False, **kw,
):  # fmt: skip
    """One log-prob pass: `(per_token_logps, entropies, aux_loss)` in TRL's `[B, T]` layout.

    `trl_forward` is TRL's `_get_per_token_logps_and_entropies` (bound to the trainer); `routing` the rows' routing
    record `[B, T, layers, top_k]` or None; `sequence_parallel` runs this pass sequence-parallel (the loss forward,
    on the group's pooled batch); `flip_replay` routes the other way than `routing_replay` says (the extra pass of
    `routing_mismatch_every`).
    """
    if sequence_parallel:
        return _sequence_parallel_logps_and_entropies(
            trainer, model, input_ids, attention_mask, logits_to_keep,
            compute_aux_loss=kw.get("compute_aux_loss", False), routing=routing, flip_replay=flip_replay,
        )  # fmt: skip
    packed = trainer.resolved.padding_free and not a and all(kw.get(k) is None for k in kw if k not in PACKED_KWARGS)
    if not packed and routing is None:
        return trl_forward(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
    if a:
        raise ValueError("routing replay: unexpected positional arguments to the log-prob pass")
    from hf_gptoss_rl.packing import packed_completion_logprobs, rows_are_contiguous

    kw = dict(kw)
    batch_size = kw.pop("batch_size", None) or input_ids.size(0)
    compute_entropy, compute_aux_loss = kw.get("compute_entropy", False), kw.get("compute_aux_loss", False)
    chunks = range(0, input_ids.size(0), batch_size)
    if routing is not None and torch.is_grad_enabled() and len(chunks) > 1:
        # the backward's checkpoint recompute replays the plan in place when it runs: one forward per backward
        raise ValueError("routing replay: a differentiated log-prob pass must be one forward (batch_size=None)")
    outs = []
    for start in chunks:
        ids = input_ids[start : start + batch_size]
        mask = attention_mask[start : start + batch_size]
        contiguous = packed and rows_are_contiguous(mask)
        if routing is not None:  # packed: the records of the real tokens, as `pack_rows` packs the ids
            rows = routing[start : start + batch_size]
            replay_routing(trainer, rows[mask.bool()] if contiguous else rows, flip=flip_replay)
        if contiguous:
            outs.append(
                packed_completion_logprobs(
                    model,
                    ids,
                    mask,
                    logits_to_keep,
                    compute_aux_loss=compute_aux_loss,
                    autocast=trainer.accelerator.autocast,
                )  # fmt: skip
            )
            continue
        if packed:
            _warn_once(
                "padding_free: an attention mask with a hole inside a trajectory; this chunk runs padded "
                "(TRL's path) to keep its positions"
            )
        outs.append(trl_forward(model, ids, mask, logits_to_keep, **kw))
    if routing is not None and not torch.is_grad_enabled():
        trainer.routing_replay.clear()
    logps = torch.cat([o[0] for o in outs], dim=0)
    entropies = torch.cat([o[1] for o in outs], dim=0) if compute_entropy else None
    aux_loss = torch.stack([o[2] for o in outs]).mean() if compute_aux_loss else None
    return logps, entropies, aux_loss


def replay_routing(trainer, routing: torch.Tensor, *, flip: bool = False) -> None:
    """Install `routing` (`[B, T, ...]` or `[N, ...]` of the next forward's tokens) on the policy's routers."""
    # None (auto) replays whenever the engine recorded routing; False only measures the agreement; `flip` (the extra
    # pass of `routing_mismatch_every`) runs the other way
    replay = (trainer.args.routing_replay is not False) != flip
    trainer.routing_replay.set_plan(routing, replay=replay, device=trainer.accelerator.device)


def _sequence_parallel_logps_and_entropies(
    trainer, model, input_ids, attention_mask, logits_to_keep, compute_aux_loss=False, routing=None, flip_replay=False
):
    from hf_gptoss_rl.sequence_parallel import gather_outputs, shard_inputs

    group = trainer._sp_group
    seq_len = input_ids.shape[1]
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if routing is not None:
        batch["routed_experts"] = routing  # sharded with its tokens
    shard = shard_inputs(batch, group, pad_token_id=trainer._tokenizer.pad_token_id)
    if routing is not None:
        replay_routing(trainer, shard["routed_experts"], flip=flip_replay)
    extra = {"output_router_logits": True} if compute_aux_loss else {}
    with trainer.accelerator.autocast():
        out = model(
            input_ids=shard["input_ids"],
            attention_mask=shard["attention_mask"],
            position_ids=shard["position_ids"],
            shift_labels=shard["shift_labels"],
            fused_lm_head=True,
            **extra,
        )
    # [B, S_padded] on every rank: position t scores token t+1
    logps = gather_outputs(out.log_probs, group, dim=1)[:, : seq_len - 1]
    entropy = gather_outputs(out.entropy, group, dim=1)[:, : seq_len - 1]
    return logps[:, -logits_to_keep:], entropy[:, -logits_to_keep:], out.aux_loss


def setup_sequence_parallel(trainer):
    """Ulysses SP over groups of `sequence_parallel_size` consecutive ranks (DDP); returns this rank's group.

    The ranks of a group pool their micro-batches (`pool_sequence_parallel_inputs`) and each computes 1/P of every
    sequence of the pooled batch (`hf_gptoss_rl.sequence_parallel`); the loss is scaled
    (`sequence_parallel_loss_scale`) so that DDP's average over all ranks gives the gradient of the data-parallel run
    without SP.
    """
    import torch.distributed as dist

    from hf_gptoss_rl.sequence_parallel import enable_sequence_parallel

    size = trainer.args.sequence_parallel_size
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("sequence_parallel_size > 1 needs several processes (accelerate launch / torchrun)")
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"world size {world} is not divisible by sequence_parallel_size={size}")
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        raise ValueError("sequence_parallel_size > 1 is supported with DDP (accelerate launch --multi_gpu) only")
    if not trainer.args.is_on_policy or trainer.beta != 0.0:
        raise ValueError(
            "sequence_parallel_size > 1 needs the on-policy setting (num_iterations=1, one optimizer step per "
            "generation) and beta=0: the extra old/reference log-prob passes are not sequence-parallel"
        )
    rank, own = dist.get_rank(), None
    for start in range(0, world, size):  # every rank creates every group (torch.distributed's rule)
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            own = group
    enable_sequence_parallel(trainer.accelerator.unwrap_model(trainer.model), own)
    return own


def pool_sequence_parallel_inputs(trainer, inputs: dict[str, Any]) -> dict[str, Any]:
    """Concatenate the micro-batches of the SP group (every rank then holds the same pooled batch)."""
    import torch.distributed as dist

    gathered: list = [None] * trainer.args.sequence_parallel_size
    dist.all_gather_object(gathered, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    device = trainer.accelerator.device
    out: dict[str, Any] = {}
    left_padded = {"prompt_ids": trainer._tokenizer.pad_token_id, "prompt_mask": 0}
    right_padded = {
        "completion_ids": trainer._tokenizer.pad_token_id,
        "completion_mask": 0,
        "tool_mask": 1,
        "sampling_per_token_logps": 0.0,
        "old_per_token_logps": 0.0,
        "ref_per_token_logps": 0.0,
    }
    if "prompt_routed_experts" in inputs:  # routing replay: padding has no record
        from hf_gptoss_rl.routing import no_route

        left_padded["prompt_routed_experts"] = no_route(inputs["prompt_routed_experts"].dtype)
        right_padded["completion_routed_experts"] = no_route(inputs["completion_routed_experts"].dtype)
    for key, value in inputs.items():
        parts = [g[key] for g in gathered]
        if key == "num_items_in_batch":
            out[key] = value  # already global
        elif key in left_padded or key in right_padded:
            width = max(p.shape[1] for p in parts)
            pad_value = left_padded.get(key, right_padded.get(key))
            padded = []
            for p in parts:
                filler = p.new_full((p.shape[0], width - p.shape[1], *p.shape[2:]), pad_value)
                padded.append(torch.cat([filler, p] if key in left_padded else [p, filler], dim=1))
            out[key] = torch.cat(padded).to(device)
        elif isinstance(value, torch.Tensor) and value.dim() >= 1:
            out[key] = torch.cat(parts).to(device)
        else:
            raise ValueError(f"cannot pool input {key!r} across the sequence-parallel group")
    return out


def sequence_parallel_loss_scale(trainer) -> float:
    # Losses normalised by a count of the (pooled, P times larger) batch need x P; those normalised by the
    # global token count (dapo, cispo, vespo) already match the data-parallel run.
    return 1.0 if trainer.loss_type in ("dapo", "cispo", "vespo") else float(trainer.args.sequence_parallel_size)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
