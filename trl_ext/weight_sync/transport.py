"""How weights travel: SGLang's serialization of tensors, flattened buckets, the NCCL group, files on disk.

- `serialize_per_rank`: SGLang's ``MultiprocessingSerializer`` payloads (CUDA-IPC handles, `on_cuda_for_ipc`), one per
  TP rank.
- `plan_buckets` + `flatten_bucket`: SGLang's ``FlattenedTensorBucket`` layout, one NCCL broadcast per bucket.
- `init_weight_update_group`: the standalone NCCL/gloo group shared by the trainer and the engine ranks.
- `write_checkpoint`, `write_adapter`, `save_config_for_sglang`: what ``/update_weights_from_disk`` and
  ``/load_lora_adapter`` read; `write_served_model`, `checkpoint_dtypes`, `convert_checkpoint`: a checkpoint stored in
  the dtype its server serves (what SGLang's start needs).
- `load_state_tensors`: the in-process receiver (the embedded engine).

SGLang behaviour this follows is cited by upstream file and function (sglang 0.5.17 and 0.5.23 wheels).
"""

from __future__ import annotations

import inspect
import io
import json
import shutil
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch


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


def on_cuda_for_ipc(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors on this process's current CUDA device, so that `serialize` sends CUDA-IPC handles, as SGLang's own
    callers send them (host tensors would travel as shared memory, which a receiver in another process can only open
    with this process's multiprocessing authkey). Unchanged without CUDA."""
    if not torch.cuda.is_available():
        return list(named)
    device = torch.device("cuda", torch.cuda.current_device())
    return [(n, t.to(device)) for n, t in named]


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


def write_adapter(out_dir: Path, adapter) -> None:
    from safetensors.torch import save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(
        {k: v.to("cpu").contiguous() for k, v in adapter.named_tensors}, str(out_dir / "adapter_model.safetensors")
    )
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter.config_dict))


def write_checkpoint(
    out_dir: Path, named: list[tuple[str, torch.Tensor]], *, max_shard_size, model_config=None
) -> None:
    """``named`` as safetensors shards (``huggingface_hub.save_torch_state_dict``) in ``out_dir``, replacing any
    earlier shards (an old shard must never mix with new ones), with ``config.json`` when ``model_config`` is given."""
    from huggingface_hub import save_torch_state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(out_dir.glob("*.safetensors")) + list(out_dir.glob("*.safetensors.index.json")):
        stale.unlink()
    state = {name: t.to("cpu").contiguous() for name, t in named}
    save_torch_state_dict(state, out_dir, max_shard_size=max_shard_size)
    if model_config is not None:
        save_config_for_sglang(model_config, out_dir)


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


# SGLang 0.5.17 started with ``--dtype bfloat16`` on a checkpoint stored in float32 stops at its warm-up with
# "mat1 and mat2 must have the same dtype, but got BFloat16 and Float" (``F.linear`` in
# sglang/srt/layers/quantization/unquant.py): a served checkpoint must be stored in the dtype it is served in.
SAFETENSORS_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def write_served_model(model: torch.nn.Module, out_dir: str | Path, dtype: torch.dtype) -> None:
    """``model`` as an SGLang server started with ``--dtype <dtype>`` loads it: its floating-point tensors stored in
    ``dtype`` (the model itself is left as it is, e.g. fp32 master weights), ``config.json`` naming ``dtype``
    (``dtype`` and the ``torch_dtype`` that SGLang's pinned transformers reads) and `save_config_for_sglang`'s keys."""
    out_dir = Path(out_dir)
    state = {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).to("cpu").contiguous()
        for k, v in model.state_dict().items()
    }
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    save_config_for_sglang(model.config, out_dir)
    _set_config_dtype(out_dir / "config.json", dtype)


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    data = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    data["dtype"] = data["torch_dtype"] = name
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(size))


def checkpoint_dtypes(model_dir: str | Path) -> dict[str, int]:
    """Floating-point dtype name -> number of tensors stored in it, over the ``*.safetensors`` files of
    ``model_dir`` (headers only: nothing is loaded). Integer tensors (MXFP4 blocks and scales) are not counted."""
    counts: dict[str, int] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    for path in files:
        for name, entry in _safetensors_header(path).items():
            dtype = SAFETENSORS_FLOAT_DTYPES.get(entry.get("dtype")) if name != "__metadata__" else None
            if dtype:
                counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """A copy of the checkpoint in ``model_dir`` with every floating-point tensor stored in ``dtype``, shard by shard
    (one shard in memory at a time), the shard index's sizes and ``config.json``'s dtype updated, every other file
    (tokenizer, chat template, generation config) copied. Returns ``out_dir``."""
    from safetensors.torch import load_file, save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError(f"convert_checkpoint: the output folder is the input folder ({model_dir})")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}/config.json not found")
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(model_dir.iterdir()):
        if path.suffix == ".safetensors":
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(out_dir / path.name), metadata=_safetensors_header(path).get("__metadata__"))
        elif path.is_file() and not path.name.endswith(".safetensors.index.json"):
            shutil.copy2(path, out_dir / path.name)
    for index in model_dir.glob("*.safetensors.index.json"):
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total
        (out_dir / index.name).write_text(json.dumps(data, indent=2) + "\n")
    _set_config_dtype(out_dir / "config.json", dtype)
    return out_dir


def default_weight_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="sglang_weights_"))
