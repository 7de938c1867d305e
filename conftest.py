"""Session-wide test environment (loaded by pytest before any test module is imported).

- ``TRITON_INTERPRET=1`` on machines without CUDA: ``triton.jit`` decides interpreted vs compiled when a function
  is decorated (and triton decorates its own library on first import), so it must be set before anything imports
  triton. With it, the Triton kernels run on CPU tensors and CI tests the real kernel code.
- ``SINK_FLASH_ATTN3_BACKEND=torch``: with ``TRITON_INTERPRET=1`` the attention kernel would otherwise route every
  CPU call to the (slow) Triton interpreter; model, trainer and example tests stay on the plain PyTorch path, and
  the kernel tests pick the Triton path explicitly (``backend="triton"``). The kernel reads the variable once, when
  it is imported.
- No test touches the network: the Hub is offline, kernels resolve from the packaged sources.
Explicit values in the environment win over these defaults.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SINK_FLASH_ATTN3_BACKEND", "torch")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass


import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_cached_attention_calls():
    """The attention kernel caches what each input signature dispatches to (``triton_kernels._CALLS``); tests stand in
    for the hardware that dispatch reads (device capability, multiprocessor count), so every test starts without
    entries made under another test's stand-ins."""
    for name, module in list(sys.modules.items()):
        if name.endswith(".triton_kernels") and isinstance(getattr(module, "_CALLS", None), dict):
            module._CALLS.clear()


@pytest.fixture(autouse=True)
def _backends_restored():
    """Tests choose the Triton-or-PyTorch backends with ``hf_gptoss_rl.set_backends``: each test ends with the
    settings it started with."""
    backend = sys.modules.get("hf_gptoss_rl._backend")
    before = dict(vars(backend.current)) if backend is not None else None
    yield
    backend = sys.modules.get("hf_gptoss_rl._backend")
    if backend is not None:
        backend.set_backends(**(before or vars(backend.backends_from_environment(os.environ))))
