# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""Cold start for agentic RL: supervised fine-tuning on tool-calling demonstrations before GRPO.

ReTool (Feng et al., 2025, https://arxiv.org/abs/2504.11536, section 3.1) starts RL from a model that was first
fine-tuned on code-interpreter trajectories, so that its first rollouts already contain well-formed tool calls. A
model that never emits a parseable `<|call|>` gets no signal from RL about tool use. This module builds such
demonstrations for GSM8K-style rows and trains on them with TRL's `SFTTrainer`:

* `annotation_program` turns a GSM8K solution's calculator annotations (`<<48/2=24>>`) into a short Python program
  that recomputes the final answer;
* `tool_call_demonstrations` runs those programs in the code tool's sandbox and renders, in harmony, one trajectory
  per problem: think → call `code_interpreter` with the program → the tool's real output → `\\boxed{answer}`. It
  returns a tokenized dataset (`input_ids`, `assistant_masks`) whose mask covers the assistant's tokens only (the
  prompt and the tool's output are context, not targets);
* `cold_start` trains a model on them with `SFTTrainer` and returns the rows it practised; the callbacks
  `StopAtLoss` (stop once the logged loss is low enough) and `LossHistory` (keep every logged loss) read its logs.

Typical use (the CPU demo in `examples/grpo_retool.py` does exactly this):

```python
from trl import SFTConfig
from trl_ext.cold_start import cold_start

practised = cold_start(model, tokenizer, dataset, tool, args=SFTConfig(output_dir="out/cold_start", max_steps=60))
```
"""

from __future__ import annotations

import asyncio
import json
import math
import re

from transformers import TrainerCallback

from trl_ext.tools import ToolError

__all__ = [
    "LossHistory",
    "StopAtLoss",
    "annotation_program",
    "cold_start",
    "cosine_cold_start_config",
    "run_programs",
    "tool_call_demonstrations",
]

_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")  # GSM8K's calculator annotations: <<48/2=24>>
_ARITHMETIC = frozenset("0123456789+-*/(). ")
_NAMES = "abcdefghijklmnopqrstuvwxyz"


def _same_number(a: str, b: str) -> bool:
    try:
        x, y = float(a.strip().replace(",", "")), float(b.strip().replace(",", ""))
    except ValueError:
        return False
    return abs(x - y) <= 1e-6 * max(1.0, abs(y))


def annotation_program(solution: str, answer: str) -> str | None:
    """Python that recomputes a GSM8K solution from its calculator annotations, or None if it cannot be trusted.

    "Natalia sold 48/2 = <<48/2=24>>24 clips ... 48+24 = <<48+24=72>>72 ...#### 72" gives `a = 48/2`, `b = 48+24`,
    `print(b)`. None when there is no annotation, when an expression is not plain arithmetic (only digits,
    `+ - * / ( ) .` and spaces; no `**`), or when the last annotation's value is not the final answer. The
    program is never evaluated here: `tool_call_demonstrations` runs it in the tool's sandbox.
    """
    steps = _ANNOTATION.findall(solution)
    if not steps or len(steps) > len(_NAMES) or not _same_number(steps[-1][1], answer):
        return None
    lines = []
    for name, (expression, _) in zip(_NAMES, steps):
        expression = " ".join(expression.split())
        if not expression or set(expression) - _ARITHMETIC or "**" in expression:
            return None
        if not any(ch.isdigit() for ch in expression):
            return None
        lines.append(f"{name} = {expression}")
    return "\n".join(lines + [f"print({_NAMES[len(steps) - 1]})"])


# runs a batch of programs in ONE sandbox call; each program's stdout, or None where it raised
_BATCH_RUNNER = """import contextlib, io, json
outputs = []
for program in {programs!r}:
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            exec(program, {{}})
        outputs.append(buffer.getvalue())
    except Exception:
        outputs.append(None)
print(json.dumps(outputs))
"""


def run_programs(tool, programs: list[str], chunk: int = 64) -> list[str | None]:
    """Each program's output as `tool` (a `CodeInterpreterTool`) returns it, batched: one sandbox call per `chunk`
    programs. None for a program that raised, or for every program of a chunk whose sandbox call failed."""
    from trl_ext.rollout import run_sync

    async def one(batch):
        try:
            text = await tool({"code": _BATCH_RUNNER.format(programs=batch)})
            outputs = json.loads(text)
        except (ToolError, OSError, ValueError):  # sandbox error, timeout note, truncation: drop the chunk only
            return [None] * len(batch)
        return outputs if isinstance(outputs, list) and len(outputs) == len(batch) else [None] * len(batch)

    async def run_all():
        batches = [programs[i : i + chunk] for i in range(0, len(programs), chunk)]
        return [out for outs in await asyncio.gather(*(one(b) for b in batches)) for out in outs]

    return run_sync(run_all()) if programs else []


def tool_call_demonstrations(tokenizer, dataset, tool=None, *, max_rows: int = 512, reasoning_effort: str = "low",
                             seed: int = 0):  # fmt: skip
    """Tokenized harmony demonstrations for `SFTTrainer`, one per distinct row of `dataset`.

    `dataset` has the columns `prompt` (chat messages), `answer` (the final answer) and optionally `solution` (a
    GSM8K worked solution with calculator annotations), as `trl_ext.recipes.load_math_dataset` makes them.

    With a `tool` (the code interpreter): think, call the tool with the solution's own arithmetic
    (`annotation_program`), read its output, answer in `\\boxed{}`. The programs are run in the tool's sandbox first,
    so each demonstration shows the tool's real output, and rows whose program does not print the final answer are
    left out. A dataset without usable annotations falls back to `print(<answer>)`. Without a tool: think, answer.

    Rows are taken in a `seed`-ed random order, up to `max_rows`. Returns a `datasets.Dataset` with `input_ids`,
    `assistant_masks` (1 on the tokens the assistant writes: its analysis, its tool call and its final answer; 0 on
    the prompt and on the tool's output, which `SFTTrainer` turns into ignored labels) and `row` (the index of the
    row in `dataset`).
    """
    import torch
    from datasets import Dataset

    from hf_gptoss_rl.harmony import render_prompt, render_tool_result

    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    missing = {"prompt", "answer"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"tool_call_demonstrations: the dataset has no {sorted(missing)} column(s); it has "
                         f"{dataset.column_names}")  # fmt: skip
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    answers = list(dataset["answer"])
    solutions = list(dataset["solution"]) if "solution" in dataset.column_names else [""] * len(dataset)
    rows, programs, outputs = [], [], []
    if tool is None:
        rows = order[:max_rows]
    else:
        for i in order:
            program = annotation_program(solutions[i], answers[i])
            if program is not None:
                rows.append(i)
                programs.append(program)
                if len(rows) == max_rows:
                    break
        outputs = run_programs(tool, programs)
        verified = [
            (i, p, o) for i, p, o in zip(rows, programs, outputs) if o is not None and _same_number(o, answers[i])
        ]
        if verified:
            rows, programs, outputs = (list(x) for x in zip(*verified))
        else:  # no GSM8K annotations (another dataset): the program just prints the answer
            rows = order[:max_rows]
            programs = [f"print({answers[i]})" for i in rows]
            outputs = [f"{answers[i]}\n" for i in rows]
    records = []
    for n, i in enumerate(rows):
        row = dataset[i]
        prompt = render_prompt(row["prompt"], tools=[tool.spec()] if tool else None, reasoning_effort=reasoning_effort)
        final = encode(f"<|channel|>final<|message|>\\boxed{{{row['answer']}}}<|return|>")
        if tool is None:
            think = encode("<|channel|>analysis<|message|>Compute.<|end|><|start|>assistant")
            ids, mask = prompt + think + final, [0] * len(prompt) + [1] * (len(think) + len(final))
        else:
            call = encode(
                "<|channel|>analysis<|message|>Use python.<|end|><|start|>assistant<|channel|>commentary "
                f"to=functions.{tool.name} <|constrain|>json<|message|>{json.dumps({'code': programs[n]})}<|call|>"
            )
            result = render_tool_result(tool.name, outputs[n])
            ids = prompt + call + result + final
            mask = [0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * len(final)
        records.append({"input_ids": ids, "assistant_masks": mask, "row": i})
    return Dataset.from_list(records)


class StopAtLoss(TrainerCallback):
    """Stops training once the mean logged `loss` of the last `window` logs is below `target` (a partly learnt
    warm-up leaves RL something to improve). The loss is read from the trainer's logs: set `logging_steps=1` for a
    per-step window."""

    def __init__(self, target: float, window: int = 10):
        if not (target > 0 and math.isfinite(target)) or window < 1:
            raise ValueError(f"StopAtLoss: target must be a positive number and window >= 1, got {target}, {window}")
        self.target, self.window = float(target), int(window)
        self.recent: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.recent = (self.recent + [float(logs["loss"])])[-self.window :]
            if len(self.recent) == self.window and sum(self.recent) / self.window < self.target:
                control.should_training_stop = True


class LossHistory(TrainerCallback):
    """Keeps the trainer's logged training losses: `history` gets ``{"step", "loss", "grad_norm"}`` for every log
    with a `loss` (``grad_norm`` None where none was logged). With `logging_steps=1` (`cosine_cold_start_config`),
    one entry per step; `cold_start` does not return its trainer, whose ``state.log_history`` has the same."""

    def __init__(self):
        self.history: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            norm = logs.get("grad_norm")
            self.history.append(
                {
                    "step": state.global_step,
                    "loss": float(logs["loss"]),
                    "grad_norm": None if norm is None else float(norm),
                }
            )


def cosine_cold_start_config(output_dir: str, *, max_steps: int, batch_size: int, learning_rate: float, seed: int = 0,
                             use_cpu: bool = False, bf16: bool = False):  # fmt: skip
    """A `trl.SFTConfig` for `cold_start` with a fixed step count: a linear warm-up over the first 5 % of
    ``max_steps``, then cosine decay (a constant high rate plateaus before the trajectories are learnt); the loss
    logged every step (`StopAtLoss` reads it), nothing saved, no gradient checkpointing, no length cut, and
    ``router_aux_loss_coef=0.0``, so that the logged loss is the demonstrations' negative log-likelihood alone."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch_size, learning_rate=learning_rate,
        lr_scheduler_type="cosine", warmup_steps=max(1, max_steps // 20), logging_steps=1, save_strategy="no",
        report_to="none", seed=seed, use_cpu=use_cpu, bf16=bf16, gradient_checkpointing=False, max_length=None,
        router_aux_loss_coef=0.0, disable_tqdm=True,
    )  # fmt: skip


def _lean_sft_trainer_class():
    """`SFTTrainer` whose loss scores only the labelled positions, in 512-row tiles (`hf_gptoss_rl.logprobs`).

    TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) scores every position of the batch where Triton does
    not run (CPU) and tiles 32,768 rows at a time: with GPT-OSS's 201,088-token vocabulary a 4 x 330-token batch makes
    a 1.1 GB float32 tile per temporary, and one cold-start step of the tiny model took 28 CPU-seconds (half of them
    in the kernel, allocating) against about 2 with the labelled-only 512-row tiles of
    `hf_gptoss_rl.logprobs.add_chunked_logprob_head`, measured on a 2-core CPU. Everything else is `SFTTrainer`'s
    own: dataset preparation (labels from `assistant_masks`), collator, optimizer, schedule, logging, `report_to`,
    distributed training. Logged metrics: `loss` and `entropy` (not `mean_token_accuracy`, which needs an arg-max
    over the vocabulary at every position).
    """
    import torch
    from trl import SFTTrainer

    from hf_gptoss_rl.logprobs import add_chunked_logprob_head

    class LeanSFTTrainer(SFTTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            add_chunked_logprob_head(self.model)  # replaces the fused head SFTTrainer installed

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if self.model.training else "eval"
            outputs = model(**inputs, fused_lm_head=True)
            mask = inputs["labels"][:, 1:] != -100
            num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = -outputs.log_probs.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            # as in `SFTTrainer.compute_loss`: `num_items_in_batch` counts every rank's tokens, DDP averages gradients
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes
            num_valid = self.accelerator.gather_for_metrics(mask.sum()).sum()
            entropy_sum = self.accelerator.gather_for_metrics(outputs.entropy.detach().sum()).sum()
            self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
            return (loss, outputs) if return_outputs else loss

    return LeanSFTTrainer


def cold_start(model, tokenizer, dataset, tool=None, *, args=None, max_rows: int = 512, reasoning_effort: str = "low",
               callbacks=None) -> list[int]:  # fmt: skip
    """Supervised fine-tuning of `model` (in place) on `tool_call_demonstrations` with TRL's `SFTTrainer` (its loss
    computed on the labelled positions only, in tiles: see `_lean_sft_trainer_class`).

    Args:
        model: a `PreTrainedModel` (trained in place; left in eval mode).
        tokenizer: its tokenizer (e.g. `hf_gptoss_rl.harmony.load_gptoss_tokenizer()`).
        dataset: rows with `prompt`, `answer` and optionally `solution` (see `tool_call_demonstrations`).
        tool: the code tool the demonstrations call (None: demonstrations without tool calls).
        args: a `trl.SFTConfig` (its `output_dir`, `max_steps`, `learning_rate`, batch size, ...). `max_length`
            is honoured: demonstrations longer than it are truncated by `SFTTrainer`. `router_aux_loss_coef=0.0`
            makes the logged loss the demonstrations' negative log-likelihood alone. Defaults to the CPU demo's
            warm-up: steps of 4 demonstrations, AdamW at a constant 1e-2 after 6 warm-up steps, until the mean loss
            of 5 steps is below 0.05 (`StopAtLoss`) or for at most 120 steps, no checkpoints.
        max_rows: most distinct problems to practise.
        reasoning_effort: written into the demonstrations' harmony system message; use the same value for RL.
        callbacks: extra `TrainerCallback`s (e.g. `StopAtLoss(0.015)`).

    Returns the indices of the `dataset` rows the demonstrations solve (the "practised" problems).
    """
    from trl import SFTConfig

    if args is None:
        args = SFTConfig(
            output_dir="cold_start", max_steps=120, per_device_train_batch_size=4, learning_rate=1e-2,
            lr_scheduler_type="constant_with_warmup", warmup_steps=6, logging_steps=5, save_strategy="no",
            gradient_checkpointing=False, bf16=False, max_length=None, router_aux_loss_coef=0.0,
        )  # fmt: skip
        callbacks = [*(callbacks or []), StopAtLoss(0.05, window=1)]  # logged every 5 steps: the mean of 5 steps
    if not isinstance(args, SFTConfig):
        raise TypeError(f"cold_start: args must be a trl.SFTConfig, got {type(args).__name__}")
    demonstrations = tool_call_demonstrations(
        tokenizer, dataset, tool, max_rows=max_rows, reasoning_effort=reasoning_effort, seed=args.seed
    )
    # SFTTrainer switches the MoE router outputs on or off in the model's config for its auxiliary loss; the config
    # is restored afterwards, or generation would keep returning router logits
    text_config = model.config.get_text_config()
    saved = {
        k: getattr(text_config, k) for k in ("output_router_logits", "router_aux_loss_coef") if hasattr(text_config, k)
    }
    trainer = _lean_sft_trainer_class()(
        model=model,
        args=args,
        train_dataset=demonstrations.remove_columns("row"),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    try:
        trainer.train()
    finally:
        for key, value in saved.items():
            setattr(text_config, key, value)
    model.eval()
    return list(demonstrations["row"])
