"""Rollout weight sync: how trained weights leave the policy, reach a rollout engine, and are checked there.

One package, one file per concern:

- `settings`: the modes and checks (`SYNC_MODES`, `VERIFY_MODES`), `WeightSyncConfig`, `WeightSyncError`,
  `ServerLostError`;
- `export`: what is sent (merged weights named as the base model names them, or a LoRA adapter; FSDP gathers);
- `transport`: how it travels (SGLang's tensor serialization, flattened buckets, the NCCL group, files on disk);
- `verify`: what the server serves against what was sent (names, changed parameters, the log-prob probe);
- `sglang`: SGLang's weight-update endpoints, driven and checked for every server of an `SGLangEngine`;
- `offline`: the weight updates of an in-process ``sglang.Engine``, driven and checked for an `SGLangOfflineEngine`;
- `history`: `SyncRecord`, what one sync did (bytes, outcome, seconds, the log-prob probe), one per sync in the
  ``sync_history`` of an `SGLangEngine`'s weight sync.

`push_policy_weights` is the trainer's one call per step.
"""

from __future__ import annotations

from collections.abc import Callable

from .export import LoRAAdapter, export_lora_adapter, export_policy_weights
from .history import SyncRecord
from .settings import SYNC_MODES, VERIFY_MODES, ServerLostError, WeightSyncConfig, WeightSyncError
from .transport import (
    checkpoint_dtypes,
    convert_checkpoint,
    load_state_tensors,
    save_config_for_sglang,
    write_served_model,
)
from .verify import reference_logprobs

__all__ = [
    "SYNC_MODES",
    "VERIFY_MODES",
    "LoRAAdapter",
    "ServerLostError",
    "SyncRecord",
    "WeightSyncConfig",
    "WeightSyncError",
    "checkpoint_dtypes",
    "convert_checkpoint",
    "export_lora_adapter",
    "export_policy_weights",
    "load_state_tensors",
    "push_policy_weights",
    "reference_logprobs",
    "save_config_for_sglang",
    "write_served_model",
]


def push_policy_weights(
    engine,
    model,
    *,
    version: int,
    accelerator=None,
    is_fsdp: bool = False,
    lora: bool = False,
    is_main_process: bool = True,
    probe_ids: list[int] | None = None,
    run: Callable | None = None,
) -> None:
    """Send ``model`` (the unwrapped policy) to ``engine`` as ``version``: the trainer's one call per step.

    ``lora=True`` pushes only the PEFT adapter (``engine.update_lora_adapter``); otherwise merged weights
    (``engine.update_weights``). Only the main process talks to a remote engine (``is_main_process``), but
    every process enters the export (FSDP gathers collectively). ``probe_ids``: when the engine verifies with
    ``"logprobs"``, the policy's log-probs of these ids are the reference. ``run`` runs a coroutine to the end
    from synchronous code.
    """
    if run is None:
        from .._async import run_sync as run
    if lora:
        adapter = export_lora_adapter(model, accelerator=accelerator, is_fsdp=is_fsdp)
        if not is_main_process:
            return
        if not hasattr(engine, "update_lora_adapter"):
            raise WeightSyncError(f"{type(engine).__name__} cannot load LoRA adapters; use merged weight sync")
        run(engine.update_lora_adapter(adapter, version=version))
    else:
        with export_policy_weights(model, accelerator=accelerator, is_fsdp=is_fsdp) as named:
            if not is_main_process:
                return
            run(engine.update_weights(list(named()), version=version))
    sync = getattr(engine, "weight_sync", None)
    if probe_ids and sync is not None and "logprobs" in sync.config.verify:
        run(engine.verify_logprobs(probe_ids, reference_logprobs(model, probe_ids)))
