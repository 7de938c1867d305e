"""Data types shared by the rollout engines, the agent loop and the trainer.

The default stop tokens come from `hf_gptoss_rl.harmony.STOP_TOKEN_IDS` (``<|return|>``, ``<|call|>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_gptoss_rl.harmony import STOP_TOKEN_IDS

FINISH_REASONS = ("stop", "length", "abort")
TRAJECTORY_FINISH_REASONS = ("final", "max_turns", "length", "abort", "no_final")


@dataclass
class SamplingParams:
    """Sampling parameters of one generation call (SGLang's names and conventions).

    ``top_k=-1`` and ``top_p=1.0`` disable those filters; ``temperature=0`` is greedy decoding. Log-probs are
    always those of ``softmax(logits / temperature)`` (``temperature=0`` → unscaled logits), never
    renormalised by top-p/top-k: that is SGLang's convention and the scaling TRL applies in the loss.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = tuple(STOP_TOKEN_IDS)

    def __post_init__(self) -> None:
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        self.max_new_tokens = int(self.max_new_tokens)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class GenerationOutput:
    """What an engine returns for one prompt.

    ``output_ids`` are the sampled ids, the stop token included; ``logprobs[i]`` is the log-prob of
    ``output_ids[i]`` (same length, always). ``finish_reason`` is ``"stop"`` (a stop token was sampled),
    ``"length"`` (``max_new_tokens`` reached) or ``"abort"`` (the engine aborted the request; the output may
    be partial or empty). ``weight_version`` is the engine's weight version that produced the tokens.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | str | None = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"GenerationOutput: {len(self.output_ids)} output ids but {len(self.logprobs)} log-probs"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


@dataclass
class ToolCallRecord:
    """One tool call of a trajectory: the raw argument string as sampled, and the result or the error."""

    name: str
    arguments: str
    result: str | None = None
    error: str | None = None


@dataclass
class Trajectory:
    """One agentic rollout, token-in/token-out.

    ``completion_ids`` is everything after ``prompt_ids``: sampled assistant tokens (``completion_mask`` 1,
    trained) interleaved with rendered tool messages and ``<|start|>assistant`` headers (mask 0).
    ``rollout_logprobs`` has one entry per completion token, 0.0 where the mask is 0. ``prompt_ids +
    completion_ids`` is exactly the context the engine saw on the last turn (nothing is re-tokenized).
    ``finish_reason``: ``"final"`` (final answer, ``<|return|>``), ``"max_turns"``, ``"length"`` (token
    budget), ``"abort"`` (engine abort), ``"no_final"`` (the model stopped without a final answer or a call).
    ``tool_calls[i].error`` holds each failed call's error (what the model was told); ``errors`` holds the
    trajectory-level problems (unparseable turns, no final answer, engine failures), never the tool errors again.
    ``weight_version`` is the version of the first (oldest) turn.
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    num_turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    finish_reason: str = "no_final"
    final_text: str | None = None
    weight_version: int | str | None = None

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    def check_alignment(self) -> None:
        """Raise if ids, mask and log-probs do not line up (a bug, never expected)."""
        n = len(self.completion_ids)
        if len(self.completion_mask) != n or len(self.rollout_logprobs) != n:
            raise AssertionError(
                f"trajectory misaligned: {n} ids, {len(self.completion_mask)} mask, "
                f"{len(self.rollout_logprobs)} log-probs"
            )
        for m, lp in zip(self.completion_mask, self.rollout_logprobs):
            if m not in (0, 1) or (m == 0 and lp != 0.0):
                raise AssertionError("trajectory misaligned: mask must be 0/1 and log-prob 0.0 where mask is 0")
