"""The rollout-engine interface: token ids in, sampled ids + per-token log-probs out, weight sync, health."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from .types import GenerationOutput, SamplingParams


class RolloutEngine(ABC):
    """Async, token-in/token-out generation backend used by `AgentLoop` and the trainer.

    Implementations: `EmbeddedEngine` (transformers, in-process), `SGLangEngine` (SGLang's native HTTP API),
    `SGLangOfflineEngine` (``sglang.Engine`` in-process). All are safe to call concurrently from many
    coroutines; each call samples one continuation of ``input_ids``.
    """

    @abstractmethod
    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        """Sample a continuation of ``input_ids`` (stop token kept in ``output_ids``)."""

    async def generate_batch(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationOutput]:
        """Sample one continuation per prompt, concurrently; order preserved."""
        return list(await asyncio.gather(*(self.generate(p, sampling) for p in prompts)))

    @abstractmethod
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load new policy weights (parameter names as in the policy's ``state_dict``) and record ``version``."""

    @abstractmethod
    async def health(self) -> bool:
        """True when the engine can serve requests."""

    async def close(self) -> None:
        """Release resources (threads, HTTP connections). Idempotent."""

    def rng_state(self) -> dict | None:
        """State of the random generators this process owns for sampling (None: none; a server samples with the
        per-request ``sampling_seed``). The trainer saves it in every checkpoint and restores it on resume."""
        return None

    def load_rng_state(self, state: dict) -> None:
        """Restore what `rng_state` returned."""
        raise ValueError(f"{type(self).__name__} keeps no generator state, but a checkpoint holds one: {sorted(state)}")

    @property
    @abstractmethod
    def weight_version(self) -> int | str | None:
        """Version of the weights currently served (None before the first sync)."""

    async def __aenter__(self) -> RolloutEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def validate_input_ids(input_ids, vocab_size: int | None = None) -> list[int]:
    """Check a prompt is a non-empty list of in-range ints; return it as a plain list."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.tolist()
    ids = list(input_ids)
    if not ids:
        raise ValueError("input_ids is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError("input_ids must be a list of ints")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"input_ids out of range [0, {vocab_size}): min {min(ids)}, max {max(ids)}")
    return ids
