# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Building blocks of the math/tool-use recipes in `examples/`: datasets, TRL reward functions, a greedy tool-use
evaluation and a one-line-per-step progress printer.

* `load_math_dataset`: GSM8K, DAPO-Math-17k or AIME rows (a local `.jsonl` or a Hub dataset) as
  `{"prompt": [user message], "answer": str, "solution": str}`.
* Reward functions with TRL's signature (keyword arguments; the agentic trainer adds `final_text`,
  `num_tool_calls`, ...): `retool_reward_func`, `correctness_reward_func`, `boxed_format_reward_func`.
* `evaluate_tool_use`: agent rollouts on a rollout engine (greedy, or sampled as training does), scored by
  math-verify, with the tool-call rate and the share of tool calls that ran without error.
* `ToolUseAccuracyCallback`: `evaluate_tool_use` on the trainer's rollout engine every N optimizer steps, logged with
  that step's metrics.
* `StepSummaryCallback`: prints `step N | reward ... | tool_calls ... | ...` from the trainer's logs;
  `WallClockLimit` stops training after a number of seconds.
* `policy_from_model_config`: the policy, its LoRA config and its quantization config from TRL's `ModelConfig`
  (`--model_name_or_path`, `--dtype`, `--attn_implementation`, `--use_peft`, `--lora_*`, `--load_in_4bit`, ...), as
  TRL's example scripts pass them to the trainer; `DEMO_MODEL_DEFAULTS` are the CPU demos' values.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from transformers import TrainerCallback

from trl_ext.rewards import extract_boxed, math_reward, retool_reward

__all__ = [
    "ANSWER_FORMAT",
    "DEMO_MODEL_DEFAULTS",
    "StepSummaryCallback",
    "ToolUseAccuracyCallback",
    "WallClockLimit",
    "boxed_format_reward_func",
    "correctness_reward_func",
    "evaluate_tool_use",
    "load_math_dataset",
    "policy_from_model_config",
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


def demo_dataset_path(name: str = "gsm8k_train_mini.jsonl") -> str:
    """A GSM8K slice shipped in the repository's ``data/`` folder, found from this package's location, so that the
    examples and the notebook run from any working directory."""
    path = Path(__file__).resolve().parents[1] / "data" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the demo data ships in the repository's data/ folder (a source checkout, or "
            "`pip install -e .`); pass --dataset_name with a .jsonl file or a Hub dataset instead"
        )
    return str(path)


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


# %% Model -------------------------------------------------------------------------------------------------------------------
#: `trl.ModelConfig` values of the CPU demos (a `--config` file or a flag overrides them): the tiny GPT-OSS built
#: locally; a checkpoint loads in its own dtype (TRL's default would be float32); `--use_peft` adapts every linear layer.
DEMO_MODEL_DEFAULTS = {"model_name_or_path": "tiny", "dtype": "auto", "lora_target_modules": "all-linear"}


def policy_from_model_config(model_args, training_args):
    """`(model, peft_config, quantization_config)` from TRL's `ModelConfig`, for `AgenticGRPOTrainer(model, ...,
    peft_config=, quantization_config=)`.

    `--model_name_or_path tiny` builds a small GPT-OSS here (seeded with `training_args.seed`; `--dtype`,
    `--attn_implementation` applied; eager attention by default). Any other value is returned as the id/path for TRL
    to load, with `training_args.model_init_kwargs` set as TRL's scripts set them (`trl/scripts/grpo.py`: revision,
    attention and dtype from `ModelConfig`, the config's own `model_init_kwargs` winning); an MXFP4 checkpoint (the
    released gpt-oss) is dequantized, since RL trains bf16 weights. LoRA comes from TRL's `get_peft_config`, 4/8-bit
    loading from `get_quantization_config`; a flag that cannot work is an error naming the reason (bitsandbytes
    missing, quantizing the tiny model, a quantized model without `--use_peft`, 4-bit compute in `--dtype auto`).
    """
    from trl import get_peft_config, get_quantization_config

    name = model_args.model_name_or_path
    if not name:
        raise ValueError("--model_name_or_path is required: 'tiny' (built here) or a model id/path")
    tiny = name == "tiny"
    quantization_config = None
    if model_args.load_in_4bit or model_args.load_in_8bit:
        flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError(
                f"{flag} quantizes the base model with the bitsandbytes package, which is not installed "
                "(pip install bitsandbytes; it needs a GPU it supports)"
            )
        if tiny:
            raise ValueError(f"{flag} applies to a checkpoint (--model_name_or_path), not to the 'tiny' model")
        if not model_args.use_peft:
            raise ValueError(f"{flag} freezes the quantized base weights: add --use_peft to train a LoRA adapter")
        if model_args.load_in_4bit and model_args.dtype in (None, "auto"):
            raise ValueError("--load_in_4bit computes in --dtype: pass --dtype bfloat16, float16 or float32, not auto")
        quantization_config = get_quantization_config(model_args)
    peft_config = get_peft_config(model_args)  # None without --use_peft; TRL's error names peft if it is missing
    if tiny:
        import torch
        from transformers import GptOssForCausalLM

        from hf_gptoss_rl.model_builders import tiny_gptoss_config

        if training_args.model_init_kwargs:
            raise ValueError("--model_init_kwargs applies to a checkpoint, not to the 'tiny' model built here")
        torch.manual_seed(training_args.seed)
        config = tiny_gptoss_config()
        config._attn_implementation = model_args.attn_implementation or "eager"
        model = GptOssForCausalLM(config)
        if model_args.dtype not in (None, "auto"):
            model = model.to(getattr(torch, model_args.dtype))
        return model, peft_config, quantization_config

    init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    if quantization_config is None and "quantization_config" not in init_kwargs:
        from transformers import AutoConfig, Mxfp4Config

        checkpoint = AutoConfig.from_pretrained(name, revision=model_args.model_revision)
        if (getattr(checkpoint, "quantization_config", None) or {}).get("quant_method") == "mxfp4":
            init_kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    training_args.model_init_kwargs = init_kwargs
    return name, peft_config, quantization_config


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
                      reasoning_effort: str = "low", temperature: float = 0.0) -> dict:  # fmt: skip
    """Agent rollouts of `rows` on `engine`, greedy by default, scored against each row's `answer`.

    Args:
        engine: a `trl_ext.rollout.RolloutEngine`, e.g. a trainer's `rollout_engine` (it follows the trained
            weights) or `EmbeddedEngine.from_policy(model)`.
        tools: the tools the model may call (rendered into the prompt and executed).
        rows: rows with `prompt` (chat messages) and `answer`.
        max_completion_length / max_turns: trajectory budget, as in `AgenticGRPOConfig`.
        temperature: 0 is greedy; 1 samples as training does (the accuracy a rollout of the policy gets).

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
        sampling=SamplingParams(max_new_tokens=max_completion_length, temperature=temperature),
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


class ToolUseAccuracyCallback(TrainerCallback):
    """Every ``every`` optimizer steps, the accuracy of agent rollouts of ``rows`` (`evaluate_tool_use` on the
    trainer's `rollout_engine`, with its tools, `max_completion_length`, `max_turns` and `reasoning_effort`) goes into
    the trainer's metrics as ``name``, so that it is logged with that step.

    Add it with ``trainer.add_callback(ToolUseAccuracyCallback(trainer, rows, every=...))``: it then runs after the
    trainer's own callbacks, i.e. after the step's weight sync, and the engine serves the weights of that step.
    ``temperature`` 1 samples as training does; 0 is greedy. The main process evaluates.
    """

    def __init__(self, trainer, rows, *, every: int, temperature: float = 1.0, name: str = "eval/tool_use_accuracy"):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.trainer = trainer
        self.rows = list(rows)
        self.every = every
        self.temperature = temperature
        self.name = name

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every or not state.is_world_process_zero:
            return
        score = evaluate_tool_use(
            self.trainer.rollout_engine,
            self.trainer.agent_tools,
            self.rows,
            max_completion_length=args.max_completion_length,
            max_turns=args.max_turns,
            reasoning_effort=args.reasoning_effort,
            temperature=self.temperature,
        )
        self.trainer._metrics["train"][self.name].append(score["accuracy"])


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


class WallClockLimit(TrainerCallback):
    """Stops training once ``seconds`` of wall time have passed since `on_train_begin` (the step in flight ends, so
    a run stops at a step boundary with every metric of its last step logged)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.start > self.seconds:
            control.should_training_stop = True
