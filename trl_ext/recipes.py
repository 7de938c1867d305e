# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Building blocks of the math/tool-use recipes in `examples/`: datasets, TRL reward functions, a greedy tool-use
evaluation and a one-line-per-step progress printer.

* `load_math_dataset`: GSM8K, DAPO-Math-17k or AIME rows (a local `.jsonl` or a Hub dataset) as
  `{"prompt": [user message], "answer": str, "solution": str}`.
* Reward functions with TRL's signature (keyword arguments; the agentic trainer adds `final_text`,
  `num_tool_calls`, ...): `retool_reward_func`, `correctness_reward_func`, `boxed_format_reward_func`.
* `evaluate_tool_use`: greedy agent rollouts on a rollout engine, scored by math-verify, with the tool-call
  rate and the share of tool calls that ran without error.
* `StepSummaryCallback`: prints `step N | reward ... | tool_calls ... | ...` from the trainer's logs.
"""

from __future__ import annotations

from transformers import TrainerCallback

from trl_ext.rewards import extract_boxed, math_reward, retool_reward

__all__ = [
    "ANSWER_FORMAT",
    "StepSummaryCallback",
    "boxed_format_reward_func",
    "correctness_reward_func",
    "evaluate_tool_use",
    "load_math_dataset",
    "retool_reward_func",
    "to_math_row",
]

# the answer format instruction of ReTool's and DAPO-Math-17k's prompts
ANSWER_FORMAT = "\n\nThe answer format must be: \\boxed{'The final answer goes here.'}"


# %% Data -----------------------------------------------------------------------------------------------------------------
def _gsm8k_answer(text: str) -> str:
    return text.split("####")[-1].strip().replace(",", "")


def to_math_row(example: dict) -> dict:
    """One GSM8K / DAPO-Math-17k / AIME row as `{"prompt": [user message], "answer": str, "solution": str}`.

    `answer` is the final answer only (what the rewards compare against); `solution` keeps GSM8K's worked solution
    with its `<<expression=value>>` calculator annotations (the cold start's demonstrations use them; "" for other
    datasets). Raises `ValueError` naming the columns it found when it recognises none.
    """
    if "reward_model" in example:  # DAPO-Math-17k: chat prompt + reward_model.ground_truth (prompt has the format)
        question = example["prompt"][-1]["content"] if isinstance(example["prompt"], list) else example["prompt"]
        answer = str(example["reward_model"]["ground_truth"])
        return {"prompt": [{"role": "user", "content": question}], "answer": answer, "solution": ""}
    question = example.get("question") or example.get("problem") or example.get("Problem")
    answer = example.get("answer") if "answer" in example else example.get("Answer")
    if question is None or answer is None:
        raise ValueError(
            f"cannot find the question/answer columns in {sorted(example)}: expected question|problem|Problem and "
            "answer|Answer (GSM8K, AIME) or prompt + reward_model.ground_truth (DAPO-Math-17k)"
        )
    solution = answer if isinstance(answer, str) and "####" in answer else ""
    answer = _gsm8k_answer(answer) if solution else str(answer)
    return {"prompt": [{"role": "user", "content": question + ANSWER_FORMAT}], "answer": answer, "solution": solution}


def load_math_dataset(name: str, config: str | None = None, split: str = "train", limit: int | None = None):
    """A math dataset in the recipe's row format (`to_math_row`).

    `name` is a `.jsonl`/`.json` file (its rows; `split` must then be "train", the only split of a file) or a Hub
    dataset id, loaded with `datasets.load_dataset(name, config, split=split)`. `limit` keeps the first rows.
    """
    from datasets import load_dataset

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if name.endswith((".jsonl", ".json")):
        if config is not None:
            raise ValueError(f"a dataset config ({config!r}) was given for the local file {name}, which has none")
        raw = load_dataset("json", data_files=name, split=split)
    else:
        raw = load_dataset(name, config, split=split)
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    return raw.map(to_math_row, remove_columns=raw.column_names)


# %% Rewards (TRL's reward-function signature) ------------------------------------------------------------------------------
def retool_reward_func(completions, final_text, num_tool_calls, answer, **kwargs) -> list[float]:
    """ReTool's reward on the final channel (`trl_ext.rewards.retool_reward`: 1 correct, -1 otherwise, with a bonus
    of 0.1 per tool call on a wrong answer, up to -0.6), from the trainer's `num_tool_calls` column."""
    return [retool_reward(f, a, n) for f, a, n in zip(final_text, answer, num_tool_calls)]


def correctness_reward_func(completions, final_text, answer, **kwargs) -> list[float]:
    """1 when the final channel's `\\boxed{}` answer is equivalent to the ground truth (math-verify), else 0."""
    return [math_reward(f, a) for f, a in zip(final_text, answer)]


def boxed_format_reward_func(completions, final_text, **kwargs) -> list[float]:
    """1 when the final answer has a `\\boxed{}`, else 0 (log it with weight 0, or use a small weight to shape)."""
    return [float(extract_boxed(f) is not None) for f in final_text]


# %% Evaluation ---------------------------------------------------------------------------------------------------------------
def evaluate_tool_use(engine, tools, rows, *, max_completion_length: int, max_turns: int,
                      reasoning_effort: str = "low") -> dict:  # fmt: skip
    """Greedy (temperature 0) agent rollouts of `rows` on `engine`, scored against each row's `answer`.

    Args:
        engine: a `trl_ext.rollout.RolloutEngine`, e.g. a trainer's `rollout_engine` (it follows the trained
            weights) or `EmbeddedEngine.from_policy(model)`.
        tools: the tools the model may call (rendered into the prompt and executed).
        rows: rows with `prompt` (chat messages) and `answer`.
        max_completion_length / max_turns: trajectory budget, as in `AgenticGRPOConfig`.

    Returns `accuracy` (math-verify on the final channel), `correct`, `n`, `tool_call_rate` (share of trajectories
    with at least one call), `tool_calls` (their number), `tool_call_success_rate` (share of calls that parsed and
    ran without error; None without calls) and `final_answer_rate` (share that ended with a final answer).
    """
    from hf_gptoss_rl.harmony import render_prompt
    from trl_ext.rollout import AgentLoop, SamplingParams

    rows = list(rows)
    if not rows:
        raise ValueError("evaluate_tool_use: no rows")
    loop = AgentLoop(
        engine,
        list(tools or []),
        sampling=SamplingParams(max_new_tokens=max_completion_length, temperature=0.0),
        max_turns=max_turns,
        max_completion_tokens=max_completion_length,
    )
    specs = [tool.spec() for tool in tools] if tools else None
    prompts = [render_prompt(r["prompt"], tools=specs, reasoning_effort=reasoning_effort) for r in rows]
    trajectories = loop.run_batch_sync(prompts)
    correct = [math_reward(t.final_text or "", r["answer"]) for t, r in zip(trajectories, rows)]
    calls = [call for t in trajectories for call in t.tool_calls]
    ok = sum(call.error is None for call in calls)
    return {
        "accuracy": sum(correct) / len(rows),
        "correct": int(sum(correct)),
        "n": len(rows),
        "tool_call_rate": sum(t.num_tool_calls > 0 for t in trajectories) / len(rows),
        "tool_calls": len(calls),
        "tool_call_success_rate": ok / len(calls) if calls else None,
        "final_answer_rate": sum(t.finish_reason == "final" for t in trajectories) / len(rows),
    }


# %% Progress -----------------------------------------------------------------------------------------------------------------
class StepSummaryCallback(TrainerCallback):
    """Prints one line per logged GRPO step from the trainer's logs (rewards, tool use, rollout/training mismatch),
    on the main process. Every metric is still logged in full through `report_to`; this is a console summary."""

    KEYS = (
        ("reward", "reward"),
        ("rollout/tool_calls_mean", "tool_calls"),
        ("rollout/tool_errors_per_call", "tool_err"),
        ("rollout/frac_final_answer", "final"),
        ("mismatch/k3_kl", "k3_kl"),
        ("clip_ratio/region_mean", "clip"),
        ("loss", "loss"),
    )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        parts = [f"step {state.global_step}"]
        parts += [f"{short} {logs[key]:.4g}" for key, short in self.KEYS if logs.get(key) is not None]
        print(" | ".join(parts), flush=True)
