"""Rollout weight sync: how trained weights leave the policy and reach a rollout engine.

Everything about weight sync lives here, behind one interface:

- **What is sent.** `export_policy_weights` (full weights, PEFT adapters merged, FSDP state dicts gathered) and
  `export_lora_adapter` (only the adapter: a rank-16 q/k/v/o adapter of gpt-oss-20b is ~16 MB against ~42 GB of
  merged bf16 weights).
- **How it travels.** `serialize_per_rank` (SGLang's ``MultiprocessingSerializer`` with SGLang's torch
  reductions, one payload per TP rank), `plan_buckets` + `flatten_bucket` (SGLang's ``FlattenedTensorBucket``
  layout for one NCCL broadcast per bucket), and the standalone NCCL/gloo group `init_weight_update_group`.
- **Who receives it.** `RolloutEngine.update_weights(named_tensors, version=...)` (every engine) and
  ``update_lora_adapter(adapter, version=...)`` (`SGLangEngine`, `SGLangOfflineEngine`); the SGLang HTTP protocol
  (begin/end session, pause/continue, per-server checks and verification) is `SGLangHTTPWeightSync`.
- **The trainer's entry point.** `push_policy_weights(engine, model, version=..., ...)`.

SGLang behaviour this follows is cited by upstream file and function (sglang 0.5.17 and 0.5.23 wheels).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import logging
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SYNC_MODES = ("disk", "distributed", "tensor")
VERIFY_MODES = ("version", "checksum", "logprobs")


class WeightSyncError(RuntimeError):
    """A weight sync failed or could not be verified; the message names the server(s) and the mismatch."""


# ---------------------------------------------------------------------------------------------------- export


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


# ---------------------------------------------------------------------------------------------------- transport


def _sglang_attr(module: str, name: str):
    """An attribute of an installed sglang (GPU installs), or None: the fallbacks below are the same algorithm."""
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except Exception:  # noqa: BLE001 - sglang absent or not importable here (no GPU stack): use the fallback
        return None


_REDUCE_TENSOR_ARG_DEVICE_INDEX = 6  # index of the device in the args of torch's `rebuild_cuda_tensor`


class _Global:
    """A reference to ``module.name`` written into a pickle without importing it here (see `serialize`)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle requires the reduce function to be callable; it is never called here
        raise RuntimeError(f"{self.module}.{self.name} is only a reference for the receiving process")


# SGLang's receiver-side rebuild: maps a device UUID back to a local device index
# (``_rebuild_cuda_tensor_modified`` in ``sglang/srt/utils/patch_torch.py``), allowed by SGLang's
# ``SafeUnpickler`` (``sglang/srt/utils/common.py``: an exact allow-list in 0.5.23, a module-prefix one in 0.5.17).
_SGLANG_REBUILD_CUDA_TENSOR = _Global("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")


def _reduce_tensor_with_uuid(tensor):
    """torch's tensor reduction, with a CUDA tensor's device written as its UUID and rebuilt by SGLang's
    ``_rebuild_cuda_tensor_modified`` (what SGLang's patched ``reduce_tensor`` produces)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        i = _REDUCE_TENSOR_ARG_DEVICE_INDEX
        uuid = str(torch.cuda.get_device_properties(args[i]).uuid)
        return _SGLANG_REBUILD_CUDA_TENSOR, (*args[:i], uuid, *args[i + 1 :])
    return rebuild, args


def _sglang_pickler():
    import copyreg
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    class Pickler(pickle._Pickler):  # the pure-Python pickler: its `dispatch` can write `_Global` references
        dispatch = dict(pickle._Pickler.dispatch)

        def __init__(self, file) -> None:
            super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
            table = dict(copyreg.dispatch_table)
            table.update(ForkingPickler._extra_reducers)
            for cls in list(table):
                if isinstance(cls, type) and issubclass(cls, torch.Tensor):
                    table[cls] = _reduce_tensor_with_uuid
            self.dispatch_table = table

        def save_sglang_global(self, obj: _Global) -> None:
            if self.proto >= 4:
                self.save(obj.module)
                self.save(obj.name)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.memoize(obj)

        dispatch[_Global] = save_sglang_global

    return Pickler


def serialize(obj) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)`` as SGLang's own sender runs it
    (``sglang/srt/utils/common.py``, after ``monkey_patch_torch_reductions`` from ``sglang/srt/utils/patch_torch.py``):
    a ``ForkingPickler`` dump (torch's reductions: CUDA tensors travel as CUDA IPC handles, CPU ones as shared
    memory) in base64. Keep the tensors alive until the receiver answered.

    CUDA devices are identified by UUID, not index: torch records the sender's device *index*, which names another
    GPU in a receiver whose ``CUDA_VISIBLE_DEVICES`` differs (pytorch/pytorch#149248); SGLang's patch writes the
    UUID and resolves it on the receiving side. With sglang importable its functions are used. Otherwise (the usual
    case: SGLang pins its own dependencies, so the trainer runs in another environment) the same payload is built
    here: torch's reduction with the UUID in place of the index and a reference to SGLang's rebuild function,
    which the servers' ``SafeUnpickler`` allows.
    """
    import base64

    sgl_serializer = _sglang_attr("sglang.srt.utils.common", "MultiprocessingSerializer")
    sgl_patch = _sglang_attr("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions")
    if sgl_serializer is not None and sgl_patch is not None:
        sgl_patch()
        return sgl_serializer.serialize(obj, output_str=True)
    buf = io.BytesIO()
    _sglang_pickler()(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def serialize_per_rank(obj, tp_size: int) -> list[str]:
    """One serialized copy per TP rank, as ``Engine._serialize_tensors_per_rank`` builds it
    (``sglang/srt/entrypoints/engine.py``): each rank deserializes only ``payloads[tp_rank]``
    (``TpModelWorker.deserialize_own_rank``), so every copy must hold its own CUDA-IPC reference."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return [serialize(obj) for _ in range(tp_size)]


@dataclass
class BucketMetadata:
    """One tensor of a flattened bucket (the fields of SGLang's ``FlattenedTensorMetadata``)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split ``named`` into buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own).

    Within a bucket, tensors are ordered by decreasing element size: SGLang rebuilds each tensor as a ``view``
    of a uint8 buffer at its byte offset (``FlattenedTensorBucket.reconstruct_tensors``; 0.5.23's
    ``FlattenedTensorBucket.empty`` rejects an offset not divisible by the dtype size), so no tensor may start
    at an offset that is not a multiple of its own element size.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, current, size = [], [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        buckets.append(current)
    return [sorted(b, key=lambda nt: -nt[1].element_size()) for b in buckets]


def flatten_bucket(named: list[tuple[str, torch.Tensor]], device=None) -> tuple[torch.Tensor, list[BucketMetadata]]:
    """Concatenate tensors as bytes in order: SGLang's ``FlattenedTensorBucket(named_tensors=...)`` layout
    (``sglang/srt/weight_sync/tensor_bucket.py``, same in 0.5.17 and 0.5.23), which the receiver of a
    ``load_format="flattened_bucket"`` update rebuilds from ``names``/``dtypes``/``shapes`` alone."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    parts, metadata, offset = [], [], 0
    for name, t in named:
        flat = t.detach().to(device).contiguous().flatten().view(torch.uint8)
        if offset % t.element_size():
            raise ValueError(f"{name}: byte offset {offset} is not a multiple of {t.dtype}'s size (use plan_buckets)")
        metadata.append(BucketMetadata(name, t.shape, t.dtype, offset, offset + flat.numel(), flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return torch.cat(parts), metadata


def unflatten_bucket(flat: torch.Tensor, metadata: list[BucketMetadata]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `flatten_bucket` (``FlattenedTensorBucket.reconstruct_tensors``)."""
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (``""``: every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = timedelta(minutes=10),
):
    """Join (rank 0: host) a standalone process group shared by the trainer and the engine ranks.

    SGLang's ``/init_weights_update_group`` makes each engine rank join a *new* group (rank
    ``rank_offset + tp_rank``) through a TCP rendezvous hosted by the trainer, independent of the trainer's own
    default group (``init_custom_process_group`` in ``sglang/srt/utils/common.py``). `torch.distributed.new_group`
    cannot do that (it splits the default group), so this builds the group as that helper does, with
    `_new_process_group_helper` on a TCP store at ``address:port`` (hosted here by rank 0).
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if rank == 0:
        # Rank 0 hosts a store of its own rather than through `rendezvous`: under torchrun (`accelerate launch`),
        # TORCHELASTIC_USE_AGENT_STORE=True makes `rendezvous` return a *client* of ``master_port`` on every rank
        # (``_create_c10d_store`` in torch/distributed/rendezvous.py), so nobody hosted the store and the group
        # timed out; and the store `rendezvous` hosts is multi-tenant: shared with an earlier group's store still
        # alive on the same port, whose stale peer addresses a rebuilt group then tried to connect to. Here a
        # port still bound fails at once (EADDRINUSE).
        store = TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
    else:
        store, rank, world_size = next(
            rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options_kw = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **{options_kw: None}
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_update_group(pg) -> None:
    """Tear down a group made by `init_weight_update_group`."""
    if pg is not None:
        import torch.distributed as dist

        dist.destroy_process_group(pg)


# ---------------------------------------------------------------------------------------------------- SGLang


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = []
    for piece in str(version).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


# ``/begin_weight_update`` and ``/end_weight_update`` appeared between 0.5.17 and 0.5.23; from then on
# ``update_weights_from_tensor``/``_distributed`` answer "must run between begin_weight_update() and
# end_weight_update()" without a session (``SchedulerWeightUpdaterManager.update_weights_from_distributed``
# in ``sglang/srt/managers/scheduler_components/weight_updater.py``, 0.5.23). Servers that report an older
# version, or answer 404 on ``/begin_weight_update``, are driven without the session.
_SESSION_SINCE = (0, 5, 18)


@dataclass
class ServerState:
    """What the client knows of one SGLang server (from ``GET /server_info``)."""

    url: str
    tp_size: int = 1
    dp_size: int = 1
    version: str | None = None
    has_session: bool | None = None  # begin/end weight-update session (None: not known yet)
    enable_lora: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_info(cls, url: str, info) -> ServerState:
        info = info if isinstance(info, dict) else {}
        version = info.get("version")
        vt = version_tuple(version)
        return cls(
            url=url,
            tp_size=int(info.get("tp_size") or 1),
            dp_size=int(info.get("dp_size") or 1),
            version=version,
            has_session=None if vt is None else vt >= _SESSION_SINCE,
            enable_lora=bool(info.get("enable_lora", False)),
        )


class SGLangHTTPWeightSync:
    """The weight-sync protocol of SGLang's HTTP server, driven for every server of an `SGLangEngine`.

    One sync: ``/pause_generation`` on every server (inside the ``try``: a failed pause still continues the
    servers already paused), ``/begin_weight_update`` where the server has it, the load (disk, NCCL broadcast
    or CUDA IPC tensors), ``/end_weight_update``, ``/continue_generation`` on every paused server (always), then
    the verification: every server reports the new ``weight_version`` (``GET /model_info``), plus the
    optional ``/weights_checker`` checksum or log-prob probe. Every answer's ``success`` is checked. When any
    server fails, the step fails with a `WeightSyncError` naming each server's state, and the engine refuses
    to generate until a later sync succeeds (the servers may hold different versions). A failed distributed sync
    (e.g. a server died mid-broadcast) also drops the weight-update group (`drop_group`): the next sync builds a new
    one, which a restarted server joins.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.group = None
        self._checksums: dict[str, dict] = {}
        self._fingerprint: list[float] | None = None  # of the tensors sent last (see `_fingerprint`)
        self._trainer_changed = True
        self._lora_names: dict[str, str] = {}  # url -> adapter name currently loaded
        self._stale_group = False  # a failed group was dropped here; servers may still hold it (`drop_group`)

    # -------------------------------------------------------------- helpers

    async def server_states(self) -> list[ServerState]:
        infos = await asyncio.gather(*(self.engine._request("GET", u, "/server_info") for u in self.engine.base_urls))
        return [ServerState.from_info(u, i) for u, i in zip(self.engine.base_urls, infos)]

    async def _post(self, url: str, path: str, payload: dict, *, retries: int | None = None, ok_404: bool = False):
        """POST and check SGLang's ``success``; returns the answer (None for an accepted 404 when ``ok_404``)."""
        answer = await self.engine._request(
            "POST", url, path, payload, retries=retries, ok_statuses=(404,) if ok_404 else ()
        )
        if answer is _NOT_FOUND:
            return None
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"{url}{path} refused: {answer.get('message') or answer.get('error_message')}")
        return answer

    async def _begin(self, state: ServerState) -> bool:
        if state.has_session is False:
            return False
        answer = await self._post(state.url, "/begin_weight_update", {}, retries=0, ok_404=True)
        state.has_session = answer is not None
        return state.has_session

    async def _end(self, state: ServerState) -> None:
        await self._post(state.url, "/end_weight_update", {}, retries=0)

    # -------------------------------------------------------------- entry points

    async def update(self, named: list[tuple[str, torch.Tensor]], version, *, lora: LoRAAdapter | None = None):
        engine = self.engine
        states = await self.server_states()
        for s in states:
            if s.dp_size > 1 and engine.sync_mode != "disk":
                raise WeightSyncError(
                    f"{s.url} runs with dp_size={s.dp_size}; {engine.sync_mode} sync supports one TP group per server "
                    "(SGLang asserts dp_size == 1 for it): launch one server per data-parallel replica"
                )
        check_sums = "checksum" in engine.verify and lora is None
        if check_sums:
            if not self._checksums:  # a baseline, so that even the first sync must change the served weights
                self._checksums = await self.checksums(states)
            fingerprint = _fingerprint(named)
            self._trainer_changed = fingerprint != self._fingerprint
            self._fingerprint = fingerprint
        paused: list[str] = []
        failures: dict[str, str] = {}
        loaded: set[str] = set()
        try:
            if engine.pause_mode is not None:
                for s in states:
                    paused.append(s.url)  # before the call: a pause that failed half-way is continued too
                    await self._post(s.url, "/pause_generation", {"mode": engine.pause_mode})
            if lora is not None:
                await self._load_lora(states, lora, version, loaded, failures)
            elif engine.sync_mode == "disk":
                await self._sync_disk(states, named, version, loaded, failures)
            elif engine.sync_mode == "distributed":
                await self._sync_distributed(states, named, version, loaded, failures)
            else:
                await self._sync_tensor(states, named, version, loaded, failures)
        except WeightSyncError as exc:
            failures.setdefault("(sync)", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported with the per-server state below
            failures.setdefault("(sync)", f"{type(exc).__name__}: {exc}")
        finally:
            # After a failed sync, one attempt each: the engine refuses to generate until a later sync succeeds,
            # and that sync pauses and continues every server again, so retrying only held the trainer (for
            # `retry_deadline_s`) on a server that died in the sync; a restarted server is not paused anyway.
            retries = 0 if failures else None
            for url in paused:
                try:
                    await self._post(url, "/continue_generation", {}, retries=retries)
                except Exception as exc:  # noqa: BLE001 - every paused server must be continued; report all
                    failures[url] = f"{failures.get(url, '')} /continue_generation failed: {exc}".strip()
        if failures:
            detail = "; ".join(f"{u}: {m}" for u, m in failures.items())
            states_text = ", ".join(f"{s.url} {'loaded' if s.url in loaded else 'not loaded'}" for s in states)
            engine._mark_inconsistent(f"weight sync to version {version} failed ({detail}); servers: {states_text}")
            raise WeightSyncError(engine._inconsistent)
        if lora is not None:
            engine._lora_name = self._lora_names[states[0].url]
        await self.verify(states, version)

    async def verify(self, states: list[ServerState], version) -> None:
        """Every server must report ``weight_version == str(version)``; then the optional checks."""
        engine = self.engine
        infos = await asyncio.gather(*(engine._request("GET", s.url, "/model_info") for s in states))
        wrong = {
            s.url: (i or {}).get("weight_version")
            for s, i in zip(states, infos)
            if str((i or {}).get("weight_version")) != str(version)
        }
        if wrong:
            msg = ", ".join(f"{u} reports weight_version {v!r}" for u, v in wrong.items())
            engine._mark_inconsistent(f"after the sync to version {version}: {msg} (expected {str(version)!r})")
            raise WeightSyncError(engine._inconsistent)
        if "checksum" in engine.verify and engine._lora_name is None:
            await self._verify_checksums(states, version)

    async def checksums(self, states: list[ServerState]) -> dict[str, dict]:
        answers = await asyncio.gather(*(self._post(s.url, "/weights_checker", {"action": "checksum"}) for s in states))
        return {s.url: (a or {}) for s, a in zip(states, answers)}

    async def _verify_checksums(self, states: list[ServerState], version) -> None:
        """``/weights_checker`` ``checksum`` (SGLang's per-parameter hashes, ``sglang/srt/utils/weight_checker.py``):
        when the weights sent changed (`_fingerprint`), the servers' overall checksum must have changed since the
        previous sync, or since a baseline taken before the first one (a sync whose every name SGLang skipped leaves
        it unchanged: ``GptOssForCausalLM.load_weights`` skips unknown names and still succeeds), and servers with
        the same parallelism must agree."""
        now = await self.checksums(states)
        previous, self._checksums = self._checksums, now
        problems = []
        for url, answer in now.items():
            before = previous.get(url)
            if not self._trainer_changed:  # the trainer sent what it sent last time: nothing to see
                continue
            if before and before.get("per_engine_checksum") == answer.get("per_engine_checksum"):
                problems.append(
                    f"{url}: no served parameter changed although the weights sent did (are the tensor names those "
                    "of the server's checkpoint? SGLang skips names it does not know)"
                )
            elif before:
                unchanged = _unchanged_params(before, answer)
                if unchanged:
                    logger.warning(
                        "%s: %d parameters unchanged by the sync to version %s (first: %s); a name the server "
                        "does not know is skipped silently by SGLang",
                        url,
                        len(unchanged),
                        version,
                        unchanged[:5],
                    )
        by_layout: dict[tuple, list[tuple[str, str]]] = {}
        for s in states:
            by_layout.setdefault((s.tp_size, s.dp_size), []).append((s.url, now[s.url].get("per_engine_checksum")))
        for layout, members in by_layout.items():
            if len({c for _, c in members}) > 1:
                problems.append(f"servers with tp/dp {layout} disagree: " + ", ".join(f"{u}={c}" for u, c in members))
        if problems:
            self.engine._mark_inconsistent(f"checksum verification of version {version}: " + "; ".join(problems))
            raise WeightSyncError(self.engine._inconsistent)

    # -------------------------------------------------------------- modes

    async def _sync_disk(self, states, named, version, loaded, failures) -> None:
        from huggingface_hub import save_torch_state_dict

        engine = self.engine
        out_dir = engine._weights_dir()

        def write() -> None:
            for stale in list(out_dir.glob("*.safetensors")) + list(out_dir.glob("*.safetensors.index.json")):
                stale.unlink()  # never let an old shard mix with the new ones
            state = {name: t.to("cpu").contiguous() for name, t in named}
            save_torch_state_dict(state, out_dir, max_shard_size=engine.max_shard_size)
            if engine.model_config is not None:
                save_config_for_sglang(engine.model_config, out_dir)

        await asyncio.to_thread(write)
        payload = {"model_path": str(out_dir), "weight_version": str(version), "flush_cache": engine._flush_in_update}

        async def one(s: ServerState) -> None:
            try:
                await self._post(s.url, "/update_weights_from_disk", payload)
                loaded.add(s.url)
            except Exception as exc:  # noqa: BLE001
                failures[s.url] = str(exc)

        await asyncio.gather(*(one(s) for s in states))

    async def _sync_tensor(self, states, named, version, loaded, failures) -> None:
        engine = self.engine
        hint = ""
        if torch.cuda.is_available():  # CUDA IPC: the servers map this process's GPU memory
            device = torch.device("cuda", torch.cuda.current_device())
            named = [(n, t.to(device)) for n, t in named]
        else:
            hint = (
                " (no CUDA here: the tensors travel as CPU shared memory, which a server in another process can only "
                "open if it shares this process's multiprocessing authkey; use weight_sync_mode='disk' on CPU)"
            )
        buckets = plan_buckets(named, engine.bucket_bytes)

        async def one(s: ServerState) -> None:
            session = False
            try:
                session = await self._begin(s)
                for k, bucket in enumerate(buckets):
                    payload = {
                        "serialized_named_tensors": serialize_per_rank(bucket, s.tp_size),
                        "load_format": None,
                        "flush_cache": engine._flush_in_update and k == len(buckets) - 1,
                        "weight_version": str(version),
                    }
                    await self._post(s.url, "/update_weights_from_tensor", payload, retries=0)
                loaded.add(s.url)
            except Exception as exc:  # noqa: BLE001
                failures[s.url] = str(exc) + hint
            finally:
                if session:
                    try:
                        await self._end(s)
                    except Exception as exc:  # noqa: BLE001
                        failures[s.url] = f"{failures.get(s.url, '')} /end_weight_update: {exc}".strip()

        await asyncio.gather(*(one(s) for s in states))

    def drop_group(self) -> None:
        """Destroy this process's side of the weight-update group after a failed distributed sync.

        A failed collective leaves the group unusable: with a server dead, every later broadcast fails (gloo:
        "Connection closed by peer"), and a restarted server has no group (it answers 400 "Group ... not in []").
        The next sync builds a new group with ``/init_weights_update_group`` on every server; SGLang replaces a
        group of the same name (``init_weights_update_group`` in
        ``sglang/srt/model_executor/model_runner_components/weight_updater.py`` assigns
        ``_model_update_group[group_name]``), and the old one is destroyed on the servers first (`ensure_group`).
        """
        group, self.group = self.group, None
        if group is None:
            return
        self._stale_group = True
        try:
            destroy_weight_update_group(group)
        except Exception as exc:  # noqa: BLE001 - the group is broken already; a new one replaces it
            logger.warning("destroying the failed weight-update group: %s", exc)

    async def ensure_group(self, states: list[ServerState]) -> None:
        if self.group is not None:
            return
        engine = self.engine
        if self._stale_group:  # after `drop_group`: servers that survived still hold the old group
            self._stale_group = False
            answers = await asyncio.gather(
                *(
                    self._post(s.url, "/destroy_weights_update_group", {"group_name": engine.group_name}, retries=0)
                    for s in states
                ),
                return_exceptions=True,
            )
            for s, answer in zip(states, answers):
                if isinstance(answer, BaseException):  # a restarted server has none: "does not exist"
                    logger.info("%s: old weight-update group not destroyed: %s", s.url, answer)
        world_size = 1 + sum(s.tp_size for s in states)
        port = engine.dist_master_port or free_port("")
        offsets, offset = [], 1
        for s in states:
            offsets.append(offset)
            offset += s.tp_size
        join = asyncio.to_thread(
            init_weight_update_group,
            backend=engine.dist_backend,
            master_address=engine.dist_master_address,
            master_port=port,
            world_size=world_size,
            rank=0,
            group_name=engine.group_name,
            timeout=timedelta(seconds=engine.dist_timeout_s),
        )
        posts = [
            self._post(
                s.url,
                "/init_weights_update_group",
                {
                    "master_address": engine.dist_master_address,
                    "master_port": port,
                    "rank_offset": off,
                    "world_size": world_size,
                    "group_name": engine.group_name,
                    "backend": engine.dist_backend,
                },
                retries=0,
            )
            for s, off in zip(states, offsets)
        ]
        results = await asyncio.gather(join, *posts, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if not isinstance(results[0], BaseException):
                destroy_weight_update_group(results[0])
            raise WeightSyncError(f"init_weights_update_group failed: {errors[0]}")
        self.group = results[0]

    async def _sync_distributed(self, states, named, version, loaded, failures) -> None:
        """NCCL broadcast from this process (rank 0) to every server rank, one flattened bucket per call.

        Every server must join every broadcast (a collective), so the session is opened on all servers before
        the first broadcast: a server that refuses ``/begin_weight_update`` fails the step *before* anyone waits
        in a collective (without an open update, SGLang 0.5.23 answers 400 and never joins, and the broadcast would hang).
        """
        import torch.distributed as dist

        engine = self.engine
        await self.ensure_group(states)
        sessions = []
        done = False
        try:
            for s in states:
                if await self._begin(s):
                    sessions.append(s)
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if engine.dist_backend == "nccl"
                else torch.device("cpu")
            )
            buckets = plan_buckets(named, engine.bucket_bytes)
            for k, bucket in enumerate(buckets):
                flat, meta = flatten_bucket(bucket, device=device)
                payload = {
                    "names": [m.name for m in meta],
                    "dtypes": [str(m.dtype).removeprefix("torch.") for m in meta],
                    "shapes": [list(m.shape) for m in meta],
                    "group_name": engine.group_name,
                    "flush_cache": engine._flush_in_update and k == len(buckets) - 1,
                    "weight_version": str(version),
                    "load_format": "flattened_bucket",
                }

                def broadcast(flat=flat) -> None:
                    dist.broadcast(flat, src=0, group=self.group)

                results = await asyncio.gather(
                    asyncio.to_thread(broadcast),
                    *(self._post(s.url, "/update_weights_from_distributed", payload, retries=0) for s in states),
                    return_exceptions=True,
                )
                bad = {s.url: r for s, r in zip(states, results[1:]) if isinstance(r, BaseException)}
                if isinstance(results[0], BaseException):
                    bad["(broadcast)"] = results[0]
                if bad:
                    for url, exc in bad.items():
                        failures[url] = f"bucket {k + 1}/{len(buckets)}: {exc}"
                    return
            loaded.update(s.url for s in states)
            done = True
        finally:
            for s in sessions:
                try:
                    await self._end(s)
                except Exception as exc:  # noqa: BLE001
                    failures[s.url] = f"{failures.get(s.url, '')} /end_weight_update: {exc}".strip()
            if not done:  # a failed collective (or a server gone before it) leaves the group unusable
                self.drop_group()

    async def _load_lora(self, states, adapter: LoRAAdapter, version, loaded, failures) -> None:
        """Load the adapter under a new name (``<prefix>-v<version>``), then unload the previous one.

        Requests name the adapter with ``lora_path`` (``GenerateReqInput.lora_path``); the engine switches to the
        new name once every server loaded it. ``disk`` mode writes ``adapter_model.safetensors`` +
        ``adapter_config.json`` and calls ``/load_lora_adapter``; ``tensor`` mode sends the tensors per TP rank to
        ``/load_lora_adapter_from_tensors`` (CUDA IPC: same node). SGLang has no NCCL path for adapters.
        """
        engine = self.engine
        name = f"{engine.lora_name}-v{version}"
        if engine.sync_mode == "distributed":
            raise WeightSyncError(
                "LoRA sync supports weight_sync_mode 'disk' or 'tensor' (SGLang loads adapters "
                "from a path or from tensors, not over NCCL)"
            )
        for s in states:
            if not s.enable_lora:
                raise WeightSyncError(
                    f"{s.url} was not launched with --enable-lora; LoRA sync needs it "
                    "(--enable-lora --max-lora-rank R --lora-target-modules ...)"
                )
        if engine.sync_mode == "disk":
            out_dir = engine._weights_dir() / name
            await asyncio.to_thread(_write_adapter, out_dir, adapter)
            payload_for = lambda s: {"lora_name": name, "lora_path": str(out_dir)}  # noqa: E731
            path = "/load_lora_adapter"
        else:
            tensors = dict(adapter.named_tensors)
            if torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
                tensors = {k: v.to(device) for k, v in tensors.items()}
            payload_for = lambda s: {  # noqa: E731
                "lora_name": name,
                "config_dict": adapter.config_dict,
                "serialized_named_tensors": serialize_per_rank(tensors, s.tp_size),
            }
            path = "/load_lora_adapter_from_tensors"

        async def one(s: ServerState) -> None:
            try:
                await self._post(s.url, path, payload_for(s), retries=0)
                self._lora_names[s.url], old = name, self._lora_names.get(s.url)
                # the adapter carries no version of its own: tag the server so /model_info and meta_info agree
                await self._post(
                    s.url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
                )
                loaded.add(s.url)
                if old and old != name:
                    try:
                        await self._post(s.url, "/unload_lora_adapter", {"lora_name": old})
                    except Exception as exc:  # noqa: BLE001 - the new adapter serves; the old one only costs memory
                        logger.warning("%s: could not unload adapter %s: %s", s.url, old, exc)
            except Exception as exc:  # noqa: BLE001
                failures[s.url] = str(exc)

        await asyncio.gather(*(one(s) for s in states))


class _NotFound:
    pass


_NOT_FOUND = _NotFound()


def _fingerprint(named: list[tuple[str, torch.Tensor]]) -> list[float]:
    """A cheap summary of the tensors to send (a strided sample of at most 4096 elements of each, summed in fp32 on
    the tensor's device): it changes when an optimizer step changed the weights."""
    out = []
    for _, t in named:
        flat = t.detach().reshape(-1)
        out.append(float(flat[:: max(1, flat.numel() // 4096)].float().sum()))
    return out


def _unchanged_params(before: dict, after: dict) -> list[str]:
    names = []
    for rb, ra in zip(before.get("ranks") or [], after.get("ranks") or []):
        cb, ca = rb.get("checksums") or {}, ra.get("checksums") or {}
        names += [n for n in ca if cb.get(n) == ca[n]]
    return sorted(set(names))


def _write_adapter(out_dir: Path, adapter: LoRAAdapter) -> None:
    import json

    from safetensors.torch import save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(
        {k: v.to("cpu").contiguous() for k, v in adapter.named_tensors}, str(out_dir / "adapter_model.safetensors")
    )
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter.config_dict))


# ---------------------------------------------------------------------------------------------------- trainer side


def reference_logprobs(model, input_ids: list[int]) -> list[float]:
    """Log-probs of ``input_ids[1:]`` under ``model`` at temperature 1 (the log-prob probe's reference)."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    # autocast off: the reference must not depend on whether the caller runs inside accelerate's mixed-precision
    # forward (the first sync happens before training, later ones inside it)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


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
    run: Callable = None,
) -> None:
    """Send ``model`` (the unwrapped policy) to ``engine`` as ``version``: the trainer's one call per step.

    ``lora=True`` pushes only the PEFT adapter (``engine.update_lora_adapter``); otherwise merged weights
    (``engine.update_weights``). Only the main process talks to a remote engine (``is_main_process``), but
    every process enters the export (FSDP gathers collectively). ``probe_ids``: when the engine verifies with
    ``"logprobs"``, the policy's log-probs of these ids are the reference. ``run`` runs a coroutine to the end
    from synchronous code.
    """
    if run is None:
        from .rollout.agent_loop import run_sync as run
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
    if probe_ids and "logprobs" in getattr(engine, "verify", ()):
        run(engine.verify_logprobs(probe_ids, reference_logprobs(model, probe_ids)))


def load_state_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy tensors into ``model`` by ``state_dict`` name, all-or-nothing: every name and shape is checked
    before anything is copied (`KeyError` for an unknown name, `ValueError` for a shape mismatch)."""
    state = model.state_dict()
    staged = []
    for name, tensor in named_tensors:
        if name not in state:
            raise KeyError(f"update_weights: unknown parameter {name!r} (not in the engine model)")
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(tensor.shape)}, engine expects {tuple(state[name].shape)}"
            )
        staged.append((name, tensor))
    with torch.no_grad():
        for name, tensor in staged:
            state[name].copy_(tensor.detach().to(device=state[name].device, dtype=state[name].dtype))


# transformers 5.17's GptOssExperts clamps with a hard-coded limit of 7.0 and its GptOssConfig has no `swiglu_limit`
GPTOSS_DEFAULT_SWIGLU_LIMIT = 7.0


def save_config_for_sglang(config, out_dir: str | Path) -> None:
    """``config.save_pretrained(out_dir)``, plus what SGLang's GPT-OSS loader reads that some transformers releases
    leave out: ``swiglu_limit`` (``GptOssSparseMoeBlock.__init__`` in sglang/srt/models/gpt_oss.py reads
    ``config.swiglu_limit``; without it the server dies while building the model)."""
    config.save_pretrained(out_dir)
    if getattr(config, "model_type", None) != "gpt_oss":
        return
    path = Path(out_dir) / "config.json"
    data = json.loads(path.read_text())
    if "swiglu_limit" not in data:
        data["swiglu_limit"] = float(getattr(config, "swiglu_limit", None) or GPTOSS_DEFAULT_SWIGLU_LIMIT)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def default_weight_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="sglang_weights_"))
