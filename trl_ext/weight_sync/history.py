"""What each weight sync did: one `SyncRecord` per attempt, kept in a bounded history by the sync that made it.

`SGLangHTTPWeightSync` (the weight sync of an `SGLangEngine`) appends a record to its ``sync_history`` when a sync
starts and fills it as the sync goes: what was sent (version, merged weights or LoRA adapter, bytes), whether the
transfer and its checks succeeded and how long they took, then what the log-prob probe that follows the sync
measured; the trainer adds its whole push (`trl_ext.rollout_sync.sync_rollout_weights`, the same seconds it logs as
``timing/weight_sync_s``). Importing this module imports neither torch nor an engine.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

SYNC_HISTORY_LIMIT = 1024
"""Most records a weight sync keeps (the oldest are dropped): one per sync, a few hundred bytes each."""


@dataclass
class SyncRecord:
    """One weight sync attempt. A field that does not apply or was not measured (yet) is None.

    Attributes:
        version: the weight version sent.
        kind: ``"merged"`` (full weights, ``update_weights``) or ``"lora"`` (an adapter, ``update_lora_adapter``).
        bytes: bytes of the tensors sent (the adapter's alone for LoRA).
        lora_tensors: LoRA: the adapter's tensor count.
        ok: whether the transfer and its checks (version, checksums) succeeded; None while it runs.
        error: ``"<type>: <message>"`` of the failure, the transfer's or the probe's.
        transfer_s: seconds of the transfer and its checks (pause, load, continue, version and checksum checks; a
            sync sent again to a server that restarted during it counts once, with all its attempts).
        verify_s: seconds of the log-prob probe that followed the sync (``verify_logprobs``).
        probe_pass: whether that probe passed.
        probe_tokens, probe_dlogp_mean, probe_dlogp_max, probe_mean_abs_logp, probe_tolerance: what the probe
            measured (`trl_ext.weight_sync.verify.probe_verdict`: tokens scored, mean and max |served - trainer
            log-prob|, mean |trainer log-prob|, the tolerance) on the server that differed most.
        sync_total_s: the trainer's whole sync (export, transfer, probe reference, probe), set by the trainer.
    """

    version: int | str
    kind: str
    bytes: int
    lora_tensors: int | None = None
    ok: bool | None = None
    error: str | None = None
    transfer_s: float | None = None
    verify_s: float | None = None
    probe_pass: bool | None = None
    probe_tokens: int | None = None
    probe_dlogp_mean: float | None = None
    probe_dlogp_max: float | None = None
    probe_mean_abs_logp: float | None = None
    probe_tolerance: float | None = None
    sync_total_s: float | None = None

    @classmethod
    def for_update(cls, version, named, lora=None) -> SyncRecord:
        """The record of a sync of ``named`` (``(name, tensor)`` pairs) or, when given, of the adapter ``lora``."""
        if lora is not None:
            return cls(version=version, kind="lora", bytes=lora.nbytes, lora_tensors=len(lora.named_tensors))
        return cls(version=version, kind="merged", bytes=sum(t.numel() * t.element_size() for _, t in named))

    @contextlib.contextmanager
    def timed(self, outcome: str, seconds: str):
        """Time the ``with`` block into the field ``seconds`` and set the field ``outcome`` to whether it raised
        nothing; a failure's ``"<type>: <message>"`` goes to ``error`` and the exception propagates."""
        start = time.perf_counter()
        try:
            yield self
            setattr(self, outcome, True)
        except BaseException as exc:  # a cancelled sync is a failed one too; re-raised
            setattr(self, outcome, False)
            self.error = f"{type(exc).__name__}: {exc}"[:2000]
            raise
        finally:
            setattr(self, seconds, time.perf_counter() - start)

    def add_probe(self, measured: dict[str, dict]) -> None:
        """What a log-prob probe measured (``{url: probe_verdict}``), from the server that differed most."""
        if not measured:
            return
        worst = max(measured.values(), key=lambda verdict: verdict["mean_abs"])
        self.probe_tokens = worst["tokens"]
        self.probe_dlogp_mean = worst["mean_abs"]
        self.probe_dlogp_max = worst["max_abs"]
        self.probe_mean_abs_logp = worst.get("mean_abs_reference")
        self.probe_tolerance = worst.get("tolerance")

    def as_dict(self) -> dict:
        """The fields that were set, as a JSON-ready dict."""
        return {k: v for k, v in asdict(self).items() if v is not None}
