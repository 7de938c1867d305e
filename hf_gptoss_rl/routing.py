"""Rollout routing replay (R3, arXiv 2510.11370) for transformers' GPT-OSS: the trainer's MoE layers use the experts
the rollout engine chose.

GPT-OSS routes each token to the top-k of its router logits and weights those experts by a softmax over the k
logits (`GptOssTopKRouter.forward` in `transformers/models/gpt_oss/modeling_gpt_oss.py`). bf16 noise in the logits
is enough for the engine and the trainer to pick different experts for some tokens: a mismatch that no correction of
the log-probs removes. Replay keeps the engine's indices and recomputes the gates from the trainer's logits,

    scores = softmax(logits.gather(-1, recorded_indices))

so the router still gets a gradient (through the gates) and the load-balancing loss, which reads the logits, is
unchanged. transformers has no router interface, so a forward hook on each `GptOssTopKRouter` replaces its output;
the experts implementation (eager, `grouped_mm`, `memory_efficient`) receives the replayed indices and gates as it
would the native ones.

Layout: a routing array holds, per token, per MoE layer, the top-k expert ids: `[tokens, layers, top_k]`, stored as
uint8 for up to 255 experts and int16 above; `NO_ROUTE` (255, or -1 as int16) marks a token without a record
(padding, the last generated token, tool output no pass has read yet), which routes natively.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = [
    "RoutingError",
    "RoutingRecorder",
    "RoutingReplay",
    "check_routing",
    "no_route",
    "routing_dtype",
    "routing_shape",
]


class RoutingError(ValueError):
    """A routing record that cannot be replayed (wrong shape, ids out of range or repeated, a missing record)."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 up to 255 experts (255 is `no_route`), int16 above."""
    return torch.uint8 if num_experts <= 255 else torch.int16


def no_route(dtype: torch.dtype) -> int:
    """The value that marks a token without a record, for a routing array of `dtype`."""
    return 255 if dtype == torch.uint8 else -1


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (modules with `top_k`, `num_experts`, `weight` named `*.mlp.router`)."""
    return [m for name, m in model.named_modules() if name.endswith("mlp.router") and hasattr(m, "top_k")]


def routing_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(MoE layers, top_k, experts) of a GPT-OSS model; `RoutingError` for a model without routers."""
    routers = _routers(model)
    if not routers:
        raise RoutingError(f"{type(model).__name__} has no MoE routers (`*.mlp.router`): routing replay is for GPT-OSS")
    return len(routers), int(routers[0].top_k), int(routers[0].num_experts)


def check_routing(
    routing: torch.Tensor, *, num_layers: int, top_k: int, num_experts: int, tokens: int | None = None, source: str
) -> None:
    """Raise `RoutingError` unless `routing` is `[tokens, num_layers, top_k]` of distinct in-range ids per row.

    A real top-k never repeats an expert, so a row of zeros (what a runner that records nothing leaves) or a layer
    broadcast into another fails here, as does an id >= `num_experts`. `source` names where it came from.
    """
    expected = (tokens if tokens is not None else routing.shape[0], num_layers, top_k)
    if routing.dim() != 3 or tuple(routing.shape) != expected:
        raise RoutingError(f"{source}: routing of shape {tuple(routing.shape)}, expected {expected}")
    if routing.numel() == 0:
        return
    ids = routing.long()
    if int(ids.min()) < 0 or int(ids.max()) >= num_experts:
        raise RoutingError(
            f"{source}: expert ids in [{int(ids.min())}, {int(ids.max())}], outside [0, {num_experts}) experts"
        )
    ordered = ids.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    if bool(repeated.any()):
        n = int(repeated.sum())
        raise RoutingError(
            f"{source}: {n} of {repeated.numel()} (token, layer) records repeat an expert (e.g. all zeros): not a "
            "top-k. A runner that records nothing returns zeros"
        )


# ---------------------------------------------------------------------------------------------------- engine side


class RoutingRecorder:
    """Captures the top-k indices of every router of `model` during its forwards (for an inference engine).

    `with recorder.capture() as step:` around one forward; afterwards `step.routing()` is `[B * T, layers, top_k]`
    in the forward's token order (the routers see the batch flattened row by row).
    """

    def __init__(self, model: torch.nn.Module):
        self.num_layers, self.top_k, self.num_experts = routing_shape(model)
        self.dtype = routing_dtype(self.num_experts)
        self._active: _Capture | None = None
        self._routers = _routers(model)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            # a deep copy of the model carries the hook along: only this model's routers record
            if self._active is not None and module is self._routers[layer]:
                self._active.layers[layer] = output[2].to(self.dtype)

        return hook

    @contextlib.contextmanager
    def capture(self):
        step = _Capture(self.num_layers)
        self._active = step
        try:
            yield step
        finally:
            self._active = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class _Capture:
    num_layers: int
    layers: dict[int, torch.Tensor] = field(default_factory=dict)

    def routing(self) -> torch.Tensor:
        missing = [i for i in range(self.num_layers) if i not in self.layers]
        if missing:
            raise RoutingError(f"the forward ran no router of layers {missing}")
        return torch.stack([self.layers[i] for i in range(self.num_layers)], dim=1)


# ---------------------------------------------------------------------------------------------------- trainer side


@dataclass
class _Plan:
    indices: torch.Tensor  # [N, layers, top_k] int64, on the model's device
    has_record: torch.Tensor  # [N] bool
    replay: bool
    counted: set = field(default_factory=set)  # layers whose agreement was counted (a recompute counts nothing)


class RoutingReplay:
    """Forward hooks on a GPT-OSS model's routers that replay (or only compare with) recorded routing.

    `set_plan(routing)` with a `[B, T, layers, top_k]` array aligned with the next forward's `input_ids` (or
    `[N, layers, top_k]` for its flattened tokens). The plan stays in place until the next `set_plan` or `clear`, so
    that a gradient-checkpointing recompute in the backward replays the same indices. With `replay=False` the hooks
    only measure agreement. Tokens marked `no_route` route natively. Agreement per layer (top-k sets equal, over the
    tokens with a record) accumulates over forwards until `take_agreement`.
    """

    def __init__(self, model: torch.nn.Module):
        self.num_layers, self.top_k, self.num_experts = routing_shape(model)
        self._plan: _Plan | None = None
        self._agree = torch.zeros(self.num_layers, dtype=torch.float64)
        self._total = torch.zeros(self.num_layers, dtype=torch.float64)
        self._routers = _routers(model)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._plan = None

    def set_plan(self, routing: torch.Tensor, *, replay: bool, device=None) -> None:
        if routing.dim() == 4:
            routing = routing.reshape(-1, *routing.shape[2:])
        if routing.dim() != 3 or tuple(routing.shape[1:]) != (self.num_layers, self.top_k):
            raise RoutingError(
                f"routing of shape {tuple(routing.shape)}: expected [tokens, {self.num_layers}, {self.top_k}]"
            )
        has_record = (routing != no_route(routing.dtype)).all(dim=-1).all(dim=-1)
        indices = routing.long().clamp(min=0, max=self.num_experts - 1)
        self._plan = _Plan(indices.to(device), has_record.to(device), replay)

    def clear(self) -> None:
        self._plan = None

    def take_agreement(self) -> tuple[float, float] | None:
        """(agreement over all (token, layer) records, lowest layer's agreement) since the last call; None if no
        record was compared."""
        if not bool((self._total > 0).any()):
            return None
        total = float(self._agree.sum() / self._total.sum())
        per_layer = self._agree[self._total > 0] / self._total[self._total > 0]
        self._agree.zero_()
        self._total.zero_()
        return total, float(per_layer.min())

    def _hook(self, layer: int):
        def hook(module, args, output):
            plan = self._plan
            if plan is None or module is not self._routers[layer]:  # a deep copy of the model carries the hook
                return None
            logits, scores, native = output
            if logits.shape[0] != plan.indices.shape[0]:
                raise RoutingError(
                    f"routing replay: the router of layer {layer} sees {logits.shape[0]} tokens, the plan holds "
                    f"{plan.indices.shape[0]}: the routing is not aligned with this forward's tokens"
                )
            recorded = plan.indices[:, layer, :]
            same_set = (recorded.sort(dim=-1).values == native.sort(dim=-1).values).all(dim=-1)
            if layer not in plan.counted:
                plan.counted.add(layer)
                self._agree[layer] += float((same_set & plan.has_record).sum())
                self._total[layer] += float(plan.has_record.sum())
            if not plan.replay:
                return None
            # keep the native order where the sets agree: then the experts sum in the same order, bitwise
            keep_native = same_set | ~plan.has_record
            indices = torch.where(keep_native.unsqueeze(-1), native, recorded)
            values = logits.gather(1, indices)
            return logits, torch.softmax(values, dim=1, dtype=values.dtype), indices

        return hook
