"""What is sent: the policy's weights as the base model names them, or only its LoRA adapter.

- `export_policy_weights`: full weights, PEFT LoRA deltas added out of place, FSDP state dicts gathered.
- `export_lora_adapter`: only the adapter (a rank-16 q/k/v/o adapter of gpt-oss-20b is ~16 MB against ~42 GB of
  merged bf16 weights), named as ``adapter_model.safetensors`` names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .settings import WeightSyncError


@contextmanager
def export_policy_weights(model, *, accelerator=None, is_fsdp: bool = False) -> Iterator[Callable[[], Iterator]]:
    """Yield a function listing ``(name, tensor)`` of the policy as the base model names them (LoRA merged).

    ``model`` is the unwrapped policy. With FSDP, ``accelerator.get_state_dict`` gathers the full state dict
    (a collective: every rank must enter). LoRA deltas are added out of place, tensor by tensor, so the live
    model's frozen base weights are never written; other PEFT adapters are merged for the export and unmerged
    afterwards, as TRL's vLLM sync does (``trl.trainer.grpo_trainer.GRPOTrainer._move_model_to_vllm``).
    """
    from peft import PeftModel

    if is_fsdp:
        state_dict = accelerator.get_state_dict(model)  # full tensors on the main process (FULL_STATE_DICT)
        if isinstance(model, PeftModel):
            yield lambda: _merged_from_state_dict(model, state_dict)
        else:
            yield lambda: ((k, v) for k, v in state_dict.items())
        return
    if not isinstance(model, PeftModel):
        yield lambda: ((k, v.detach()) for k, v in model.state_dict().items())
        return
    prefix = model.prefix  # "lora_"
    deltas = _lora_deltas_by_storage(model)
    if deltas is None:  # adapters other than LoRA: merge for the export and unmerge after, as TRL does
        with torch.no_grad():
            model.merge_adapter()
            try:
                yield lambda: _base_named_tensors(model, prefix, {})
            finally:
                model.unmerge_adapter()
        return
    # LoRA: W + scaling * B A computed out of place, one tensor at a time. Merging into the live model and
    # unmerging afterwards (TRL's `_move_model_to_vllm`) leaves W + BA - BA != W rounding in the frozen base weights
    # after every sync; here they are never written.
    yield lambda: _base_named_tensors(model, prefix, deltas)


def _lora_deltas_by_storage(model) -> dict[tuple[int, tuple[int, ...]], list] | None:
    """``{(data_ptr, shape) of a base weight: [(lora layer, adapter), ...]}`` for the active, unmerged LoRA adapters;
    None when the model has tuner layers other than LoRA (they have no out-of-place delta)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    deltas: dict[tuple[int, tuple[int, ...]], list] = {}
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not isinstance(module, LoraLayer):
            return None
        adapters = [a for a in module.active_adapters if a in module.lora_A and a not in module.merged_adapters]
        if not adapters:
            continue
        weight = module.get_param() if isinstance(module, ParamWrapper) else module.get_base_layer().weight
        deltas.setdefault((weight.data_ptr(), tuple(weight.shape)), []).extend((module, a) for a in adapters)
    return deltas


def _base_model_name(peft_name: str) -> str:
    """A PEFT model's state-dict name as the base model (and the rollout engine) names it."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer", "")


def _base_named_tensors(model, prefix: str, deltas: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's ``(name, tensor)`` pairs, each LoRA delta added to its base weight (fp32 sum, base dtype)."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if prefix in name:  # adapter tensors: their delta is in the base weight
                continue
            tensor = tensor.detach()
            layers = deltas.get((tensor.data_ptr(), tuple(tensor.shape)), ())
            if layers:
                merged = tensor.to(torch.float32, copy=True)
                for layer, adapter in layers:
                    merged += layer.get_delta_weight(adapter).float()
                tensor = merged.to(tensor.dtype)
            yield _base_model_name(name), tensor


def _merged_from_state_dict(model, state_dict: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's ``(name, tensor)`` pairs from a full state dict of the PEFT ``model`` (what FSDP's gather
    returns: its live weights are shards), each LoRA delta ``scaling * B A`` added in fp32 (base dtype out).

    Only LoRA on ``nn.Linear`` layers (peft's ``lora.Linear``: q/k/v/o, routers, ``lm_head``) is merged this way;
    other tuner layers (LoRA on the experts' 3-D parameters, DoRA, other adapters) raise: their delta needs the
    module's own weights."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    prefix = model.prefix
    merged: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        adapters = [a for a in module.active_adapters if a in getattr(module, "lora_A", {})]
        if not isinstance(module, LoraLinear) or any(module.use_dora.get(a) for a in adapters):
            raise WeightSyncError(
                f"merged weight sync of a sharded (FSDP) PEFT model supports LoRA on linear layers only; "
                f"{module_name} is {type(module).__name__}. Sync the adapter instead (weight_sync_lora=True)."
            )
        adapters = [a for a in adapters if a not in module.merged_adapters]
        if not adapters:
            continue
        key = f"{module_name}.base_layer.weight"
        with torch.no_grad():
            weight = state_dict[key].to(torch.float32, copy=True)
            for a in adapters:
                lora_a = state_dict[f"{module_name}.lora_A.{a}.weight"].float()
                lora_b = state_dict[f"{module_name}.lora_B.{a}.weight"].float()
                delta = (lora_b @ lora_a) * module.scaling[a]
                weight += delta.T if module.fan_in_fan_out else delta
            merged[key] = weight.to(state_dict[key].dtype)
    for name, tensor in state_dict.items():
        if prefix in name:  # adapter tensors: their delta is in the base weight
            continue
        yield _base_model_name(name), merged.get(name, tensor)


@dataclass
class LoRAAdapter:
    """A PEFT adapter as SGLang loads it: ``config_dict`` (``adapter_config.json``) and PEFT-named tensors."""

    config_dict: dict
    named_tensors: list[tuple[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors)


def export_lora_adapter(
    model, adapter_name: str = "default", *, accelerator=None, is_fsdp: bool = False
) -> LoRAAdapter:
    """The active adapter of a PEFT ``model``, named like ``adapter_model.safetensors`` (what SGLang reads).

    SGLang serves LoRA on GPT-OSS for the attention projections, the experts, ``lm_head`` and the embeddings
    (``GptOssForCausalLM._lora_pattern_moe`` in ``sglang/srt/models/gpt_oss.py``); launch the server with
    ``--enable-lora --max-lora-rank R --lora-target-modules ...`` covering the adapter's modules. With FSDP the
    adapter is read from ``accelerator.get_state_dict`` (a collective: every rank must call this).
    """
    from peft import PeftModel, get_peft_model_state_dict

    if not isinstance(model, PeftModel):
        raise WeightSyncError("LoRA weight sync needs a PEFT model (peft_config); use merged sync otherwise")
    config = model.peft_config[adapter_name]
    if (
        getattr(config, "peft_type", None) is not None
        and str(getattr(config.peft_type, "value", config.peft_type)) != "LORA"
    ):
        raise WeightSyncError(f"LoRA weight sync supports LoRA adapters only, got {config.peft_type}")
    config_dict = config.to_dict()
    for key, value in list(config_dict.items()):  # JSON: sets -> sorted lists, enums -> values
        if isinstance(value, set):
            config_dict[key] = sorted(value)
        elif hasattr(value, "value"):
            config_dict[key] = value.value
    full = accelerator.get_state_dict(model) if is_fsdp else None  # FSDP: the live weights are shards
    state = get_peft_model_state_dict(model, state_dict=full, adapter_name=adapter_name)
    return LoRAAdapter(config_dict, [(k, v.detach()) for k, v in state.items()])
