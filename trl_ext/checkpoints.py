"""Which checkpoint a run resumes from, and the rollout side's random state saved with each checkpoint.

transformers' `Trainer.train(resume_from_checkpoint=True)` takes the highest-numbered `checkpoint-N` folder
(`get_last_checkpoint` in `transformers/trainer_utils.py`), complete or not, and a command line gives the string
``"True"``, which `Trainer` reads as a path. Here ``True``, ``"true"``, ``"last"`` and ``"latest"`` all mean the
latest *complete* checkpoint of `output_dir`: one whose `trainer_state.json`, which `Trainer._save_checkpoint` writes
after the weights, optimizer and RNG files, parses and names the folder's own step, and whose weights are there. A
checkpoint left half-written by a kill or a full disk during the save is skipped, with a warning; a save that fails
because the disk is full says so (`disk_full_while_saving`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
from collections.abc import Iterator

logger = logging.getLogger(__name__)

__all__ = [
    "ROLLOUT_RNG_FILE",
    "CheckpointDiskFullError",
    "checkpoint_problem",
    "disk_full_while_saving",
    "latest_checkpoint",
    "resolve_resume_checkpoint",
    "resume_hint",
]

# per process: `rollout_rng_state.pth`, or `rollout_rng_state_{process_index}.pth` with several processes
ROLLOUT_RNG_FILE = "rollout_rng_state"
_LATEST = ("true", "last", "latest")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
# the files `save_model` writes for a full model, a sharded one or a PEFT adapter
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


class CheckpointDiskFullError(OSError):
    """A checkpoint could not be written because its disk is full; the message names the checkpoint, the free space
    and the checkpoint to resume from. ``errno`` is ``ENOSPC``."""


# "No space left on device" as Python (errno), safetensors ("os error 28") and quotas (EDQUOT) report it
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), f"os error {errno.ENOSPC}")


def _disk_full(exc: BaseException, folder: str) -> bool:
    """Whether ``exc``, raised while writing into ``folder``, means its file system is full: an ENOSPC/EDQUOT in the
    exception chain, or (torch's writer reports a full disk as "unexpected pos ...", without the errno) no block
    left available on that file system."""
    seen = exc
    while seen is not None:
        if getattr(seen, "errno", None) in _FULL_ERRNOS or any(t in str(seen) for t in _FULL_TEXTS):
            return True
        seen = seen.__cause__ or seen.__context__
    return _available_bytes(folder) == 0


def _available_bytes(folder: str) -> int | None:
    path = folder
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path or ".")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


@contextlib.contextmanager
def disk_full_while_saving(folder: str) -> Iterator[None]:
    """Around the save of the checkpoint ``folder``: a failure because the disk is full is raised as
    `CheckpointDiskFullError`, which says so (torch's own error does not), names the half-written ``folder`` (which
    resuming skips) and the checkpoint to resume from. Any other failure is raised as it is."""
    try:
        yield
    except Exception as exc:
        if not _disk_full(exc, folder):
            raise
        output_dir = os.path.dirname(os.path.normpath(folder))
        raise CheckpointDiskFullError(
            errno.ENOSPC,
            f"saving {folder} failed: the disk is full ({_available_bytes(folder)} bytes available on its file "
            f"system; {type(exc).__name__}: {exc}). {folder} is incomplete: resuming skips it, with a warning; "
            f"{resume_hint(output_dir)} once space is freed",
        ) from exc


def checkpoint_problem(path: str) -> str | None:
    """Why `path` is not a complete checkpoint, or None when it is."""
    if not os.path.isdir(path):
        return "no such directory"
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_file):
        return "no trainer_state.json (the save did not finish)"
    try:
        with open(state_file) as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError) as exc:
        return f"trainer_state.json is unreadable ({type(exc).__name__}: {exc})"
    match = _CHECKPOINT_DIR.match(os.path.basename(os.path.normpath(path)))
    if match is not None and step != int(match.group(1)):
        return f"trainer_state.json says step {step}, the folder step {match.group(1)}"
    if not any(os.path.isfile(os.path.join(path, name)) for name in _WEIGHT_FILES):
        return "no weights (model.safetensors, a sharded index, pytorch_model.bin or adapter_model.safetensors)"
    return None


def latest_checkpoint(output_dir: str) -> str | None:
    """The highest-step complete `checkpoint-N` folder of `output_dir` (None if there is none)."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        ((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT_DIR.match(name))),
        reverse=True,
    )
    for _, name in steps:
        path = os.path.join(output_dir, name)
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning("skipping %s: %s", path, problem)
    return None


def resolve_resume_checkpoint(value, output_dir: str) -> str | None:
    """The checkpoint `Trainer.train` should resume from.

    None, False, ``""``, ``"false"`` and ``"none"``: start afresh. True, ``"true"``, ``"last"``, ``"latest"``: the latest
    complete checkpoint of `output_dir` (a `ValueError` when there is none). Any other string is a path, which must
    be a complete checkpoint (a `ValueError` names what is missing).
    """
    if value is None or value is False:
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in _LATEST):
        found = latest_checkpoint(output_dir)
        if found is None:
            raise ValueError(f"resume_from_checkpoint={value!r}: no complete checkpoint-N folder in {output_dir!r}")
        return found
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"resume_from_checkpoint must be a path, True or 'last', got {type(value).__name__}")
    value = os.fspath(value)
    if value.strip().lower() in ("", "false", "none"):
        return None
    problem = checkpoint_problem(value)
    if problem is not None:
        raise ValueError(f"resume_from_checkpoint={value!r} is not a complete checkpoint: {problem}")
    return value


def resume_hint(output_dir: str) -> str:
    """Where a stopped run resumes from, for an error message: the latest complete checkpoint of `output_dir`."""
    found = latest_checkpoint(output_dir)
    if found is None:
        return f"{output_dir!r} holds no complete checkpoint yet: a new run starts from the beginning"
    return f"resume from {found} (resume_from_checkpoint='latest' picks it)"
