"""Weight-sync settings: the modes, the checks, and `WeightSyncConfig`, the one place they are set.

Importing this module imports neither torch nor an engine: `AgenticGRPOConfig` validates its fields against the
tuples below, and its `weight_sync_*` fields take their defaults from `WeightSyncConfig`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SYNC_MODES = ("disk", "distributed", "tensor")
"""How merged weights travel: safetensors on a shared disk, an NCCL broadcast, or CUDA-IPC tensor payloads."""

VERIFY_MODES = ("version", "checksum", "logprobs")
"""Checks after each sync. ``version`` is always on; the tensor names are always checked before sending."""

PAUSE_MODES = ("retract", "abort", "in_place", None)
"""``/pause_generation`` modes around a sync (None: no pause)."""

DEFAULT_SGLANG_VERIFY = ("version", "checksum")


class WeightSyncError(RuntimeError):
    """A weight sync failed or could not be verified; the message names the server(s) and the mismatch."""


class ServerLostError(WeightSyncError):
    """A server stopped answering during a weight sync and did not answer again within the deadline; the message
    names it and its last error."""


@dataclass
class WeightSyncConfig:
    """How an SGLang rollout engine receives the trainer's weights, and how each sync is checked.

    Args:
        mode: ``"disk"`` (``/update_weights_from_disk``: safetensors in ``weight_dir``, which the servers must
            read), ``"distributed"`` (``/update_weights_from_distributed``: one NCCL broadcast per bucket) or
            ``"tensor"`` (``/update_weights_from_tensor``: CUDA-IPC handles, servers on this node).
        verify: checks after every sync. ``"version"`` (always on): every server reports the new
            ``weight_version``. ``"checksum"`` (``/weights_checker``): every served parameter fed by a tensor that
            changed since the previous sync changed on the server, and servers of the same layout agree.
            ``"logprobs"``: the servers' log-probs of a probe sequence match the trainer's (`probe_margin`).
            Before anything is sent, every tensor name is checked against the names the server loads (its
            checkpoint's, or its own parameters'), whatever ``verify`` holds.
        checkpoint_path: where to read the tensor names the servers load. Default: the ``model_path`` each server
            was launched with, when this process can read it (a local directory or the Hugging Face cache);
            otherwise the servers' own parameter names (``/weights_checker``) through SGLang's loader mapping.
        pause_mode: ``/pause_generation`` mode around a sync: ``"retract"`` (running requests are recomputed with
            the new weights), ``"abort"`` (they return ``abort``), ``"in_place"`` (they finish on their old KV
            cache; the radix cache is flushed once they are done, and this engine holds its new requests until
            then), or None (no pause).
        weight_dir: disk mode: the directory shared with the servers (a temporary one by default: only valid when
            the servers run on this machine). ``model_config`` (``save_pretrained``-able) is written next to the
            weights, since SGLang reads ``config.json`` there. ``max_shard_size``: shard size of the safetensors.
        bucket_bytes: most bytes per broadcast (distributed) or per tensor request (tensor).
        dist_backend: distributed mode backend (``"nccl"`` with CUDA, ``"gloo"`` otherwise);
            ``dist_master_address`` is this process's address that the servers reach for the rendezvous
            (``127.0.0.1`` only when they run on this machine), ``dist_master_port`` (a free port by default),
            ``group_name``, ``dist_timeout_s`` (the rendezvous and each collective).
        probe_atol, probe_rtol, probe_margin: the log-prob probe (``"logprobs"``). It fails when the mean absolute
            difference between server and trainer exceeds ``atol + rtol * mean |trainer log-prob|`` (a gross
            mismatch), or ``probe_margin`` times the floor measured at the first verified sync (the difference of
            two engines holding the same weights). Whether a stale server would have been caught is reported per
            sync (``separable``): one optimizer step must move the trainer's log-probs by more than the tolerance.
        lora_name: name prefix of the adapters loaded with LoRA sync (``<lora_name>-v<version>``).
    """

    mode: str = "disk"
    verify: tuple[str, ...] = DEFAULT_SGLANG_VERIFY
    checkpoint_path: str | None = None
    pause_mode: str | None = "retract"
    weight_dir: str | None = None
    model_config: Any = None
    max_shard_size: str | int = "5GB"
    bucket_bytes: int = 1 << 30
    dist_backend: str | None = None
    dist_master_address: str = "127.0.0.1"
    dist_master_port: int | None = None
    group_name: str = "weight_update_group"
    dist_timeout_s: float = 600.0
    probe_atol: float = 0.05
    probe_rtol: float = 0.01
    probe_margin: float = 3.0
    lora_name: str = "policy"

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ValueError(f"weight sync mode must be one of {SYNC_MODES}, got {self.mode!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        self.verify = normalize_verify(self.verify)
        for name in ("bucket_bytes", "dist_timeout_s", "probe_margin"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not (self.probe_atol >= 0 and self.probe_rtol >= 0):
            raise ValueError(f"probe_atol and probe_rtol must be >= 0, got {self.probe_atol}, {self.probe_rtol}")


def normalize_verify(verify: str | Iterable[str]) -> tuple[str, ...]:
    """``verify`` as a tuple that starts with ``"version"``; unknown checks raise `ValueError`."""
    checks = (verify,) if isinstance(verify, str) else tuple(verify)
    unknown = sorted(set(checks) - set(VERIFY_MODES))
    if unknown:
        raise ValueError(f"verify: unknown checks {unknown} (choose from {VERIFY_MODES})")
    return ("version", *(c for c in dict.fromkeys(checks) if c != "version"))
