"""What `AgenticGRPOTrainer` checks and derives from its arguments: before TRL's `GRPOTrainer.__init__`, the config
(a plain `GRPOConfig` upgraded), harmony's rendering arguments, the model type, the datasets' prompt column and the
logging backends, each refused with a message that names the problem; after it, the rollout components built from
the flat fields (`weight_sync_config`, `sglang_engine_kwargs`, `agent_loop_kwargs`: the one place each field reaches
its component)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from trl import GRPOConfig
from trl.trainer.utils import get_config_model_id

from hf_gptoss_rl.harmony import DEFAULT_REASONING_EFFORT, REASONING_EFFORTS

from .config import AgenticGRPOConfig
from .weight_sync.settings import WeightSyncConfig


def agentic_args(model, args) -> AgenticGRPOConfig:
    """`args` as an `AgenticGRPOConfig`: TRL's default config when None, a plain `GRPOConfig` upgraded."""
    if args is None:  # TRL's default, `<model name>-GRPO`
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        name = (name or "").rstrip("/").split("/")[-1]
        return AgenticGRPOConfig(f"{name}-GRPO" if name else "agentic-grpo")
    if isinstance(args, AgenticGRPOConfig):
        return args
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a GRPOConfig or an AgenticGRPOConfig, got {type(args).__name__}")
    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    extra = sorted(f.name for f in dataclasses.fields(args) if f.init and f.name not in trl_fields)
    if extra:
        raise TypeError(
            f"args is a {type(args).__name__}, a GRPOConfig subclass with fields AgenticGRPOConfig does not have: "
            f"{extra}. Pass an AgenticGRPOConfig (or a subclass of it) instead."
        )
    values = {name: getattr(args, name) for name in trl_fields}
    # GRPOConfig.__post_init__ derived generation_batch_size from steps_per_generation (setting both is refused)
    # and moved the deprecated aliases onto their successors: let the new config derive them again.
    values.update(generation_batch_size=None, vllm_importance_sampling_cap=None, use_transformers_paged=False)
    return AgenticGRPOConfig(**values)


def harmony_kwargs(args: AgenticGRPOConfig) -> dict[str, Any]:
    """`render_prompt` keyword arguments from the config and TRL's `chat_template_kwargs`.

    GPT-OSS's chat template takes `reasoning_effort`; `conversation_start_date` and `developer_instructions`
    are harmony's own. Other keys (`model_identity`, `builtin_tools`, ...) are refused by name.
    """
    kwargs: dict[str, Any] = {
        "reasoning_effort": args.reasoning_effort,
        "developer_instructions": args.developer_instructions,
    }
    template_kwargs = dict(args.chat_template_kwargs or {})
    harmony_keys = {"reasoning_effort", "conversation_start_date", "developer_instructions"}
    unsupported = sorted(set(template_kwargs) - harmony_keys)
    if unsupported:
        raise ValueError(
            f"chat_template_kwargs {unsupported} are not supported for GPT-OSS: prompts are rendered in harmony "
            "(hf_gptoss_rl.harmony.render_prompt), which takes reasoning_effort, conversation_start_date and "
            "developer_instructions."
        )
    for key, value in template_kwargs.items():
        configured = kwargs.get(key)
        default = {"reasoning_effort": DEFAULT_REASONING_EFFORT}.get(key)
        if configured not in (None, default, value):
            raise ValueError(
                f"chat_template_kwargs[{key!r}]={value!r} disagrees with {key}={configured!r}; set only one."
            )
        kwargs[key] = value
    if kwargs["reasoning_effort"] not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {kwargs['reasoning_effort']!r}.")
    return kwargs


def weight_sync_config(args: AgenticGRPOConfig, model_config) -> WeightSyncConfig:
    """The `WeightSyncConfig` of the `weight_sync_*` fields (`weight_sync_lora` picks what the trainer pushes, not
    how it travels); `model_config` is written next to the weights of a disk sync."""
    return WeightSyncConfig(
        mode=args.weight_sync_mode,
        verify=tuple(args.weight_sync_verify),
        checkpoint_path=args.weight_sync_checkpoint,
        pause_mode=None if args.weight_sync_pause_mode == "none" else args.weight_sync_pause_mode,
        weight_dir=args.weight_sync_dir or os.path.join(args.output_dir, "rollout_weights"),
        model_config=model_config,
        bucket_bytes=args.weight_sync_bucket_mb << 20,
        dist_master_address=args.weight_sync_master_address,
        dist_master_port=args.weight_sync_master_port,
        probe_atol=args.weight_sync_probe_atol,
        probe_rtol=args.weight_sync_probe_rtol,
        probe_margin=args.weight_sync_probe_margin,
    )


def sglang_engine_kwargs(args: AgenticGRPOConfig) -> dict[str, Any]:
    """`SGLangEngine` keywords of `sglang_urls`, the `sglang_*` fields and `rollout_concurrency`; the API key falls
    back to `$SGLANG_API_KEY`."""
    return {
        "base_urls": args.sglang_urls,
        "max_concurrency": args.rollout_concurrency,
        "timeout_s": args.sglang_timeout_s,
        "retry_deadline_s": args.sglang_retry_deadline_s,
        "ready_timeout_s": args.sglang_ready_timeout_s,
        "log_every_s": args.sglang_log_every_s,
        "api_key": args.sglang_api_key or os.environ.get("SGLANG_API_KEY") or None,
    }


def agent_loop_kwargs(args: AgenticGRPOConfig) -> dict[str, Any]:
    """`AgentLoop` limits of the config: turns, TRL's `max_completion_length` (the whole trajectory's token
    budget), tool output and time, concurrency."""
    return {
        "max_turns": args.max_turns,
        "max_completion_tokens": args.max_completion_length,
        "max_tool_output_chars": args.max_tool_output_chars,
        "tool_timeout_s": args.tool_timeout_s,
        "max_concurrency": args.rollout_concurrency,
    }


def model_type(model, args) -> str | None:
    """`config.model_type` of a model instance, or of a model id/path (read from its config, as TRL will load it)."""
    if not isinstance(model, str):
        return getattr(model.config, "model_type", None)
    from transformers import AutoConfig

    init_kwargs = args.model_init_kwargs or {}
    config = AutoConfig.from_pretrained(
        model,
        revision=init_kwargs.get("revision"),
        trust_remote_code=init_kwargs.get("trust_remote_code", args.trust_remote_code),
    )
    return config.model_type


def check_prompt_column(dataset, name: str) -> None:
    """TRL reads `example["prompt"]` at the first step; fail at construction instead, naming the column."""
    if dataset is None:
        return
    if isinstance(dataset, dict):  # DatasetDict, or TRL's {name: dataset} eval sets
        for key, value in dataset.items():
            check_prompt_column(value, f"{name}[{key!r}]")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:  # an IterableDataset whose features are unknown until read
        return
    if "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (its columns: {list(columns)}). GRPO samples completions for the "
            "prompts in a 'prompt' column: text, or a list of chat messages. Rename yours, e.g. "
            "`dataset.rename_column('question', 'prompt')`, or map it."
        )


# `report_to` backends with an extra of their own: (modules that may provide it, the extra)
_LOGGING_BACKENDS = {"tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"), "wandb": (("wandb",), "wandb"),
                     "trackio": (("trackio",), "trackio")}  # fmt: skip


def check_report_to(report_to) -> None:
    """Fail at construction, naming what to install, for a `report_to` backend that is not installed (transformers
    would too, but without the project's extra)."""
    import importlib.util

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name not in _LOGGING_BACKENDS:
            continue
        modules, extra = _LOGGING_BACKENDS[name]
        if not any(importlib.util.find_spec(m) is not None for m in modules):
            raise ImportError(
                f"report_to={name!r} needs the {modules[0]} package: pip install 'hf_gptoss_rl[{extra}]' (or pip "
                f"install {modules[0]}), or pass report_to='none'"
            )
