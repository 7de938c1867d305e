"""AgenticGRPOTrainer: real training steps of a tiny GPT-OSS on tool-calling harmony trajectories (CPU).

A scripted engine makes the trajectories deterministic (turn 1 calls the `add` tool, or answers at once; turn 2
answers right or wrong) while its log-probs are the real ones of its own copy of the policy, perturbed per token
to emulate a different inference kernel. It receives the trainer's weight syncs like any engine. Separate tests
run the real embedded engine and the SGLang-protocol HTTP server.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os

import pytest
import torch
from datasets import Dataset
from transformers import GptOssForCausalLM

from hf_gptoss_rl import set_backends
from hf_gptoss_rl.harmony import CALL, load_gptoss_tokenizer
from hf_gptoss_rl.logprobs import causal_lm_token_logprobs
from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_ext.rollout import EmbeddedEngine, GenerationOutput, RolloutEngine
from trl_ext.rollout.recovery import RESTART_RECOVERIES
from trl_ext.tools import FunctionTool

PERTURBATION = 0.05  # |log p_rollout - log p_engine_model| per token


@pytest.fixture(scope="module")
def tokenizer():
    return load_gptoss_tokenizer()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def tiny_model(seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    config = tiny_gptoss_config(num_hidden_layers=2, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    return GptOssForCausalLM(config)


def dataset(n: int = 4) -> Dataset:
    rows = [{"prompt": [{"role": "user", "content": f"What is 2 + 3? (variant {i})"}], "answer": "5"} for i in range(n)]
    return Dataset.from_list(rows)


def reward_correct(completions, final_text, answer, num_tool_calls, **kwargs):
    """1 for the right boxed answer, plus a little for each tool call (so every group has reward variance)."""
    return [float(f.strip() == f"\\boxed{{{a}}}") + 0.1 * n for f, a, n in zip(final_text, answer, num_tool_calls)]


class ScriptedEngine(RolloutEngine):
    """Deterministic harmony outputs, real (perturbed) log-probs from its own copy of the policy."""

    def __init__(self, model, tokenizer):
        self.model = copy.deepcopy(model).eval()
        self.model.__dict__.pop("forward", None)
        self.tok = tokenizer
        self._version = 0
        self.calls = 0
        self.updates: list[int] = []

    @property
    def weight_version(self):
        return self._version

    async def health(self):
        return True

    async def update_weights(self, named_tensors, *, version):
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                state[name].copy_(tensor)
        self._version = version
        self.updates.append(version)
        self.calls = 0

    async def generate(self, input_ids, sampling):
        rng = torch.Generator().manual_seed(1000 * int(self._version) + self.calls)
        self.calls += 1
        coin = torch.rand(2, generator=rng).tolist()
        if CALL not in input_ids and coin[0] < 0.7:
            text = (
                "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
            )
        else:
            answer = "5" if coin[1] < 0.5 else "7"
            text = f"<|channel|>final<|message|>\\boxed{{{answer}}}<|return|>"
        ids = self.tok.encode(text, add_special_tokens=False)[: sampling.max_new_tokens]
        full = torch.tensor([list(input_ids) + ids])
        with torch.no_grad():
            logps, _ = causal_lm_token_logprobs(
                self.model, full, logits_to_keep=len(ids), temperature=sampling.temperature or 1.0
            )
        signs = torch.tensor([(-1.0) ** i for i in range(len(ids))])
        logps = (logps[0] + PERTURBATION * signs).tolist()
        return GenerationOutput(ids, logps, "stop", self._version)


def make_config(tmp_path, **overrides) -> AgenticGRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        learning_rate=1e-2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=64,
        max_turns=3,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast, even on CPU
        seed=0,
        rollout_concurrency=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return AgenticGRPOConfig(**kwargs)


class RecordingTrainer(AgenticGRPOTrainer):
    """Records each policy forward (log-probs with their grad) and each loss call's inputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards: list[torch.Tensor] = []
        self.loss_inputs: list[dict] = []
        self.loss_weights: list[torch.Tensor | None] = []

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, ent, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if logps.requires_grad:
            logps.retain_grad()
        self.forwards.append(logps)
        return logps, ent, aux

    def _compute_loss(self, model, inputs):
        self.loss_inputs.append(inputs)
        self.last_importance_weights = None
        loss = super()._compute_loss(model, inputs)
        self.loss_weights.append(self.last_importance_weights)
        return loss


def scripted_trainer(tmp_path, tokenizer, cls=RecordingTrainer, model=None, engine_cls=None, **overrides):
    model = model if model is not None else tiny_model()
    engine = (engine_cls or ScriptedEngine)(model, tokenizer)
    trainer = cls(
        model=model,
        reward_funcs=reward_correct,
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset(),
        processing_class=tokenizer,
        tools=[FunctionTool(add)],
        rollout_engine=engine,
    )
    return trainer, engine


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_on_policy_steps_with_tool_calls(tmp_path, tokenizer):
    trainer, engine = scripted_trainer(tmp_path, tokenizer, max_steps=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()

    assert all(math.isfinite(x) for x in _logged(trainer, "loss"))
    # one policy forward per micro-batch: no second "old log-probs" pass on-policy
    assert len(trainer.forwards) == len(trainer.loss_inputs) == 2
    signed = []  # (advantage, d loss / d sum of the row's policy log-probs)
    for inputs, logps in zip(trainer.loss_inputs, trainer.forwards):
        assert "old_per_token_logps" not in inputs
        tool_mask, completion_mask = inputs["tool_mask"], inputs["completion_mask"]
        assert (tool_mask == 0).any(), "the trajectories must contain tool tokens"
        policy = (completion_mask * tool_mask).bool()
        # tool tokens (and padding) have exactly zero weight in the loss
        assert torch.all(logps.grad[~policy] == 0)
        # rollout log-probs are aligned with the completion ids (0 on tool tokens)
        assert torch.all(inputs["sampling_per_token_logps"][tool_mask == 0] == 0)
        # the sign of the policy gradient: a descent step raises the log-probs of trajectories with a positive
        # advantage and lowers those with a negative one
        advantages = inputs["advantages"].reshape(-1)
        grad_per_row = (logps.grad * policy).sum(-1)
        signed += [(a, g) for a, g in zip(advantages.tolist(), grad_per_row.tolist()) if abs(a) > 1e-6]
    assert signed and all(a * g < 0 for a, g in signed), signed
    assert any(logps.grad.abs().sum() > 0 for logps in trainer.forwards)  # a learning signal reached the policy
    # ratio is exactly 1 on-policy: nothing is clipped
    assert _logged(trainer, "clip_ratio/region_mean") == [0.0, 0.0]
    # tool use and mismatch metrics are logged every step
    assert all(x > 0 for x in _logged(trainer, "rollout/tool_calls_mean"))
    assert _logged(trainer, "tools/call_frequency") == _logged(trainer, "rollout/tool_calls_mean")  # TRL's name
    for key in ("mismatch/prob_diff_mean", "mismatch/prob_diff_max", "mismatch/k3_kl", "mismatch/log_ppl_diff"):
        assert len(_logged(trainer, key)) == 2
    # the engine log-probs are the policy's own (step 1) perturbed by +-PERTURBATION
    k3 = _logged(trainer, "mismatch/k3_kl")[0]
    expected_k3 = (math.expm1(PERTURBATION) - PERTURBATION + math.expm1(-PERTURBATION) + PERTURBATION) / 2
    assert k3 == pytest.approx(expected_k3, rel=0.2)
    # weights were synced to the engine after each optimizer step
    assert engine.updates == [1, 2] and engine.weight_version == trainer.state.global_step == 2
    # the versions the engine served: step 1's rollouts on the initial weights (0), step 2's on the first sync's
    assert _logged(trainer, "rollout/weight_version") == [0.0, 1.0]
    assert _logged(trainer, "rollout/stale_trajectories") == [0.0, 0.0]
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for name, tensor in engine.model.state_dict().items():
        torch.testing.assert_close(tensor, after[name])


class LaggingEngine(ScriptedEngine):
    """Loads every sync (and reports its version as `weight_version`) but its answers say they were served on the
    weights before it, as a server that fell behind would: the trainer must go by the served version."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.served = 0

    async def update_weights(self, named_tensors, *, version):
        self.served = self._version
        await super().update_weights(named_tensors, version=version)

    async def generate(self, input_ids, sampling):
        out = await super().generate(input_ids, sampling)
        out.weight_version = self.served
        return out


def test_stale_rollouts_fail_by_default(tmp_path, tokenizer):
    trainer, engine = scripted_trainer(tmp_path, tokenizer, engine_cls=LaggingEngine, max_steps=2)
    assert trainer.args.allow_stale_rollouts is False
    # step 1 samples the initial weights (version 0, the trainer's too); step 2's batch was served on version 0
    # although the trainer synced version 1: all 8 trajectories (2 prompts x 4 generations) are stale
    with pytest.raises(RuntimeError, match=r"8 of 8 trajectories .*served on weight version\(s\) \[0\].*expected 1.*"
                       r"allow_stale_rollouts=True"):  # fmt: skip
        trainer.train()
    assert engine.updates == [1] and engine.weight_version == 1  # the engine's own claim is not what is checked
    assert _logged(trainer, "rollout/stale_trajectories") == [0.0]  # step 1 was logged, clean


def test_stale_rollouts_are_counted_when_allowed(tmp_path, tokenizer):
    trainer, engine = scripted_trainer(
        tmp_path, tokenizer, engine_cls=LaggingEngine, max_steps=3, allow_stale_rollouts=True
    )
    trainer.train()
    assert engine.updates == [1, 2, 3]
    assert _logged(trainer, "rollout/stale_trajectories") == [0.0, 8.0, 8.0]
    assert _logged(trainer, "rollout/weight_version") == [0.0, 0.0, 1.0]  # served, one sync behind the trainer
    assert all(math.isfinite(x) for x in _logged(trainer, "loss"))


class _TurnVersionsEngine(RolloutEngine):
    """Two turns per trajectory (an `add` call, then `\\boxed{5}`), each answer tagged with the next version of
    `versions` (again from the first for a trajectory sampled again); `weight_version` (the engine's own record) is
    never consulted by the trainer's check. `syncs` counts the weight updates it received."""

    def __init__(self, tokenizer, versions):
        self.tok = tokenizer
        self.versions = list(versions)
        self.answers = 0
        self.syncs = 0

    @property
    def weight_version(self):
        return 0

    async def health(self):
        return True

    async def update_weights(self, named_tensors, *, version):
        self.syncs += 1

    async def generate(self, input_ids, sampling):
        if CALL in input_ids:
            text = "<|channel|>final<|message|>\\boxed{5}<|return|>"
        else:
            text = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
        ids = self.tok.encode(text, add_special_tokens=False)
        version = self.versions[self.answers % len(self.versions)]
        self.answers += 1
        return GenerationOutput(ids, [-0.5] * len(ids), "stop", version)


@pytest.mark.parametrize(
    "synced, versions, stale, served_min",
    [
        (None, [None, None], 0, 0.0),  # no sync yet: an unversioned engine (SGLang's "default") serves the initial
        (None, [0, 0], 0, 0.0),  # ... and so does one that calls them version 0
        (None, [7, 7], 1, 7.0),  # an engine left on another run's version 7 is not the initial policy
        (3, [3, 3], 0, 3.0),
        (3, [2, 3], 1, 2.0),  # the turns disagree: the trajectory is stale, and the oldest version is logged
        (3, [None, None], 1, 0.0),  # no version after a sync: e.g. a server restarted on its launch weights
        (3, ["3", "3"], 0, 3.0),  # a version reported as text is the same version
    ],
)
def test_served_versions_checked_per_turn(tmp_path, tokenizer, synced, versions, stale, served_min):
    def make(**overrides):
        return AgenticGRPOTrainer(
            model=tiny_model(),
            reward_funcs=reward_correct,
            args=make_config(tmp_path, **overrides),
            train_dataset=dataset(),
            processing_class=tokenizer,
            tools=[FunctionTool(add)],
            rollout_engine=_TurnVersionsEngine(tokenizer, versions),
        )

    trainer = make(allow_stale_rollouts=True)
    trainer.synced_weight_version = synced
    trainer.model.train()
    out = trainer._rollout(["What is 2 + 3?"])
    assert out["num_turns"] == [2] and out["final_text"] == ["\\boxed{5}"]
    metrics = trainer._metrics["train"]
    assert metrics["rollout/stale_trajectories"] == [float(stale)]
    assert metrics["rollout/weight_version"] == [served_min]
    # turns on the launch weights (no version) after a sync: a restarted server, so the weights are pushed again and
    # the batch sampled again, RESTART_RECOVERIES times here, as this engine never stops answering without a version
    restarted = synced is not None and None in versions
    engine = trainer.rollout_engine
    assert (engine.syncs, engine.answers) == (
        (RESTART_RECOVERIES, 2 * (1 + RESTART_RECOVERIES)) if restarted else (0, 2)
    )
    if stale:
        trainer = make()
        trainer.synced_weight_version = synced
        with pytest.raises(RuntimeError, match="1 of 1 trajectories"):
            trainer._rollout(["What is 2 + 3?"])


def test_allow_stale_rollouts_is_a_bool(tmp_path):
    with pytest.raises(ValueError, match="allow_stale_rollouts"):
        make_config(tmp_path, allow_stale_rollouts="yes")


class _ByPromptEngine(RolloutEngine):
    """`variant 0`: answers 7 at once; `variant 1`: calls `add` once, then answers 7; `variant 2`: answers 5."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    @property
    def weight_version(self):
        return 0

    async def health(self):
        return True

    async def update_weights(self, named_tensors, *, version):
        pass

    async def generate(self, input_ids, sampling):
        prompt = self.tok.decode(input_ids)
        if "variant 1" in prompt and CALL not in input_ids:
            text = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
        else:
            answer = "5" if "variant 2" in prompt else "7"
            text = f"<|channel|>final<|message|>\\boxed{{{answer}}}<|return|>"
        ids = self.tok.encode(text, add_special_tokens=False)
        return GenerationOutput(ids, [-0.5] * len(ids), "stop", 0)


def test_retool_reward_of_trainer_rollouts(tmp_path, tokenizer):
    """The ReTool recipe's reward on the trainer's own rollout columns, against verl's formula by hand."""
    pytest.importorskip("math_verify")
    from trl_ext.recipes import retool_reward_func

    trainer = AgenticGRPOTrainer(
        model=tiny_model(),
        reward_funcs=retool_reward_func,
        args=make_config(tmp_path),
        train_dataset=dataset(),
        processing_class=tokenizer,
        tools=[FunctionTool(add)],
        rollout_engine=_ByPromptEngine(tokenizer),
    )
    rows = dataset(3)
    out = trainer._rollout(list(rows["prompt"]))
    assert out["num_turns"] == [1, 2, 1] and out["num_tool_calls"] == [0, 1, 0]
    rewards = retool_reward_func(completions=[""] * 3, answer=list(rows["answer"]), **out)
    # verl counts messages: user prompt + assistant turns + tool results, and scores a wrong answer
    # min(-0.6, -1 + (messages - 2) / 2 * 0.1)
    # variant 0, wrong, no tool call: 1 + 1 + 0 = 2 messages -> -1 + (2 - 2) / 2 * 0.1 = -1.0
    # variant 1, wrong, 1 round trip: 1 + 2 + 1 = 4 messages -> -1 + (4 - 2) / 2 * 0.1 = -0.9
    # variant 2, right: 1.0
    assert rewards == [-1.0, pytest.approx(-0.9, abs=1e-12), 1.0]


def test_token_truncate_weights_match_hand_computation(tmp_path, tokenizer):
    model = tiny_model()
    snapshot = copy.deepcopy(model.state_dict())
    trainer, _ = scripted_trainer(
        tmp_path,
        tokenizer,
        model=model,
        max_steps=1,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1.03,
    )
    trainer.train()
    inputs, weights = trainer.loss_inputs[0], trainer.loss_weights[0]
    assert weights is not None

    # Hand computation: log-probs of the sampled tokens under the pre-step policy, in fp32, by an independent path
    reference = tiny_model()
    reference.load_state_dict(snapshot)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        train_logps, _ = causal_lm_token_logprobs(
            reference, ids, attn, logits_to_keep=inputs["completion_ids"].shape[1]
        )
    mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    expected = torch.ones_like(train_logps)
    ratio = torch.exp(train_logps - inputs["sampling_per_token_logps"])
    expected[mask] = ratio[mask].clamp(max=1.03)
    torch.testing.assert_close(weights, expected, rtol=1e-4, atol=1e-5)
    assert (weights[mask] < 1.03).any() and (weights[mask] == 1.03).any()  # both regimes exercised
    # still on-policy: ratio 1, no clipping, one forward
    assert _logged(trainer, "clip_ratio/region_mean") == [0.0]
    assert len(trainer.forwards) == 1
    # TRL's metrics: the ratio over the policy tokens, after truncation
    assert _logged(trainer, "sampling/importance_sampling_ratio/max") == [pytest.approx(1.03)]
    assert _logged(trainer, "sampling/importance_sampling_ratio/min")[0] == pytest.approx(expected[mask].min().item())
    assert _logged(trainer, "sampling/importance_sampling_ratio/mean")[0] == pytest.approx(
        expected[mask].mean().item(), rel=1e-5
    )
    logp_diff = (train_logps - inputs["sampling_per_token_logps"]).abs()[mask]
    assert _logged(trainer, "sampling/sampling_logp_difference/max")[0] == pytest.approx(
        logp_diff.max().item(), rel=1e-4
    )
    assert 0 < _logged(trainer, "mismatch/frac_is_truncated")[0] < 1
    # the weight reaches the gradient: d loss / d logp = -A * w / N on policy tokens (DAPO, ratio 1)
    logps = trainer.forwards[0]
    adv = inputs["advantages"].unsqueeze(1).expand_as(logps)
    n = inputs["num_items_in_batch"]
    torch.testing.assert_close(logps.grad[mask], (-adv * weights)[mask] / n, rtol=1e-5, atol=1e-7)


def test_off_policy_keeps_standard_path(tmp_path, tokenizer):
    trainer, _ = scripted_trainer(
        tmp_path, tokenizer, max_steps=2, num_iterations=2, vllm_importance_sampling_mode="token_mask"
    )
    trainer.train()
    assert all("old_per_token_logps" in x for x in trainer.loss_inputs)
    # one extra no-grad forward per generation (the old log-probs), then one per loss call
    assert len(trainer.forwards) == len(trainer.loss_inputs) + 1
    assert all(math.isfinite(x) for x in _logged(trainer, "loss"))
    assert len(_logged(trainer, "mismatch/frac_is_masked")) == 2


def test_resume_continues_identically(tmp_path, tokenizer):
    # the 2-step run must share the schedule. The IS correction is off: its sequence ratio exp(sum of log-ratios)
    # scales the advantages, which turned the runs' float32 rounding differences (<= ~2e-7) into 1.6e-6 after Adam
    kwargs = dict(cls=AgenticGRPOTrainer, lr_scheduler_type="constant", vllm_importance_sampling_correction=False)
    straight, _ = scripted_trainer(tmp_path / "a", tokenizer, max_steps=4, **kwargs)
    straight.train()

    first, _ = scripted_trainer(tmp_path / "b", tokenizer, max_steps=2, save_strategy="steps", save_steps=2, **kwargs)
    first.train()
    resumed, engine = scripted_trainer(tmp_path / "b", tokenizer, max_steps=4, **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))

    assert engine.updates[0] == 2  # the engine received the checkpoint's weights, as version 2, before step 3
    # same prompts, rollouts, rewards and updates; parameters equal up to float32 rounding: within 1e-6 for all but
    # one entry of 6.4M (an embedding row, where Adam divides rounding by a tiny second moment), measured at 1.03e-6
    # (padded log-prob forwards) and 1.66e-6 (packed)
    for name, tensor in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, rtol=0, atol=5e-6)

    def after_resume(trainer, key):  # the resumed history starts with the checkpoint's steps 1-2
        return [h[key] for h in trainer.state.log_history if key in h and h["step"] > 2]

    assert after_resume(resumed, "completions/mean_length") == after_resume(straight, "completions/mean_length")
    assert len(after_resume(resumed, "reward")) == 2
    for key in ("reward", "loss", "grad_norm", "mismatch/k3_kl"):
        assert after_resume(resumed, key) == pytest.approx(after_resume(straight, key), rel=1e-5)


def test_embedded_engine_real_sampling(tmp_path, tokenizer):
    """The default backend: an in-process copy of the policy samples; weights follow every optimizer step."""
    trainer = AgenticGRPOTrainer(
        model=tiny_model(),
        reward_funcs=reward_correct,
        args=make_config(tmp_path, max_steps=2, max_completion_length=24, rollout_concurrency=8),
        train_dataset=dataset(),
        processing_class=tokenizer,
        tools=[FunctionTool(add)],
    )
    assert isinstance(trainer.rollout_engine, EmbeddedEngine)
    trainer.train()
    assert all(math.isfinite(x) for x in _logged(trainer, "loss"))
    assert trainer.rollout_engine.weight_version == 2
    for name, tensor in trainer.rollout_engine.model.state_dict().items():
        torch.testing.assert_close(tensor, trainer.model.state_dict()[name])
    # same weights, same temperature: only numerics separate the engine's log-probs from the trainer's
    assert max(_logged(trainer, "mismatch/prob_diff_max")) < 1e-3


def test_sglang_protocol_server_with_weight_sync(tmp_path, tokenizer):
    from fake_sglang_server import FakeSGLangServer  # tests/: a test double of SGLang's HTTP server

    model = tiny_model()
    server = FakeSGLangServer(EmbeddedEngine(copy.deepcopy(model), seed=0)).start()
    try:
        trainer = AgenticGRPOTrainer(
            model=model,
            reward_funcs=reward_correct,
            args=make_config(
                tmp_path, max_steps=2, max_completion_length=24, rollout_backend="sglang", sglang_urls=[server.url]
            ),
            train_dataset=dataset(),
            processing_class=tokenizer,
            tools=[FunctionTool(add)],
        )
        trainer.train()
        assert all(math.isfinite(x) for x in _logged(trainer, "loss"))
        assert server.request_counts.get("/update_weights_from_disk", 0) == 2
        assert trainer.rollout_engine.weight_version == 2
        served = server.engine.model.state_dict()
        for name, tensor in trainer.model.state_dict().items():
            torch.testing.assert_close(served[name], tensor)
        assert max(_logged(trainer, "mismatch/prob_diff_max")) < 1e-3
    finally:
        server.stop()


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="sglang_urls"):
        make_config(tmp_path, rollout_backend="sglang")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of .* got 'token_tis'"):
        make_config(tmp_path, vllm_importance_sampling_mode="token_tis")
    with pytest.raises(ValueError, match="clip_min .* must be less than"):  # TRL's own check
        make_config(tmp_path, vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5)
    with pytest.raises(ValueError, match="VESPO loss requires"):
        make_config(tmp_path, loss_type="vespo")  # TRL's default mode, sequence_mask, is not token-level
    with pytest.raises(ValueError, match="use_vllm"):
        make_config(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="reasoning_effort"):
        make_config(tmp_path, reasoning_effort="max")
    config = make_config(tmp_path, rollout_backend="sglang", sglang_urls="http://a:1, http://b:2")
    assert config.sglang_urls == ["http://a:1", "http://b:2"]
    config = make_config(tmp_path, rollout_backend="sglang", sglang_urls=["http://a:1,http://b:2", "http://c:3"])
    assert config.sglang_urls == ["http://a:1", "http://b:2", "http://c:3"]  # `--sglang_urls a,b c` on the CLI
    assert make_config(tmp_path).is_on_policy
    assert not make_config(tmp_path, num_iterations=2).is_on_policy


def test_lora_policy_is_merged_for_the_engine(tmp_path, tokenizer):
    from peft import LoraConfig

    trainer = AgenticGRPOTrainer(
        model=tiny_model(),
        reward_funcs=reward_correct,
        args=make_config(tmp_path, max_steps=1, max_completion_length=16, rollout_concurrency=8, learning_rate=1e-1),
        train_dataset=dataset(),
        processing_class=tokenizer,
        tools=[FunctionTool(add)],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    engine = trainer.rollout_engine
    assert not any("lora" in name for name in engine.model.state_dict())  # the engine serves a plain GPT-OSS
    # its LoRA layers skip the input casts that bf16 autocast undoes (hf_gptoss_rl.lora)
    assert trainer.model.get_base_model().model.layers[0].self_attn.q_proj._hf_gptoss_rl_autocast_casts
    # and add the adapter update in lora_B's product (fuse_lora_update: on by default; merging falls back to PEFT)
    assert trainer.model.get_base_model().model.layers[0].self_attn.q_proj._hf_gptoss_rl_fused_update
    trainer.train()
    assert engine.weight_version == 1
    merged = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    base_q = trainer.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    served = engine.model.state_dict()
    assert not torch.allclose(served["model.layers.0.self_attn.q_proj.weight"], base_q)  # the adapter is in it
    for name, tensor in merged.items():
        torch.testing.assert_close(served[name], tensor, rtol=1e-5, atol=1e-6)
    # merging for the export left the trainable model unmerged
    assert not trainer.model.get_base_model().model.layers[0].self_attn.q_proj.merged


def test_project_attention_kernel_and_experts_from_config(tmp_path, tokenizer):
    """The trainer runs the sink kernel and the memory-efficient experts; the engine (eager) agrees with it."""
    trainer, _ = scripted_trainer(
        tmp_path,
        tokenizer,
        max_steps=1,
        attn_implementation="hf-gptoss-rl/sink-flash-attn3",
        experts_implementation="memory_efficient",
    )
    assert trainer.model.config._attn_implementation == "hf-gptoss-rl/sink-flash-attn3"
    assert trainer.model.config._experts_implementation == "memory_efficient"
    trainer.train()
    assert math.isfinite(_logged(trainer, "loss")[0])
    # the scripted engine's copy runs eager attention and the default experts: only numerics separate them
    # (k3 is then the injected +-0.05 perturbation alone; a kernel dropping the sinks would move it by orders)
    assert _logged(trainer, "mismatch/k3_kl")[0] == pytest.approx(1.25e-3, rel=0.05)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_parallel_matches_data_parallel(tmp_path):
    """2 processes: Ulysses SP over both (pooled batch, each rank 1/2 of every sequence) vs plain DDP."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    runs = {}
    for sp_size in (1, 2):
        out = tmp_path / f"sp{sp_size}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               str(repo / "tests" / "trainer_sp_worker.py"), str(sp_size), str(out)]  # fmt: skip
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[sp_size] = (torch.load(out / "params.pt"), json.loads((out / "history.json").read_text()))
    (dp_params, dp_log), (sp_params, sp_log) = runs[1], runs[2]
    dp_norms = [h["grad_norm"] for h in dp_log if "grad_norm" in h]
    assert dp_norms[-1] > 0  # a real update happened
    assert [h["grad_norm"] for h in sp_log if "grad_norm" in h] == pytest.approx(dp_norms, rel=1e-4, abs=1e-7)
    for name, tensor in dp_params.items():
        torch.testing.assert_close(sp_params[name], tensor, rtol=0, atol=2e-5)


def test_fused_rope_routes_the_policy_through_the_kernel(tmp_path, tokenizer, monkeypatch):
    """`fused_rope=True` installs the fused rotary dispatcher; training (CPU, Triton interpreter) stays finite."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    monkeypatch.setattr(modeling_gpt_oss, "apply_rotary_pos_emb", modeling_gpt_oss.apply_rotary_pos_emb)
    set_backends(rope="triton")
    original = modeling_gpt_oss.apply_rotary_pos_emb
    trainer, _ = scripted_trainer(tmp_path, tokenizer, max_steps=1, fused_rope=True)
    assert modeling_gpt_oss.apply_rotary_pos_emb.hf_gptoss_rl_original is original
    trainer.train()
    assert math.isfinite(_logged(trainer, "loss")[0])


def test_checkpoint_saves_make_gradient_checkpointing_selective(tmp_path, tokenizer):
    """`checkpoint_saves` turns the checkpointing Trainer.train enables into selective checkpointing."""
    with pytest.raises(ValueError, match="checkpoint_saves: unknown"):
        make_config(tmp_path, checkpoint_saves=["mlp"])
    with pytest.raises(ValueError, match="non-reentrant"):
        make_config(tmp_path, checkpoint_saves="attention", gradient_checkpointing_kwargs={"use_reentrant": True})
    assert make_config(tmp_path, checkpoint_saves="attention, experts").checkpoint_saves == ["attention", "experts"]

    trainer, _ = scripted_trainer(
        tmp_path,
        tokenizer,
        max_steps=1,
        attn_implementation="hf-gptoss-rl/sink-flash-attn3",
        experts_implementation="memory_efficient",
        gradient_checkpointing=True,
        checkpoint_saves=["attention", "experts"],
    )
    trainer.train()
    assert math.isfinite(_logged(trainer, "loss")[0])
    layer = trainer.model.model.layers[0]
    assert layer.gradient_checkpointing
    context_fn = layer._gradient_checkpointing_func.keywords["context_fn"]
    policy = context_fn.args[0]  # functools.partial(create_selective_checkpoint_contexts, policy)
    from torch.utils.checkpoint import CheckpointPolicy

    experts_op = torch.ops.hf_gptoss_rl.memory_efficient_experts.default
    tokens = torch.empty(100, 8)  # the op's [T, H] input
    assert trainer.checkpoint_experts_max_tokens is None  # CPU: host memory, no bound
    assert policy(None, experts_op, tokens) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE

    with pytest.raises(ValueError, match="checkpoint_experts_max_tokens"):
        make_config(tmp_path, checkpoint_experts_max_tokens=-2)
    with pytest.raises(ValueError, match="checkpoint_projections_max_tokens"):
        make_config(tmp_path, checkpoint_projections_max_tokens=-3)
    trainer, _ = scripted_trainer(
        tmp_path,
        tokenizer,
        max_steps=1,
        experts_implementation="memory_efficient",
        checkpoint_saves=["attention", "experts"],
        checkpoint_experts_max_tokens=64,
    )
    trainer.train()
    policy = trainer.model.model.layers[0]._gradient_checkpointing_func.keywords["context_fn"].args[0]
    assert trainer.checkpoint_experts_max_tokens == 64
    assert policy(None, experts_op, torch.empty(64, 8)) == CheckpointPolicy.MUST_SAVE
    assert policy(None, experts_op, tokens) == CheckpointPolicy.PREFER_RECOMPUTE


def test_checkpoint_max_tokens_defaults_follow_gpu_memory(monkeypatch):
    """The default bounds on a GPU: half of the memory that the weights on it leave (the policy's, plus a reference
    model's or an embedded engine's copy), over the kept bytes per token of every layer (experts: with the kept
    projections' when those are kept too); `-1` and an explicit value are taken as they are."""
    from types import SimpleNamespace

    from hf_gptoss_rl import checkpointing
    from trl_ext.policy import resolve_checkpoint_max_tokens

    model, engine_copy = tiny_model(), tiny_model(seed=1)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    total = 2 * (weight_bytes + buffer_bytes) + 10 * 2**20
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    # the parameters live on the CPU here: count them as if they were on the GPU
    count = checkpointing._bytes_on
    monkeypatch.setattr(checkpointing, "_bytes_on", lambda device, modules: count(torch.device("cpu"), modules))

    def resolve(kept, setting, saves=("attention", "experts"), engine=None):
        fake = SimpleNamespace(
            args=SimpleNamespace(**{f"checkpoint_{kept}_max_tokens": setting}, checkpoint_saves=list(saves)),
            accelerator=SimpleNamespace(device=torch.device("cuda", 0), unwrap_model=lambda m: m),
            model=model,
            _harmony=True,
            rollout_engine=SimpleNamespace(model=engine),
        )
        return resolve_checkpoint_max_tokens(fake, kept)

    layers, free = model.config.num_hidden_layers, total - weight_bytes - buffer_bytes
    experts = checkpointing.kept_experts_bytes_per_token(model.config, 4) * layers
    projections = checkpointing.kept_projection_bytes_per_token(model.config, 4) * layers
    alone = resolve("experts", None)
    assert alone == free // 2 // experts > 0
    assert resolve("experts", None, engine=engine_copy) == (10 * 2**20) // 2 // experts < alone
    assert resolve("experts", -1) is None and resolve("experts", 7) == 7
    assert resolve("experts", None, saves=("attention",)) is None
    all_three = ("attention", "experts", "projections")
    assert resolve("experts", None, saves=all_three) == free // 2 // (experts + projections) < alone
    assert resolve("projections", None, saves=all_three) == free // 2 // projections > alone
    assert resolve("projections", None) is None  # not kept
    assert resolve("projections", -1, saves=all_three) is None and resolve("projections", 9, saves=all_three) == 9


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_chunked_head_is_the_default_and_follows_the_entropy_bonus(tmp_path, tokenizer, monkeypatch, entropy_coef):
    """`logprobs_implementation="auto"` installs the chunked head on every device; the hidden states' gradient is
    computed in its forward unless TRL's entropy bonus differentiates the entropy (then it would be a wasted pass)."""
    from types import SimpleNamespace

    from hf_gptoss_rl import logprobs
    from trl_ext.policy import use_chunked_logprobs

    calls = []
    install = logprobs.add_chunked_logprob_head
    monkeypatch.setattr(logprobs, "add_chunked_logprob_head", lambda *a, **k: calls.append(k) or install(*a, **k))
    for choice, expected in (("auto", True), ("chunked", True), ("trl", False)):  # on every device: no device input
        assert use_chunked_logprobs(SimpleNamespace(logprobs_implementation=choice)) == expected, choice
    trainer, _ = scripted_trainer(tmp_path, tokenizer, entropy_coef=entropy_coef)
    assert trainer.entropy_coef == entropy_coef
    assert calls and calls[-1]["hidden_grad_in_forward"] is (False if entropy_coef else None)


def test_projections_are_kept_for_gpt_oss_policies_only():
    """`"projections"` is sized for GPT-OSS's layers (attention and router products); in another model the same
    rule would keep its MLP products too, so it matches nothing there, like `"attention"` with another attention."""
    from types import SimpleNamespace

    from trl_ext.policy import checkpoint_saves

    saves = ["attention", "experts", "projections"]
    for gpt_oss, expected in ((True, saves), (False, ["attention", "experts"])):
        fake = SimpleNamespace(args=SimpleNamespace(checkpoint_saves=saves), _harmony=gpt_oss)
        assert checkpoint_saves(fake) == expected


def test_bytes_on_counts_each_tensor_on_the_device_once():
    from hf_gptoss_rl.checkpointing import _bytes_on

    on_cpu = torch.nn.Linear(4, 3)  # 12 + 3 floats
    elsewhere = torch.nn.Linear(4, 3, device="meta")
    shared = torch.nn.Sequential(on_cpu, elsewhere)
    assert _bytes_on(torch.device("cpu"), [on_cpu, shared, elsewhere]) == 15 * 4


def _ragged_batch(lengths, generator, vocab=1000):
    """TRL's padded layout for trajectories of the given (prompt, completion) lengths: left-padded prompts,
    right-padded completions; a completion length of 0 keeps one masked token (a fully masked completion)."""
    batch = len(lengths)
    prompt_width = max(p for p, _ in lengths)
    width = max(max(c, 1) for _, c in lengths)
    prompt_ids = torch.zeros(batch, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(batch, prompt_width)
    completion_ids = torch.zeros(batch, width, dtype=torch.long)
    completion_mask = torch.zeros(batch, width)
    for b, (p, c) in enumerate(lengths):
        prompt_ids[b, prompt_width - p :] = torch.randint(1, vocab, (p,), generator=generator)
        prompt_mask[b, prompt_width - p :] = 1
        completion_ids[b, : max(c, 1)] = torch.randint(1, vocab, (max(c, 1),), generator=generator)
        completion_mask[b, :c] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("attn", ["eager", "hf-gptoss-rl/sink-flash-attn3"])  # flex: no sinks on CPU
def test_padding_free_loss_and_gradients_equal_padded(tmp_path, tokenizer, attn, monkeypatch):
    """Packed (one varlen row, positions restarting per trajectory) vs TRL's padded forward: same loss (TRL's
    `_compute_loss`, with clipping, a tool mask and the router aux loss) and same gradient of every parameter."""
    import functools

    from hf_gptoss_rl.attention import load_kernel

    kernel, varlen_calls = load_kernel(), []
    original_varlen = kernel.flash_attn_varlen_func

    @functools.wraps(original_varlen)  # transformers reads the signature
    def counting_varlen(*args, **kwargs):
        varlen_calls.append(kwargs.get("cu_seqlens_q", args[3] if len(args) > 3 else None))
        # packed rows pass their varlen arguments with the forward: a Python int, no per-layer read from the GPU
        assert type(kwargs.get("max_seqlen_q", args[5] if len(args) > 5 else None)) is int
        return original_varlen(*args, **kwargs)

    monkeypatch.setattr(kernel, "flash_attn_varlen_func", counting_varlen)
    from transformers import modeling_flash_attention_utils

    def no_derivation(*args, **kwargs):
        raise AssertionError("varlen arguments derived from position_ids in a layer (a host sync per layer)")

    monkeypatch.setattr(modeling_flash_attention_utils, "_prepare_from_posids", no_derivation)

    # transformers caches the kernel's functions at first use: make it look them up again
    monkeypatch.setattr(modeling_flash_attention_utils, "_loaded_implementation", None)
    model = tiny_model()
    model.config.output_router_logits = True  # TRL then adds router_aux_loss_coef * aux_loss
    trainer, _ = scripted_trainer(
        tmp_path, tokenizer, model=model, attn_implementation=attn, per_device_train_batch_size=6,
        num_generations=2, vllm_importance_sampling_correction=False,
    )  # fmt: skip
    assert trainer.resolved.padding_free  # the default where the attention implementation honours packed positions
    assert trainer.aux_loss_enabled
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    # very different lengths (longer than the sliding window, 8), a fully masked completion, a 1-token one
    lengths = [(3, 61), (12, 5), (7, 0), (2, 1), (9, 30), (5, 17)]
    prompt_ids, prompt_mask, completion_ids, completion_mask = _ragged_batch(lengths, g)
    tool_mask = torch.ones_like(completion_mask)
    tool_mask[0, 20:30] = 0  # a tool response inside the first trajectory
    old = -5.0 + 0.3 * torch.randn(completion_mask.shape, generator=g)  # off-policy: some ratios clip
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "tool_mask": tool_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, 0.1]),
        "old_per_token_logps": old, "num_items_in_batch": (completion_mask * tool_mask).sum(),
    }  # fmt: skip
    policy = trainer.model
    policy.train()
    results = {}
    for packed in (False, True):
        trainer.resolved = dataclasses.replace(trainer.resolved, padding_free=packed)
        policy.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(policy, dict(inputs))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            policy, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            completion_ids.shape[1], compute_entropy=True,
        )  # fmt: skip
        results[packed] = (loss.detach(), grads, logps.detach())
        if attn != "eager" and packed:  # the packed row ran the kernel's varlen path, one sequence per trajectory
            expected = torch.tensor([0] + [p + max(c, 0) for p, c in lengths]).cumsum(0)
            assert varlen_calls and varlen_calls[-1].tolist() == expected.tolist()
    (padded_loss, padded_grads, padded_logps), (packed_loss, packed_grads, packed_logps) = results[False], results[True]
    assert padded_loss.abs() > 0
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(packed_logps, padded_logps, rtol=1e-5, atol=1e-6)
    assert (packed_logps[completion_mask == 0] == 0).all()
    names = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert set(padded_grads) == set(packed_grads) == names  # every parameter, the sinks and the router included
    assert any("sinks" in n for n in names)
    for name, grad in padded_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_padding_free_refuses_what_cannot_honour_boundaries(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="padding_free=True and sequence_parallel_size"):
        make_config(tmp_path, padding_free=True, sequence_parallel_size=2)
    model = tiny_model()
    model.config._attn_implementation = "paged|sdpa"  # no packed-sequence support in its mask
    with pytest.raises(ValueError, match="padding_free=True: attn_implementation='paged|sdpa'"):
        scripted_trainer(tmp_path, tokenizer, model=model, padding_free=True)


def test_cpu_defaults_fall_back(tmp_path, tokenizer):
    """Defaults on CPU: selective checkpointing (the projections kept; eager attention is not matched), no Liger /
    fused RoPE (CUDA-only), packing on; asking for Liger without CUDA is an error."""
    config = make_config(tmp_path)
    assert config.checkpoint_saves == ["attention", "experts", "projections"] and config.gradient_checkpointing
    assert config.checkpoint_experts_max_tokens is None and config.checkpoint_projections_max_tokens is None
    assert config.liger_rms_norm is None and config.fused_rope is None and config.padding_free is None
    trainer, _ = scripted_trainer(tmp_path, tokenizer, max_steps=1)
    resolved = trainer.resolved
    assert (resolved.liger_rms_norm, resolved.fused_rope, resolved.padding_free) == (False, False, True)
    assert resolved.chunked_logprobs and resolved.routing_shape == (2, 2, 4)  # "auto" log-probs; the tiny MoE
    with pytest.raises(dataclasses.FrozenInstanceError):  # resolved once: the trainer's forwards all see the same
        resolved.padding_free = False
    trainer.train()
    assert math.isfinite(_logged(trainer, "loss")[0])
    with pytest.raises(ValueError, match="liger_rms_norm=True needs a CUDA device"):
        scripted_trainer(tmp_path, tokenizer, liger_rms_norm=True)
