"""What reward functions receive from `AgenticGRPOTrainer`: TRL's `completions`, plus the agent loop's keywords.

TRL 1.16 hands a reward, for a chat prompt, the completion as messages (`GRPOTrainer._generate` and
`_tool_call_loop`, each assistant turn parsed by `trl.chat_template_utils.parse_response`): the assistant message with
`tool_calls`, the `tool` message, the next assistant message. The same scripted GPT-OSS conversation runs through
TRL's own trainer (its tool loop, its GPT-OSS chat template and response parser; generation replaced by the script)
and through `AgenticGRPOTrainer` (the agent loop on a scripted engine), and both rewards must receive the same
`completions`. A reward written for a tool-free answer, `trl.rewards.accuracy_reward`, must grade the final answer,
not the reasoning or the channel markup.
"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from test_trainer import add  # the trainer tests' `add` tool
from transformers import GptOssForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import gptoss_chat_template

from hf_gptoss_rl.harmony import CALL, END, RETURN, load_gptoss_tokenizer
from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext import AgenticGRPOTrainer
from trl_ext.rollout import AgentLoop, GenerationOutput, RolloutEngine, SamplingParams
from trl_ext.rollout_batch import reward_completions
from trl_ext.tools import FunctionTool

CPU = dict(use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
QUESTION = "What is 2 + 3?"

# A call with the recipient in the header, as GPT-OSS's chat template renders it: the only placement TRL's GPT-OSS
# response template (`gptoss_template`) parses.
TOOL_TURN = (
    "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant to=functions.add<|channel|>commentary json"
    '<|message|>{"a": 2, "b": 3}<|call|>'
)
# The same call as GPT-OSS samples it (recipient after the channel, `<|constrain|>json`), which TRL's template misses.
SAMPLED_TOOL_TURN = (
    "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.add "
    '<|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
)
ANSWER_TURN = (
    "<|channel|>analysis<|message|>2 + 3 = 5.<|end|><|start|>assistant<|channel|>final<|message|>\\boxed{5}<|return|>"
)
EXPECTED = [
    {
        "role": "assistant",
        "thinking": "Use the tool.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        "content": "",
    },
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "thinking": "2 + 3 = 5.", "content": "\\boxed{5}"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_gptoss_tokenizer()


def tiny_model() -> GptOssForCausalLM:
    torch.manual_seed(0)
    config = tiny_gptoss_config(num_hidden_layers=1, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    return GptOssForCausalLM(config)


def config(tmp_path) -> GRPOConfig:
    # one prompt, two generations; a budget the whole conversation fits in (TRL cuts what goes past it)
    return GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=256, **CPU
    )


def rows(prompt, **columns) -> list[dict]:
    return [{"prompt": prompt, **columns}] * 2


def recording_reward(seen: dict):
    def record(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [0.0] * len(completions)

    return record


def turn_of(input_ids, turns: list[str]) -> str:
    """The scripted turn for a context: the first before any call, the next one after each call."""
    return turns[min(list(input_ids).count(CALL), len(turns) - 1)]


class ScriptedEngine(RolloutEngine):
    """Answers with the scripted turn for the context (`turn_of`), cut at a stop id or `max_new_tokens`."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tok, self.turns = tokenizer, turns

    @property
    def weight_version(self):
        return 0

    async def health(self):
        return True

    async def update_weights(self, named_tensors, *, version):
        pass

    def next_turn(self, input_ids) -> str:
        return turn_of(input_ids, self.turns)

    async def generate(self, input_ids, sampling):
        out = []
        for token in self.tok.encode(self.next_turn(input_ids), add_special_tokens=False):
            out.append(token)
            if token in sampling.stop_token_ids or len(out) == sampling.max_new_tokens:
                break
        reason = "stop" if out[-1] in sampling.stop_token_ids else "length"
        return GenerationOutput(out, [-0.5] * len(out), reason, 0)


class SequenceEngine(ScriptedEngine):
    """Answers with the scripted turns in order (one trajectory)."""

    def next_turn(self, input_ids) -> str:
        return self.turns.pop(0)


def agentic_scores(tmp_path, tokenizer, turns, reward_funcs, inputs) -> AgenticGRPOTrainer:
    trainer = AgenticGRPOTrainer(
        model=tiny_model(),
        reward_funcs=reward_funcs,
        args=config(tmp_path),
        train_dataset=Dataset.from_list(inputs),
        processing_class=tokenizer,
        tools=[add],
        rollout_engine=ScriptedEngine(tokenizer, turns),
    )
    trainer.model.train()
    trainer._generate_and_score_completions([dict(x) for x in inputs])  # where TRL calls the reward functions
    return trainer


def test_tool_conversation_reaches_the_reward_as_trl_passes_it(tmp_path, tokenizer):
    inputs = rows([{"role": "user", "content": QUESTION}])

    # TRL's trainer with its own copy of GPT-OSS's chat template, the one `add_response_schema` recognises (tool results
    # rendered by it, turns parsed by TRL's response template); its generation returns the scripted turns
    trl_tokenizer = copy.deepcopy(tokenizer)
    trl_tokenizer.chat_template = gptoss_chat_template
    trl_seen: dict = {}
    trl_trainer = GRPOTrainer(
        model=tiny_model(),
        reward_funcs=recording_reward(trl_seen),
        args=config(tmp_path / "trl"),
        train_dataset=Dataset.from_list(inputs),
        processing_class=trl_tokenizer,
        tools=[add],
    )

    def scripted_generation(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        turns = [trl_tokenizer.encode(turn_of(ids, [TOOL_TURN, ANSWER_TURN]), add_special_tokens=False)
                 for ids in prompt_ids]  # fmt: skip
        return turns, None

    trl_trainer._generate_single_turn = scripted_generation
    trl_trainer.model.train()
    trl_trainer._generate_and_score_completions([dict(x) for x in inputs])
    assert trl_seen["completions"] == [EXPECTED, EXPECTED]  # what TRL makes of the conversation

    seen: dict = {}
    agentic_scores(tmp_path / "agentic", tokenizer, [TOOL_TURN, ANSWER_TURN], recording_reward(seen), inputs)
    assert seen["completions"] == trl_seen["completions"]
    # the agent loop's keywords come along
    assert seen["final_text"] == ["\\boxed{5}"] * 2 and seen["num_tool_calls"] == [1, 1]
    assert seen["tool_errors"] == [0, 0] and seen["format_errors"] == [0, 0] and seen["num_turns"] == [2, 2]


def test_call_as_the_model_samples_it_gives_the_same_messages(tmp_path, tokenizer):
    seen: dict = {}
    inputs = rows([{"role": "user", "content": QUESTION}])
    agentic_scores(tmp_path, tokenizer, [SAMPLED_TOOL_TURN, ANSWER_TURN], recording_reward(seen), inputs)
    assert seen["completions"] == [EXPECTED, EXPECTED]


# The reasoning repeats the answer format the prompt asks for (`\boxed{answer}`); the final answer is right.
TOOL_FREE_TURN = (
    "<|channel|>analysis<|message|>Reply in the form \\boxed{answer}. 2 + 3 = 5.<|end|><|start|>assistant"
    "<|channel|>final<|message|>The answer is $5$.<|return|>"
)


def test_accuracy_reward_grades_the_final_answer(tmp_path, tokenizer):
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    inputs = rows([{"role": "user", "content": QUESTION + " Answer in \\boxed{}."}], solution="5")
    trainer = agentic_scores(tmp_path, tokenizer, [TOOL_FREE_TURN], [accuracy_reward], inputs)
    assert list(trainer._logs["rewards"]["accuracy_reward"]) == [1.0, 1.0]  # this trainer's one batch


# A turn cut off by the token budget in its reasoning: no final answer, but the model wrote something.
TRUNCATED_TURN = "<|channel|>analysis<|message|>Let me add the two numbers, 2 and 3"


def test_text_prompt_gets_trls_decoding_of_a_truncated_completion(tmp_path, tokenizer):
    """TRL passes a text prompt's completion as `processing_class.batch_decode(completion_ids,
    skip_special_tokens=True)`: a truncated completion, which has no final answer, is not empty."""
    seen: dict = {}
    agentic_scores(tmp_path, tokenizer, [TRUNCATED_TURN], recording_reward(seen), rows(QUESTION))
    assert seen["finish_reason"] == ["length", "length"] and seen["final_text"] == ["", ""]
    assert seen["completions"] == tokenizer.batch_decode(seen["completion_ids"], skip_special_tokens=True)
    assert seen["completions"] == ["analysisLet me add the two numbers, 2 and 3"] * 2


def test_text_prompt_gets_trls_decoding_of_the_whole_trajectory(tmp_path, tokenizer):
    """With a tool call, the decoded completion is the whole trajectory (turns and tool message), as TRL decodes the
    completion ids it trains on; the final answer comes as `final_text`."""
    seen: dict = {}
    agentic_scores(tmp_path, tokenizer, [TOOL_TURN, ANSWER_TURN], recording_reward(seen), rows(QUESTION))
    assert seen["completions"] == tokenizer.batch_decode(seen["completion_ids"], skip_special_tokens=True)
    assert seen["completions"][0].endswith("assistantfinal\\boxed{5}") and "functions.add" in seen["completions"][0]
    assert seen["final_text"] == ["\\boxed{5}", "\\boxed{5}"] and seen["num_tool_calls"] == [1, 1]


@pytest.mark.parametrize(
    "text",
    [
        TRUNCATED_TURN,  # cut in the reasoning: the partial reasoning under `thinking`
        "<|channel|>analysis<|message|>2 + 3 = 5.<|end|><|start|>assistant<|channel|>final<|message|>\\boxed{5",
        "<|channel|>final<|message|>The answer is",  # cut in the answer: the partial answer as `content`
        "<|channel|>analysis<|message|>2 + 3 = 5.<|end|><|start|>assistant<|channel|>fin",  # cut in a header
        SAMPLED_TOOL_TURN[: SAMPLED_TOOL_TURN.index("3}")],  # cut in a call's arguments: no call
        "The sky is blue",  # no harmony structure at all
        ANSWER_TURN,  # the positive control: a complete turn
    ],
    ids=["analysis", "final-after-analysis", "final", "header", "call-arguments", "no-structure", "complete"],
)
def test_truncated_turn_message_is_what_trls_parser_gives(tokenizer, text):
    """`AssistantTurn.to_message` against TRL's own parse of the same ids (`trl.chat_template_utils.parse_response`
    with TRL's GPT-OSS response template, the prompt as prefix), for turns cut off anywhere."""
    from trl.chat_template_utils import add_response_schema, parse_response

    from hf_gptoss_rl.harmony import parse_assistant_turn

    trl_tokenizer = copy.deepcopy(tokenizer)
    trl_tokenizer.chat_template = gptoss_chat_template
    add_response_schema(trl_tokenizer)
    prompt = trl_tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert parse_assistant_turn(ids).to_message() == parse_response(trl_tokenizer, ids, prefix=prompt)


CALL_MESSAGE = EXPECTED[0]
ANSWER_MESSAGE = EXPECTED[2]
BAD_JSON_CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2,<|call|>'


@pytest.mark.parametrize(
    "turns, limits, expected",
    [
        # a turn stopped by <|end|> (an extra stop id) goes on sampling the same assistant message
        (["<|channel|>analysis<|message|>2 + 3 = 5.<|end|>", "<|channel|>final<|message|>\\boxed{5}<|return|>"],
         {"stop_token_ids": (RETURN, CALL, END)}, [ANSWER_MESSAGE]),
        # arguments that are not JSON: no parsed call (as in TRL); the model read an error, and so does the reward
        ([BAD_JSON_CALL, ANSWER_TURN], {},
         [{"role": "assistant", "content": ""},
          {"role": "tool", "name": "add", "content": "Error: tool call arguments are not valid JSON (Expecting property "
           "name enclosed in double quotes at char 8)"},
          ANSWER_MESSAGE]),
        # the last allowed turn calls a tool: the call is not run, no tool message
        ([TOOL_TURN], {"max_turns": 1}, [CALL_MESSAGE]),
        # the tool result does not fit the budget: its tokens are not appended, nor its message
        ([TOOL_TURN], {"max_completion_tokens": 40}, [CALL_MESSAGE]),
        # a final answer cut off by the token budget: its partial text, as TRL's parser gives it (`final_text` is "")
        (["<|channel|>analysis<|message|>2 + 3 = 5.<|end|><|start|>assistant<|channel|>final<|message|>\\boxed{5}"
          "<|return|>"], {"max_new_tokens": 21}, [{"role": "assistant", "thinking": "2 + 3 = 5.", "content": "\\boxed{5"}]),
    ],
    ids=["end-stop", "bad-json", "max-turns", "no-room-for-result", "cut-answer"],
)  # fmt: skip
def test_trajectory_messages(tokenizer, turns, limits, expected):
    limits = dict(limits)
    sampling = {k: limits.pop(k) for k in ("stop_token_ids", "max_new_tokens") if k in limits}
    loop = AgentLoop(
        SequenceEngine(tokenizer, list(turns)),
        [FunctionTool(add)],
        sampling=SamplingParams(**{"max_new_tokens": 256, **sampling}),
        **limits,
    )
    traj = loop.run_batch_sync([tokenizer.encode("<|start|>user<|message|>What is 2 + 3?<|end|><|start|>assistant")])[0]
    assert traj.messages == expected


def test_a_trajectory_that_sampled_nothing_is_an_empty_answer():
    """An aborted request can return no token: the reward gets what TRL makes of an empty completion."""
    from trl_ext.rollout.types import Trajectory

    empty = Trajectory(prompt_ids=[1], finish_reason="abort")
    chat = [{"role": "user", "content": QUESTION}]
    assert reward_completions([chat], [empty]) == [[{"role": "assistant", "content": ""}]]
    # text prompts: TRL's own decoding of the completion ids (for an empty trajectory, a pad: "")
    assert reward_completions([QUESTION], [empty]) is None
