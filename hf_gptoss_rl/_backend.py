"""One rule for the project's Triton-or-PyTorch switches: one setting per part, read from the environment once.

Parts: ``experts`` (``hf_gptoss_rl.experts``), ``logprobs`` (``hf_gptoss_rl.logprobs``), ``rope``
(``hf_gptoss_rl.fused_layers``). Each is ``auto|torch|triton``: ``auto`` (the default) runs Triton on CUDA tensors
and PyTorch elsewhere; ``triton`` also runs the kernels on CPU tensors, which needs TRITON_INTERPRET=1 set before
triton is imported (how the CPU tests exercise them); ``torch`` always takes the PyTorch path. One more switch,
``experts_grouped_mm``, runs the experts' matmuls in ``torch._grouped_mm`` (hence the sync-free plan) on CPU too.

The starting values come from ``HF_GPTOSS_RL_<PART>_BACKEND`` and ``HF_GPTOSS_RL_EXPERTS_GROUPED_MM=0|1``, read
when this module is imported; :func:`set_backends` / :func:`use_backends` change them in-process (how tests and
benchmarks choose). The hot paths read :data:`current`, never ``os.environ``: the kernel's own settings are read
once at import as well, so the project has one rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

import torch

BACKENDS = ("auto", "torch", "triton")
PARTS = ("experts", "logprobs", "rope")
GROUPED_MM_ENV_VAR = "HF_GPTOSS_RL_EXPERTS_GROUPED_MM"


def env_var(part: str) -> str:
    """The environment variable that starts `part`'s backend, e.g. ``HF_GPTOSS_RL_EXPERTS_BACKEND``."""
    return f"HF_GPTOSS_RL_{part.upper()}_BACKEND"


@dataclasses.dataclass
class Backends:
    experts: str = "auto"
    logprobs: str = "auto"
    rope: str = "auto"
    experts_grouped_mm: bool = False


def _checked(name: str, value, source: str):
    if name == "experts_grouped_mm":
        if not isinstance(value, bool):
            raise ValueError(f"{source} must be a bool (0 or 1 in the environment), got {value!r}")
    elif name not in PARTS:
        raise ValueError(f"unknown backend part {name!r}: the parts are {', '.join(PARTS)} and experts_grouped_mm")
    elif value not in BACKENDS:
        raise ValueError(f"{source} must be auto, torch or triton, got {value!r}")
    return value


def backends_from_environment(environ: Mapping[str, str]) -> Backends:
    """The settings `environ` asks for (unset: ``auto`` / off); a value outside the choices is a clear error."""
    values = {part: _checked(part, environ.get(env_var(part), "auto"), env_var(part)) for part in PARTS}
    grouped = environ.get(GROUPED_MM_ENV_VAR, "0")
    if grouped not in ("0", "1"):
        raise ValueError(f"{GROUPED_MM_ENV_VAR} must be 0 or 1, got {grouped!r}")
    return Backends(**values, experts_grouped_mm=grouped == "1")


#: The settings in force; the hot paths read these attributes (one attribute load per call).
current = backends_from_environment(os.environ)


def set_backends(**changes) -> dict:
    """Set some of :class:`Backends`' fields, e.g. ``set_backends(experts="torch")``; returns their previous values.
    Every change is checked before any is applied."""
    for name, value in changes.items():
        _checked(name, value, f"backend {name}")
    previous = {name: getattr(current, name) for name in changes}
    for name, value in changes.items():
        setattr(current, name, value)
    return previous


@contextlib.contextmanager
def use_backends(**changes) -> Iterator[Backends]:
    """``with use_backends(logprobs="torch"): ...``: :func:`set_backends` for the block, restored after it."""
    previous = set_backends(**changes)
    try:
        yield current
    finally:
        set_backends(**previous)


def use_triton(part: str, t: torch.Tensor, kernels_importable: bool) -> bool:
    """Whether `t` goes to `part`'s Triton kernels: on CUDA, or anywhere when the part's backend is ``triton``."""
    backend = getattr(current, part)
    if backend == "torch" or not kernels_importable:
        if backend == "triton":
            raise RuntimeError(
                f"the {part} backend is triton ({env_var(part)} or set_backends) but triton could not be imported"
            )
        return False
    return t.is_cuda or backend == "triton"
