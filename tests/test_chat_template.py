"""The offline GPT-OSS tokenizer's harmony chat template: the same token ids as openai-harmony (through
`render_prompt`), and a trained checkpoint's tokenizer that renders chats wherever it is loaded."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from jinja2.exceptions import TemplateError
from transformers import GptOssForCausalLM

from hf_gptoss_rl.harmony import RETURN, encode_text, load_gptoss_tokenizer, render_prompt
from hf_gptoss_rl.model_builders import tiny_gptoss_config


@pytest.fixture(scope="module")
def tok():
    return load_gptoss_tokenizer()


def template_ids(tok, messages, *, tools=None, add_generation_prompt=True, **kwargs) -> list[int]:
    ids = tok.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(ids)


def harmony_training_ids(messages, **kwargs) -> list[int]:
    """openai-harmony's rendering of the whole conversation for training: `render_prompt` (harmony's
    `render_conversation_for_completion`) minus the `<|start|>assistant` it appends, with the last `<|end|>` of a
    conversation that ends in a final answer replaced by `<|return|>` (`render_conversation_for_training`)."""
    ids = render_prompt(messages, **kwargs)
    tail = [ids[-2], *encode_text("assistant")]
    assert ids[-len(tail) :] == tail
    ids = ids[: -len(tail)]
    last = messages[-1]
    if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
        ids[-1] = RETURN
    return ids


def get_weather(city: str, unit: str = "c") -> str:
    """Get the current weather.

    Args:
        city: The city, e.g. "Paris".
        unit: Temperature unit.
    """
    return "20"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather.\nSecond line of the description.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                "days": {"type": "integer", "default": 1, "description": "Forecast days"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}
# every schema construct harmony's json_schema_to_typescript knows, flat and nested
KITCHEN_SINK = {
    "name": "kitchen_sink",
    "description": "Exercise the schema conversion.",
    "parameters": {
        "type": "object",
        "description": "Top-level object.",
        "properties": {
            "title_and_examples": {"type": "string", "title": "A title", "examples": ["a", "b"]},
            "nullable": {"type": "string", "nullable": True, "description": "Maybe null."},
            "union": {"type": ["integer", "string", "null"]},
            "number": {"type": "number", "default": 0.5},
            "flag": {"type": "boolean", "default": False},
            "anything": {"type": "array"},
            "untyped": {"description": "No type."},
            "enum_default": {"type": "string", "enum": ["x", "y"], "default": "y"},
            "string_default": {"type": "string", "default": "hello"},
            "object_default": {"type": "object", "properties": {}, "default": {"k": [1, 2]}},
            "nested": {
                "type": "object",
                "properties": {
                    "inner": {"type": "integer", "description": "Inner value."},
                    "deeper": {
                        "type": "object",
                        "properties": {"leaf": {"type": "array", "items": {"type": "number"}}},
                        "required": ["leaf"],
                    },
                },
                "required": ["inner"],
            },
            "alternatives": {
                "description": "One of two.",
                "default": "a",
                "oneOf": [
                    {"type": "string", "description": "A string."},
                    {"type": "integer", "nullable": True, "default": 3, "description": "A number."},
                ],
            },
            "same_description": {
                "description": "Shared.",
                "oneOf": [{"type": "string", "description": "Shared."}, {"type": "boolean"}],
            },
        },
        "required": ["union", "nested"],
    },
}
NO_PARAMETERS = {"name": "ping", "description": ""}
TOP_LEVEL_ONE_OF = {"name": "pick", "parameters": {"oneOf": [{"type": "string"}, {"type": "number", "default": 1}]}}

CONVERSATIONS = {
    "plain chat": ([{"role": "user", "content": "What is 2 + 2?"}], {}),
    "multi-turn with reasoning": (
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "thinking": "Simple arithmetic.", "content": "4"},
            {"role": "user", "content": "And 9 / 2?"},
        ],
        {},
    ),
    "system instructions": (
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
        {"developer_instructions": "Be brief.", "conversation_start_date": "2025-06-28"},
    ),
    "developer message": (
        [{"role": "developer", "content": "Only JSON."}, {"role": "user", "content": "Hi"}],
        {"reasoning_effort": "low"},
    ),
    "tool call and result": (
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "thinking": "I need the weather.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "name": "get_weather", "content": '{"temperature": 20}'},
        ],
        {"tools": [WEATHER], "reasoning_effort": "high"},
    ),
    "tool round then answer then new question": (
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "reasoning_content": "Call the tool.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}],
            },
            {"role": "tool", "name": "get_weather", "content": "18"},
            {"role": "assistant", "thinking": "It is 18.", "content": "18 °C."},
            {"role": "user", "content": "Thanks. Tomorrow?"},
            {
                "role": "assistant",
                "thinking": "Call again.",
                "tool_calls": [{"name": "get_weather", "arguments": "{}"}],
            },
            {"role": "tool", "name": "get_weather", "content": "ok"},
        ],
        {"tools": [WEATHER, KITCHEN_SINK, NO_PARAMETERS, TOP_LEVEL_ONE_OF], "reasoning_effort": "medium"},
    ),
    "commentary preamble and explicit channel": (
        [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "channel": "commentary", "content": "Working on it."},
            {"role": "assistant", "channel": "analysis", "content": "Think first."},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Again"},
            {"role": "assistant", "channel": "analysis", "content": "Second thoughts."},
            {"role": "assistant", "content": "Done again."},
            {"role": "user", "content": "Once more"},
        ],
        {},
    ),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_template_renders_the_ids_of_openai_harmony(tok, name):
    messages, kwargs = CONVERSATIONS[name]
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    expected = render_prompt(messages, tools=tools, **kwargs)
    got = template_ids(tok, messages, tools=tools, **kwargs)
    assert got == expected, "\n" + tok.decode(got) + "\n----- harmony:\n" + tok.decode(expected)


@pytest.mark.parametrize(
    "messages",
    [
        # a finished answer: earlier reasoning before the first final answer is dropped, the last final ends <|return|>
        CONVERSATIONS["multi-turn with reasoning"][0][:2],
        CONVERSATIONS["multi-turn with reasoning"][0]
        + [{"role": "assistant", "thinking": "9 / 2 = 4.5", "content": "4.5"}],
        CONVERSATIONS["commentary preamble and explicit channel"][0][:-1],
        # still working (last assistant message is a tool call): every analysis message is kept
        CONVERSATIONS["tool round then answer then new question"][0][:2],
    ],
)
def test_template_without_generation_prompt_renders_harmony_training_ids(tok, messages):
    tools = [WEATHER]
    assert template_ids(tok, messages, tools=tools, add_generation_prompt=False) == harmony_training_ids(
        messages, tools=tools
    )


def test_python_functions_as_tools(tok):
    """transformers turns a typed, documented function into a JSON schema; the template renders it as harmony does."""
    from transformers.utils import get_json_schema

    messages = [{"role": "user", "content": "Weather?"}]
    assert template_ids(tok, messages, tools=[get_weather]) == render_prompt(
        messages, tools=[get_json_schema(get_weather)]
    )


def test_reasoning_effort_and_tools_reach_the_system_message(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[WEATHER], tokenize=False, reasoning_effort="low"
    )
    assert "Reasoning: low" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert "type get_weather = (_: {" in text
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "Reasoning: medium" in plain and "# Tools" not in plain and "<|start|>developer" not in plain


def test_tool_result_without_name_takes_the_called_function(tok):
    messages = CONVERSATIONS["tool call and result"][0]
    unnamed = [*messages[:-1], {"role": "tool", "tool_call_id": "call_0", "content": messages[-1]["content"]}]
    assert template_ids(tok, unnamed, tools=[WEATHER]) == template_ids(tok, messages, tools=[WEATHER])


def test_assistant_tokens_mask_covers_the_assistant_messages(tok):
    """`{% generation %}` blocks: TRL's `assistant_only_loss` trains on what follows each `<|start|>assistant`."""
    messages = CONVERSATIONS["tool call and result"][0] + [{"role": "assistant", "content": "20 degrees."}]
    out = tok.apply_chat_template(
        messages, tools=[WEATHER], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    # the analysis before the answer is dropped (harmony's rule for a conversation that ends in a final answer)
    assert trained == (
        ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        "<|channel|>final<|message|>20 degrees.<|return|>"
    )
    assert tok.decode(ids).endswith("<|start|>assistant<|channel|>final<|message|>20 degrees.<|return|>")


@pytest.mark.parametrize(
    "messages, kwargs, error",
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], {}, "only allowed first"),
        ([{"role": "narrator", "content": "a"}], {}, "unknown role"),
        ([{"role": "user", "content": "a"}], {"reasoning_effort": "max"}, "reasoning_effort must be one of"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "1"}], {}, "needs the tool's name"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}], {}, "has no content"),
    ],
)
def test_template_rejects_bad_conversations(tok, messages, kwargs, error):
    with pytest.raises(TemplateError, match=error):
        tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_duplicate_tool_names_are_refused(tok):
    with pytest.raises(TemplateError, match="duplicate tool name: get_weather"):
        tok.apply_chat_template([{"role": "user", "content": "a"}], tools=[WEATHER, WEATHER], tokenize=False)


def test_trained_checkpoint_renders_chats_wherever_it_is_loaded(tmp_path):
    """One GRPO step of a tiny GPT-OSS with the embedded engine, `trainer.save_model`, then the checkpoint is used the
    way anyone downloading it would: `AutoTokenizer` + `apply_chat_template` and a text-generation pipeline."""
    from transformers import AutoTokenizer, pipeline

    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer

    torch.manual_seed(0)
    config = tiny_gptoss_config(num_hidden_layers=1, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=8, max_turns=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=0, rollout_backend="embedded",
    )  # fmt: skip
    trainer = AgenticGRPOTrainer(
        model=GptOssForCausalLM(config),
        reward_funcs=lambda completions, **kwargs: [float(len(str(c))) for c in completions],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}"}]} for i in range(2)]),
    )  # the default processing_class: the offline GPT-OSS tokenizer
    trainer.train()
    saved = tmp_path / "model"
    trainer.save_model(str(saved))
    assert (saved / "chat_template.jinja").is_file()

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    reloaded = AutoTokenizer.from_pretrained(saved)
    ids = reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == render_prompt(messages)

    generator = pipeline("text-generation", model=str(saved), device="cpu")
    out = generator(messages, max_new_tokens=3, do_sample=False)
    conversation = out[0]["generated_text"]
    assert conversation[:2] == messages and conversation[-1]["role"] == "assistant"
