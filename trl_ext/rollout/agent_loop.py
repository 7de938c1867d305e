"""The harmony agent loop: token-in/token-out multi-turn rollouts with tool calls.

One trajectory::

    context = prompt_ids                                   # ends with <|start|>assistant
    repeat:
        out = engine.generate(context, max_new_tokens=min(per-turn cap, budget left))
        completion += out.output_ids   (mask 1, rollout log-probs)      # appended UNCHANGED
        parse the turn (hf_gptoss_rl.harmony.parse_assistant_turn)
        <|return|> with a final message  -> finish "final"
        <|call|> to=functions.NAME       -> run the tool (timeout), then
        completion += render_tool_result(NAME, result)  (mask 0, log-prob 0)   # ends <|start|>assistant
        anything else                    -> see below
    stop at max_turns, at the token budget ("length"), or on an engine abort.

Decisions (documented in docs/rollouts.md):

- History is never re-tokenized: ``prompt_ids + completion_ids`` is exactly what the engine saw, so the
  trainer scores the very tokens the policy sampled, with the rollout log-probs aligned to them.
- Malformed calls never end a trajectory: bad JSON, a non-object, an unknown tool, arguments that fail the
  tool's schema, a `ToolError`, a tool exception or a timeout all come back to the model as
  ``Error: ...`` tool results (raw text, truncated to ``max_tool_output_chars``), and are recorded in
  ``tool_calls[i].error`` (only there: ``errors`` holds the trajectory-level problems — unparseable turns,
  missing final answers, engine failures). A ``<|call|>`` without a recipient is answered from
  ``functions.unknown``, and so is a ``<|call|>`` whose message could not be parsed.
- A turn that ends with ``<|end|>`` (only when ``<|end|>`` is made a stop token) gets ``<|start|>assistant``
  appended (mask 0) and sampling continues; a turn that stops on ``<|return|>`` without a final-channel
  message, or on another stop id, ends the trajectory with ``"no_final"``.
- Token budget: ``max_completion_tokens`` bounds ``len(completion_ids)``; each turn samples at most what is
  left. A tool result that would leave no room for one more sampled token ends the trajectory with
  ``"length"`` (the tool ran and is recorded; its tokens are not appended).
- When ``max_turns`` turns have been sampled and the last one is a call, the call is recorded with the error
  ``"max_turns reached: not executed"`` and not run (the model could not read the result anyway).
- An engine failure (e.g. SGLang unreachable after its retries) ends that trajectory with ``"abort"`` and the
  error text in ``errors``; the other trajectories of the batch go on.
- ``turn_format="plain"`` (models that do not speak harmony): one generate call per trajectory, no tools; a stop
  token ends it with ``"final"`` (the caller decodes the text), the budget with ``"length"``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import torch

from hf_gptoss_rl.harmony import CALL, END, RETURN, START, encode_text, parse_assistant_turn, render_tool_result
from hf_gptoss_rl.routing import RoutingError

from .._async import run_sync
from ..tools import Tool, ToolError
from .engine import RolloutEngine
from .settings import MAX_CONCURRENCY, MAX_TOOL_OUTPUT_CHARS, MAX_TURNS, TOOL_TIMEOUT_S
from .types import GenerationOutput, SamplingParams, ToolCallRecord, Trajectory, rollout_seed

logger = logging.getLogger(__name__)


class AgentLoop:
    """Runs harmony tool-calling trajectories against a `RolloutEngine`.

    Args:
        engine: any `RolloutEngine` (embedded, SGLang HTTP, SGLang in-process).
        tools: the tools the model may call (``functions.NAME``); names must be unique.
        sampling: sampling parameters of every turn; ``max_new_tokens`` is the per-turn cap.
        max_turns: most assistant turns (generate calls) per trajectory.
        max_completion_tokens: budget of ``completion_ids`` (sampled + injected tokens).
        max_tool_output_chars: tool results longer than this are cut (with a note saying how much was cut).
        tool_timeout_s: wall-clock limit of one tool call (on top of the tool's own limits).
        max_concurrency: most trajectories running at once in `run_batch`.
        turn_format: ``"harmony"`` (GPT-OSS: multi-turn, tool calls) or ``"plain"`` (any causal LM: one turn, no
            tools; the stop tokens are ``sampling.stop_token_ids``).
        progress: show a progress bar (tqdm) of the finished trajectories while `run_batch` runs, with the mean
            turns and tool calls so far.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tools: list[Tool] | None = None,
        *,
        sampling: SamplingParams,
        max_turns: int = MAX_TURNS,
        max_completion_tokens: int = 2048,
        max_tool_output_chars: int = MAX_TOOL_OUTPUT_CHARS,
        tool_timeout_s: float = TOOL_TIMEOUT_S,
        max_concurrency: int = MAX_CONCURRENCY,
        turn_format: str = "harmony",
        progress: bool = False,
    ) -> None:
        if max_turns < 1 or max_completion_tokens < 1 or max_concurrency < 1:
            raise ValueError("max_turns, max_completion_tokens and max_concurrency must be >= 1")
        if turn_format not in ("harmony", "plain"):
            raise ValueError(f"turn_format must be 'harmony' or 'plain', got {turn_format!r}")
        if turn_format == "plain" and tools:
            raise ValueError("tool calls are parsed from harmony turns: turn_format='plain' takes no tools")
        self.turn_format = turn_format
        self.progress = bool(progress)
        self.engine = engine
        self.tools: dict[str, Tool] = {}
        for tool in tools or []:
            if tool.name in self.tools:
                raise ValueError(f"duplicate tool name {tool.name!r}")
            self.tools[tool.name] = tool
        self.sampling = sampling
        self.max_turns = int(max_turns)
        self.max_completion_tokens = int(max_completion_tokens)
        self.max_tool_output_chars = int(max_tool_output_chars)
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_concurrency = int(max_concurrency)
        self._assistant_start = [START, *encode_text("assistant")]

    # ------------------------------------------------------------------ public API

    async def run(self, prompt_ids: list[int], seed: int | None = None) -> Trajectory:
        """One trajectory from ``prompt_ids`` (rendered with ``render_prompt``: ends with ``<|start|>assistant``).

        ``seed``: turn t samples with ``sampling_seed = rollout_seed(seed, t)``, so the trajectory is a function of the
        seed, the prompt, the weights and the tools' outputs (None: the engine's own randomness)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        traj = Trajectory(prompt_ids=prompt)
        turn_ids: list[int] = []  # the assistant turn being sampled: its ids since the prompt or the last tool result
        while True:
            left = self.max_completion_tokens - len(traj.completion_ids)
            if left <= 0:
                traj.finish_reason = "length"
                break
            if traj.num_turns >= self.max_turns:
                traj.finish_reason = "max_turns"
                break
            sampling = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, left))
            if seed is not None:
                sampling = replace(sampling, sampling_seed=rollout_seed(seed, traj.num_turns))
            try:
                out = await self.engine.generate(traj.prompt_ids + traj.completion_ids, sampling)
            except RoutingError:  # a server set up without routing fails every request: stop, never train without it
                raise
            except Exception as exc:  # noqa: BLE001 - one failing request must not sink the batch
                logger.warning("rollout engine failed: %s: %s", type(exc).__name__, exc)
                traj.errors.append(f"engine error: {type(exc).__name__}: {exc}")
                traj.finish_reason = "abort"
                break
            self._append_sampled(traj, out)
            if self.turn_format == "plain":
                traj.finish_reason = {"stop": "final", "length": "length", "abort": "abort"}[out.finish_reason]
                break
            if out.output_ids:  # the turn's chat message; after an <|end|> stop sampling continues the same message
                if not turn_ids:
                    traj.messages.append({})
                turn_ids.extend(out.output_ids)
                traj.messages[-1] = parse_assistant_turn(turn_ids).to_message()
            if out.finish_reason == "abort":
                traj.finish_reason = "abort"
                break
            if out.finish_reason == "length" or not out.output_ids:
                traj.finish_reason = "length"
                break
            turn = parse_assistant_turn(out.output_ids)
            last = out.output_ids[-1]
            if turn.error:
                traj.errors.append(f"turn {traj.num_turns}: {turn.error}")
            if last == CALL:  # a tool call, well formed or not: the model always gets an answer
                call = turn.tool_call if turn.stop == "call" else None
                if not await self._handle_call(traj, call, turn.error):
                    break
                turn_ids = []
                continue
            if turn.stop == "return" and last == RETURN:
                if turn.final is not None:
                    traj.final_text = turn.final
                    traj.finish_reason = "final"
                else:
                    traj.finish_reason = "no_final"
                    traj.errors.append(f"turn {traj.num_turns}: <|return|> without a final-channel message")
                break
            if turn.stop == "end" and last == END:
                # a non-final message ended the turn: open the next assistant message and keep sampling
                if not self._append_injected(traj, self._assistant_start):
                    break
                turn_ids.extend(self._assistant_start)
                continue
            traj.finish_reason = "no_final"
            traj.errors.append(f"turn {traj.num_turns}: stopped on token {last} without a final answer or a call")
            break
        traj.check_alignment()
        return traj

    async def run_batch(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[Trajectory]:
        """Run trajectories concurrently (at most ``max_concurrency`` at once); order preserved. ``seeds``: one per
        prompt (see `run`)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"run_batch: {len(seeds)} seeds for {len(prompts)} prompts")
        semaphore = asyncio.Semaphore(self.max_concurrency)
        bar = self._progress_bar(len(prompts)) if self.progress else None
        totals = {"turns": 0, "tool_calls": 0, "done": 0}

        async def one(prompt: list[int], seed: int | None) -> Trajectory:
            async with semaphore:
                traj = await self.run(prompt, seed)
            if bar is not None:
                totals["done"] += 1
                totals["turns"] += traj.num_turns
                totals["tool_calls"] += traj.num_tool_calls
                bar.set_postfix(
                    turns=f"{totals['turns'] / totals['done']:.2f}",
                    tool_calls=f"{totals['tool_calls'] / totals['done']:.2f}",
                    refresh=False,
                )
                bar.update(1)
            return traj

        try:
            return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds or [None] * len(prompts)))))
        finally:
            if bar is not None:
                bar.refresh()  # the final counts, even when the batch finished within tqdm's refresh interval
                bar.close()

    @staticmethod
    def _progress_bar(total: int):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="rollouts", unit="traj", leave=False, dynamic_ncols=True)

    def run_batch_sync(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[Trajectory]:
        """`run_batch` from synchronous code (see `run_sync`)."""
        return run_sync(self.run_batch(prompts, seeds))

    # ------------------------------------------------------------------ helpers

    def _append_sampled(self, traj: Trajectory, out: GenerationOutput) -> None:
        if len(out.output_ids) != len(out.logprobs):
            raise AssertionError("engine returned misaligned output ids / log-probs")
        if out.routed_experts is not None:
            # this turn's record covers the context it read and its own tokens but the last; the tokens an earlier
            # turn read keep that turn's routing (the routing their successors were sampled with)
            expected = len(traj.prompt_ids) + len(traj.completion_ids) + len(out.output_ids) - 1
            if out.routed_experts.shape[0] != expected:
                raise AssertionError(
                    f"engine returned routing for {out.routed_experts.shape[0]} tokens, expected {expected}"
                )
            done = 0 if traj.routed_experts is None else traj.routed_experts.shape[0]
            new = out.routed_experts[done:]
            traj.routed_experts = new if traj.routed_experts is None else torch.cat([traj.routed_experts, new])
        traj.completion_ids.extend(int(t) for t in out.output_ids)
        traj.completion_mask.extend([1] * len(out.output_ids))
        traj.rollout_logprobs.extend(float(x) for x in out.logprobs)
        traj.num_turns += 1
        # the version the engine says served this turn (never the engine's own record of its last sync)
        traj.weight_versions.append(out.weight_version)
        traj.weight_version = traj.weight_versions[0]

    def _append_injected(self, traj: Trajectory, ids: list[int]) -> bool:
        """Append mask-0 tokens if at least one sampled token still fits after them; else finish "length"."""
        if len(traj.completion_ids) + len(ids) >= self.max_completion_tokens:
            traj.finish_reason = "length"
            return False
        traj.completion_ids.extend(ids)
        traj.completion_mask.extend([0] * len(ids))
        traj.rollout_logprobs.extend([0.0] * len(ids))
        return True

    async def _handle_call(self, traj: Trajectory, call, parse_error: str | None = None) -> bool:
        """Run one tool call; append its rendered result and its tool message. False when the trajectory ends."""
        if call is None:
            reason = parse_error or "<|call|> without a recipient (to=functions.NAME)"
            record = ToolCallRecord(name="", arguments="", error=f"malformed tool call: {reason}")
            author = "unknown"
        else:
            record = ToolCallRecord(name=call.name, arguments=call.arguments)
            author = call.recipient if "." in call.recipient else call.name
        traj.tool_calls.append(record)
        if traj.num_turns >= self.max_turns:
            record.error = "max_turns reached: not executed"
            traj.finish_reason = "max_turns"
            return False
        if call is not None:
            record.result, record.error = await self._run_tool(call)
        text = self._truncate(record.result if record.error is None else f"Error: {record.error}")
        if not self._append_injected(traj, render_tool_result(author, text)):
            return False
        traj.messages.append({"role": "tool", "name": call.name if call is not None else "unknown", "content": text})
        return True

    async def _run_tool(self, call) -> tuple[str | None, str | None]:
        """(result, None) or (None, error message for the model)."""
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return None, f"unknown tool {call.recipient!r}; available tools: {available}"
        try:
            arguments = call.parsed_arguments()
        except ValueError as exc:
            return None, str(exc)
        try:
            # the tool's own run time only: a sandboxed tool waiting for a free slot bounds that wait separately
            # (Tool.call_with_timeout); tools without the hook get the whole call bounded
            run = getattr(tool, "call_with_timeout", None)
            if run is not None:
                result = await run(arguments, self.tool_timeout_s)
            else:
                result = await asyncio.wait_for(tool(arguments), timeout=self.tool_timeout_s)
        except ToolError as exc:
            return None, str(exc)
        except (asyncio.TimeoutError, TimeoutError):
            return None, f"{call.name} timed out after {self.tool_timeout_s:g} s"
        except TypeError as exc:  # a callable that rejected its arguments
            return None, f"{call.name}: bad arguments: {exc}"
        except Exception as exc:  # noqa: BLE001 - a bug in the tool: tell the model, log it
            logger.exception("tool %s raised", call.name)
            return None, f"{call.name} failed: {type(exc).__name__}: {exc}"
        if not isinstance(result, str):
            return None, f"{call.name} returned {type(result).__name__}, expected str"
        return result, None

    def _truncate(self, text: str) -> str:
        limit = self.max_tool_output_chars
        if len(text) <= limit:
            return text
        return text[:limit] + f"\n...[truncated {len(text) - limit} characters]"
