"""AgenticGRPOTrainer as a drop-in for TRL's GRPOTrainer: TRL's fields honoured or refused by name, plain GRPOConfig,
dataset checks, the sampler without shuffling, the default tokenizer, TRL's rollout_func (tiny GPT-OSS, CPU)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from datasets import Dataset
from transformers import GptOssForCausalLM
from trl import GRPOConfig

from hf_gptoss_rl.harmony import CALL, load_gptoss_tokenizer
from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_ext.rollout import GenerationOutput, RolloutEngine, SamplingParams
from trl_ext.rollout.sglang import sampling_params_payload
from trl_ext.rollout.types import sampling_params_from_config
from trl_ext.trainer import _EpochSeededRepeatSampler

CPU = dict(use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_gptoss_tokenizer()


def tiny_model() -> GptOssForCausalLM:
    torch.manual_seed(0)
    config = tiny_gptoss_config(num_hidden_layers=1, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    return GptOssForCausalLM(config)


def dataset(n: int = 4) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is 2 + {i}?"}]} for i in range(n)])


def reward_len(completions, **kwargs):
    return [float(len(c[0]["content"]) if isinstance(c, list) else len(c)) for c in completions]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def config(tmp_path, cls=AgenticGRPOConfig, **overrides):
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=16)
    return cls(**{**kwargs, **CPU, **overrides})


def trainer(tmp_path, tokenizer, args=None, **kwargs):
    kwargs.setdefault("reward_funcs", reward_len)
    kwargs.setdefault("train_dataset", dataset())
    return AgenticGRPOTrainer(
        model=tiny_model(), args=args if args is not None else config(tmp_path), processing_class=tokenizer, **kwargs
    )


# ---------------------------------------------------------------- configs


def test_config_parses_next_to_trl_model_config(tmp_path):
    """A TRL script's parser, `TrlParser((..., AgenticGRPOConfig, ModelConfig))`: `--attn_implementation` is
    `ModelConfig`'s (the option cannot be defined twice), while `AgenticGRPOConfig(attn_implementation=...)` keeps
    working in Python."""
    from trl import ModelConfig, TrlParser

    parser = TrlParser((AgenticGRPOConfig, ModelConfig))
    args, model_args = parser.parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--attn_implementation", "eager", "--experts_implementation",
         "memory_efficient"]
    )  # fmt: skip
    assert model_args.attn_implementation == "eager" and args.attn_implementation is None
    assert args.experts_implementation == "memory_efficient"
    assert config(tmp_path, attn_implementation="eager").attn_implementation == "eager"
    assert config(tmp_path).attn_implementation is None
    with pytest.raises(TypeError, match="attn_implementation must be a string or None, got int"):
        config(tmp_path, attn_implementation=1)


def test_plain_grpo_config_is_upgraded(tmp_path, tokenizer):
    plain = config(
        tmp_path,
        cls=GRPOConfig,
        learning_rate=3e-4,
        steps_per_generation=2,
        temperature=0.7,
        loss_type="bnpo",
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5,
        max_tool_calling_iterations=2,
    )
    t = trainer(tmp_path, tokenizer, args=plain)
    assert type(t.args) is AgenticGRPOConfig
    skip = {"generation_batch_size"}  # re-derived from steps_per_generation, to the same value
    for f in dataclasses.fields(GRPOConfig):
        if f.init and f.name not in skip:
            assert getattr(t.args, f.name) == getattr(plain, f.name), f.name
    assert t.args.generation_batch_size == plain.generation_batch_size
    assert t.args.rollout_backend == "embedded" and t.args.max_turns == 3  # agentic defaults; 2 tool rounds + 1
    assert t.agent_loop.max_turns == 3


def test_grpo_config_subclass_with_unknown_fields_is_refused(tmp_path, tokenizer):
    @dataclasses.dataclass
    class MyConfig(GRPOConfig):
        my_field: int = 1

    with pytest.raises(TypeError, match=r"fields AgenticGRPOConfig does not have: \['my_field'\]"):
        trainer(tmp_path, tokenizer, args=config(tmp_path, cls=MyConfig))
    with pytest.raises(TypeError, match="args must be a GRPOConfig"):
        trainer(tmp_path, tokenizer, args={"learning_rate": 1e-5})


def test_max_tool_calling_iterations_sets_the_turn_cap(tmp_path):
    assert config(tmp_path).max_turns == 8  # neither set
    assert config(tmp_path, max_tool_calling_iterations=1).max_turns == 2
    assert config(tmp_path, max_tool_calling_iterations=0).max_turns == 1
    assert config(tmp_path, max_turns=2, max_tool_calling_iterations=1).max_turns == 2
    with pytest.raises(ValueError, match="max_turns=2 and max_tool_calling_iterations=3 disagree"):
        config(tmp_path, max_turns=2, max_tool_calling_iterations=3)


def test_transformers_generation_fields_are_refused_with_guidance(tmp_path):
    with pytest.raises(ValueError, match="use_transformers_continuous_batching .*rollout_concurrency"):
        config(tmp_path, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="cache_implementation configures TRL's transformers generation"):
        config(tmp_path, cache_implementation="static")


def test_generation_kwargs_reach_the_sampling_params(tmp_path):
    args = config(
        tmp_path,
        temperature=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        top_k=0,
        generation_kwargs={"min_p": 0.2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "top_k": 20},
    )
    sampling = sampling_params_from_config(args)
    assert (sampling.temperature, sampling.min_p, sampling.repetition_penalty) == (0.9, 0.2, 1.1)  # kwargs win
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.top_k) == (0.5, 0.25, 20)
    assert sampling_params_from_config(config(tmp_path, generation_kwargs={"do_sample": False})).temperature == 0.0
    payload = sampling_params_payload(sampling)
    assert {k: payload[k] for k in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")} == {
        "min_p": 0.2, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
    }  # fmt: skip
    sglang_only = sampling_params_from_config(config(tmp_path, generation_kwargs={"min_new_tokens": 3}))
    assert sampling_params_payload(sglang_only)["min_new_tokens"] == 3
    # the trainer seeds each request itself: one seed for all would give a group's completions the same tokens
    with pytest.raises(ValueError, match=r"'sampling_seed': the trainer seeds every request"):
        config(tmp_path, generation_kwargs={"sampling_seed": 3})
    assert sampling_params_payload(replace(sampling, sampling_seed=7))["sampling_seed"] == 7
    with pytest.raises(ValueError, match=r"generation_kwargs: 'num_beams': beam search does not sample"):
        config(tmp_path, generation_kwargs={"num_beams": 4})
    with pytest.raises(ValueError, match=r"'suppress_tokens': not implemented by the rollout engines"):
        config(tmp_path, generation_kwargs={"suppress_tokens": [1]})
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        config(tmp_path, repetition_penalty=0.0)


def test_sampling_fields_reach_the_embedded_engine(tmp_path, tokenizer):
    t = trainer(tmp_path, tokenizer, args=config(tmp_path, min_p=0.1, generation_kwargs={"repetition_penalty": 1.3}))
    assert (t.agent_loop.sampling.min_p, t.agent_loop.sampling.repetition_penalty) == (0.1, 1.3)
    with pytest.raises(ValueError, match=r"\['min_new_tokens'\] are SGLang-only; the embedded engine"):
        trainer(tmp_path, tokenizer, args=config(tmp_path, generation_kwargs={"min_new_tokens": 1}))


# ---------------------------------------------------------------- constructor arguments and datasets


def test_reward_funcs_optional_with_trls_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="No reward source provided"):
        AgenticGRPOTrainer(tiny_model(), args=config(tmp_path), train_dataset=dataset(), processing_class=tokenizer)


def test_environment_factory_and_tools_guidance(tmp_path, tokenizer):
    class Env:
        def reset(self, **kwargs):
            return None

        def add(self, a: int, b: int) -> int:
            """Add.

            Args:
                a: first
                b: second
            """
            return a + b

    with pytest.raises(ValueError, match=r"environment_factory is not supported .*tools=\[\.\.\.\]"):
        trainer(tmp_path, tokenizer, environment_factory=Env)
    # TRL's way of passing tools, plain functions, works (wrapped in FunctionTool)
    t = trainer(tmp_path, tokenizer, tools=[add])
    assert [tool.name for tool in t.agent_tools] == ["add"] and t.tools == []  # TRL's own tool loop stays off


def test_dataset_without_prompt_column(tmp_path, tokenizer):
    bad = Dataset.from_dict({"question": ["a", "b"], "answer": ["1", "2"]})
    expected = r"train_dataset has no 'prompt' column \(its columns: \['question', 'answer'\]\)"
    with pytest.raises(ValueError, match=expected):
        trainer(tmp_path, tokenizer, train_dataset=bad)
    with pytest.raises(ValueError, match=r"eval_dataset\['b'\] has no 'prompt' column"):
        trainer(tmp_path, tokenizer, eval_dataset={"a": dataset(), "b": bad})


def test_default_tokenizer_is_harmony_for_gpt_oss(tmp_path):
    t = AgenticGRPOTrainer(tiny_model(), reward_len, config(tmp_path), dataset())
    assert len(t.processing_class) == 201088 and t.processing_class.convert_tokens_to_ids("<|call|>") == CALL


def test_sampler_without_shuffling(tmp_path, tokenizer):
    ds = dataset(8)
    plain = _EpochSeededRepeatSampler(ds, mini_repeat_count=2, batch_size=2, shuffle=False, seed=3)
    plain.set_epoch(1)  # TRL creates no generator without shuffling: this used to raise AttributeError
    assert list(plain) == [i for i in range(8) for _ in range(2)]
    shuffled = _EpochSeededRepeatSampler(ds, mini_repeat_count=1, batch_size=8, shuffle=True, seed=3)
    shuffled.set_epoch(1)
    first = list(shuffled)
    shuffled.set_epoch(0)
    shuffled.set_epoch(1)
    assert list(shuffled) == first  # the order of an epoch depends on (seed, epoch) only
    t = trainer(tmp_path, tokenizer, args=config(tmp_path, shuffle_dataset=False, max_steps=1))
    t.train()
    assert math.isfinite(t.state.log_history[-1]["train_loss"])


# ---------------------------------------------------------------- rendering


def test_chat_template_kwargs_for_harmony(tmp_path, tokenizer):
    t = trainer(tmp_path, tokenizer, args=config(tmp_path, chat_template_kwargs={"reasoning_effort": "low"}))
    text = tokenizer.decode(t._render_prompt("What is 2 + 3?"))
    assert "Reasoning: low" in text
    dated_args = config(tmp_path, chat_template_kwargs={"conversation_start_date": "2026-01-02"})
    dated = trainer(tmp_path, tokenizer, args=dated_args)
    assert "Current date: 2026-01-02" in tokenizer.decode(dated._render_prompt("hi"))
    with pytest.raises(ValueError, match=r"chat_template_kwargs \['model_identity'\] are not supported for GPT-OSS"):
        trainer(tmp_path, tokenizer, args=config(tmp_path, chat_template_kwargs={"model_identity": "x"}))
    with pytest.raises(ValueError, match="disagrees with reasoning_effort='high'"):
        args = config(tmp_path, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
        trainer(tmp_path, tokenizer, args=args)


def test_chat_template_kwargs_for_other_models(tmp_path):
    """A non-GPT-OSS model is rendered with its own chat template and `chat_template_kwargs`, as TRL does."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    template_tok = PreTrainedTokenizerFast(  # the o200k vocabulary, with a chat template this time
        tokenizer_object=load_gptoss_tokenizer().backend_tokenizer, eos_token="<|return|>", pad_token="<|endoftext|>"
    )
    template_tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant{% if terse %} (terse){% endif %}:{% endif %}"
    )
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(template_tok), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, eos_token_id=template_tok.eos_token_id)
    )  # fmt: skip
    t = AgenticGRPOTrainer(
        llama,
        reward_len,
        config(tmp_path, chat_template_kwargs={"terse": True}),
        dataset(),
        processing_class=template_tok,
    )
    assert t.agent_loop.turn_format == "plain" and template_tok.eos_token_id in t.agent_loop.sampling.stop_token_ids
    ids = t._render_prompt([{"role": "user", "content": "hi"}])
    assert template_tok.decode(ids) == "user: hi\nassistant (terse):"
    assert template_tok.decode(t._render_prompt("plain text")) == "plain text"  # standard prompts: no template
    with pytest.raises(ValueError, match="parses tool calls from GPT-OSS harmony turns"):
        AgenticGRPOTrainer(llama, reward_len, config(tmp_path), dataset(), processing_class=template_tok, tools=[add])


# ---------------------------------------------------------------- TRL's rollout_func


def test_user_rollout_func_replaces_the_agent_loop(tmp_path, tokenizer):
    calls = []

    def my_rollout(prompts, trainer):
        calls.append(len(prompts))
        ids = tokenizer.encode("<|channel|>final<|message|>5<|return|>", add_special_tokens=False)
        return {
            "prompt_ids": [trainer._render_prompt(p) for p in prompts],
            "completion_ids": [ids for _ in prompts],
            "logprobs": [[-1.0] * len(ids) for _ in prompts],
        }

    t = trainer(tmp_path, tokenizer, args=config(tmp_path, max_steps=1), rollout_func=my_rollout)
    assert t.rollout_func is my_rollout
    t.train()
    assert calls == [4] and math.isfinite(t.state.log_history[-1]["train_loss"])
    # the rollout engine still follows the policy
    assert t.rollout_engine.weight_version == 1


# ---------------------------------------------------------------- importance sampling in the loss


class _CallThenAnswer(RolloutEngine):
    """Always calls `add` while it may; log-probs are all -1 (a large mismatch against the tiny model)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    @property
    def weight_version(self):
        return 0

    async def health(self):
        return True

    async def update_weights(self, named_tensors, *, version):
        pass

    async def generate(self, input_ids, sampling: SamplingParams):
        text = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
        ids = self.tok.encode(text, add_special_tokens=False)
        return GenerationOutput(ids, [-1.0] * len(ids), "stop", 0)


def test_max_tool_calling_iterations_in_a_rollout(tmp_path, tokenizer):
    t = trainer(
        tmp_path,
        tokenizer,
        args=config(tmp_path, max_tool_calling_iterations=1, max_completion_length=256),
        tools=[add],
        rollout_engine=_CallThenAnswer(tokenizer),
    )
    out = t._rollout(["What is 2 + 3?"])
    assert out["num_turns"] == [2] and out["num_tool_calls"] == [2]  # one executed round, the second call is not
    assert out["tool_errors"] == [1] and out["finish_reason"] == ["max_turns"]


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_geometric_mask", "token_truncate"])
def test_importance_sampling_modes_in_the_loss(tmp_path, tokenizer, mode):
    bounds = {"vllm_importance_sampling_clip_min": 0.5} if mode == "sequence_geometric_mask" else {}
    t = trainer(
        tmp_path,
        tokenizer,
        args=config(tmp_path, max_steps=1, max_completion_length=64, vllm_importance_sampling_mode=mode, **bounds),
        tools=[add],
        rollout_engine=_CallThenAnswer(tokenizer),
    )
    t.train()
    logged = t.state.log_history[0]
    weights = t.last_importance_weights
    if mode.startswith("sequence"):  # one value per sequence
        assert torch.equal(weights, weights[:, :1].expand_as(weights))
    for stat in ("min", "mean", "max"):
        assert math.isfinite(logged[f"sampling/importance_sampling_ratio/{stat}"])
    assert logged["sampling/sampling_logp_difference/max"] > 0
    assert logged["tools/call_frequency"] > 0 and 0 <= logged["tools/failure_frequency"] <= 1  # TRL's tool metrics
    if mode == "sequence_geometric_mask":  # a random tiny model is far from log p = -1 everywhere: all masked
        assert logged["mismatch/frac_is_masked"] == 1.0 and logged["sampling/importance_sampling_ratio/max"] == 0.0


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "trackio"])
def test_missing_logging_backend_fails_at_start_naming_the_extra(tmp_path, tokenizer, backend, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith((backend, "tensorboardX")) else real(name, *a),
    )
    with pytest.raises(ImportError, match=rf"report_to='{backend}' needs .*pip install 'hf_gptoss_rl\[{backend}\]'"):
        trainer(tmp_path, tokenizer, args=config(tmp_path, report_to=[backend]))
