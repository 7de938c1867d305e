"""Policy preparation: what `AgenticGRPOTrainer` does to the policy model around TRL's `GRPOTrainer.__init__`.

Before it: the attention / experts implementations (`apply_model_implementations`). After it, the policy loaded and
on its device: the config's automatic settings resolved (`resolve_auto_settings`: fused layers, packed forwards,
chunked log-probs, the routing record), then `prepare_policy`: the fused layers (Liger RMSNorm, fused RoPE), the
LoRA casts and fused LoRA update, selective gradient checkpointing (`checkpoint_saves`) and the chunked log-prob head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from accelerate.utils import is_peft_model

from .config import AgenticGRPOConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedSettings:
    """The config's automatic settings (`None` / `"auto"`) as this trainer runs them (`resolve_auto_settings`)."""

    liger_rms_norm: bool
    fused_rope: bool
    padding_free: bool
    """Whether the log-prob forwards run packed."""
    chunked_logprobs: bool
    """`logprobs_implementation` "auto" or "chunked": the project's chunked head replaces TRL's fused one."""
    routing_shape: tuple[int, int, int] | None
    """(MoE layers, top_k, experts) when the rollouts can record GPT-OSS routing, else None."""


def resolve_auto_settings(trainer, args: AgenticGRPOConfig) -> ResolvedSettings:
    """Resolve every automatic setting that depends on the policy, its device or the installed kernels, once, after
    TRL's `GRPOTrainer.__init__` (the policy loaded and on its device). An explicit `True` that cannot hold is an
    error naming why (`liger_rms_norm`, `padding_free`, `routing_replay`).

    Resolved elsewhere, each for a reason: `max_turns` and `weight_sync_verify` in `AgenticGRPOConfig.__post_init__`
    (from other fields alone, and visible on the saved arguments); `weight_sync_dir` and `sglang_api_key` where the
    components are built (`trl_ext.trainer_args`); the `checkpoint_*_max_tokens` bounds at each
    `gradient_checkpointing_enable` (`resolve_checkpoint_max_tokens`: the free GPU memory changes once the embedded
    engine holds its copy); whether routing is replayed, from what the engine returns (the SGLang servers are asked
    when the engine is built, and each batch says whether it carries routing).
    """
    liger_rms_norm, fused_rope = _resolve_fused_layers(trainer, args)
    return ResolvedSettings(
        liger_rms_norm=liger_rms_norm,
        fused_rope=fused_rope,
        padding_free=_resolve_padding_free(trainer, args),
        chunked_logprobs=use_chunked_logprobs(args),
        routing_shape=_resolve_routing_shape(trainer, args),
    )


def prepare_policy(trainer, args: AgenticGRPOConfig) -> None:
    """Prepare `trainer.model` after TRL's `GRPOTrainer.__init__`, as `trainer.resolved` says."""
    resolved: ResolvedSettings = trainer.resolved
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if resolved.liger_rms_norm:
        from hf_gptoss_rl.fused_layers import apply_liger_gptoss_rms_norm

        apply_liger_gptoss_rms_norm(unwrapped)
    if resolved.fused_rope:
        from hf_gptoss_rl.fused_layers import apply_fused_gptoss_rope

        apply_fused_gptoss_rope(unwrapped)
    if is_peft_model(unwrapped):
        from hf_gptoss_rl.lora import fuse_lora_update, skip_autocast_undone_lora_casts

        # bf16 autocast runs the float32 adapters' matmuls in bf16: PEFT's float32 copy of every LoRA input
        # would only be cast back (bitwise the same results without it)
        skip_autocast_undone_lora_casts(unwrapped)
        if args.fuse_lora_update:
            fuse_lora_update(unwrapped)
    if args.checkpoint_saves and selective_checkpointing_matches(trainer):
        install_selective_checkpointing(trainer)
    if resolved.chunked_logprobs:
        from hf_gptoss_rl.logprobs import add_chunked_logprob_head

        # Replaces TRL's fused head with the same call contract (`fused_lm_head=True`); see the config field.
        add_chunked_logprob_head(
            unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped,
            temperature=trainer.temperature,
            chunk_size=args.logprobs_chunk_size,
            # an entropy bonus differentiates the entropy: its gradient needs the logits again in the backward,
            # so computing the log-probs' part in the forward would be a wasted pass over the vocabulary
            hidden_grad_in_forward=False if getattr(trainer, "_entropy_bonus_enabled", False) else None,
        )


def apply_model_implementations(model, args: AgenticGRPOConfig):
    """Select the attention kernel / experts implementation requested in the config."""
    if args.attn_implementation is None and args.experts_implementation is None:
        return model
    import hf_gptoss_rl

    hf_gptoss_rl.register()  # the sink kernel id and "memory_efficient" (idempotent; the import already did it)

    if isinstance(model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        if args.attn_implementation is not None:
            init_kwargs["attn_implementation"] = args.attn_implementation
        if args.experts_implementation is not None:
            init_kwargs["experts_implementation"] = args.experts_implementation
        args.model_init_kwargs = init_kwargs
        return model
    if args.attn_implementation is not None:
        model.set_attn_implementation(args.attn_implementation)
    if args.experts_implementation is not None:
        model.set_experts_implementation(args.experts_implementation)
    return model


def selective_checkpointing_matches(trainer) -> bool:
    """Whether `checkpoint_saves` names an op this policy runs (else plain checkpointing, without the
    selective-checkpointing dispatch mode): the sink kernel's attention, the `memory_efficient` experts, a
    GPT-OSS policy's projections."""
    from hf_gptoss_rl.attention import KERNEL_REPO_ID

    config = policy_model(trainer).config
    saves = set(checkpoint_saves(trainer))
    return (
        "projections" in saves
        or ("attention" in saves and getattr(config, "_attn_implementation", None) == KERNEL_REPO_ID)
        or ("experts" in saves and getattr(config, "_experts_implementation", None) == "memory_efficient")
    )


def checkpoint_saves(trainer) -> list[str]:
    """`args.checkpoint_saves` as this policy runs it: `"projections"` keeps a layer's attention and router
    products, sized for GPT-OSS (`kept_projection_bytes_per_token`); in another model the same rule would also
    keep its MLP products, so there it matches nothing, like `"attention"` with another attention."""
    return [name for name in trainer.args.checkpoint_saves if name != "projections" or trainer._harmony]


def install_selective_checkpointing(trainer):
    """Make every `gradient_checkpointing_enable` call on the policy selective (`args.checkpoint_saves`).

    `Trainer.train` (re-)enables checkpointing from `args.gradient_checkpointing_kwargs`, which must stay
    JSON-serialisable (it is logged), so the `context_fn` is added at that call rather than stored in the args.
    """
    from hf_gptoss_rl.checkpointing import selective_checkpointing_kwargs

    saves = tuple(checkpoint_saves(trainer))
    # resolved when checkpointing is enabled
    trainer.checkpoint_experts_max_tokens = trainer.checkpoint_projections_max_tokens = None
    model = trainer.model
    enable = model.gradient_checkpointing_enable

    def gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, **kwargs):
        kwargs_ = dict(gradient_checkpointing_kwargs or {})
        kwargs_.pop("use_reentrant", None)  # refused for True in the config; False is what we set
        # resolved at each call: `Trainer.train` calls this again once the rollout engine holds its copy
        trainer.checkpoint_experts_max_tokens = resolve_checkpoint_max_tokens(trainer, "experts")
        trainer.checkpoint_projections_max_tokens = resolve_checkpoint_max_tokens(trainer, "projections")
        selective = selective_checkpointing_kwargs(
            saves,
            experts_max_tokens=trainer.checkpoint_experts_max_tokens,
            projections_max_tokens=trainer.checkpoint_projections_max_tokens,
            **kwargs_,
        )
        return enable(gradient_checkpointing_kwargs=selective, **kwargs)

    model.gradient_checkpointing_enable = gradient_checkpointing_enable
    if trainer.args.gradient_checkpointing:  # already enabled by TRL for PEFT models: make it selective now
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)


def resolve_checkpoint_max_tokens(trainer, kept: str) -> int | None:
    """`args.checkpoint_{kept}_max_tokens` (`kept`: "experts" or "projections") as the checkpointing policy takes
    it (None: no bound); its default is where memory allows: the kept outputs take at most half of the GPU
    memory that the weights on it leave (`experts_max_tokens_for_model`, `projections_max_tokens_for_model`)."""
    from hf_gptoss_rl.checkpointing import experts_max_tokens_for_model, projections_max_tokens_for_model

    setting = getattr(trainer.args, f"checkpoint_{kept}_max_tokens")
    saves = checkpoint_saves(trainer)
    if kept not in saves or setting == -1:
        return None
    if setting is not None:
        return setting
    # what else holds weights on this GPU: TRL's reference model (beta > 0, no PEFT), the embedded engine's copy
    engine = getattr(getattr(trainer, "rollout_engine", None), "model", None)
    resident = [m for m in (getattr(trainer, "ref_model", None), engine) if isinstance(m, torch.nn.Module)]
    policy, device = policy_model(trainer), trainer.accelerator.device
    if kept == "experts":
        with_projections = "projections" in saves
        max_tokens = experts_max_tokens_for_model(policy, device, resident=resident, with_projections=with_projections)
    else:
        max_tokens = projections_max_tokens_for_model(policy, device, resident=resident)
    if max_tokens is not None:
        logger.info(
            "checkpoint_saves keeps the %s outputs of micro-batches up to %d tokens (half of the GPU memory that "
            "the weights on it leave); set checkpoint_%s_max_tokens to change it",
            kept,
            max_tokens,
            kept,
        )
    return max_tokens


def policy_model(trainer):
    """The trainer's policy unwrapped (accelerate) and, for a PEFT model, its base model."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped


def _resolve_fused_layers(trainer, args: AgenticGRPOConfig) -> tuple[bool, bool]:
    """`(liger_rms_norm, fused_rope)`: `None` means on for a GPT-OSS policy on CUDA with the kernel's library."""
    import importlib.util

    from hf_gptoss_rl.fused_layers import liger_available

    on_cuda = trainer.accelerator.device.type == "cuda"
    gptoss = trainer._harmony
    liger, rope = args.liger_rms_norm, args.fused_rope
    if liger is None:
        liger = gptoss and on_cuda and liger_available()
    elif liger and not (on_cuda and liger_available()):
        raise ValueError(
            "liger_rms_norm=True needs a CUDA device and liger-kernel (`pip install liger-kernel`): "
            f"device {trainer.accelerator.device.type}, liger-kernel {'installed' if liger_available() else 'missing'}. "
            "Leave it unset to use it only where it runs."
        )
    if rope is None:
        rope = gptoss and on_cuda and importlib.util.find_spec("triton") is not None
    return bool(liger), bool(rope)


def _resolve_padding_free(trainer, args: AgenticGRPOConfig) -> bool:
    """Whether the log-prob forwards run packed (see `AgenticGRPOConfig.padding_free`)."""
    reason = None
    from hf_gptoss_rl.packing import PACKED_MASK_ATTENTION, attention_honours_packing

    attn = getattr(policy_model(trainer).config, "_attn_implementation", None)
    if not trainer._harmony:
        reason = "only GPT-OSS policies are packed (the per-layer-type masks are built for its layers)"
    elif args.sequence_parallel_size > 1:
        reason = "sequence_parallel_size > 1 (the sequence-parallel forward shards padded rows)"
    elif not attention_honours_packing(attn):
        reason = (
            f"attn_implementation={attn!r} is not one that honours sequence boundaries given by position_ids "
            f"(supported: {sorted(PACKED_MASK_ATTENTION)}, flash-attention implementations and the sink kernel)"
        )
    elif attn in PACKED_MASK_ATTENTION and not use_chunked_logprobs(args):
        # TRL's fused head hands the model's attention_mask to the router aux loss, which cannot take the
        # prepared per-layer masks these implementations need for a packed row
        reason = (
            f"attn_implementation={attn!r} needs prepared block-diagonal masks, which TRL's fused LM head "
            "(logprobs_implementation 'trl') does not take; use logprobs_implementation='chunked' or a "
            "flash-attention implementation (the sink kernel)"
        )
    if args.padding_free and reason is not None:
        raise ValueError(f"padding_free=True: {reason}.")
    return reason is None if args.padding_free is None else bool(args.padding_free)


def _resolve_routing_shape(trainer, args: AgenticGRPOConfig) -> tuple[int, int, int] | None:
    """(MoE layers, top_k, experts) when the rollouts can record GPT-OSS routing, else None."""
    from hf_gptoss_rl.routing import RoutingError, routing_shape

    shape = None
    if trainer._harmony:
        try:
            shape = routing_shape(policy_model(trainer))
        except RoutingError:
            shape = None
    if args.routing_replay and shape is None:
        raise ValueError("routing_replay=True replays GPT-OSS MoE routing; this policy has no MoE routers")
    return shape


def use_chunked_logprobs(args) -> bool:
    """`logprobs_implementation` "auto" is "chunked"."""
    return args.logprobs_implementation in ("auto", "chunked")
