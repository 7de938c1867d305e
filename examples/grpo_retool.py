# Copyright 2026 The hf_gptoss_rl authors. Apache-2.0.
"""ReTool-style agentic GRPO for GPT-OSS: the model thinks, runs Python in a sandbox, reads the output, answers.

On its defaults this script needs nothing but a CPU and runs in minutes:

* a tiny GPT-OSS (2 layers, 4 experts, every GPT-OSS feature, the real 201,088-token vocabulary) built locally with
  the offline o200k_harmony tokenizer, given a short "cold start" (supervised steps on a handful of tool-calling
  trajectories, as ReTool's recipe does before RL) so that it emits harmony tool calls at all;
* the GSM8K rows shipped in `data/gsm8k_train_mini.jsonl`;
* the `code_interpreter` tool on the local sandbox;
* the embedded rollout engine (an in-process inference copy of the policy, re-synced after every optimizer step).

    python examples/grpo_retool.py                      # or: accelerate launch examples/grpo_retool.py

The same script trains the real thing on GPUs (the full recipe, SGLang servers included, is in docs/quickstart.md):

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/grpo_retool.py \
        --model /checkpoints/gpt-oss-20b-bf16 --bf16 \
        --rollout-backend sglang --sglang-urls http://localhost:30000 \
        --dataset BytedTsinghua-SIA/DAPO-Math-17k --eval-dataset yentinglin/aime_2025 \
        --attn-implementation hf-gptoss-rl/sink-flash-attn3 --experts-implementation memory_efficient \
        --mismatch-correction token_tis --max-completion-length 16384 --max-turns 16

(`--lora` trains an adapter under DDP instead; `--model openai/gpt-oss-20b` loads the MXFP4 release dequantized.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from transformers import TrainerCallback

from hf_gptoss_rl.harmony import (
    load_gptoss_tokenizer,
    render_prompt,
    render_tool_result,
)
from hf_gptoss_rl.logprobs import causal_lm_token_logprobs
from hf_gptoss_rl.testing import tiny_gptoss_config
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_ext.rewards import extract_boxed, retool_reward
from trl_ext.rollout import run_sync
from trl_ext.tools import CodeInterpreterTool, ToolError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = str(REPO_ROOT / "data" / "gsm8k_train_mini.jsonl")
ANSWER_FORMAT = "\n\nThe answer format must be: \\boxed{'The final answer goes here.'}"


# %% Arguments ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (built locally, CPU) or a model id/path, e.g. openai/gpt-oss-20b")
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="a .jsonl file or a Hub dataset (DAPO-Math-17k, gsm8k)")
    p.add_argument("--dataset-config", default=None, help="Hub dataset config name (e.g. 'main' for openai/gsm8k)")
    p.add_argument("--eval-dataset", default=None, help="optional eval set, e.g. yentinglin/aime_2025")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--output-dir", default="outputs/grpo_retool")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--learning-rate", type=float, default=None, help="default: 1e-6 (real models), 1e-4 (tiny)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--per-device-train-batch-size", type=int, default=8)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--max-completion-length", type=int, default=96)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reasoning-effort", default="low", choices=["low", "medium", "high"])
    p.add_argument("--rollout-backend", default="embedded", choices=["embedded", "sglang"])
    p.add_argument("--sglang-urls", default=None, help="comma-separated SGLang base URLs")
    p.add_argument("--weight-sync-mode", default="disk", choices=["disk", "distributed", "tensor"])
    p.add_argument("--sandbox-url", default=None, help="SandboxFusion URL; default: local sandbox")
    p.add_argument("--mismatch-correction", default="none", choices=["none", "token_tis", "token_mask", "sequence_mask"])
    p.add_argument("--attn-implementation", default=None, help="e.g. hf-gptoss-rl/sink-flash-attn3 (default: eager)")
    p.add_argument("--experts-implementation", default=None, help="e.g. memory_efficient")
    p.add_argument("--sequence-parallel-size", type=int, default=1)
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (merged for the weight sync)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--cold-start-steps", type=int, default=None, help="default: 60 for 'tiny', 0 otherwise")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--resume-from-checkpoint", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# %% Data: math problems with a ground-truth answer ---------------------------------------------------------------------
def _gsm8k_answer(text: str) -> str:
    return text.split("####")[-1].strip().replace(",", "")


def _to_row(example: dict) -> dict:
    """Normalise GSM8K / DAPO-Math-17k / AIME rows to {"prompt": [user message], "answer": str, "solution": str}.

    `answer` is the final answer only (what the reward compares against); `solution` keeps GSM8K's worked solution
    with its `<<expression=value>>` calculator annotations for `cold_start` ("" for other datasets).
    """
    if "reward_model" in example:  # DAPO-Math-17k: chat prompt + reward_model.ground_truth (prompt has the format)
        question = example["prompt"][-1]["content"] if isinstance(example["prompt"], list) else example["prompt"]
        answer = str(example["reward_model"]["ground_truth"])
        return {"prompt": [{"role": "user", "content": question}], "answer": answer, "solution": ""}
    question = example.get("question") or example.get("problem") or example.get("Problem")
    answer = example.get("answer") if "answer" in example else example.get("Answer")
    if question is None or answer is None:
        raise ValueError(f"cannot find question/answer columns in {sorted(example)}")
    solution = answer if isinstance(answer, str) and "####" in answer else ""
    answer = _gsm8k_answer(answer) if solution else str(answer)
    return {"prompt": [{"role": "user", "content": question + ANSWER_FORMAT}], "answer": answer, "solution": solution}


def load_math_dataset(name: str, config: str | None = None, split: str = "train", limit: int | None = None) -> Dataset:
    if name.endswith((".jsonl", ".json")):
        raw = load_dataset("json", data_files=name, split="train")
    else:
        raw = load_dataset(name, config, split=split)
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    return raw.map(_to_row, remove_columns=raw.column_names)


# %% Reward: the ReTool reward on the final channel (with its small bonus for using the tool) ---------------------------
def retool_reward_func(completions, final_text, num_turns, answer, **kwargs) -> list[float]:
    return [retool_reward(f, a, n) for f, a, n in zip(final_text, answer, num_turns)]


def boxed_format_reward(completions, final_text, **kwargs) -> list[float]:
    """Logged only (weight 0): share of trajectories whose final answer has a \\boxed{}."""
    return [float(extract_boxed(f) is not None) for f in final_text]


# %% Model ---------------------------------------------------------------------------------------------------------------
def build_model(args):
    if args.model != "tiny":
        from transformers import AutoConfig, Mxfp4Config

        init_kwargs = {"dtype": torch.bfloat16}
        quantization = getattr(AutoConfig.from_pretrained(args.model), "quantization_config", None) or {}
        if quantization.get("quant_method") == "mxfp4":
            # the released GPT-OSS checkpoints store the experts in MXFP4: train bf16 weights
            init_kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        return args.model, init_kwargs
    from transformers import GptOssForCausalLM

    torch.manual_seed(args.seed)
    config = tiny_gptoss_config()
    config._attn_implementation = args.attn_implementation or "eager"
    return GptOssForCausalLM(config), None


# %% Cold start: scripted tool-calling trajectories whose code computes the answer -------------------------------------
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
    program is never evaluated here: `cold_start` runs it in the tool's sandbox.
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
    """Each program's output as `tool` (the code interpreter) returns it, batched: one sandbox call per `chunk`
    programs. None for a program that raised, or for a whole chunk whose call failed."""

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


def cold_start_examples(tokenizer, dataset: Dataset, tool=None, max_rows: int = 512) -> list[tuple]:
    """`cold_start`'s scripted trajectories: `(token ids, loss mask, prompt length, dataset row)`, one per distinct
    row.

    With a tool: think, call it with the solution's own arithmetic (`annotation_program`: one line per GSM8K
    calculator annotation, then `print`), read its output, answer in \\boxed{}. The programs are run in the tool's
    sandbox first, so each trajectory shows the tool's real output, and rows whose program does not print the
    final answer are left out. Rows are taken in a seeded random order, up to `max_rows`. Datasets without GSM8K
    annotations fall back to `print(<answer>)`. Without a tool: think, answer.
    """
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
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
            print(f"[cold start] {len(rows)} distinct rows, with code that computes each answer (run in the sandbox)",
                  flush=True)
        else:  # no GSM8K annotations (another dataset): the program just prints the answer
            rows = order[:max_rows]
            programs = [f"print({answers[i]})" for i in rows]
            outputs = [f"{answers[i]}\n" for i in rows]
            print(f"[cold start] no usable calculator annotations: {len(rows)} rows with print(<answer>)", flush=True)
    examples = []
    for n, i in enumerate(rows):
        row = dataset[i]
        prompt = render_prompt(row["prompt"], tools=[tool.spec()] if tool else None, reasoning_effort="low")
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
        examples.append((ids, mask, len(prompt), i))
    return examples


def cold_start(
    model,
    tokenizer,
    dataset: Dataset,
    tool=None,
    steps: int = 40,
    lr: float = 3e-3,
    max_rows: int = 512,
    batch_size: int = 4,
    target_nll: float | None = None,
) -> list[int]:
    """A few supervised steps on scripted trajectories (`cold_start_examples`), a random `batch_size` per step,
    AdamW at `lr` with a linear warm-up and cosine decay.

    ReTool starts RL from a model that already writes code-interpreter calls; a randomly initialised model does
    not, so it learns the harmony format here. The trajectories come from up to `max_rows` distinct problems,
    each with code that computes its answer, so the model learns to write code from the question rather than to
    print one memorised number. Loss only on assistant tokens; memory-lean log-probs. Returns the dataset rows
    it practised on (empty when `steps` is 0). With `target_nll`, stops early once the mean loss of the last 10
    steps falls below it (a partly learnt warm-up leaves RL something to improve).
    """
    if steps <= 0:
        return []
    from transformers import get_cosine_schedule_with_warmup

    examples = cold_start_examples(tokenizer, dataset, tool, max_rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # short warm-up, then cosine decay: a constant high rate plateaus before the trajectories are learnt
    schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=max(1, steps // 20), num_training_steps=steps)
    model.train()
    generator = torch.Generator().manual_seed(0)
    recent = []
    for step in range(steps):
        batch = [examples[i] for i in torch.randperm(len(examples), generator=generator)[:batch_size].tolist()]
        width = max(len(ids) for ids, *_ in batch)
        keep = max(len(ids) - p for ids, _, p, _ in batch)
        device = model.device
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids for ids, *_ in batch],
                                 device=device)
        attn = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, *_ in batch], device=device)
        loss_mask = torch.tensor([[0] * (width - len(m)) + m for _, m, *_ in batch], device=device)[:, -keep:]
        logps, _ = causal_lm_token_logprobs(model, input_ids, attn, logits_to_keep=keep)
        loss = -(logps * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        recent = (recent + [loss.item()])[-10:]
        reached = target_nll is not None and len(recent) == 10 and sum(recent) / 10 < target_nll
        if step % 10 == 0 or step == steps - 1 or reached:
            print(f"[cold start] step {step:3d}  nll/token {loss.item():.4f}", flush=True)
        if reached:
            print(f"[cold start] mean nll/token of the last 10 steps below {target_nll}: stopped at step {step}",
                  flush=True)
            break
    model.eval()
    return [row for *_, row in examples]


# %% Progress: one readable line per step (rewards, tool use, mismatch) ---------------------------------------------------
class PrintMetrics(TrainerCallback):
    KEYS = [
        ("reward", "reward"),
        ("rollout/tool_calls_mean", "tool_calls"),
        ("rollout/tool_errors_per_call", "tool_err"),
        ("rollout/frac_final_answer", "final"),
        ("mismatch/k3_kl", "k3_kl"),
        ("mismatch/prob_diff_max", "|dp|max"),
        ("clip_ratio/region_mean", "clip"),
        ("loss", "loss"),
    ]

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        parts = [f"step {state.global_step}"]
        parts += [f"{short} {logs[key]:.4g}" for key, short in self.KEYS if logs.get(key) is not None]
        print(" | ".join(parts), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


# %% Train ---------------------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    tiny = args.model == "tiny"
    tokenizer = load_gptoss_tokenizer()
    train_dataset = load_math_dataset(args.dataset, args.dataset_config, limit=args.num_prompts)
    eval_dataset = load_math_dataset(args.eval_dataset, split="train") if args.eval_dataset else None
    tool = CodeInterpreterTool() if args.sandbox_url is None else _sandbox_fusion_tool(args.sandbox_url)

    model, model_init_kwargs = build_model(args)
    cold_start_steps = args.cold_start_steps if args.cold_start_steps is not None else (60 if tiny else 0)
    if tiny and args.resume_from_checkpoint is None:
        cold_start(model, tokenizer, train_dataset, tool, cold_start_steps)

    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear")

    config = AgenticGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate or (1e-4 if tiny else 1e-6),
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        seed=args.seed,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs=model_init_kwargs,
        reward_weights=[1.0, 0.0],
        rollout_backend=args.rollout_backend,
        sglang_urls=args.sglang_urls,
        weight_sync_mode=args.weight_sync_mode,
        max_turns=args.max_turns,
        reasoning_effort=args.reasoning_effort,
        mismatch_correction=args.mismatch_correction,
        attn_implementation=args.attn_implementation,
        experts_implementation=args.experts_implementation,
        sequence_parallel_size=args.sequence_parallel_size,
        eval_strategy="steps" if eval_dataset is not None else "no",
        eval_steps=50,
    )
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    os.makedirs(args.output_dir, exist_ok=True)
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=[retool_reward_func, boxed_format_reward],
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        tools=[tool],
        peft_config=peft_config,
        callbacks=[PrintMetrics(metrics_path)],
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.accelerator.is_main_process:
        print(
            f"done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s "
            f"(world size {trainer.accelerator.num_processes}); metrics in {metrics_path}"
        )
    return trainer


def _sandbox_fusion_tool(url: str):
    from trl_ext.tools import SandboxFusionBackend

    return CodeInterpreterTool(backend=SandboxFusionBackend(url))


if __name__ == "__main__":
    # end_training destroys the process group before interpreter exit, as torch.distributed asks
    main().accelerator.end_training()
