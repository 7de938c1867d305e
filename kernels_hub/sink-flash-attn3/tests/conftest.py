"""Fixtures that load the kernel the way users do: through `kernels`, from a freshly generated build tree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parents[1]
REPO_ID = "hf-gptoss-rl/sink-flash-attn3"


def load_build_noarch():
    """``kernels_hub/build_noarch.py`` (a script, not a package) imported by path."""
    name = "_sink_flash_attn3_build_noarch"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, KERNEL_DIR.parent / "build_noarch.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def built_kernel_repo(tmp_path_factory) -> Path:
    """A kernel repo root holding ``build/`` generated from ``torch-ext/`` (the repo's own build/ is untouched)."""
    root = tmp_path_factory.mktemp("sink-flash-attn3")
    load_build_noarch().build(KERNEL_DIR, root / "build")
    return root


@pytest.fixture(scope="session")
def kernel(built_kernel_repo):
    """The kernel module as ``kernels.get_local_kernel`` loads it."""
    kernels = pytest.importorskip("kernels")
    return kernels.get_local_kernel(built_kernel_repo)


@pytest.fixture
def hub_kernel(built_kernel_repo, monkeypatch):
    """The kernel module as ``kernels.get_kernel(REPO_ID)`` loads it, redirected with ``LOCAL_KERNELS``."""
    kernels = pytest.importorskip("kernels")
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO_ID}={built_kernel_repo}")
    return kernels.get_kernel(REPO_ID, version=1)
