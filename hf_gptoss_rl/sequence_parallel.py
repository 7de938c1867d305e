"""Sink-aware Ulysses sequence parallelism for GPT-OSS, as a transformers attention backend.

Every rank of a sequence-parallel (SP) group holds a full replica of the model and ``1/P`` of the sequence. Only
attention needs the whole sequence, so :func:`ulysses_attention_forward`, registered through transformers'
``AttentionInterface`` as ``attn_implementation="ulysses_sp"`` by :func:`hf_gptoss_rl.register`, re-lays the
projections around it::

    q, k, v  [B, H, S/P, D]  (sequence-sharded)  --all-to-all-->  [B, H/P, S, D]  (head-sharded)
    inner attention (eager, flash, the sink kernel ...) on the full sequence, this rank's heads and sinks
    out      [B, S, H/P, D]  (head-sharded)      --all-to-all-->  [B, S/P, H, D]  (sequence-sharded)

What GPT-OSS needs on top of textbook Ulysses:

- sinks: each rank passes the sink logits of its own heads (``sinks[r*H/P:(r+1)*H/P]``). The slice is taken
  inside autograd, so each rank's backward writes the gradient of its heads into the full parameter; the sum over
  the group is the single-process sink gradient;
- sliding windows: the inner attention sees the whole sequence, so ``sliding_window`` is passed through unchanged;
- GQA with fewer KV heads than ranks: KV heads are repeated (``repeat_interleave``) just enough that their count
  divides by ``P`` and every rank receives the KV heads its query heads read;
- masks and packed sequences: the model builds its masks on the *sharded* sequence, which is meaningless here.
  ``ulysses_sp`` has no mask function, so transformers hands the raw 2D padding mask through; the wrapper gathers
  it and the (sharded) position ids once per forward and builds, with transformers' own ``create_causal_mask`` /
  ``create_sliding_window_causal_mask`` for the inner implementation, the mask the inner attention would get on the
  full sequence. Packed sequences (``position_ids`` restarting, no padding) are found on the full position ids,
  as transformers' flash path does.

Public API: :func:`enable_sequence_parallel`, :func:`disable_sequence_parallel`, :func:`shard_inputs`,
:func:`gather_outputs`, :func:`sequence_parallel_logprobs`, :func:`get_sequence_parallel_group`,
:func:`sequence_parallel_mesh`. ``docs/sequence_parallel.md`` has the launch recipes, memory model and costs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .packing import cache_keyword, flash_varlen_kwargs

__all__ = [
    "ULYSSES_ATTENTION",
    "enable_sequence_parallel",
    "disable_sequence_parallel",
    "sequence_parallel_disabled",
    "is_sequence_parallel_enabled",
    "shard_inputs",
    "gather_outputs",
    "all_to_all",
    "sequence_parallel_logprobs",
    "get_sequence_parallel_group",
    "sequence_parallel_mesh",
    "ulysses_attention_forward",
]

ULYSSES_ATTENTION = "ulysses_sp"
"""The ``attn_implementation`` name under which the Ulysses wrapper is registered."""

IGNORE_INDEX = -100

# Keys whose padding value is not 0 (everything else that is per-token is padded with 0).
_PAD_VALUES = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 1}


# ----------------------------------------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------------------------------------


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


def sequence_parallel_mesh(
    sp_size: int,
    *,
    dp_replicate_size: int = 1,
    device_type: str | None = None,
) -> torch.distributed.device_mesh.DeviceMesh:
    """Build the device mesh for SP next to FSDP2 data parallelism: dims ``([dp_replicate,] dp_shard, sp)``.

    accelerate's ``ParallelismConfig`` only accepts ``sp_backend="deepspeed"`` and builds no mesh for it, so the mesh
    is built here with ``init_device_mesh`` in accelerate's canonical order (``sp`` innermost of the data dims, so the
    ranks of one SP group are neighbours, i.e. on the same node). Flattened dims added, with accelerate's names:

    - ``"dp"``: the data-parallel ranks (``dp_replicate x dp_shard``); each dp index feeds one batch to its SP group;
    - ``"dp_shard_cp"``: ``dp_shard x sp``, the dim FSDP2 shards parameters over (every SP rank holds the same
      parameters, so they are sharded across the SP group too, as accelerate does for ``cp``);
    - ``"sp"`` itself is the group to pass to :func:`enable_sequence_parallel`.

    ``dp_shard`` is ``world_size / (dp_replicate_size * sp_size)``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if sp_size < 1 or world % (sp_size * dp_replicate_size):
        raise ValueError(
            f"world size {world} is not divisible by sp_size={sp_size} x dp_replicate_size={dp_replicate_size}"
        )
    dp_shard_size = world // (sp_size * dp_replicate_size)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    names, shape = ["dp_shard", "sp"], [dp_shard_size, sp_size]
    if dp_replicate_size > 1:
        names, shape = ["dp_replicate", *names], [dp_replicate_size, *shape]
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    mesh[tuple(n for n in names if n.startswith("dp"))]._flatten("dp")
    mesh[("dp_shard", "sp")]._flatten("dp_shard_cp")
    return mesh


def get_sequence_parallel_group(source: Any = None, *, device_type: str | None = None) -> dist.ProcessGroup:
    """The SP process group from whatever the user's setup has.

    Args:
        source: ``None`` (the default group: every rank is one SP group), a ``ProcessGroup`` (returned as is), a
            ``DeviceMesh`` (1-D: its group; n-D: its ``"sp"`` dim), or an accelerate ``ParallelismConfig`` with
            ``sp_size > 1``: its ``device_mesh`` when that has an ``"sp"`` dim, otherwise the mesh of
            :func:`sequence_parallel_mesh` built from its sizes and stored as its ``device_mesh`` (accelerate
            then reuses it).
        device_type: device type for a mesh built here (default: cuda when available, else cpu).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sequence parallelism needs torch.distributed initialised (torchrun / accelerate launch)")
    if source is None:
        return dist.group.WORLD
    if isinstance(source, dist.ProcessGroup):
        return source
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(source, DeviceMesh):
        if source.ndim == 1:
            return source.get_group()
        if "sp" not in (source.mesh_dim_names or ()):
            raise ValueError(f"device mesh has no 'sp' dimension (dims: {source.mesh_dim_names})")
        return source.get_group("sp")
    if hasattr(source, "sp_size") and hasattr(source, "dp_replicate_size"):  # accelerate ParallelismConfig
        if source.sp_size <= 1:
            raise ValueError("ParallelismConfig.sp_size is 1: there is no sequence-parallel group")
        mesh = getattr(source, "device_mesh", None)
        if mesh is None or "sp" not in (mesh.mesh_dim_names or ()):
            mesh = sequence_parallel_mesh(
                source.sp_size, dp_replicate_size=source.dp_replicate_size, device_type=device_type
            )
            source.device_mesh = mesh
        return mesh.get_group("sp")
    raise TypeError(
        f"cannot get a sequence-parallel group from {type(source).__name__}; pass a ProcessGroup, a DeviceMesh, "
        "an accelerate ParallelismConfig or None"
    )


# ----------------------------------------------------------------------------------------------------------------------
# Differentiable collectives
# ----------------------------------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = _group_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(f"dim {scatter_dim} of size {x.shape[scatter_dim]} is not divisible by the group size {world}")
    # send[j] goes to rank j; recv[j] came from rank j, whose chunk is the j-th along gather_dim.
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """All-to-all that splits ``scatter_dim`` across ranks and concatenates along ``gather_dim``.

    Its adjoint is the same all-to-all with the two dims swapped.
    """

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: ``x`` split in ``P`` chunks along ``scatter_dim`` (chunk ``j`` to rank ``j``),
    the received chunks concatenated in rank order along ``gather_dim``."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world = _group_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank holds the same gathered tensor and (by contract) computes the same loss from it, so the
        # gradient of this rank's shard is its slice of the gathered gradient; no communication needed.
        world = _group_size(ctx.group)
        return grad.chunk(world, dim=ctx.dim)[_group_rank(ctx.group)].contiguous(), None, None


def gather_outputs(tensor: torch.Tensor, group: Any = None, dim: int = 1) -> torch.Tensor:
    """Concatenate the sequence shards of ``tensor`` from every rank of ``group`` along ``dim`` (autograd-aware).

    Every shard must have the same shape (:func:`shard_inputs` pads to make it so; slice the padding off
    afterwards). Backward gives each rank the slice of the gradient that belongs to its shard, which is exact when
    every rank computes the same loss from the gathered tensor (the usual case: it is identical on all ranks).
    """
    return _GatherAlongDim.apply(tensor, get_sequence_parallel_group(group), dim)


# ----------------------------------------------------------------------------------------------------------------------
# Input sharding
# ----------------------------------------------------------------------------------------------------------------------


def _shard(t: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].contiguous()


def _pad_seq(t: torch.Tensor, pad: int, value: float | int) -> torch.Tensor:
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[1] = pad
    return torch.cat([t, t.new_full(shape, value)], dim=1)


def shard_inputs(
    batch: dict[str, Any],
    group: Any = None,
    *,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """This rank's slice of a model batch, for a model under :func:`enable_sequence_parallel`.

    Every rank of the group must pass the same full batch. What is computed on the full sequence first:

    - ``position_ids`` (``arange(S)`` per row if absent, as the model itself would), so RoPE gets global positions
      and packed sequences (positions restarting) keep their boundaries;
    - ``shift_labels`` from ``labels`` (the target of token ``t`` is ``labels[t+1]``), so the target of a shard's
      last token, which lives on the next rank, is not lost; ``labels`` is kept so the model computes a loss;
    - ``num_items_in_batch`` (number of targets != -100) when labels are given and it is absent, so each rank's
      loss is its share: the sum of the per-rank losses is the single-process mean loss.

    Then the sequence is padded at the end to a multiple of the group size (``input_ids`` with ``pad_token_id``,
    labels with -100, ``attention_mask`` with 1 -- the padding is at the end, so causality already hides it from
    real tokens and an all-ones mask stays all-ones --, ``position_ids`` counting on, other per-token tensors with
    0, ``routed_experts`` -- a routing-replay record, `hf_gptoss_rl.routing` -- with its no-record value) and every
    tensor whose first two dims are ``(B, S)`` is split along dim 1. Other entries pass unchanged.
    """
    group = get_sequence_parallel_group(group)
    world, rank = _group_size(group), _group_rank(group)
    if "input_ids" in batch and batch["input_ids"] is not None:
        ref = batch["input_ids"]
    elif batch.get("inputs_embeds") is not None:
        ref = batch["inputs_embeds"]
    else:
        raise ValueError("shard_inputs needs `input_ids` or `inputs_embeds` in the batch")
    bsz, seq_len = ref.shape[:2]
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"shard_inputs takes a 2D padding attention_mask [B, S]; got shape {tuple(attention_mask.shape)}"
        )
    out = dict(batch)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq_len, device=ref.device).unsqueeze(0).expand(bsz, -1)
    elif out["position_ids"].shape[0] != bsz:
        out["position_ids"] = out["position_ids"].expand(bsz, -1)
    if out.get("labels") is not None and out.get("shift_labels") is None:
        labels = out["labels"]
        out["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((bsz, 1), IGNORE_INDEX)], dim=1)
        if out.get("num_items_in_batch") is None:
            out["num_items_in_batch"] = (out["shift_labels"] != IGNORE_INDEX).sum()

    pad = (-seq_len) % world
    for key, value in out.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != (bsz, seq_len):
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, pad + 1, device=value.device)
            value = torch.cat([value, tail.to(value.dtype)], dim=1) if pad else value
        else:
            if key == "input_ids":
                fill = pad_token_id
            elif key == "routed_experts":  # routing replay: the padding has no record and routes natively
                from .routing import no_route

                fill = no_route(value.dtype)
            else:
                fill = _PAD_VALUES.get(key, 0)
            value = _pad_seq(value, pad, fill)
        out[key] = _shard(value, world, rank)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The attention wrapper
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class _SPState:
    """Per-model SP state, shared by the model's attention modules."""

    group: dist.ProcessGroup
    inner: str
    # One forward's full-sequence inputs and masks, keyed by the identity of the sharded tensors the model hands to
    # every layer: the collectives and the mask construction run once per forward, not once per layer (and the
    # gradient-checkpointing recompute, which sees the same tensors, reuses them).
    _source: tuple = ()
    _full: dict = field(default_factory=dict)
    _masks: dict = field(default_factory=dict)
    _varlen: dict | None = None

    def __deepcopy__(self, memo):
        # A deep-copied model (e.g. TRL's reference model) shares the group (process groups cannot be copied); the
        # cache depends only on the inputs, so sharing it is harmless.
        return self

    def full_inputs(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, bsz: int) -> dict:
        source = (position_ids, attention_mask)
        if len(self._source) != 2 or any(a is not b for a, b in zip(self._source, source)):
            full_pos = _all_gather(position_ids.expand(bsz, -1).contiguous(), self.group, dim=1)
            full_mask = None
            if attention_mask is not None:
                full_mask = _all_gather(attention_mask.to(torch.int32), self.group, dim=1).bool()
                if full_mask.all():  # as transformers' flash path: an all-ones mask is no mask (packing detectable)
                    full_mask = None
            self._source, self._full, self._masks = source, {"position_ids": full_pos, "attention_mask": full_mask}, {}
            self._varlen = None
        return self._full

    def flash_varlen_kwargs(self) -> dict:
        """transformers' varlen ``FlashAttentionKwargs`` of the full row (one sequence or packed ones), computed
        once per forward: without them transformers' flash path reads ``position_ids`` back from the GPU in every
        layer (``modeling_flash_attention_utils._is_packed_sequence``). Empty for several rows or a padding mask,
        which take the dense / unpadding paths."""
        if self._varlen is None:
            full, self._varlen = self._full, {}
            if full["attention_mask"] is None and full["position_ids"].shape[0] == 1:
                self._varlen = flash_varlen_kwargs(full["position_ids"])
        return self._varlen

    def full_mask(self, config, sliding_window: int | None, like: torch.Tensor):
        """The mask transformers builds for the inner implementation on the full sequence (cached per forward)."""
        bsz, seq_len = self._full["position_ids"].shape
        key = (sliding_window, like.dtype, like.device, bsz, seq_len)
        if key not in self._masks:
            make_mask = create_sliding_window_causal_mask if sliding_window is not None else create_causal_mask
            self._masks[key] = make_mask(
                config=_InnerConfig(config, self.inner),
                inputs_embeds=like.new_empty((bsz, seq_len, 0)),
                attention_mask=self._full["attention_mask"],
                position_ids=self._full["position_ids"],
                **{cache_keyword(make_mask): None},
            )
        return self._masks[key]


_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _InnerConfig:
    """The model config as the inner attention implementation sees it."""

    def __init__(self, config, attn_implementation: str):
        self.__dict__["_config"] = config
        self.__dict__["_attn_implementation"] = attn_implementation

    def __getattr__(self, name):
        return getattr(self.__dict__["_config"], name)


class _RankLocalModule:
    """What the inner attention receives as ``module``: the real attention module, with this rank's sinks slice,
    the rank-local GQA grouping and a config naming the inner implementation."""

    def __init__(self, module: nn.Module, sinks: torch.Tensor | None, num_key_value_groups: int, inner: str):
        self.__dict__.update(
            _module=module,
            sinks=sinks,
            num_key_value_groups=num_key_value_groups,
            config=_InnerConfig(module.config, inner),
        )

    def __getattr__(self, name):
        return getattr(self.__dict__["_module"], name)


def _inner_attention_function(module: nn.Module, inner: str) -> Callable:
    if inner == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__}'s modeling file has no eager_attention_forward")
        return fn
    if inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"inner attention {inner!r} is not registered in transformers' AttentionInterface")
    return ALL_ATTENTION_FUNCTIONS[inner]


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Ulysses attention: ``[B, H, S/P, D]`` projections in, ``[B, S/P, H, D]`` attention output out.

    Registered as ``attn_implementation="ulysses_sp"``; :func:`enable_sequence_parallel` sets it and stores the group
    and the inner implementation on the attention modules.
    """
    state: _SPState | None = getattr(module, "_sequence_parallel", None)
    if state is None:
        raise RuntimeError(
            f"attn_implementation={ULYSSES_ATTENTION!r} is set but sequence parallelism was not enabled on this "
            "model: call hf_gptoss_rl.enable_sequence_parallel(model, group)"
        )
    group, inner = state.group, state.inner
    world, rank = _group_size(group), _group_rank(group)
    bsz, num_heads, local_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_heads % world:
        raise ValueError(f"{num_heads} query heads cannot be split over {world} sequence-parallel ranks")
    if position_ids is None:
        raise ValueError("sequence-parallel attention needs the sharded position_ids (use shard_inputs)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "sequence-parallel attention takes a 2D padding mask; a prepared 4D mask cannot be re-sharded "
            f"(got shape {tuple(attention_mask.shape)})"
        )
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        raise ValueError("sequence-parallel attention does not support a KV cache")

    # GQA: repeat KV heads until their count divides by P; then every rank's query heads find their KV heads
    # among the ones it receives (head h reads repeated KV head h // (H / num_kv_heads_repeated)).
    kv_repeat = world // math.gcd(num_kv_heads, world)
    if kv_repeat > 1:
        key = key.repeat_interleave(kv_repeat, dim=1)
        value = value.repeat_interleave(kv_repeat, dim=1)
    local_groups = num_heads // (num_kv_heads * kv_repeat)

    # Sequence-sharded -> head-sharded.
    query = all_to_all(query, group, scatter_dim=1, gather_dim=2)
    key = all_to_all(key, group, scatter_dim=1, gather_dim=2)
    value = all_to_all(value, group, scatter_dim=1, gather_dim=2)
    full_len = query.shape[2]

    heads_per_rank = num_heads // world
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    local_sinks = sinks[rank * heads_per_rank : (rank + 1) * heads_per_rank] if sinks is not None else None

    # The mask transformers would build for the inner implementation on the full sequence.
    full = state.full_inputs(position_ids, attention_mask, bsz)
    if full["position_ids"].shape[1] != full_len:
        raise ValueError(f"gathered position_ids cover {full['position_ids'].shape[1]} tokens, attention {full_len}")
    full_mask = state.full_mask(module.config, sliding_window, query)

    local_module = _RankLocalModule(module, local_sinks, local_groups, inner)
    inner_fn = _inner_attention_function(module, inner)
    if getattr(inner_fn, "func", inner_fn) is flash_attention_forward and not any(k in kwargs for k in _VARLEN_KWARGS):
        kwargs = {**kwargs, **state.flash_varlen_kwargs()}
    out, _ = inner_fn(
        local_module,
        query,
        key,
        value,
        full_mask,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        s_aux=local_sinks,
        position_ids=full["position_ids"],
        **kwargs,
    )
    # out: [B, S, H/P, D] (every transformers attention returns the heads after the sequence) -> [B, S/P, H, D].
    out = all_to_all(out, group, scatter_dim=1, gather_dim=2)
    return out, None


def _sharded_padding_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask "creation" for ``ulysses_sp``: hand the shard's 2D padding mask through untouched.

    A mask built on the shard would be wrong, and without a registered mask function transformers drops the 2D
    mask altogether; the wrapper gathers this one and builds the full-sequence mask itself.
    """
    return attention_mask


# ----------------------------------------------------------------------------------------------------------------------
# Enabling on a model
# ----------------------------------------------------------------------------------------------------------------------


def _pretrained_model(model: nn.Module) -> PreTrainedModel:
    if isinstance(model, PreTrainedModel):
        return model
    for sub in model.modules():  # peft / DDP / FSDP wrappers
        if isinstance(sub, PreTrainedModel):
            return sub
    raise TypeError(f"no transformers PreTrainedModel found in {type(model).__name__}")


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim")]


def _check_sharded_call(module, args, kwargs):
    # forward(input_ids, attention_mask, position_ids, past_key_values, ...): position_ids may be positional.
    position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if position_ids is None:
        raise ValueError(
            "sequence parallelism is enabled: pass position_ids computed on the full sequence (use "
            "hf_gptoss_rl.shard_inputs(batch, group)); the model would otherwise number each shard from 0"
        )
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
        raise ValueError("sequence parallelism is enabled: a KV cache (use_cache / past_key_values) is not supported")
    kwargs["use_cache"] = False
    return args, kwargs


def is_sequence_parallel_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable_sequence_parallel` is active on ``model``."""
    return getattr(_pretrained_model(model), "_sequence_parallel", None) is not None


def enable_sequence_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    """Run ``model``'s attention as Ulysses sequence parallelism over ``group`` (idempotent; returns ``model``).

    The model's current ``attn_implementation`` (eager, a flash implementation, the project's
    ``hf-gptoss-rl/sink-flash-attn3`` kernel ...) becomes the inner attention; ``attn_implementation`` becomes
    ``"ulysses_sp"``. ``group`` is anything :func:`get_sequence_parallel_group` takes (``None``: all ranks).
    Calling it again with another group switches the group. Afterwards feed the model :func:`shard_inputs`
    batches; a forward without ``position_ids`` or with a KV cache raises.
    """
    group = get_sequence_parallel_group(group)
    base = _pretrained_model(model)
    heads = base.config.num_attention_heads
    if heads % _group_size(group):
        raise ValueError(f"{heads} attention heads cannot be split over {_group_size(group)} ranks")
    state: _SPState | None = getattr(base, "_sequence_parallel", None)
    if state is not None:
        state.group = group
        return model
    inner = base.config._attn_implementation or "eager"
    if inner == ULYSSES_ATTENTION:
        raise ValueError(
            f"the model already uses {ULYSSES_ATTENTION!r} without SP state; load it with its real attention"
        )
    state = _SPState(group=group, inner=inner)
    attention_modules = _attention_modules(base)
    if not attention_modules:
        raise TypeError(f"{type(base).__name__} has no attention module to parallelise")
    for module in attention_modules:
        module._sequence_parallel = state
    for sub in base.modules():
        if isinstance(sub, PreTrainedModel):
            sub.register_forward_pre_hook(_check_sharded_call, with_kwargs=True)
    base._sequence_parallel = state
    base.set_attn_implementation(ULYSSES_ATTENTION)
    return model


def disable_sequence_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_sequence_parallel`: restore the inner attention implementation (no-op if not enabled)."""
    base = _pretrained_model(model)
    state: _SPState | None = getattr(base, "_sequence_parallel", None)
    if state is None:
        return model
    for sub in base.modules():
        # Found by identity rather than through stored handles, so this also works on a deep copy of the model.
        for key in [k for k, hook in sub._forward_pre_hooks.items() if hook is _check_sharded_call]:
            del sub._forward_pre_hooks[key]
            sub._forward_pre_hooks_with_kwargs.pop(key, None)
    for module in _attention_modules(base):
        module.__dict__.pop("_sequence_parallel", None)
    del base._sequence_parallel
    base.set_attn_implementation(state.inner)
    return model


@contextmanager
def sequence_parallel_disabled(model: nn.Module):
    """Run ``model`` as a plain single-process model inside the block (e.g. ``model.generate`` for an embedded
    rollout), then re-enable SP on the same group. No weights are touched; a no-op if SP is not enabled."""
    state: _SPState | None = getattr(_pretrained_model(model), "_sequence_parallel", None)
    if state is None:
        yield model
        return
    disable_sequence_parallel(model)
    try:
        yield model
    finally:
        enable_sequence_parallel(model, state.group)


# ----------------------------------------------------------------------------------------------------------------------
# Log-probs for RL trainers
# ----------------------------------------------------------------------------------------------------------------------


def _is_wrapped_for_data_parallel(model: nn.Module) -> bool:
    """DDP / FSDP1 wrappers, or FSDP2 ``fully_shard`` modules anywhere in the model."""
    wrappers = ("DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule")
    return any(cls.__name__ in wrappers for module in model.modules() for cls in type(module).__mro__)


def _logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int):
    """log_softmax(logits / T)[target] and the entropy per token, float32, ``chunk_size`` tokens at a time."""
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    logps, entropy = [], []
    for start in range(0, flat_logits.shape[0], chunk_size):
        z = flat_logits[start : start + chunk_size].float() / temperature
        lse = torch.logsumexp(z, dim=-1)
        logps.append(z.gather(-1, flat_targets[start : start + chunk_size, None]).squeeze(-1) - lse)
        entropy.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
    return torch.cat(logps).view(targets.shape), torch.cat(entropy).view(targets.shape)


def sequence_parallel_logprobs(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    group: Any = None,
    temperature: float = 1.0,
    logits_to_keep: int | None = None,
    *,
    return_entropy: bool = False,
    chunk_size: int = 512,
    through_model_forward: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of full sequences, computed sequence-parallel and gathered on every rank.

    Contract (what a GRPO trainer calls in place of its per-token log-prob pass):

    - ``model``: a causal LM (``GptOssForCausalLM``, or a peft model around one) with
      :func:`enable_sequence_parallel` active on ``group``. Every rank of the group passes the same FULL batch;
    - ``batch``: ``input_ids [B, S]``, optional ``attention_mask [B, S]`` (padding, left or right), optional
      ``position_ids`` (default ``arange(S)``; restarting positions mark packed sequences in a row);
    - returns float32 ``logps [B, S-1]``, ``logps[:, t] = log_softmax(logits[:, t] / temperature)[input_ids[:,
      t+1]]``, identical on every rank; with ``logits_to_keep=k`` the last ``k`` only, ``[B, k]`` (TRL's
      convention: ``logps[:, j]`` scores ``input_ids[:, S-k+j]``); with ``return_entropy=True`` a pair
      ``(logps, entropy)`` of the same shape. Positions whose target is padding hold a value; mask them as usual;
    - by default the backbone (``model.base_model``) runs on this rank's shard and the LM head is applied
      ``chunk_size`` tokens at a time (``hf_gptoss_rl.logprobs.chunked_logprobs``): no ``[S/P, vocab]`` logits are
      ever materialised. That reads the head weight outside the model's own forward, which a DDP wrapper (gradient
      hooks armed by its forward) or FSDP2 (the root's parameters are sharded outside its forward) does not allow:
      there ``through_model_forward=True`` calls ``model(**shard)`` and reduces its ``[B, S/P, vocab]`` logits
      ``chunk_size`` tokens at a time. The default (``None``) picks it when ``model`` is DDP/FSDP-wrapped or holds
      FSDP2 (``fully_shard``) modules;
    - differentiable: backprop a loss computed from the result (identically on every rank, which is automatic
      since the result is identical) and each rank's parameter gradients are its share; their SUM over the group
      is the single-process gradient. DDP / FSDP2 average gradients over all ranks, so there multiply the loss
      by the SP group size (the dp ranks' average is then the usual data-parallel mean).
    """
    from .logprobs import chunked_logprobs

    group = get_sequence_parallel_group(group)
    input_ids = batch["input_ids"]
    bsz, seq_len = input_ids.shape
    if seq_len < 2:
        raise ValueError("sequence_parallel_logprobs needs at least 2 tokens per row")
    if logits_to_keep is not None and not 0 < logits_to_keep < seq_len:
        raise ValueError(f"logits_to_keep must be in [1, {seq_len - 1}], got {logits_to_keep}")
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    lm = _pretrained_model(lm)
    targets = torch.cat([input_ids[:, 1:], input_ids.new_zeros((bsz, 1))], dim=1)
    model_batch = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if batch.get(k) is not None}
    model_batch["targets"] = targets
    shard = shard_inputs(model_batch, group)
    local_targets = shard.pop("targets")
    if through_model_forward is None:
        through_model_forward = _is_wrapped_for_data_parallel(model)
    if through_model_forward:
        logits = model(**shard).logits
        local_logps, local_entropy = _logprobs_from_logits(logits, local_targets, temperature, chunk_size)
    else:
        hidden = lm.base_model(**shard).last_hidden_state
        head = lm.get_output_embeddings()
        local_logps, local_entropy = chunked_logprobs(
            hidden, head.weight, local_targets, bias=head.bias, temperature=temperature, chunk_size=chunk_size
        )
    keep = slice(seq_len - 1 - logits_to_keep, seq_len - 1) if logits_to_keep is not None else slice(0, seq_len - 1)
    logps = gather_outputs(local_logps, group, dim=1)[:, keep]
    if not return_entropy:
        return logps
    return logps, gather_outputs(local_entropy, group, dim=1)[:, keep]
