"""`trl_ext.cold_start`: harmony demonstrations whose code_interpreter calls compute each GSM8K answer from the
solution's calculator annotations, over many distinct problems, with the tool's real output; and the SFT on them
through TRL's `SFTTrainer` (loss on the assistant's tokens only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("openai_harmony")
pytest.importorskip("datasets")

from trl_ext import cold_start as cs
from trl_ext import recipes

REPO = Path(__file__).resolve().parents[1]
DATASET = str(REPO / "data" / "gsm8k_train_mini.jsonl")

NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_annotation_program():
    assert cs.annotation_program(NATALIA, "72") == "a = 48/2\nb = 48+24\nprint(b)"
    assert cs.annotation_program("x <<0.2 * 50=10>>10\n#### 10", "10") == "a = 0.2 * 50\nprint(a)"
    # left out: no annotation, last value is not the answer, not plain arithmetic
    assert cs.annotation_program("She has 5.\n#### 5", "5") is None
    assert cs.annotation_program(NATALIA, "73") is None
    for expression in ("__import__('os')", "2**99999", "3%2", "x*2", "2^3"):
        assert cs.annotation_program(f"<<{expression}=8>>8\n#### 8", "8") is None, expression


def test_load_math_dataset_keeps_solution_but_not_for_the_reward():
    dataset = recipes.load_math_dataset(DATASET)
    row = dataset[0]
    assert row["answer"] == "72" and row["solution"].endswith("#### 72") and "<<48/2=24>>" in row["solution"]
    assert recipes.retool_reward_func(["c"], ["\\boxed{72}"], [1], [row["answer"]], solution=[row["solution"]]) == [
        recipes.retool_reward("\\boxed{72}", "72", num_tool_calls=1)
    ]


def _tool_calls(tokenizer, examples):
    """(code, tool output, boxed answer) of each trajectory, decoded from its tokens."""
    out = []
    for ids in examples["input_ids"]:
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
    dataset = recipes.load_math_dataset(DATASET)
    examples = cs.tool_call_demonstrations(tokenizer, dataset, CodeInterpreterTool())
    calls = _tool_calls(tokenizer, examples)
    assert len(calls) >= 50  # most of the 64 shipped rows; a few have no usable annotations
    codes = [code for code, _, _ in calls]
    assert len(set(codes)) == len(codes)  # one trajectory per distinct problem, each with its own code
    for code, output, boxed in calls:
        assert re.fullmatch(r"([a-z] = [0-9+\-*/(). ]+\n)+print\([a-z]\)", code), code
        assert float(output) == pytest.approx(float(boxed)), (code, output, boxed)  # the sandbox's real output
    assert any(output.strip().endswith(".0") for _, output, _ in calls)  # not made up: `48/2` prints 24.0
    for example, (_, _output, boxed) in zip(examples, calls):
        ids, mask = example["input_ids"], example["assistant_masks"]
        assert len(ids) == len(mask) and mask[0] == 0 and mask[-1] == 1
        # targets: the assistant's call and answer; not the prompt, not the tool's output
        targets = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert "<|call|>" in targets and targets.endswith(f"\\boxed{{{boxed}}}<|return|>")
        assert "functions.code_interpreter to=assistant" not in targets and "<|start|>user" not in targets
        assert dataset[example["row"]]["answer"] == boxed  # the row index names the problem the trajectory solves
    assert len(set(examples["row"])) == len(examples)
    # up to max_rows distinct rows
    assert len(cs.tool_call_demonstrations(tokenizer, dataset, CodeInterpreterTool(), max_rows=8)) <= 8


def test_cold_start_examples_without_annotations_or_tool():
    from datasets import Dataset

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from trl_ext.tools import CodeInterpreterTool

    tokenizer = load_gptoss_tokenizer()
    rows = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {n} + 1?"}], "answer": str(n + 1)} for n in range(6)]
    )
    calls = _tool_calls(tokenizer, cs.tool_call_demonstrations(tokenizer, rows, CodeInterpreterTool()))
    assert sorted(calls) == sorted((f"print({n + 1})", f"{n + 1}\n", str(n + 1)) for n in range(6))
    plain = cs.tool_call_demonstrations(tokenizer, rows, None)
    assert len(plain) == 6 and all("<|call|>" not in tokenizer.decode(ids) for ids in plain["input_ids"])


def test_tool_call_demonstrations_rejects_bad_input():
    from datasets import Dataset

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer

    tokenizer = load_gptoss_tokenizer()
    with pytest.raises(ValueError, match="answer"):
        cs.tool_call_demonstrations(tokenizer, Dataset.from_list([{"prompt": "p"}]))
    with pytest.raises(ValueError, match="max_rows"):
        cs.tool_call_demonstrations(tokenizer, recipes.load_math_dataset(DATASET), max_rows=0)
    with pytest.raises(ValueError, match="question/answer"):
        recipes.to_math_row({"text": "no columns"})


def test_cold_start_sft_learns_the_demonstrations(tmp_path):
    """`SFTTrainer` on four demonstrations: the loss falls, only assistant tokens are targets, rows come back."""
    import torch
    from transformers import GptOssForCausalLM
    from trl import SFTConfig

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from trl_ext.tools import CodeInterpreterTool

    tokenizer = load_gptoss_tokenizer()
    dataset = recipes.load_math_dataset(DATASET)
    torch.manual_seed(0)
    config = tiny_gptoss_config(num_hidden_layers=1)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config)
    args = SFTConfig(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4, learning_rate=3e-2, logging_steps=1,
        save_strategy="no", gradient_checkpointing=False, bf16=False, report_to="none", max_length=None,
        disable_tqdm=True,
    )  # fmt: skip
    stop = cs.StopAtLoss(target=1e-9, window=12)  # never reached: all 12 steps run, their losses are kept
    history = cs.LossHistory()
    practised = cs.cold_start(model, tokenizer, dataset, CodeInterpreterTool(), args=args, max_rows=4,
                              callbacks=[stop, history])  # fmt: skip
    assert len(practised) == 4 and all(0 <= i < len(dataset) for i in practised)
    assert not model.training
    losses = stop.recent
    assert len(losses) == 12 and abs(losses[0] - 12.2) < 0.3  # ln(201088): uniform at random init
    assert sum(losses[-3:]) / 3 < losses[0] - 2.0, losses
    assert [h["step"] for h in history.history] == list(range(1, 13)) and [h["loss"] for h in history.history] == losses
    assert all(isinstance(h["grad_norm"], float) and h["grad_norm"] > 0 for h in history.history)
    with pytest.raises(TypeError, match="SFTConfig"):
        cs.cold_start(model, tokenizer, dataset, args=object())


def test_stop_at_loss():
    from transformers import TrainerControl, TrainerState

    with pytest.raises(ValueError):
        cs.StopAtLoss(0.0)
    stop, control = cs.StopAtLoss(0.5, window=2), TrainerControl()
    for loss, should_stop in ((0.4, False), (0.7, False), (0.6, False), (0.3, True)):
        stop.on_log(None, TrainerState(), control, logs={"loss": loss})
        assert control.should_training_stop == should_stop


def test_loss_history_keeps_every_logged_loss():
    from transformers import TrainerControl, TrainerState

    history, state = cs.LossHistory(), TrainerState()
    for step, logs in ((1, {"loss": 2.5, "grad_norm": 1.5}), (2, {"learning_rate": 0.1}), (3, {"loss": 1.0})):
        state.global_step = step
        history.on_log(None, state, TrainerControl(), logs=logs)
    history.on_log(None, state, TrainerControl(), logs=None)
    assert history.history == [
        {"step": 1, "loss": 2.5, "grad_norm": 1.5},
        {"step": 3, "loss": 1.0, "grad_norm": None},  # a log without grad_norm; the log without loss is skipped
    ]


def test_evaluate_tool_use_samples_at_the_temperature_asked(monkeypatch):
    """`recipes.evaluate_tool_use` is greedy by default and samples at ``temperature`` when asked (the learning run
    scores its policy both ways); the accuracy is math-verify's on the final text."""
    from types import SimpleNamespace

    import trl_ext.rollout

    temperatures = []

    class Loop:
        def __init__(self, engine, tools, *, sampling, **kwargs):
            temperatures.append(sampling.temperature)

        def run_batch_sync(self, prompts):
            final = ["\\boxed{4}", "\\boxed{5}"]
            return [
                SimpleNamespace(final_text=f, tool_calls=[], num_tool_calls=0, finish_reason="final") for f in final
            ]

    monkeypatch.setattr(trl_ext.rollout, "AgentLoop", Loop)
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}] * 2
    greedy = recipes.evaluate_tool_use(None, [], rows, max_completion_length=8, max_turns=1)
    sampled = recipes.evaluate_tool_use(None, [], rows, max_completion_length=8, max_turns=1, temperature=1.0)
    assert temperatures == [0.0, 1.0] and greedy["accuracy"] == sampled["accuracy"] == 0.5


def test_tool_use_accuracy_callback_logs_every_n_steps_on_the_trainers_engine(monkeypatch):
    """`recipes.ToolUseAccuracyCallback` evaluates the rows on the trainer's engine with its tools and the config's
    budget every ``every`` steps, on the main process only, and appends the accuracy to the trainer's metrics."""
    from collections import defaultdict
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    calls = []

    def evaluate(engine, tools, rows, **kwargs):
        calls.append((engine, tools, len(rows), kwargs))
        return {"accuracy": 0.25 * len(calls)}

    monkeypatch.setattr(recipes, "evaluate_tool_use", evaluate)
    trainer = SimpleNamespace(rollout_engine="engine", agent_tools=["tool"], _metrics={"train": defaultdict(list)})
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}] * 3
    callback = recipes.ToolUseAccuracyCallback(trainer, rows, every=2, name="eval/acc")
    args = SimpleNamespace(max_completion_length=16, max_turns=2, reasoning_effort="low")
    for step in range(1, 6):
        callback.on_step_end(args, TrainerState(global_step=step), TrainerControl())
    assert trainer._metrics["train"]["eval/acc"] == [0.25, 0.5]  # steps 2 and 4
    expected = dict(max_completion_length=16, max_turns=2, reasoning_effort="low", temperature=1.0)
    assert calls[0] == ("engine", ["tool"], 3, expected)
    other_rank = TrainerState(global_step=6, is_world_process_zero=False)
    callback.on_step_end(args, other_rank, TrainerControl())
    assert len(calls) == 2
    with pytest.raises(ValueError, match="every must be >= 1"):
        recipes.ToolUseAccuracyCallback(trainer, rows, every=0)


def test_cosine_cold_start_config_warms_up_then_decays_and_logs_the_nll_alone(tmp_path):
    from trl_ext.cold_start import cosine_cold_start_config

    config = cosine_cold_start_config(str(tmp_path), max_steps=40, batch_size=2, learning_rate=1e-3, use_cpu=True)
    assert (config.lr_scheduler_type, config.warmup_steps, config.max_steps) == ("cosine", 2, 40)
    assert config.router_aux_loss_coef == 0.0 and config.logging_steps == 1 and config.save_strategy == "no"
    assert cosine_cold_start_config(str(tmp_path), max_steps=10, batch_size=1, learning_rate=1e-3).warmup_steps == 1


def test_wall_clock_limit_stops_at_the_first_step_end_past_its_budget(monkeypatch):
    import types

    from trl_ext import recipes

    now = [100.0]
    monkeypatch.setattr(recipes.time, "perf_counter", lambda: now[0])
    limit, control = recipes.WallClockLimit(seconds=30.0), types.SimpleNamespace(should_training_stop=False)
    limit.on_train_begin(None, None, control)
    now[0] = 129.0
    limit.on_step_end(None, None, control)
    assert control.should_training_stop is False  # 29 s: within the budget
    now[0] = 131.0
    limit.on_step_end(None, None, control)
    assert control.should_training_stop is True
