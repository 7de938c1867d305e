"""`examples/grpo_retool.py`'s cold start: scripted code_interpreter trajectories whose code computes each GSM8K
answer from the solution's calculator annotations (issue 7: "a program writes correct code_interpreter solutions
for GSM8K-style problems"), over many distinct problems, with the tool's real output."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai_harmony")
pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import grpo_retool

NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_annotation_program():
    assert grpo_retool.annotation_program(NATALIA, "72") == "a = 48/2\nb = 48+24\nprint(b)"
    assert grpo_retool.annotation_program("x <<0.2 * 50=10>>10\n#### 10", "10") == "a = 0.2 * 50\nprint(a)"
    # left out: no annotation, last value is not the answer, not plain arithmetic
    assert grpo_retool.annotation_program("She has 5.\n#### 5", "5") is None
    assert grpo_retool.annotation_program(NATALIA, "73") is None
    for expression in ("__import__('os')", "2**99999", "3%2", "x*2", "2^3"):
        assert grpo_retool.annotation_program(f"<<{expression}=8>>8\n#### 8", "8") is None, expression


def test_load_math_dataset_keeps_solution_but_not_for_the_reward():
    dataset = grpo_retool.load_math_dataset(grpo_retool.DEFAULT_DATASET)
    row = dataset[0]
    assert row["answer"] == "72" and row["solution"].endswith("#### 72") and "<<48/2=24>>" in row["solution"]
    assert grpo_retool.retool_reward_func(["c"], ["\\boxed{72}"], [4], [row["answer"]], solution=[row["solution"]]) == [
        grpo_retool.retool_reward("\\boxed{72}", "72", 4)
    ]


def _tool_calls(tokenizer, examples):
    """(code, tool output, boxed answer) of each trajectory, decoded from its tokens."""
    out = []
    for ids, *_ in examples:
        text = tokenizer.decode(ids)
        call = re.search(r"<\|constrain\|>json<\|message\|>(.*?)<\|call\|>", text, re.DOTALL)
        result = re.search(r"to=assistant<\|channel\|>commentary<\|message\|>(.*?)<\|end\|>", text, re.DOTALL)
        boxed = re.search(r"\\boxed\{(.*?)\}<\|return\|>", text)
        out.append((json.loads(call.group(1))["code"], result.group(1), boxed.group(1)))
    return out


def test_cold_start_examples_compute_the_answers():
    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from trl_ext.tools import CodeInterpreterTool

    tokenizer = load_gptoss_tokenizer()
    dataset = grpo_retool.load_math_dataset(grpo_retool.DEFAULT_DATASET)
    examples = grpo_retool.cold_start_examples(tokenizer, dataset, CodeInterpreterTool())
    calls = _tool_calls(tokenizer, examples)
    assert len(calls) >= 50  # most of the 64 shipped rows; a few have no usable annotations
    codes = [code for code, _, _ in calls]
    assert len(set(codes)) == len(codes)  # one trajectory per distinct problem, each with its own code
    for code, output, boxed in calls:
        assert re.fullmatch(r"([a-z] = [0-9+\-*/(). ]+\n)+print\([a-z]\)", code), code
        assert float(output) == pytest.approx(float(boxed)), (code, output, boxed)  # the sandbox's real output
    assert any(output.strip().endswith(".0") for _, output, _ in calls)  # not made up: `48/2` prints 24.0
    for (ids, mask, prompt_len, row), (_, _, boxed) in zip(examples, calls):
        assert len(ids) == len(mask) and not any(mask[:prompt_len]) and any(mask[prompt_len:])
        assert dataset[row]["answer"] == boxed  # the row index names the problem the trajectory solves
    assert len({row for *_, row in examples}) == len(examples)
    # up to max_rows distinct rows
    assert len(grpo_retool.cold_start_examples(tokenizer, dataset, CodeInterpreterTool(), max_rows=8)) <= 8


def test_cold_start_examples_without_annotations_or_tool():
    from datasets import Dataset

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from trl_ext.tools import CodeInterpreterTool

    tokenizer = load_gptoss_tokenizer()
    rows = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {n} + 1?"}], "answer": str(n + 1)} for n in range(6)]
    )
    calls = _tool_calls(tokenizer, grpo_retool.cold_start_examples(tokenizer, rows, CodeInterpreterTool()))
    assert sorted(calls) == sorted((f"print({n + 1})", f"{n + 1}\n", str(n + 1)) for n in range(6))
    plain = grpo_retool.cold_start_examples(tokenizer, rows, None)
    assert len(plain) == 6 and all("<|call|>" not in tokenizer.decode(ids) for ids, *_ in plain)
