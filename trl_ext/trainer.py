"""`AgenticGRPOTrainer`: TRL's `GRPOTrainer` with multi-turn, tool-calling GPT-OSS rollouts.

What changes against TRL 1.16 (and why), each through the smallest hook:

- Rollouts (`rollout_func`, TRL's own extension point): prompts are rendered in harmony and run through
  `trl_ext.rollout.AgentLoop` on a `RolloutEngine` (embedded or SGLang). The sampled ids are kept exactly as
  sampled (history is never re-tokenized); tool messages are part of the completion with `env_mask = 0`, so TRL's
  `tool_mask` takes them out of the loss; the engine's per-token log-probs travel as `sampling_per_token_logps`.
- On-policy ratio: when each generation is consumed by one optimizer step, TRL (without vLLM) skips the second
  "old log-probs" forward and uses `per_token_logps.detach()`: the PPO ratio is exactly 1 and nothing is clipped.
  TRL forces that second forward whenever its (vLLM-only) importance-sampling correction is on; here the correction
  reuses the loss's own forward instead (`_get_per_token_logps_and_entropies`), so the on-policy ratio stays 1
  under MoE routing noise.
- Mismatch metrics and TRL's importance-sampling correction (`vllm_importance_sampling_*`, same modes, bounds and
  `sampling/*` metrics, applied to any rollout engine; `trl_ext.rollout_correction`) compare the rollout log-probs
  with the training log-probs of the same forward (on-policy) or with TRL's recomputed old log-probs (off-policy).
- Rendering: harmony for GPT-OSS; other causal LMs get TRL's rendering (chat template) and single-turn rollouts.
- Weight sync: after every optimizer step (and on resume) the policy's weights — LoRA merged, names as in the base
  model's `state_dict` — go to the engine (`RolloutEngine.update_weights`) with the global step as version. Each
  answer carries the version that served it; a trajectory served on another version than the last sync's is stale:
  an error by default, counted in `rollout/stale_trajectories` with `allow_stale_rollouts=True`.
- Log-probs: `hf_gptoss_rl.logprobs` replaces TRL's fused head where TRL has no Triton (same call contract), and
  sequence parallelism (`sequence_parallel_size`) pools the micro-batches of an SP group for the loss forward.

This class holds the hooks; each concern lives in a module of its own: `trainer_args` (argument checks, the rollout
components built from the flat fields), `policy` (the automatic settings resolved, policy preparation), `policy_forward` (the log-prob forward), `rollout_batch` (one generation's
rollouts, carried from `_rollout` through `_generate` to the loss), `rollout_correction` (mismatch metrics and IS
correction), `rollout_sync` (weight sync and served versions).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import PreTrainedModel, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import RepeatSampler

from .config import AgenticGRPOConfig
from .policy import apply_model_implementations, policy_model, prepare_policy, resolve_auto_settings
from .policy_forward import (
    policy_logps_and_entropies,
    pool_sequence_parallel_inputs,
    sequence_parallel_loss_scale,
    setup_sequence_parallel,
)
from .rollout_batch import (
    RolloutBatch,
    log_rollout_metrics,
    reward_completions,
    rollout_fields,
    routing_layout,
    run_rollout_batch,
)
from .rollout_correction import apply_rollout_correction, log_mismatch_by_routing
from .rollout_sync import (
    RolloutWeightSync,
    StaleRolloutError,
    check_served_versions,
    push_weights,
    sync_rollout_weights,
)
from .trainer_args import (
    agent_loop_kwargs,
    agentic_args,
    check_prompt_column,
    check_report_to,
    harmony_kwargs,
    model_type,
    sglang_engine_kwargs,
    weight_sync_config,
)

logger = logging.getLogger(__name__)

__all__ = ["AgenticGRPOTrainer", "StaleRolloutError"]


class _EpochSeededRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` whose shuffle is a function of (seed, epoch).

    TRL seeds one generator at construction and draws a new permutation per epoch from it, so a run resumed in
    epoch e > 0 (a fresh sampler) replays epoch 0's order. Reseeding on `set_epoch` (which the Trainer calls every
    epoch) makes the order of every epoch reproducible, and resume exact.
    """

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle and self.seed is not None:  # TRL only creates the generator when it shuffles
            self.generator.manual_seed(self.seed + epoch)


class AgenticGRPOTrainer(GRPOTrainer):
    """GRPO for agentic GPT-OSS: multi-turn tool-calling rollouts, rollout/training mismatch control.

    The constructor is TRL's `GRPOTrainer.__init__` (same arguments, same positions), plus the keyword-only
    `rollout_engine`.

    Args:
        model: a model id/path (loaded by TRL with `args.model_init_kwargs`) or a `PreTrainedModel`. GPT-OSS
            (`model_type="gpt_oss"`) gets harmony rollouts with tool calls; any other causal LM gets single-turn
            rollouts rendered with its chat template (`chat_template_kwargs`), without tools.
        reward_funcs: TRL reward functions / reward models. Optional in the signature as in TRL, but needed: TRL's
            other reward source (an environment's `get_reward`) is not supported, so TRL's `ValueError` is raised
            without them. They receive what TRL's `GRPOTrainer(tools=...)` passes: `prompts`, `completions`,
            `completion_ids` (the whole trajectory: sampled tokens and tool messages), the dataset columns. For
            GPT-OSS, `completions` holds, for chat prompts, each completion's messages as TRL's tool loop builds them:
            `{"role": "assistant", "thinking": <analysis>, "tool_calls": [...], "content": <final answer>}` per turn
            (`thinking` / `tool_calls` only when present) and `{"role": "tool", "name": ..., "content": ...}` after a
            call (a turn cut off by the token budget keeps its partial `thinking` / `content`, as TRL's parser does);
            for text prompts, TRL's decoding of the completion ids (`batch_decode(..., skip_special_tokens=True)`:
            every turn, channel names included, never empty when the model sampled a token). So a reward written for
            TRL's tool calling, or for a tool-free answer (`trl.rewards.accuracy_reward`), works unchanged. Each also
            receives the per-trajectory lists `final_text` (the final-channel answer, `""` when none), `num_turns`
            (assistant turns, i.e. generate calls: not a message count), `num_tool_calls` (the calls the model made),
            `tool_errors` (failed calls), `format_errors` (unparseable turns, no final answer, engine errors) and
            `finish_reason`. Other models get TRL's decoding.
        args: an [`AgenticGRPOConfig`]; a plain `trl.GRPOConfig` is upgraded to one (its values, and the agentic
            fields at their defaults).
        train_dataset / eval_dataset: datasets with a `prompt` column (a string or a list of chat messages).
        processing_class: tokenizer. Defaults to the offline GPT-OSS tokenizer (`load_gptoss_tokenizer()`) for GPT-OSS
            models, else to TRL's default (`AutoProcessor` from the model's path).
        reward_processing_classes: as in TRL (tokenizers of reward models).
        quantization_config, peft_config: as in TRL (a `peft.LoraConfig` adapter is merged for the weight sync).
        tools: `trl_ext.tools.Tool` objects or plain (sync or async) functions with type hints and a docstring, as
            TRL takes them (wrapped in `FunctionTool`), that the model may call.
        rollout_func: TRL's `rollout_func(prompts, trainer) -> dict`; replaces the agent loop (the rollout engine
            still receives the weights after every step: `trainer.rollout_engine`, `trainer.agent_loop`).
        environment_factory: not supported (see the error message for what to use).
        rollout_engine: a ready `RolloutEngine`; by default one is built from `args.rollout_backend`.
    """

    _tag_names = ["trl", "grpo", "agentic", "gpt-oss"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs=None,
        args: AgenticGRPOConfig | GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools: list | None = None,
        rollout_func: Callable | None = None,
        environment_factory=None,
        *,
        rollout_engine=None,
    ):
        if environment_factory is not None:
            raise ValueError(
                "environment_factory is not supported by AgenticGRPOTrainer: its rollouts run in the harmony agent "
                "loop, not in TRL's tool loop. Pass the environment's methods as `tools=[...]` (plain functions or "
                "`trl_ext.tools.Tool` objects; keep per-rollout state in the tool, keyed by its arguments), compute "
                "the reward in `reward_funcs` (they receive `final_text`, `num_tool_calls`, ... and the dataset "
                "columns), or pass your own `rollout_func`."
            )
        args = agentic_args(model, args)
        check_report_to(args.report_to)
        check_prompt_column(train_dataset, "train_dataset")
        check_prompt_column(eval_dataset, "eval_dataset")
        self._harmony = model_type(model, args) == "gpt_oss"
        if not self._harmony and tools:
            raise ValueError(
                "tools: the agent loop parses tool calls from GPT-OSS harmony turns, and this model is not GPT-OSS "
                "(config.model_type != 'gpt_oss'). Use TRL's GRPOTrainer(tools=...) for other chat models."
            )
        if processing_class is None and self._harmony:
            from hf_gptoss_rl.harmony import load_gptoss_tokenizer

            processing_class = load_gptoss_tokenizer()
        self._harmony_render_kwargs = harmony_kwargs(args) if self._harmony else {}
        model = apply_model_implementations(model, args)

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            rollout_func=rollout_func,
        )
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not self.is_fsdp_enabled:
            # accelerate (state.py, AcceleratorState.__init__) turns FSDP on for accelerator processes only; on CPU
            # the processes stay MULTI_CPU (DDP) or NO without a word, and every rank would hold the full policy.
            raise ValueError(
                f"FSDP was requested (ACCELERATE_USE_FSDP=true, e.g. from an accelerate config with distributed_type "
                f"FSDP) but accelerate set up {self.accelerator.distributed_type}, without FSDP: accelerate enables "
                "FSDP on GPUs/accelerators only, not with use_cpu / --cpu. Launch on GPUs, or drop the FSDP config "
                "(DDP: `torchrun` or `accelerate launch --cpu`)."
            )
        # after super().__init__: the policy is loaded and on its device
        self.resolved = resolve_auto_settings(self, args)
        prepare_policy(self, args)

        from .rollout import AgentLoop
        from .rollout.types import sampling_params_from_config
        from .tools import FunctionTool, Tool

        self.agent_tools = [t if isinstance(t, Tool) else FunctionTool(t) for t in (tools or [])]
        # harmony: <|return|> / <|call|>; other models: TRL's end-of-completion ids (tokenizer and generation config)
        sampling = sampling_params_from_config(args, stop_token_ids=None if self._harmony else self.eos_token_ids)
        self.rollout_engine = rollout_engine if rollout_engine is not None else self._build_rollout_engine()
        # after the engine's copy of the policy: the hooks serve the trainer's routers only
        self.routing_replay = None
        self._rollout_batch: RolloutBatch | None = None  # the generation in flight, from `_rollout` to the loss
        if self.resolved.routing_shape is not None:
            from hf_gptoss_rl.routing import RoutingReplay

            self.routing_replay = RoutingReplay(policy_model(self))
        if sampling.sglang_extra and args.rollout_backend == "embedded" and rollout_engine is None:
            raise ValueError(
                f"generation_kwargs {sorted(sampling.sglang_extra)} are SGLang-only; the embedded engine does not "
                "implement them. Use rollout_backend='sglang' or remove them."
            )
        self.agent_loop = AgentLoop(
            self.rollout_engine,
            self.agent_tools,
            sampling=sampling,
            **agent_loop_kwargs(args),
            turn_format="harmony" if self._harmony else "plain",
            progress=not args.disable_tqdm and self.accelerator.is_local_main_process,
        )
        # TRL's `_generate` calls `rollout_func(prompts, trainer)` and maps `env_mask` to its `tool_mask`. Set after
        # `super().__init__` so TRL's "experimental rollout_func" warning is only raised for a user's own function.
        if rollout_func is None:
            self.rollout_func = _agent_rollout
        self._sp_group = None
        if args.sequence_parallel_size > 1:  # after the engine copy: it must keep the model's own attention
            self._sp_group = setup_sequence_parallel(self)
        self._loss_inputs: dict[str, Any] | None = None  # inputs of the `_compute_loss` call in flight
        self.last_importance_weights: torch.Tensor | None = None  # the latest correction weights (for inspection)
        # the trainer's weight version: the global step of the last sync it pushed; None before the first, when the
        # engine serves the initial policy (rollouts are checked against it: `_check_served_versions`)
        self.synced_weight_version: int | None = None
        self.add_callback(RolloutWeightSync(self))

    # ------------------------------------------------------------------ setup

    def _build_rollout_engine(self):
        args = self.args
        if args.rollout_backend == "embedded":
            from .rollout import EmbeddedEngine

            if self.is_fsdp_enabled or self.is_deepspeed_enabled:
                raise ValueError(
                    "the embedded engine holds a full copy of the policy in every process; with FSDP/DeepSpeed use "
                    "rollout_backend='sglang' (see docs/quickstart.md)"
                )

            # The engine serves its own copy of the policy (merged when PEFT), like a separate inference server.
            return EmbeddedEngine.from_policy(
                self.accelerator.unwrap_model(self.model),
                pad_token_id=self._tokenizer.pad_token_id,
                seed=args.seed + self.accelerator.process_index,
                record_routing=self.resolved.routing_shape is not None,
            )
        from .rollout import SGLangEngine

        policy = self.accelerator.unwrap_model(self.model)
        if args.weight_sync_lora and not is_peft_model(policy):
            raise ValueError("weight_sync_lora=True pushes a PEFT adapter: pass peft_config (or a PeftModel)")
        if "logprobs" in args.weight_sync_verify and self.is_fsdp_enabled:
            raise ValueError(
                "weight_sync_verify 'logprobs' scores the probe with the unwrapped policy on the main process, which "
                "FSDP shards; use 'version' and 'checksum' with FSDP"
            )
        routing_shape = self.resolved.routing_shape
        engine = SGLangEngine(
            **sglang_engine_kwargs(args),
            weight_sync=weight_sync_config(args, policy_model(self).config),
            record_routing=routing_shape if args.routing_replay else None,
        )
        # Fail here, with each unreachable URL and its last error, rather than abort every trajectory of step 1.
        engine.check_servers()
        if args.weight_sync_lora:
            from .weight_sync.sglang import check_lora_servers

            peft_config = policy.peft_config[policy.active_adapter]
            check_lora_servers(
                engine.run(engine.weight_sync.server_states()),
                rank=max([peft_config.r, *(peft_config.rank_pattern or {}).values()]),
                target_modules=_lora_module_names(policy),
            )
        if routing_shape is not None and not args.routing_replay:
            from hf_gptoss_rl.routing import RoutingError

            from .rollout.sglang import check_routing_servers

            try:  # servers that can return routing do: `routing/agreement` is logged, replay off
                check_routing_servers(engine.run(engine.weight_sync.server_states()))
                engine.record_routing = routing_shape
            except RoutingError:
                pass
        return engine

    # ------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, where `resume_from_checkpoint` may also be ``"true"`` / ``"last"`` / ``"latest"`` (as a
        command line passes them) and a half-written checkpoint is never resumed (`trl_ext.checkpoints`)."""
        from .checkpoints import resolve_resume_checkpoint

        checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        try:
            return super().train(
                resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        except BaseException:  # Ctrl-C (KeyboardInterrupt) or a failure: stop generating, then let it propagate
            self._stop_rollouts()
            raise

    def _stop_rollouts(self) -> None:
        """Abort what the rollout engine is generating and release it: the embedded engine's worker stops; an SGLang
        client continues any server it left paused, leaves its weight-update group and closes its connections."""
        from .rollout import run_sync

        engine = self.rollout_engine
        try:
            if hasattr(engine, "abort_all"):
                engine.abort_all()
            run_sync(engine.close())
        except Exception as exc:  # noqa: BLE001 - the original error is the one to report
            logger.warning(
                "releasing the rollout engine after the interruption failed: %s: %s", type(exc).__name__, exc
            )

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from .checkpoints import disk_full_while_saving

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with disk_full_while_saving(folder):
            return super()._save_checkpoint(model, trial)

    def _rollout_rng_file(self, folder: str) -> str:
        from .checkpoints import ROLLOUT_RNG_FILE

        suffix = f"_{self.args.process_index}" if self.args.world_size > 1 else ""
        return os.path.join(folder, f"{ROLLOUT_RNG_FILE}{suffix}.pth")

    def _rollout_rng_states(self) -> dict[str, Any]:
        """The generators of the rollout side that this process owns: the engine's, and any tool's."""
        states = {"engine": self.rollout_engine.rng_state()}
        states.update({f"tool:{t.name}": t.rng_state() for t in self.agent_tools})
        return {k: v for k, v in states.items() if v is not None}

    def _save_rng_state(self, output_dir: str) -> None:
        # TRL's rng_state.pth holds Python's, numpy's and torch's generators; the rollout engine's sampling generator
        # and the tools' are saved next to it, so that a resumed run continues their streams
        super()._save_rng_state(output_dir)
        states = self._rollout_rng_states()
        if states:
            torch.save(states, self._rollout_rng_file(output_dir))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = self._rollout_rng_file(checkpoint)
        if not os.path.isfile(path):
            if self._rollout_rng_states():
                logger.warning(
                    "%s has no %s: the rollout engine's and tools' generators restart from their seeds, so requests "
                    "without a sampling_seed sample differently from the straight run",
                    checkpoint,
                    os.path.basename(path),
                )
            return
        states = torch.load(path, weights_only=True)
        tools = {f"tool:{t.name}": t for t in self.agent_tools}
        for key, state in states.items():
            if key == "engine":
                self.rollout_engine.load_rng_state(state)
            elif key in tools:
                tools[key].load_rng_state(state)
            else:
                raise ValueError(f"{path} holds the generator state of {key!r}, which this trainer does not have")

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if type(sampler) is RepeatSampler:
            sampler.__class__ = _EpochSeededRepeatSampler  # same state, plus `set_epoch`
        return sampler

    # ------------------------------------------------------------------ rollouts

    def _render_prompt(self, prompt) -> list[int]:
        if not self._harmony:  # TRL's rendering: the chat template for messages, plain tokenization for text
            if isinstance(prompt, str):
                return list(self._tokenizer(text=prompt)["input_ids"])
            tokenized = self.processing_class.apply_chat_template(
                conversation=list(prompt),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(self.args.chat_template_kwargs or {}),
            )
            ids = tokenized["input_ids"]
            return list(ids[0] if ids and isinstance(ids[0], list) else ids)
        from hf_gptoss_rl.harmony import render_prompt

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        tools = [t.spec() for t in self.agent_tools] or None
        return render_prompt(messages, tools=tools, **self._harmony_render_kwargs)

    def _rollout(self, prompts: list) -> dict[str, list]:
        prompt_ids = [self._render_prompt(p) for p in prompts]
        from .rollout import rollout_seed

        # one sampling stream per trajectory, a function of (seed, mode, step, process, index): the same rollouts in
        # a straight and a resumed run, whatever the engine's batching (`rollout_seed`)
        mode = "train" if self.model.training else "eval"
        rank, step = self.accelerator.process_index, self.state.global_step
        seeds = [rollout_seed(self.args.seed, mode, step, rank, i) for i in range(len(prompt_ids))]
        start = time.perf_counter()
        trajectories = run_rollout_batch(self, prompt_ids, seeds)
        self._metrics["train" if self.model.training else "eval"]["timing/rollout_s"].append(
            time.perf_counter() - start
        )
        # what reward functions get as `completions` (`_generate`): TRL's layouts, built from the harmony turns
        completions = reward_completions(prompts, trajectories) if self._harmony else None
        fields = rollout_fields(trajectories, self._tokenizer, harmony=self._harmony)
        log_rollout_metrics(self, fields)
        self._check_served_versions(trajectories)
        routing = routing_layout(self, trajectories, fields) if self.resolved.routing_shape is not None else None
        self._rollout_batch = RolloutBatch(fields, completions=completions, routing=routing)
        return fields

    def _generate(self, prompts: list):
        """TRL's `_generate` (which calls the `rollout_func`), with the agent loop's `completions` in place of TRL's
        decoding: TRL parses the completion ids as one assistant turn (or decodes them), which for a harmony
        trajectory glues the turns, the channel names and the tool output into one text."""
        self._rollout_batch = None  # set by `_rollout` (the default `rollout_func`), taken by the next hooks
        output = super()._generate(prompts)
        completions = self._rollout_batch.completions if self._rollout_batch is not None else None
        if completions is None:  # text prompts, a user's `rollout_func`, a model without harmony: TRL's decoding
            return output
        # TRL 1.16: (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images)
        return (*output[:3], completions, *output[4:])

    def _generate_and_score_completions(self, inputs):
        try:
            output = super()._generate_and_score_completions(inputs)
            batch = self._rollout_batch
        finally:  # one generation's batch: never seen by the next one, even after an error
            self._rollout_batch = None
        if batch is not None and batch.routing is not None:  # shuffled and split with the rest of the batch by TRL
            output.update(batch.routing)
        return output

    def training_step(self, *args, **kwargs):
        try:
            return super().training_step(*args, **kwargs)
        finally:  # the plan served the forward and its recompute in the backward
            if self.routing_replay is not None:
                self.routing_replay.clear()

    # ------------------------------------------------------------------ loss: mismatch metrics and correction

    def _compute_loss(self, model, inputs):
        # Shallow copy: the correction replaces `advantages` for this call only (buffered inputs are reused).
        self._loss_inputs = pool_sequence_parallel_inputs(self, inputs) if self._sp_group is not None else dict(inputs)
        try:
            loss = super()._compute_loss(model, self._loss_inputs)
        finally:
            self._loss_inputs = None
        return loss * sequence_parallel_loss_scale(self) if self._sp_group is not None else loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        routing = self._routing_for(input_ids)
        inputs = self._loss_inputs
        other_logps = None
        if routing is not None and inputs is not None and self._routing_mismatch_step():
            # before the loss forward, whose plan the checkpoint recompute of its backward replays
            with torch.no_grad():
                try:
                    kw_other = {**kw, **{k: False for k in ("compute_entropy", "compute_aux_loss") if k in kw}}
                    other_logps = self._dispatch_logps(
                        model, input_ids, attention_mask, logits_to_keep, routing, *a, flip_replay=True, **kw_other
                    )[0]
                finally:
                    self.routing_replay.clear()
                    self.routing_replay.take_agreement()  # the agreement of record is the loss forward's
        logps, entropies, aux_loss = self._dispatch_logps(
            model, input_ids, attention_mask, logits_to_keep, routing, *a, **kw
        )
        if routing is not None and inputs is not None:
            self._log_routing_agreement()
        # Only the policy forward inside `_compute_loss` is intercepted (not the reference or old-logp passes).
        if inputs is not None and inputs.get("sampling_per_token_logps") is not None:
            if other_logps is not None:
                log_mismatch_by_routing(self, logps, other_logps, inputs)
            apply_rollout_correction(self, logps, inputs)
        return logps, entropies, aux_loss

    def _routing_mismatch_step(self) -> bool:
        """Whether this step's loss batches are also scored under the other routing (`routing_mismatch_every`)."""
        every = self.args.routing_mismatch_every
        return every > 0 and self.model.training and self.state.global_step % every == 0

    def _dispatch_logps(self, model, input_ids, attention_mask, logits_to_keep, routing, *a, **kw):
        """One log-prob pass on the path this batch takes (`trl_ext.policy_forward`); SP: only the loss forward
        (inside `_compute_loss`, on the group's pooled batch) runs sequence-parallel."""
        return policy_logps_and_entropies(
            self, super()._get_per_token_logps_and_entropies, model, input_ids, attention_mask, logits_to_keep,
            routing, *a, sequence_parallel=self._sp_group is not None and self._loss_inputs is not None, **kw,
        )  # fmt: skip

    # ------------------------------------------------------------------ routing replay

    def _routing_for(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The routing record `[B, T, layers, top_k]` of this log-prob pass's rows: the loss inputs' or, in TRL's
        generation-time passes, this generation's (None: no record, or another batch, e.g. TRL's reference pass)."""
        if self.routing_replay is None:
            return None
        batch = self._rollout_batch
        source = self._loss_inputs if self._loss_inputs is not None else (batch.routing if batch is not None else None)
        if not source or "prompt_routed_experts" not in source:
            return None
        routing = torch.cat([source["prompt_routed_experts"], source["completion_routed_experts"]], dim=1)
        return routing if tuple(routing.shape[:2]) == tuple(input_ids.shape) else None

    def _log_routing_agreement(self) -> None:
        measured = self.routing_replay.take_agreement()
        if measured is not None:
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["routing/agreement"].append(measured[0])
            metrics["routing/agreement_min_layer"].append(measured[1])

    # ------------------------------------------------------------------ weight sync (`trl_ext.rollout_sync`)

    def sync_rollout_weights(self) -> None:
        """Send the current policy to the rollout engine, versioned by the global step (`rollout_sync`)."""
        sync_rollout_weights(self)

    def _push_weights(self, engine, version: int) -> None:
        push_weights(self, engine, version)

    def _check_served_versions(self, trajectories: list) -> None:
        check_served_versions(self, trajectories)


def _lora_module_names(policy) -> set[str]:
    """The leaf names (``q_proj``, ...) of the modules the active adapter wraps: what its weights name, whatever
    form ``target_modules`` took (a list, a regex, ``"all-linear"``)."""
    from peft.tuners.lora import LoraLayer

    active = policy.active_adapter
    return {
        name.rsplit(".", 1)[-1]
        for name, module in policy.named_modules()
        if isinstance(module, LoraLayer) and active in module.lora_A
    }


def _agent_rollout(prompts: list, trainer: AgenticGRPOTrainer) -> dict[str, list]:
    """TRL `rollout_func`: one agentic trajectory per prompt (the sampler already repeats each prompt G times)."""
    return trainer._rollout(prompts)
