"""The weight updates of an in-process ``sglang.Engine`` (an `SGLangOfflineEngine`), driven and checked.

The engine's tokenizer manager is called directly (no HTTP): ``update_weights_from_tensor`` inside a begin/end
session where the installed sglang has one (``Engine.begin_weight_update``, 0.5.23), one payload per TP rank
(`transport.serialize_per_rank`), and LoRA adapters from tensors (``load_lora_adapter_from_tensors``). Before
anything is sent, every tensor name must be one of the checkpoint the engine was built from (`verify.unknown_names`):
``sglang.Engine`` skips unknown names and still reports success. Every ``(success, message)`` is checked (a refusal
raises `WeightSyncError` and the version does not move), and the engine must report the new ``weight_version``
afterwards. SGLang behaviour is cited by upstream file and function (sglang 0.5.17 and 0.5.23 wheels).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch

from . import verify as checks
from .settings import WeightSyncConfig, WeightSyncError
from .transport import on_cuda_for_ipc, serialize_per_rank

logger = logging.getLogger(__name__)


class SGLangOfflineWeightSync:
    """The weight-sync protocol of an in-process ``sglang.Engine`` (``engine``: its ``tokenizer_manager`` and
    ``server_args``).

    SGLang's tokenizer manager binds its output loop to the first event loop that uses it
    (``TokenizerManager.auto_create_handle_loop``), so every tokenizer-manager coroutine is awaited through ``run``,
    which runs it on the engine's own loop. ``checkpoint_path`` (default: the engine's ``model_path``) is where the
    tensor names the engine loads are read. The caller reads `version` (the last verified sync) and
    `served_adapter` (the ``lora_path`` of its requests after a LoRA sync); `config` states what this sync does in
    `WeightSyncConfig`'s terms (CUDA-IPC tensors, the version checked, no pause: every update flushes the cache).
    """

    def __init__(
        self,
        engine,
        run: Callable[[Awaitable], Awaitable],
        *,
        checkpoint_path: str | None = None,
        lora_name: str = "policy",
    ) -> None:
        self.engine = engine
        self.run = run
        path = checkpoint_path or getattr(getattr(engine, "server_args", None), "model_path", None)
        self.config = WeightSyncConfig(
            mode="tensor", verify=("version",), checkpoint_path=path, pause_mode=None, lora_name=lora_name
        )
        self.version: int | str | None = None
        self.served_adapter: str | None = None
        self._requested_adapters: set[str] = set()  # adapter names whose load was requested
        self._checkpoint_names: set[str] | None = None

    @property
    def tp_size(self) -> int:
        return int(getattr(self.engine.server_args, "tp_size", 1) or 1)

    # -------------------------------------------------------------- names

    def checkpoint_names(self) -> set[str]:
        """The tensor names of the served checkpoint, read once; `WeightSyncError` when they cannot be read."""
        if self._checkpoint_names is None:
            path = self.config.checkpoint_path
            found = checks.checkpoint_tensor_names(path) if path else None
            if not found:
                raise WeightSyncError(
                    f"cannot read the tensor names of the served checkpoint {path!r}; pass checkpoint_path= a local "
                    "copy of it (sglang.Engine skips names its model does not have)"
                )
            self._checkpoint_names = found
        return self._checkpoint_names

    def check_names(self, names: list[str]) -> None:
        unknown = checks.unknown_names(names, checkpoint=self.checkpoint_names(), params=None)
        if unknown:
            raise WeightSyncError(
                "sglang.Engine update refused: "
                + checks.describe_unknown(unknown, f"checkpoint {self.config.checkpoint_path}")
            )

    # -------------------------------------------------------------- entry points

    async def call(self, what: str, coro) -> None:
        """Await a tokenizer-manager coroutine on the engine's loop; `WeightSyncError` when it reports failure
        (a ``(success, message)`` tuple, or an object with ``success`` and ``error_message`` / ``message``)."""
        result = await self.run(coro)
        if isinstance(result, tuple):
            success, message = result[0], result[1]
        else:
            success = getattr(result, "success", None)
            message = getattr(result, "error_message", None) or getattr(result, "message", None)
        if not success:
            raise WeightSyncError(f"sglang.Engine {what} failed: {message}")

    async def update(self, named: list[tuple[str, torch.Tensor]], version) -> None:
        """``update_weights_from_tensor`` through the tokenizer manager as ``version``, inside a begin/end session when
        this sglang has one; the session is ended even when the update fails. Then the version is checked."""
        from sglang.srt.managers import io_struct

        self.check_names([n for n, _ in named])
        named = on_cuda_for_ipc(named)
        tm = self.engine.tokenizer_manager
        session = hasattr(io_struct, "BeginWeightUpdateReqInput") and hasattr(tm, "begin_weight_update")
        if session:
            await self.call("begin_weight_update", tm.begin_weight_update(io_struct.BeginWeightUpdateReqInput(), None))
        try:
            req = io_struct.UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=serialize_per_rank(named, self.tp_size),
                load_format=None,
                flush_cache=True,
                weight_version=str(version),
            )
            await self.call("update_weights_from_tensor", tm.update_weights_from_tensor(req, None))
        finally:
            if session:
                await self.call("end_weight_update", tm.end_weight_update(io_struct.EndWeightUpdateReqInput(), None))
        self.check_version(version)
        self.version = version

    async def update_lora(self, adapter, version) -> None:
        """Load ``adapter`` as ``<lora_name>-v<version>``, tag the engine with ``version``, then unload the previous
        adapter. An adapter's name is recorded before its load is requested, so that one whose load failed (it may
        be loaded all the same) is unloaded by the next sync."""
        from sglang.srt.managers import io_struct

        tm = self.engine.tokenizer_manager
        name = f"{self.config.lora_name}-v{version}"
        modules = checks.unknown_lora_modules(
            [n for n, _ in adapter.named_tensors], checkpoint=self.checkpoint_names(), params=None
        )
        if modules:
            raise WeightSyncError(f"the adapter targets modules the served model does not have: {modules[:5]}")
        for leftover in sorted(self._requested_adapters - {self.served_adapter}):
            result = await self.run(
                tm.unload_lora_adapter(io_struct.UnloadLoRAAdapterReqInput(lora_name=leftover), None)
            )
            logger.info("unloaded leftover adapter %s: %s", leftover, result)
            self._requested_adapters.discard(leftover)
        self._requested_adapters.add(name)  # before the request: a failed load may still leave it loaded
        req = io_struct.LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name,
            config_dict=adapter.config_dict,
            serialized_named_tensors=serialize_per_rank(dict(adapter.named_tensors), self.tp_size),
        )
        await self.call("load_lora_adapter_from_tensors", tm.load_lora_adapter_from_tensors(req, None))
        old, self.served_adapter = self.served_adapter, name
        # tag the version (the adapter carries none): a coroutine from 0.5.23 on
        # (``TokenizerControlMixin.update_weight_version``); 0.5.17 records it synchronously
        # (``_update_weight_version_if_provided``, what its ``/update_weight_version`` route amounts to)
        if hasattr(tm, "update_weight_version"):
            await self.run(
                tm.update_weight_version(
                    io_struct.UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
                )
            )
        else:
            tm._update_weight_version_if_provided(str(version))
        if old is not None:
            await self.call(
                "unload_lora_adapter", tm.unload_lora_adapter(io_struct.UnloadLoRAAdapterReqInput(lora_name=old), None)
            )
            self._requested_adapters.discard(old)
        self.check_version(version)
        self.version = version

    # -------------------------------------------------------------- checks

    def check_version(self, version) -> None:
        """The engine must report ``weight_version == str(version)`` (when it reports one)."""
        tm = self.engine.tokenizer_manager
        served = (
            tm.config_value("weight_version")
            if hasattr(tm, "config_value")
            else getattr(getattr(tm, "server_args", None), "weight_version", None)
        )
        if served is not None and str(served) != str(version):
            raise WeightSyncError(f"sglang.Engine reports weight_version {served!r} after the sync to {version!r}")
