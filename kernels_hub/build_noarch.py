#!/usr/bin/env python
"""Generate the loadable ``build/`` tree of a pure-Python (noarch) ``kernels`` Hub kernel from its sources.

    python kernels_hub/build_noarch.py kernels_hub/sink-flash-attn3            # -> kernels_hub/sink-flash-attn3/build/

The kernel repo holds ``build.toml`` and its only copy of the sources in ``torch-ext/<python_name>/``. For every
backend listed in ``build.toml`` (``[general] backends``) this writes ``build/torch-<backend>/`` containing

- the sources (``__init__.py`` and the other modules; imports inside the kernel are relative),
- ``metadata.json`` (name, id = ``_<python_name>_<content hash>``, version, license, backend),
- ``<python_name>/__init__.py``, the shim older ``kernels`` clients import (same as kernel-builder's).

``kernels`` 0.16/0.17 pick ``torch-cuda`` on CUDA builds of torch and ``torch-cpu`` on CPU-only builds (a
noarch variant is accepted when its backend matches the system's, or when it is ``universal``). No third-party
imports: ``hf_gptoss_rl`` runs this same code to resolve the kernel offline from its packaged sources.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pyproject.toml declares for python_version < "3.11"
    import tomli as tomllib  # type: ignore[no-redef]

# kernel-builder's compatibility shim for clients that import build/<variant>/<python_name>/__init__.py.
COMPAT_SHIM = """import ctypes
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _import_from_path(file_path: Path) -> ModuleType:
    # A module name unique to the path (hex hash), so two variants never share a sys.modules entry.
    path_hash = "{:x}".format(ctypes.c_size_t(hash(file_path.absolute())).value)
    module_name = path_hash
    spec = importlib.util.spec_from_file_location(module_name, file_path)
    if spec is None:
        raise ImportError(f"Cannot load spec for {module_name} from {file_path}")
    module = importlib.util.module_from_spec(spec)
    if module is None:
        raise ImportError(f"Cannot load module {module_name} from spec")
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # type: ignore
    return module


globals().update(vars(_import_from_path(Path(__file__).parent.parent / "__init__.py")))
"""

SUPPORTED_NOARCH_BACKENDS = ("cuda", "cpu", "rocm", "xpu", "metal", "npu", "universal")


def read_build_toml(kernel_dir: Path) -> dict:
    """The ``[general]`` table of ``build.toml``, with ``python_name`` and ``repo_id`` filled in."""
    with open(kernel_dir / "build.toml", "rb") as f:
        config = tomllib.load(f)
    if "torch-noarch" not in config:
        raise ValueError(f"{kernel_dir}/build.toml has no [torch-noarch] section: not a noarch kernel")
    general = dict(config["general"])
    general["python_name"] = general["name"].replace("-", "_")
    general["repo_id"] = general.get("hub", {}).get("repo-id")
    general.setdefault("backends", ["cuda"])
    unknown = set(general["backends"]) - set(SUPPORTED_NOARCH_BACKENDS)
    if unknown:
        raise ValueError(f"build.toml: unsupported noarch backends {sorted(unknown)}")
    return general


def source_files(kernel_dir: Path, python_name: str) -> list[Path]:
    """The kernel's source files (``torch-ext/<python_name>/``), caches excluded, in a stable order."""
    src = kernel_dir / "torch-ext" / python_name
    if not (src / "__init__.py").is_file():
        raise FileNotFoundError(f"{src}/__init__.py not found")
    return sorted(
        p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )


def content_hash(kernel_dir: Path, files: list[Path], python_name: str) -> str:
    src = kernel_dir / "torch-ext" / python_name
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(src)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def metadata(general: dict, backend: str, source_hash: str) -> dict:
    return {
        "name": general["name"],
        "id": f"_{general['python_name']}_{source_hash}",
        "version": general.get("version", 1),
        "license": general.get("license", "Apache-2.0"),
        "python-depends": [],
        "backend": {"type": backend},
    }


def build(kernel_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Writes ``<out_dir>/torch-<backend>/`` for every backend of ``build.toml``; returns ``out_dir``.

    ``out_dir`` defaults to ``<kernel_dir>/build``. The tree is assembled in a temporary directory next to it and
    swapped in, so concurrent readers never see a half-written variant.
    """
    kernel_dir = Path(kernel_dir).resolve()
    out_dir = Path(out_dir).resolve() if out_dir is not None else kernel_dir / "build"
    general = read_build_toml(kernel_dir)
    python_name = general["python_name"]
    files = source_files(kernel_dir, python_name)
    source_hash = content_hash(kernel_dir, files, python_name)
    src = kernel_dir / "torch-ext" / python_name

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir.parent))
    try:
        for backend in general["backends"]:
            variant = staging / f"torch-{backend}"
            for path in files:
                target = variant / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
            (variant / "metadata.json").write_text(json.dumps(metadata(general, backend, source_hash), indent=2) + "\n")
            (variant / python_name).mkdir(exist_ok=True)
            (variant / python_name / "__init__.py").write_text(COMPAT_SHIM)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=".old-build-", dir=out_dir.parent))
            os.replace(out_dir, old / "build")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel_dir", nargs="?", default=Path(__file__).parent / "sink-flash-attn3")
    parser.add_argument("--out", default=None, help="output build directory (default: <kernel_dir>/build)")
    args = parser.parse_args(argv)
    out = build(args.kernel_dir, args.out)
    for path in sorted(out.rglob("*")):
        if path.is_file():
            print(path.relative_to(out.parent))


if __name__ == "__main__":
    main()
