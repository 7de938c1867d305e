"""AgentLoop with scripted harmony outputs: tool calls, malformed calls, limits, exact id/mask/log-prob alignment."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from hf_gptoss_rl.harmony import (
    CALL,
    RETURN,
    START,
    encode_text,
    get_harmony_encoding,
    render_prompt,
    render_tool_result,
)
from trl_ext.rollout import AgentLoop, GenerationOutput, RolloutEngine, SamplingParams
from trl_ext.tools import FunctionTool, ToolError


def tok(text: str) -> list[int]:
    """Harmony text (special tokens written out) -> ids, as the model would sample them."""
    return list(get_harmony_encoding().encode(text, allowed_special="all"))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: why
    """
    raise ToolError(f"refused: {reason}")


async def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "woke up"


TOOLS = [FunctionTool(add), FunctionTool(fail), FunctionTool(slow)]
PROMPT = render_prompt([{"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS)

CALL_MODEL_FORM = '<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
CALL_HEADER_FORM = ' to=functions.add<|channel|>commentary <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
FINAL = "<|channel|>analysis<|message|>It is 5.<|end|><|start|>assistant<|channel|>final<|message|>\\boxed{5}<|return|>"


class ScriptedEngine(RolloutEngine):
    """Replays pre-tokenized harmony turns; log-prob of token i of a turn is -(i + 1) / 100 - turn.

    Records every context it receives and honours ``max_new_tokens`` and the stop ids like a real engine.
    A script entry may be ``"abort"`` or an exception instance.
    """

    def __init__(self, turns, delay_s: float = 0.0):
        self.turns = list(turns)
        self.contexts: list[list[int]] = []
        self.max_new: list[int] = []
        self.delay_s = delay_s
        self.active = 0
        self.max_active = 0

    async def generate(self, input_ids, sampling):
        self.contexts.append(list(input_ids))
        self.max_new.append(sampling.max_new_tokens)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        k = len(self.contexts) - 1
        entry = self.next_entry(input_ids)
        if isinstance(entry, Exception):
            raise entry
        if entry == "abort":
            return GenerationOutput([], [], "abort", 1)
        ids = tok(entry) if isinstance(entry, str) else list(entry)
        out = []
        for t in ids:
            out.append(t)
            if t in sampling.stop_token_ids or len(out) == sampling.max_new_tokens:
                break
        reason = "stop" if out[-1] in sampling.stop_token_ids else "length"
        return GenerationOutput(out, [-(i + 1) / 100 - k for i in range(len(out))], reason, weight_version=k + 1)

    def next_entry(self, input_ids):
        return self.turns.pop(0)

    async def update_weights(self, named_tensors, *, version):
        raise NotImplementedError

    async def health(self):
        return True

    @property
    def weight_version(self):
        return None


def run(engine, prompt=PROMPT, **kwargs):
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=256))
    loop = AgentLoop(engine, TOOLS, **kwargs)
    traj = asyncio.run(loop.run(prompt))
    traj.check_alignment()
    return traj


def assert_layout(traj, segments):
    """``segments``: [(ids, sampled?, turn index)] in order; checks ids, mask and log-probs token by token."""
    ids, mask, lps = [], [], []
    for seg, sampled, k in segments:
        ids += seg
        mask += [int(sampled)] * len(seg)
        lps += [-(i + 1) / 100 - k for i in range(len(seg))] if sampled else [0.0] * len(seg)
    assert traj.completion_ids == ids
    assert traj.completion_mask == mask
    assert traj.rollout_logprobs == pytest.approx(lps, abs=0)


@pytest.mark.parametrize(
    "call_text", [CALL_MODEL_FORM, CALL_HEADER_FORM], ids=["channel-recipient", "header-recipient"]
)
def test_tool_call_then_final(call_text):
    engine = ScriptedEngine([call_text, FINAL])
    traj = run(engine)
    inject = render_tool_result("add", "5")
    assert traj.finish_reason == "final" and traj.final_text == "\\boxed{5}"
    assert traj.num_turns == 2 and traj.errors == []
    assert [(c.name, json.loads(c.arguments), c.result, c.error) for c in traj.tool_calls] == [
        ("add", {"a": 2, "b": 3}, "5", None)
    ]
    assert_layout(traj, [(tok(call_text), True, 0), (inject, False, None), (tok(FINAL), True, 1)])
    # the engine saw exactly prompt + sampled ids + injected ids: nothing re-tokenized
    assert engine.contexts == [PROMPT, PROMPT + tok(call_text) + inject]
    assert inject[-2:] == [START, *encode_text("assistant")] and tok(call_text)[-1] == CALL
    assert traj.weight_version == 1  # the oldest turn's version
    assert traj.weight_versions == [1, 2] and traj.mixed_weight_versions  # the version each turn was served on


@pytest.mark.parametrize(
    "call_text, expected_error",
    [
        ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": <|call|>', "not valid JSON"),
        ("<|channel|>commentary to=functions.add <|constrain|>json<|message|>[1, 2]<|call|>", "must be a JSON object"),
        (
            '<|channel|>commentary to=functions.mul <|constrain|>json<|message|>{"a": 2}<|call|>',
            "unknown tool 'functions.mul'",
        ),
        (
            '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2}<|call|>',
            "missing required argument",
        ),
        (
            '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": "2", "b": 3}<|call|>',
            "must be integer",
        ),
        ('<|channel|>commentary to=functions.fail <|constrain|>json<|message|>{"reason": "no"}<|call|>', "refused: no"),
        ('<|channel|>commentary <|constrain|>json<|message|>{"a": 2}<|call|>', "malformed tool call"),
    ],
    ids=["bad-json", "not-object", "unknown-tool", "missing-arg", "wrong-type", "tool-error", "no-recipient"],
)
def test_malformed_calls_return_errors_and_continue(call_text, expected_error):
    engine = ScriptedEngine([call_text, FINAL])
    traj = run(engine)
    assert traj.finish_reason == "final" and traj.num_turns == 2
    (record,) = traj.tool_calls
    assert record.result is None and expected_error in record.error
    assert not any(expected_error in e for e in traj.errors)  # tool errors are recorded once, on the call
    author = "unknown" if "no-recipient" in expected_error or record.name == "" else record.name
    inject = render_tool_result(author, f"Error: {record.error}")
    assert_layout(traj, [(tok(call_text), True, 0), (inject, False, None), (tok(FINAL), True, 1)])


def test_tool_timeout_is_an_error_for_the_model():
    call = '<|channel|>commentary to=functions.slow <|constrain|>json<|message|>{"seconds": 5}<|call|>'
    traj = run(ScriptedEngine([call, FINAL]), tool_timeout_s=0.05)
    assert traj.finish_reason == "final" and "timed out" in traj.tool_calls[0].error


def test_max_turns_stops_and_skips_the_last_call():
    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 1}<|call|>'
    engine = ScriptedEngine([call] * 3)
    traj = run(engine, max_turns=3)
    inject = render_tool_result("add", "2")
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3 and len(engine.contexts) == 3
    assert [c.result for c in traj.tool_calls] == ["2", "2", None]
    assert traj.tool_calls[2].error == "max_turns reached: not executed"
    assert_layout(
        traj,
        [
            (tok(call), True, 0),
            (inject, False, None),
            (tok(call), True, 1),
            (inject, False, None),
            (tok(call), True, 2),
        ],
    )


def test_truncation_at_the_token_budget():
    call = tok(CALL_MODEL_FORM)
    inject = render_tool_result("add", "5")
    budget = len(call) + len(inject) + 7  # 7 tokens left for the second turn
    engine = ScriptedEngine([CALL_MODEL_FORM, FINAL])
    traj = run(engine, max_completion_tokens=budget)
    assert engine.max_new == [min(256, budget), 7]  # each turn samples at most what is left
    assert traj.finish_reason == "length" and len(traj.completion_ids) == budget
    assert_layout(traj, [(call, True, 0), (inject, False, None), (tok(FINAL)[:7], True, 1)])


def test_per_turn_cap_and_tool_output_overflow_end_with_length():
    # a turn cut by the per-turn cap (no stop token) ends the trajectory
    traj = run(ScriptedEngine([FINAL]), sampling=SamplingParams(max_new_tokens=5))
    assert traj.finish_reason == "length" and traj.completion_ids == tok(FINAL)[:5]
    # a tool result that would not leave room for one sampled token is not appended
    call = tok(CALL_MODEL_FORM)
    traj = run(ScriptedEngine([CALL_MODEL_FORM, FINAL]), max_completion_tokens=len(call) + 5)
    assert traj.finish_reason == "length" and traj.completion_ids == call and traj.tool_calls[0].result == "5"


def test_long_tool_output_is_truncated():
    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 123456789, "b": 1}<|call|>'
    traj = run(ScriptedEngine([call, FINAL]), max_tool_output_chars=4)
    inject = render_tool_result("add", "1234\n...[truncated 5 characters]")
    assert_layout(traj, [(tok(call), True, 0), (inject, False, None), (tok(FINAL), True, 1)])


def test_stops_without_final_answer():
    # <|return|> without a final-channel message
    traj = run(ScriptedEngine(["<|channel|>analysis<|message|>hmm<|return|>"]))
    assert traj.finish_reason == "no_final" and traj.final_text is None and traj.errors
    # <|end|> as an extra stop token: the loop opens the next assistant message (mask 0) and goes on
    sampling = SamplingParams(max_new_tokens=64, stop_token_ids=(RETURN, CALL, 200007))
    first = "<|channel|>analysis<|message|>thinking<|end|>"
    second = "<|channel|>final<|message|>done<|return|>"
    traj = run(ScriptedEngine([first, second]), sampling=sampling)
    assert traj.finish_reason == "final" and traj.final_text == "done"
    assert_layout(
        traj, [(tok(first), True, 0), ([START, *encode_text("assistant")], False, None), (tok(second), True, 1)]
    )


def test_engine_abort_and_failure():
    traj = run(ScriptedEngine([CALL_MODEL_FORM, "abort"]))
    assert traj.finish_reason == "abort" and traj.num_turns == 2 and len(traj.tool_calls) == 1
    traj = run(ScriptedEngine([RuntimeError("server gone")]))
    assert traj.finish_reason == "abort" and traj.completion_ids == [] and "server gone" in traj.errors[0]


def test_weight_versions_are_the_served_ones_per_turn():
    class FirstTurnUnversioned(ScriptedEngine):  # e.g. a server answering on its launch weights, then synced
        async def generate(self, input_ids, sampling):
            out = await super().generate(input_ids, sampling)
            out.weight_version = None if len(self.contexts) == 1 else 4
            return out

    traj = run(FirstTurnUnversioned([CALL_MODEL_FORM, FINAL]))
    assert traj.weight_versions == [None, 4] and traj.mixed_weight_versions
    assert traj.weight_version is None  # the first (oldest) turn's, not the first version that is not None
    traj = run(ScriptedEngine([FINAL]))
    assert traj.weight_versions == [1] and traj.weight_version == 1 and not traj.mixed_weight_versions
    traj = run(ScriptedEngine([RuntimeError("server gone")]))  # nothing was served
    assert traj.weight_versions == [] and traj.weight_version is None and not traj.mixed_weight_versions


def test_run_batch_is_concurrent_and_ordered():
    n = 12
    prompts = [render_prompt([{"role": "user", "content": f"q{i}"}], tools=TOOLS) for i in range(n)]

    class PerPrompt(ScriptedEngine):
        def next_entry(self, input_ids):
            i = next(k for k, p in enumerate(prompts) if input_ids[: len(p)] == p)
            return CALL_MODEL_FORM if len(input_ids) == len(prompts[i]) else f"<|channel|>final<|message|>{i}<|return|>"

    engine = PerPrompt([], delay_s=0.05)
    loop = AgentLoop(engine, TOOLS, sampling=SamplingParams(max_new_tokens=128), max_concurrency=8)
    trajs = asyncio.run(loop.run_batch(prompts))
    assert [t.final_text for t in trajs] == [str(i) for i in range(n)]
    assert [t.prompt_ids for t in trajs] == prompts
    assert 1 < engine.max_active <= 8

    async def inside_a_running_loop():  # e.g. a notebook cell
        return loop.run_batch_sync(prompts[:2])

    assert [t.final_text for t in asyncio.run(inside_a_running_loop())] == ["0", "1"]
    assert [t.final_text for t in loop.run_batch_sync(prompts[:1])] == ["0"]


def test_run_batch_shows_progress(capsys):
    prompts = [render_prompt([{"role": "user", "content": f"q{i}"}], tools=TOOLS) for i in range(3)]

    class PerPrompt(ScriptedEngine):
        def next_entry(self, input_ids):
            return CALL_MODEL_FORM if CALL not in input_ids else FINAL

    loop = AgentLoop(PerPrompt([]), TOOLS, sampling=SamplingParams(max_new_tokens=128), progress=True)
    trajs = asyncio.run(loop.run_batch(prompts))
    assert [t.num_turns for t in trajs] == [2, 2, 2]
    err = capsys.readouterr().err
    assert "rollouts" in err and "3/3" in err and "turns=2.00" in err and "tool_calls=1.00" in err
    quiet = AgentLoop(PerPrompt([]), TOOLS, sampling=SamplingParams(max_new_tokens=128))  # off by default
    asyncio.run(quiet.run_batch(prompts))
    assert capsys.readouterr().err == ""


def test_plain_turn_format_is_one_turn_without_tools():
    """Models that do not speak harmony: one generate call; a stop token is a final answer, the budget a cut."""
    stop = 7
    engine = ScriptedEngine([[5, 6, stop], [5, 6, 8, 9]])
    loop = AgentLoop(engine, sampling=SamplingParams(max_new_tokens=3, stop_token_ids=(stop,)), turn_format="plain")
    first, second = (asyncio.run(loop.run([1, 2])) for _ in range(2))
    assert (first.completion_ids, first.finish_reason, first.num_turns) == ([5, 6, stop], "final", 1)
    assert (second.completion_ids, second.finish_reason) == ([5, 6, 8], "length")
    assert first.completion_mask == [1, 1, 1] and first.errors == [] and first.final_text is None
    with pytest.raises(ValueError, match="turn_format='plain' takes no tools"):
        AgentLoop(engine, TOOLS, sampling=SamplingParams(max_new_tokens=3), turn_format="plain")


@pytest.mark.parametrize("backend", ["embedded", "sglang-http"])
def test_rollout_logprobs_match_the_trainer_forward(backend):
    """Prompt + completion scored by the model in one forward reproduce the rollout log-probs where mask == 1,
    in process and through the SGLang client + the local SGLang-protocol server."""
    from fake_sglang_server import FakeSGLangServer  # tests/: a test double of SGLang's HTTP server
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from trl_ext.rollout import EmbeddedEngine, SGLangEngine

    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config(hidden_size=32, intermediate_size=32, head_dim=8)).float().eval()
    embedded = EmbeddedEngine(model, seed=0)
    server = FakeSGLangServer(embedded).start() if backend == "sglang-http" else None
    engine = SGLangEngine(server.url, timeout_s=60) if server else embedded
    loop = AgentLoop(
        engine, TOOLS, sampling=SamplingParams(max_new_tokens=6, temperature=0.8), max_completion_tokens=12
    )
    prompts = [PROMPT, render_prompt([{"role": "user", "content": "Hi"}])]
    try:
        trajs = loop.run_batch_sync(prompts)
    finally:
        if server:
            asyncio.run(engine.close())
            server.stop()
        embedded.shutdown()
    for traj in trajs:
        assert traj.finish_reason == "length" and sum(traj.completion_mask) == len(traj.completion_ids) > 0
        assert traj.weight_version == 0
        ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(traj.prompt_ids) - 1 : -1].double() / 0.8
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(traj.completion_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(traj.rollout_logprobs, dtype=torch.float64), ref, rtol=0, atol=3e-5)
