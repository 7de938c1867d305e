"""``attn_implementation="hf-gptoss-rl/sink-flash-attn3"``: the sink-aware flash attention kernel in transformers.

Importing ``hf_gptoss_rl`` runs :func:`register_sink_flash_attention`, which

1. adds the kernel id to ``GptOssPreTrainedModel._compatible_flash_implementations``. transformers silently
   replaces any requested attention whose name contains "flash" and is not in that list by the list's first
   entry (``kernels-community/vllm-flash-attn3``, which has no sink gradient); being listed also marks the
   kernel as trusted, so no ``allow_all_kernels`` / ``trust_remote_code`` is needed;
2. makes the id resolve offline: unless the user already mapped it in ``LOCAL_KERNELS``, it generates the
   loadable ``build/`` tree (``torch-cuda`` + ``torch-cpu`` variants, ``kernels_hub/build_noarch.py``) from the
   kernel sources shipped inside this package into a cache directory keyed by the sources' hash, and maps the id
   there. ``kernels.get_kernel`` then loads it with no Hub call.

transformers then does the rest through its own hub-kernel path (``integrations/hub_kernels.py`` ->
``integrations/flash_attention.py``): it unpads padded batches (2D ``attention_mask``) and splits packed ones
(restarting ``position_ids`` or ``cu_seq_lens_*`` kwargs) into ``flash_attn_varlen_func`` calls, passes
``window_size=(sliding_window - 1, sliding_window - 1)`` on sliding layers and the sinks as ``s_aux`` (it looks
the parameter names up in the kernel's signature), and decodes with ``seqlen_q < seqlen_k`` (bottom-right causal
mask). That path has no device gate in transformers 5.17-5.22 (the kernel id is not in
``FLASH_ATTN_KERNEL_DEVICES``, so it is assumed to run everywhere), so CPU tensors reach the kernel too and run its
plain PyTorch path: no extra ``AttentionInterface`` registration or model-file fork is needed.

Without a usable ``kernels`` package (missing, or outside the range the installed transformers accepts) the
package still imports; the id is still registered as compatible, and a warning says that selecting it will fail.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

KERNEL_REPO_ID = "hf-gptoss-rl/sink-flash-attn3"
ATTN_IMPLEMENTATION = KERNEL_REPO_ID
CACHE_ENV_VAR = "HF_GPTOSS_RL_KERNEL_CACHE"

# The kernel repo shipped with this package: ``_kernels_hub`` is the repository's ``kernels_hub/`` (a symlink in
# a source checkout, real files in a wheel), so both layouts resolve the same sources.
_KERNELS_HUB = Path(__file__).resolve().parent / "_kernels_hub"
if not _KERNELS_HUB.is_dir():  # a checkout made without symlink support: use the repository folder itself
    _KERNELS_HUB = Path(__file__).resolve().parent.parent / "kernels_hub"
KERNEL_DIR = _KERNELS_HUB / "sink-flash-attn3"


def _build_noarch() -> ModuleType:
    """``kernels_hub/build_noarch.py``, the single implementation of the build layout."""
    name = "hf_gptoss_rl._build_noarch"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _KERNELS_HUB / "build_noarch.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_gptoss_rl" / "kernels"


def build_local_kernel(cache_dir: str | os.PathLike | None = None) -> Path:
    """The kernel repo root (holding ``build/``) generated from the packaged sources; built once per source hash.

    ``cache_dir`` defaults to ``$HF_GPTOSS_RL_KERNEL_CACHE`` or ``~/.cache/hf_gptoss_rl/kernels``; when that is
    not writable, a directory under the system temp dir is used.
    """
    builder = _build_noarch()
    general = builder.read_build_toml(KERNEL_DIR)
    files = builder.source_files(KERNEL_DIR, general["python_name"])
    source_hash = builder.content_hash(KERNEL_DIR, files, general["python_name"])
    candidates = [Path(cache_dir)] if cache_dir is not None else [_default_cache_dir()]
    candidates.append(Path(tempfile.gettempdir()) / "hf_gptoss_rl_kernels")
    last_error: Exception | None = None
    for base in candidates:
        root = base / f"{general['name']}-{source_hash}"

        def complete() -> bool:
            return all((root / "build" / f"torch-{b}" / "metadata.json").is_file() for b in general["backends"])

        if complete():
            return root
        try:
            # Build in a private directory, then rename it into place: atomic, so ranks importing the package at
            # the same time never see a half-written tree (the loser of the race drops its copy).
            base.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=base))
            try:
                builder.build(KERNEL_DIR, staging / "build")
                os.replace(staging, root)
            except OSError:
                if not complete():
                    raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            return root
        except OSError as e:  # read-only cache: try the next location
            last_error = e
    raise OSError(f"could not write the sink-flash-attn3 build tree to any of {candidates}") from last_error


def kernels_usable() -> bool:
    """Whether ``kernels`` is importable and in the version range the installed transformers accepts."""
    try:
        from transformers.utils import is_kernels_available

        import kernels  # noqa: F401
    except ImportError:
        return False
    return bool(is_kernels_available())


def _map_local_kernel(path: Path) -> None:
    """Add ``KERNEL_REPO_ID=path`` to ``LOCAL_KERNELS`` unless the user already mapped the id."""
    current = os.environ.get("LOCAL_KERNELS", "")
    entries = [entry for entry in current.split(":") if entry]
    if any(entry.split("=", 1)[0] == KERNEL_REPO_ID for entry in entries):
        return
    os.environ["LOCAL_KERNELS"] = ":".join([*entries, f"{KERNEL_REPO_ID}={path}"])


def _mark_gptoss_compatible() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    compatible = list(getattr(GptOssPreTrainedModel, "_compatible_flash_implementations", None) or [])
    if KERNEL_REPO_ID not in compatible:
        # A new list (not an in-place append): the attribute may be shared with a parent class.
        GptOssPreTrainedModel._compatible_flash_implementations = [*compatible, KERNEL_REPO_ID]


def register_sink_flash_attention(cache_dir: str | os.PathLike | None = None) -> bool:
    """Make ``attn_implementation="hf-gptoss-rl/sink-flash-attn3"`` work for GPT-OSS models (idempotent).

    Returns True when the id is loadable (``kernels`` usable and the id mapped to a local build), False otherwise
    (with a warning).
    """
    _mark_gptoss_compatible()
    if not kernels_usable():
        warnings.warn(
            f"hf_gptoss_rl: the `kernels` package is missing or outside the version range this transformers accepts, "
            f'so attn_implementation="{KERNEL_REPO_ID}" cannot be loaded. Install a matching `kernels` '
            f"(transformers 5.17: kernels>=0.16,<0.17; 5.18-5.22: >=0.17,<0.18).",
            stacklevel=2,
        )
        return False
    user_mapping = any(
        entry.split("=", 1)[0] == KERNEL_REPO_ID for entry in os.environ.get("LOCAL_KERNELS", "").split(":")
    )
    if not user_mapping:
        try:
            _map_local_kernel(build_local_kernel(cache_dir))
        except Exception as e:  # never break `import hf_gptoss_rl`; say what is missing
            warnings.warn(f"hf_gptoss_rl: could not prepare the local {KERNEL_REPO_ID} kernel build: {e}", stacklevel=2)
            return False
    return True


def load_kernel() -> ModuleType:
    """The kernel module (``flash_attn_func``, ``flash_attn_varlen_func``), loaded through ``kernels``."""
    from kernels import get_kernel

    return get_kernel(KERNEL_REPO_ID, version=1)


register_sink_flash_attention()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KERNEL_REPO_ID",
    "build_local_kernel",
    "kernels_usable",
    "load_kernel",
    "register_sink_flash_attention",
]
