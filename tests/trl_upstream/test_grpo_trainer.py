"""TRL's GRPO trainer scenarios, run with TRL's `GRPOTrainer` and with `AgenticGRPOTrainer`.

Where these come from: the scenarios of TRL's own test suite, `tests/test_grpo_trainer.py` of huggingface/trl at
v1.16.0 (Apache-2.0; https://github.com/huggingface/trl/blob/v1.16.0/tests/test_grpo_trainer.py), class
`TestGRPOTrainer`. The tests here are written for this project rather than copied, and adapted:

- offline and CPU-sized: a tiny Qwen2 causal LM and a tiny Qwen2 reward model are built from configs and saved to a
  temporary folder (instead of the Hub ids `trl-internal-testing/tiny-Qwen2ForCausalLM-2.5` and
  `...ForSequenceClassification-2.5`), with a small byte-level BPE tokenizer trained on the spot and a ChatML chat
  template; the datasets are six in-memory prompts (instead of `trl-internal-testing/zen`);
- the class swap: every scenario runs once with `trl.GRPOTrainer` and once with `trl_ext.AgenticGRPOTrainer`, with
  the same `trl.GRPOConfig` (the drop-in claim), and checks the same outcome.

The scenarios kept: minimal construction, training on standard and conversational prompts, the loss types with
gradient accumulation, evaluation during training, `num_iterations > 1`, `beta > 0` (reference model), several
reward functions with weights, a reward model with an explicit `reward_processing_classes`, `shuffle_dataset=False`,
sequence-level importance sampling, `mask_truncated_completions`, `top_entropy_quantile`, a LoRA adapter, positional
arguments, and the errors for a missing reward source and a missing `prompt` column.

Scenarios of TRL's file left out, and why (not differences in behaviour):

- vLLM (`use_vllm=True`): the agentic trainer generates with its own rollout engine and refuses `use_vllm` by design;
- vision-language models, images: the agentic trainer renders text (harmony or a chat template) only;
- TRL's tool-calling loop (`tools=` with a non-GPT-OSS chat template) and `environment_factory`: tool calls are
  parsed from GPT-OSS harmony turns (tests/test_trainer.py, tests/test_agent_loop.py); for other models the
  agentic trainer refuses `tools` and `environment_factory` with an error saying what to use;
- `use_transformers_continuous_batching`, `cache_implementation`: TRL's transformers generation path, refused with guidance;
- Liger kernels, bitsandbytes, GPU-only tests, and tests that need the Hub (datasets or models by id).

Every scenario kept here passes with both classes.

TRL's own tests with only the class swapped (`AgenticGRPOTrainer` where TRL's test constructs `GRPOTrainer`), below
the scenarios: `test_train` over the tiny causal LMs of TRL's `test_train` parametrization (Cohere2, Glm4Moe,
GPT-OSS, Qwen2, Qwen3Moe), built from their configs at the sizes of TRL's `scripts/generate_tiny_models.py` and
initialised as it does, with TRL's assertions unchanged (the loss logged, the MoE aux loss logged, every parameter
changed: `torch.equal`); `test_train_peft_model`; `test_train_loss_types` (TRL's Qwen2, and GPT-OSS);
`test_train_with_generation_kwargs`; `test_train_different_reward_model`,
`test_mismatched_reward_processing_classes_length`, `test_correct_reward_processing_classes_list` and
`test_single_reward_model_with_single_processing_class`. What differs, and why:

- the runs are CPU-sized: `max_steps=3` on six prompts (TRL: three epochs of `trl-internal-testing/zen`), float32;
- one check is added where a run trains on rewards (`_assert_rewards_vary`): TRL's parameter check alone also
  passes when every completion reaches the reward empty (float rounding of zero advantages, which Adam scales to a
  full step), so a run must also show a group whose rewards differ;
- `test_train[tiny-NemotronHForCausalLM-nano]` is left out: a hybrid Mamba-2 model whose tiny config TRL's
  generation script at hand does not define; `test_train_with_generation_kwargs` keeps TRL's sampling keys
  (`do_sample`, `top_k`) and checks that its beam-search keys (`num_beams`, `length_penalty`) are refused with the
  reason: the rollout engines sample, GRPO needs sampled completions with their log-probs;
- not applicable: TRL's vLLM tests and tests of its own generation (`use_transformers_continuous_batching`,
  `cache_implementation`, `vllm_*`), as listed above.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from datasets import Dataset
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)
from trl import GRPOConfig, GRPOTrainer

from trl_ext import AgenticGRPOTrainer

TRAINERS = [GRPOTrainer, AgenticGRPOTrainer]
IDS = ["trl", "agentic"]

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The sky is blue and the grass is green.",
    "Two plus three is five, and four times two is eight.",
    "Write a short poem about the sea, the wind and the moon.",
    "What color is the sky? Why is the ocean salty?",
    "user assistant system hello world answer question",
]


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Paths of a tiny Qwen2 causal LM and a tiny Qwen2 reward model, each saved with the tokenizer."""
    root = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = _tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    policy, reward = root / "policy", root / "reward"
    Qwen2ForCausalLM(config).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    reward_model = Qwen2ForSequenceClassification(Qwen2Config(**{**config.to_dict(), "num_labels": 1}))
    reward_model.save_pretrained(reward)
    tokenizer.save_pretrained(reward)
    return str(policy), str(reward)


def _dataset(kind: str = "standard", n: int = 6) -> Dataset:
    texts = ["The sky is", "Two plus three is", "The sea", "Why is the ocean", "Hello", "The moon"]
    texts = (texts * ((n + len(texts) - 1) // len(texts)))[:n]
    if kind == "standard":
        return Dataset.from_dict({"prompt": texts})
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts]})


def _config(tmp_path, **overrides) -> GRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # tiny gradients: a large step makes "the parameters changed" observable
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        max_steps=3,  # TRL's tests run 3 epochs of their dataset; 3 steps keep the subset CPU-sized
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _length_reward(completions, **kwargs):
    """A reward with variance in every group: the completion's length in characters."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def _vowel_reward(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in (c if isinstance(c, str) else c[0]["content"]))) for c in completions]


def _assert_trained(trainer, before):
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, param in before.items():
        assert not torch.equal(param, trainer.model.get_parameter(name)), f"parameter {name} did not change"


def _train_and_check(trainer):
    before = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    _assert_trained(trainer, before)
    return trainer


@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_init_minimal(cls, tiny_models, tmp_path):
    # TRL's test omits `args`; its default config asks for bf16, which CPU-only machines refuse, so the only
    # arguments added here select the CPU.
    policy, reward = tiny_models
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    trainer = cls(model=policy, reward_funcs=reward, args=args, train_dataset=_dataset())
    # both load the model's own tokenizer from its path (AutoProcessor), with TRL's left padding
    assert trainer.processing_class.chat_template == CHATML and len(trainer.processing_class) == len(_tiny_tokenizer())
    assert trainer.processing_class.padding_side == "left"


@pytest.mark.parametrize("kind", ["standard", "conversational"])
@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_training(cls, kind, tiny_models, tmp_path):
    policy, reward = tiny_models
    trainer = cls(model=policy, reward_funcs=reward, args=_config(tmp_path), train_dataset=_dataset(kind))
    _train_and_check(trainer)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_training_loss_types(cls, loss_type, tiny_models, tmp_path):
    policy, reward = tiny_models
    args = _config(tmp_path, loss_type=loss_type, gradient_accumulation_steps=2, max_completion_length=16)
    trainer = cls(model=policy, reward_funcs=reward, args=args, train_dataset=_dataset())
    _train_and_check(trainer)


@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_training_with_eval(cls, tiny_models, tmp_path):
    policy, reward = tiny_models
    args = _config(tmp_path, per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=1)
    trainer = cls(model=policy, reward_funcs=reward, args=args, train_dataset=_dataset(), eval_dataset=_dataset(n=3))
    trainer.train()
    assert any("eval_loss" in h for h in trainer.state.log_history)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_iterations=2),
        dict(beta=0.1),
        dict(shuffle_dataset=False),
        dict(importance_sampling_level="sequence"),
        dict(mask_truncated_completions=True),
        dict(top_entropy_quantile=0.2),
    ],
    ids=["num_iterations", "beta", "no_shuffle", "sequence_is", "mask_truncated", "entropy_quantile"],
)
@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_training_options(cls, overrides, tiny_models, tmp_path):
    policy, reward = tiny_models
    trainer = cls(model=policy, reward_funcs=reward, args=_config(tmp_path, **overrides), train_dataset=_dataset())
    if overrides.get("mask_truncated_completions"):  # truncated completions leave the loss: parameters may not move
        trainer.train()
        assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
        return
    _train_and_check(trainer)


@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_training_multiple_reward_funcs_with_weights(cls, tiny_models, tmp_path):
    policy, _ = tiny_models
    args = _config(tmp_path, reward_weights=[0.7, 0.3])
    trainer = cls(model=policy, reward_funcs=[_length_reward, _vowel_reward], args=args, train_dataset=_dataset())
    _train_and_check(trainer)
    assert {"rewards/_length_reward/mean", "rewards/_vowel_reward/mean"} <= set(trainer.state.log_history[0])


@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_training_reward_model_with_processing_class(cls, tiny_models, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy, reward = tiny_models
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward, num_labels=1)
    reward_tokenizer = AutoTokenizer.from_pretrained(reward)
    trainer = cls(
        model=policy,
        reward_funcs=reward_model,
        args=_config(tmp_path),
        train_dataset=_dataset(),
        reward_processing_classes=reward_tokenizer,
    )
    assert trainer.reward_processing_classes == [reward_tokenizer]
    _train_and_check(trainer)


@pytest.mark.parametrize("cls", [GRPOTrainer, AgenticGRPOTrainer], ids=IDS)
def test_training_peft(cls, tiny_models, tmp_path):
    from peft import LoraConfig

    policy, reward = tiny_models
    trainer = cls(
        model=policy,
        reward_funcs=reward,
        args=_config(tmp_path),
        train_dataset=_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, param in before.items():
        changed = not torch.equal(param, trainer.model.get_parameter(name))
        assert changed == ("lora_" in name), name  # adapters train, the base model is frozen


@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_positional_arguments(cls, tiny_models, tmp_path):
    policy, reward = tiny_models
    # TRL's order: model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes
    trainer = cls(policy, reward, _config(tmp_path), _dataset(), None, None, None)
    assert trainer.train_dataset is not None and trainer.eval_dataset is None


@pytest.mark.parametrize("cls", TRAINERS, ids=IDS)
def test_no_reward_source_is_trls_error(cls, tiny_models, tmp_path):
    policy, _ = tiny_models
    with pytest.raises(ValueError, match="No reward source provided"):
        cls(model=policy, args=_config(tmp_path), train_dataset=_dataset())


def test_missing_prompt_column_fails_at_construction(tiny_models, tmp_path):
    """TRL raises `KeyError: 'prompt'` at the first step; the agentic trainer refuses the dataset up front."""
    policy, reward = tiny_models
    bad = Dataset.from_dict({"question": ["The sky is", "Hello", "The sea"]})
    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' column \(its columns: \['question'\]\)"):
        AgenticGRPOTrainer(model=policy, reward_funcs=reward, args=_config(tmp_path), train_dataset=bad)
    trl = GRPOTrainer(model=policy, reward_funcs=reward, args=_config(tmp_path, max_steps=1), train_dataset=bad)
    with pytest.raises(KeyError, match="prompt"):
        trl.train()


def test_signature_is_trls():
    ours = list(inspect.signature(AgenticGRPOTrainer.__init__).parameters.values())
    theirs = list(inspect.signature(GRPOTrainer.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])
    assert [p.name for p in ours[len(theirs) :]] == ["rollout_engine"]


# --------------------------------------------------------------------------------------------------------------------
# TRL's `test_train` over its tiny causal LMs, and its PEFT-model, loss-type, generation-kwargs and reward-processing-
# class tests, with `AgenticGRPOTrainer` in place of `GRPOTrainer` and nothing else changed but the offline models.


def _init_weights_tiny_model(model) -> None:
    """TRL's `init_weights_tiny_model` (scripts/generate_tiny_models.py), which its tiny Hub models were made with."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)):
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
            torch.nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, torch.nn.LayerNorm):
            torch.nn.init.ones_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)


# TRL's `test_train` ids -> (config class, model class, extra config): the sizes of TRL's generate_tiny_models.py
# (hidden 8, 4 heads, 2 KV heads, 2 layers, intermediate 32; MoE: 4 experts, top-2)
TINY_CAUSAL_LMS = {
    "trl-internal-testing/tiny-Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM", {}),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"n_routed_experts": 4}),
    "trl-internal-testing/tiny-GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4}),
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4}),
}


@pytest.fixture(scope="module")
def tiny_causal_lm_dir(tmp_path_factory):
    """`model_id -> folder`: each of TRL's tiny causal LMs built from its config, saved with a tokenizer (GPT-OSS's
    offline tokenizer for GPT-OSS, as `AgenticGRPOTrainer` loads for it; the tiny BPE tokenizer for the others)."""
    import transformers

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer

    root = tmp_path_factory.mktemp("tiny-causal-lms")
    built: dict[str, str] = {}

    def build(model_id: str) -> str:
        if model_id not in built:
            config_name, model_name, extra = TINY_CAUSAL_LMS[model_id]
            tokenizer = load_gptoss_tokenizer() if "GptOss" in model_id else _tiny_tokenizer()
            config = getattr(transformers, config_name)(
                vocab_size=len(tokenizer), hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, intermediate_size=32, **({"num_experts_per_tok": 2, **extra} if extra else {}),
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            torch.manual_seed(0)
            model = getattr(transformers, model_name)(config)
            _init_weights_tiny_model(model)
            folder = root / model_id.split("/")[-1]
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            built[model_id] = str(folder)
        return built[model_id]

    return build


def _trl_config(tmp_path, **overrides) -> GRPOConfig:
    """TRL's test arguments (`learning_rate=0.1`, 3 generations, `max_completion_length=8`), on the CPU and
    CPU-sized (`_config`)."""
    return _config(tmp_path, **overrides)


def _assert_params_changed(trainer, previous_trainable_params):
    """TRL's check, unchanged: the train loss is logged and every parameter changed (`torch.equal`)."""
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def _assert_rewards_vary(trainer):
    """Beyond TRL's check: some group's rewards differ, i.e. the reward model saw the completions. TRL's parameter
    check alone also passes when every completion reaches the reward empty: the group mean of three equal float32
    rewards can round (advantages of about 4e-5 were measured here), and Adam turns any gradient into a full step."""
    zero_std = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    assert zero_std and min(zero_std) < 1.0, f"every group had the same reward on every step: {zero_std}"


@pytest.mark.parametrize("model_id", sorted(TINY_CAUSAL_LMS))
def test_train(model_id, tiny_causal_lm_dir, tiny_models, tmp_path):
    _, reward = tiny_models  # TRL: "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
    trainer = AgenticGRPOTrainer(
        model=tiny_causal_lm_dir(model_id), reward_funcs=reward, args=_trl_config(tmp_path), train_dataset=_dataset()
    )
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    # MoE models log the load-balancing auxiliary loss (on by default)
    if trainer.aux_loss_enabled:
        assert trainer.state.log_history[-1]["aux_loss"] is not None
    _assert_params_changed(trainer, previous_trainable_params)
    _assert_rewards_vary(trainer)


def test_train_peft_model(tiny_models, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    policy, reward = tiny_models
    model = AutoModelForCausalLM.from_pretrained(policy, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    model = get_peft_model(model, LoraConfig())
    trainer = AgenticGRPOTrainer(model=model, reward_funcs=reward, args=_trl_config(tmp_path), train_dataset=_dataset())
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    # Check that the peft params have changed and the base model params have not changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n and "ref" not in n:  # and the peft params to be different (except base and ref)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize(
    "model_id", ["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", "trl-internal-testing/tiny-GptOssForCausalLM"]
)
def test_train_loss_types(model_id, loss_type, tiny_causal_lm_dir, tiny_models, tmp_path):
    """TRL's test (Qwen2), and the same with the GPT-OSS policy this trainer is for."""
    _, reward = tiny_models
    args = _trl_config(tmp_path, max_completion_length=32, gradient_accumulation_steps=2, loss_type=loss_type)
    trainer = AgenticGRPOTrainer(
        model=tiny_causal_lm_dir(model_id), reward_funcs=reward, args=args, train_dataset=_dataset()
    )
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    _assert_params_changed(trainer, previous_trainable_params)
    _assert_rewards_vary(trainer)


@pytest.mark.parametrize(
    "model_id", ["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", "trl-internal-testing/tiny-GptOssForCausalLM"]
)
def test_train_with_generation_kwargs(model_id, tiny_causal_lm_dir, tiny_models, tmp_path):
    """TRL's sampling keys; its beam-search keys (`num_beams`, `length_penalty`) are refused, naming why."""
    _, reward = tiny_models
    args = _trl_config(tmp_path, generation_kwargs={"do_sample": True, "top_k": 50})
    trainer = AgenticGRPOTrainer(
        model=tiny_causal_lm_dir(model_id), reward_funcs=reward, args=args, train_dataset=_dataset()
    )
    assert trainer.agent_loop.sampling.top_k == 50
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    _assert_params_changed(trainer, previous_trainable_params)
    _assert_rewards_vary(trainer)

    beams = _trl_config(tmp_path, generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2})
    with pytest.raises(ValueError, match="'num_beams': beam search does not sample"):
        AgenticGRPOTrainer(
            model=tiny_causal_lm_dir(model_id), reward_funcs=reward, args=beams, train_dataset=_dataset()
        )


def test_train_different_reward_model(tiny_models, tmp_path):
    """A reward model with its own tokenizer (`reward_processing_classes`), conversational prompts."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy, reward = tiny_models
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward)
    reward_tokenizer = AutoTokenizer.from_pretrained(reward)
    trainer = AgenticGRPOTrainer(
        model=policy,
        reward_funcs=reward_model,
        args=_trl_config(tmp_path),
        train_dataset=_dataset("conversational"),
        reward_processing_classes=reward_tokenizer,
    )
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    _assert_params_changed(trainer, previous_trainable_params)
    _assert_rewards_vary(trainer)


def test_mismatched_reward_processing_classes_length(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    policy, reward = tiny_models
    with pytest.raises(ValueError, match="must match"):
        AgenticGRPOTrainer(
            model=policy,
            reward_funcs=[reward, reward],
            reward_processing_classes=AutoTokenizer.from_pretrained(reward),  # only one, but need two
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none"),
            train_dataset=_dataset(),
        )


def test_correct_reward_processing_classes_list(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    policy, reward = tiny_models
    classes = [AutoTokenizer.from_pretrained(reward), AutoTokenizer.from_pretrained(reward)]
    trainer = AgenticGRPOTrainer(
        model=policy,
        reward_funcs=[reward, reward],
        reward_processing_classes=classes,
        args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none"),
        train_dataset=_dataset(),
    )
    assert len(trainer.reward_processing_classes) == 2


def test_single_reward_model_with_single_processing_class(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    policy, reward = tiny_models
    single_processing_class = AutoTokenizer.from_pretrained(reward)
    trainer = AgenticGRPOTrainer(
        model=policy,
        reward_funcs=reward,
        reward_processing_classes=single_processing_class,  # single object for single reward model
        args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none"),
        train_dataset=_dataset(),
    )
    assert len(trainer.reward_processing_classes) == 1
    assert trainer.reward_processing_classes[0] == single_processing_class
