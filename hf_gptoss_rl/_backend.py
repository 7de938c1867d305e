"""One rule for the project's Triton-or-PyTorch switches (`HF_GPTOSS_RL_<PART>_BACKEND=auto|torch|triton`).

`auto` (the default) runs Triton on CUDA tensors and PyTorch elsewhere; `triton` also runs the kernels on CPU
tensors, which needs TRITON_INTERPRET=1 set before triton is imported (how the CPU tests exercise them);
`torch` always takes the PyTorch path.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def backend_from_env(var: str) -> str:
    """The value of `var` (`auto` when unset); anything outside `BACKENDS` is a clear error."""
    backend = os.environ.get(var, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"{var} must be auto, torch or triton, got {backend!r}")
    return backend


def use_triton(var: str, t: torch.Tensor, kernels_importable: bool) -> bool:
    """Whether `t` goes to the Triton kernels under `var`: on CUDA, or anywhere when `var` asks for triton."""
    backend = backend_from_env(var)
    if backend == "torch" or not kernels_importable:
        if backend == "triton":
            raise RuntimeError(f"{var}=triton but triton could not be imported")
        return False
    return t.is_cuda or backend == "triton"
