"""Rewards for math answers: ``\\boxed{}`` extraction, math-verify equivalence, and ReTool's tool-use bonus.

Only the *final* channel is graded: callers pass ``AssistantTurn.final`` (``hf_gptoss_rl.harmony``), never the
analysis text, so an answer that appears only in the reasoning earns nothing.
"""

from __future__ import annotations

import threading

__all__ = ["extract_boxed", "math_reward", "retool_reward", "is_equivalent"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}`` / ``\\boxed 5``) in ``text``, with nested braces
    balanced; None when there is none or its braces never close."""
    if not text:
        return None
    best = None
    for command in _BOX_COMMANDS:
        start = text.rfind(command)
        while start != -1:
            candidate = _boxed_at(text, start + len(command))
            if candidate is not None:
                if best is None or start > best[0]:
                    best = (start, candidate)
                break
            start = text.rfind(command, 0, start)
    return best[1] if best else None


def _boxed_at(text: str, i: int) -> str | None:
    """Argument of a box command whose name ends at ``i``."""
    if i < len(text) and text[i].isalpha():  # "\\boxedx" is another command, not a box
        return None
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # "\boxed 5": the argument runs to the next whitespace or "$"
        if text[i - 1] != " ":
            return None
        j = i
        while j < len(text) and not text[j].isspace() and text[j] != "$":
            j += 1
        return text[i:j] or None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "\\" and j + 1 < len(text) and text[j + 1] in "{}":
            continue
        if c == "{" and (j == 0 or text[j - 1] != "\\"):
            depth += 1
        elif c == "}" and (j == 0 or text[j - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _timeouts() -> int | None:
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """math-verify equivalence of two answer strings (LaTeX or plain expressions): ``0.5`` == ``\\frac{1}{2}``."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = _timeouts()
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    try:
        gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=configs, parsing_timeout=timeout)
        if not gold:
            gold = parse(ground_truth, extraction_config=configs, parsing_timeout=timeout)
        pred = parse(f"\\boxed{{{answer}}}", extraction_config=configs, parsing_timeout=timeout)
        if not gold or not pred:
            return answer.strip() == ground_truth.strip()
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:
        return False


def math_reward(final_text: str | None, ground_truth: str) -> float:
    """1.0 if the last ``\\boxed{}`` of the final-channel text is math-verify-equivalent to ``ground_truth``, else
    0.0 (also when there is no final answer or no box)."""
    answer = extract_boxed(final_text)
    if answer is None:
        return 0.0
    return 1.0 if is_equivalent(answer, str(ground_truth)) else 0.0


def retool_reward(final_text: str | None, ground_truth: str, num_tool_calls: int, *, tool_bonus: bool = True) -> float:
    """ReTool's reward, as the ReTool recipe of verl-project/verl-recipe (``retool/``) scores it: +1 for a correct
    boxed answer, -1 otherwise; with ``tool_bonus`` a wrong answer earns 0.1 per tool call, up to -0.6.

    ``num_tool_calls`` is the number of tool calls the model made (`Trajectory.num_tool_calls`, the trainer's
    ``num_tool_calls`` column). verl scores from a message count instead, ``min(-0.6, -1 + (messages - 2) / 2 * 0.1)``
    with ``messages`` = the user prompt + the assistant turns + the tool results; a trajectory that answers after
    ``k`` tool round trips has ``1 + (k + 1) + k = 2 + 2k`` of them, which is the count used here. (A call the model
    makes on its last allowed turn, which the agent loop records but does not run, counts here; verl does not
    count a call it stops before running. Past 4 calls the cap makes them agree.)
    """
    if num_tool_calls < 0:
        raise ValueError(f"num_tool_calls must be >= 0, got {num_tool_calls}")
    score = 1.0 if math_reward(final_text, ground_truth) == 1.0 else -1.0
    if score < 0 and tool_bonus:
        messages = 2 + 2 * num_tool_calls  # verl's count: prompt, the answer, and a call + its result per round trip
        score = min(-0.6, score + (messages - 2) / 2 * 0.1)
    return score
