"""``attn_implementation="hf-gptoss-rl/sink-flash-attn3"``: the sink-aware flash attention kernel in transformers.

Importing this module changes nothing: the package's :func:`hf_gptoss_rl.register` (called once by ``import
hf_gptoss_rl``, idempotent) calls the functions below, and like them it writes nothing to disk and nothing to
``os.environ``. They only touch transformers' in-memory registries:

1. It adds the id to ``GptOssPreTrainedModel._compatible_flash_implementations``. transformers
   (``PreTrainedModel._check_and_adjust_attn_implementation``, 5.17 and later) replaces any requested
   ``attn_implementation`` that contains "flash" and is not in that list with an entry of the list
   (``kernels-community/vllm-flash-attn3`` on CUDA and CPU, which has no sink gradient), and only logs it. Being
   listed also marks the kernel as trusted, so no ``allow_all_kernels`` is needed. Since 5.18 transformers picks
   the first entry that runs on the current device (``FLASH_ATTN_KERNEL_DEVICES``), which on CPU is this kernel:
   hence the guard of point 4.
2. It registers the id in ``AttentionInterface`` (transformers' ``flash_attention_forward`` wrapper, which unpads
   padded batches, splits packed ones, passes the sliding window and the sinks as ``s_aux``) and in
   ``AttentionMaskInterface`` (the flash-style 2D padding mask), as transformers' own hub-kernel loader
   (``integrations/hub_kernels.py::load_and_register_attn_kernel``) would.
3. It resolves the id without the Hub and without ``kernels``: transformers treats any ``org/name`` string as a
   Hub kernel and loads it through ``load_and_register_attn_kernel``, which needs the one ``kernels`` release
   the installed transformers accepts (0.16.x for 5.17, 0.17.x for 5.18-5.22, 0.18.2 or later 0.18.x for 5.23
   and 5.24; ``KERNELS_MIN_VERSION`` / ``KERNELS_MAX_VERSION`` in ``utils/import_utils.py``). For this id
   only, that function is wrapped to import the kernel sources shipped inside this package, on first use. Every
   other id goes to transformers unchanged. If you map the id yourself in ``LOCAL_KERNELS``, that build is
   loaded through ``kernels.get_kernel`` instead.
4. It refuses silent remaps on GPT-OSS models: a name that looks like a misspelling of the id raises
   ``ValueError``, and any other flash name that transformers replaces (``flash_attention_2``,
   ``kernels-community/flash-attn3``, ...) is reported with an :class:`AttentionRemapWarning` naming both.

Without ``import hf_gptoss_rl`` (or :func:`hf_gptoss_rl.register`), transformers 5.17-5.24 silently replace
``"hf-gptoss-rl/sink-flash-attn3"`` on GPT-OSS with ``kernels-community/vllm-flash-attn3``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
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
# The import name of the packaged kernel sources; the kernel derives its torch.library namespace from it.
_KERNEL_MODULE = "hf_gptoss_rl._sink_flash_attn3"


class AttentionRemapWarning(UserWarning):
    """transformers replaced the requested ``attn_implementation`` of a GPT-OSS model with another kernel.

    Make it an error with ``warnings.simplefilter("error", AttentionRemapWarning)``.
    """


# --------------------------------------------------------------------------------------------------------------
# The kernel module
# --------------------------------------------------------------------------------------------------------------

_load_lock = threading.Lock()


def _user_mapped_local_kernel() -> bool:
    """Whether ``LOCAL_KERNELS`` (``kernels``' override variable) maps the id to a build of the user's choice."""
    entries = os.environ.get("LOCAL_KERNELS", "").split(":")
    return any(entry.split("=", 1)[0] == KERNEL_REPO_ID for entry in entries if "=" in entry)


def import_kernel_sources() -> ModuleType:
    """The kernel imported from the sources shipped in this package (no ``kernels``, no Hub, nothing written).

    The same files the Hub build is generated from (``kernels_hub/sink-flash-attn3/torch-ext/sink_flash_attn3``),
    imported once as ``hf_gptoss_rl._sink_flash_attn3``.
    """
    with _load_lock:
        module = sys.modules.get(_KERNEL_MODULE)
        if module is not None:
            return module
        package_dir = KERNEL_DIR / "torch-ext" / "sink_flash_attn3"
        spec = importlib.util.spec_from_file_location(
            _KERNEL_MODULE, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
        )
        if spec is None or spec.loader is None or not (package_dir / "__init__.py").is_file():
            raise ImportError(f"the {KERNEL_REPO_ID} kernel sources are missing from {package_dir}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_KERNEL_MODULE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_KERNEL_MODULE]
            raise
        return module


def load_kernel() -> ModuleType:
    """The kernel module that ``attn_implementation="hf-gptoss-rl/sink-flash-attn3"`` runs
    (``flash_attn_func``, ``flash_attn_varlen_func``).

    The id mapped in ``LOCAL_KERNELS`` by the user: that build, through ``kernels.get_kernel``. Otherwise the
    sources shipped in this package (:func:`import_kernel_sources`).
    """
    if _user_mapped_local_kernel():
        try:
            from kernels import get_kernel
        except ImportError as e:
            raise ImportError(
                f"LOCAL_KERNELS maps {KERNEL_REPO_ID}, but the `kernels` package that loads such builds is not "
                "importable; install it or remove the mapping to use the packaged kernel"
            ) from e
        return get_kernel(KERNEL_REPO_ID, version=1)
    return import_kernel_sources()


# --------------------------------------------------------------------------------------------------------------
# The `kernels` Hub layout (build/torch-<backend>/), for `kernels.get_local_kernel` and for publishing
# --------------------------------------------------------------------------------------------------------------


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

    Load it with ``kernels.get_local_kernel(root)``, or map it with ``LOCAL_KERNELS=hf-gptoss-rl/sink-flash-attn3=
    <root>``. Neither ``import hf_gptoss_rl`` nor the transformers integration calls this.

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
            # Build in a private directory, then rename it into place: atomic, so processes building at the same
            # time never see a half-written tree (the loser of the race drops its copy).
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
    """Whether ``kernels`` is importable and in the version range the installed transformers accepts.

    The transformers integration of this kernel does not need it (see the module docstring).
    """
    try:
        import kernels  # noqa: F401
        from transformers.utils import is_kernels_available
    except ImportError:
        return False
    return bool(is_kernels_available())


# --------------------------------------------------------------------------------------------------------------
# Registration with transformers
# --------------------------------------------------------------------------------------------------------------


def _register_attention_function(name: str, attention_wrapper=None) -> None:
    """Register ``name`` as transformers' hub-kernel loader registers a flash kernel."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention_wrapper or flash_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def _mark_gptoss_compatible() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    compatible = list(getattr(GptOssPreTrainedModel, "_compatible_flash_implementations", None) or [])
    if KERNEL_REPO_ID not in compatible:
        # A new list (not an in-place append): the attribute may be shared with a parent class.
        GptOssPreTrainedModel._compatible_flash_implementations = [*compatible, KERNEL_REPO_ID]


def _install_kernel_loader() -> None:
    """Route transformers' hub-kernel loading of this id (and ``paged|`` + id) to :func:`load_kernel`."""
    from transformers.integrations import hub_kernels

    original = hub_kernels.load_and_register_attn_kernel
    if getattr(original, "_hf_gptoss_rl", False):
        return

    @functools.wraps(original)
    def load_and_register_attn_kernel(attn_implementation, attention_wrapper=None, *args, **kwargs):
        if attn_implementation.rpartition("|")[2] != KERNEL_REPO_ID:
            return original(attn_implementation, attention_wrapper, *args, **kwargs)
        kernel = load_kernel()
        _register_attention_function(attn_implementation, attention_wrapper)
        return kernel

    load_and_register_attn_kernel._hf_gptoss_rl = True
    # `_lazy_imports` (modeling_flash_attention_utils) imports this attribute at each call, so the wrapper is what
    # `from_pretrained`, `set_attn_implementation` and every flash forward reach.
    hub_kernels.load_and_register_attn_kernel = load_and_register_attn_kernel


def _misspelling_of_the_id(name: str) -> bool:
    normalized = name.strip().lower().replace("_", "-")
    if normalized == KERNEL_REPO_ID:
        return True
    # 0.85: one or two characters off the id or its name part ("sink-flash-attn", "sink_flash_attn2"), while
    # other kernels' names stay below it ("flash-attn3" scores 0.81 against "sink-flash-attn3")
    tail = normalized.rpartition("/")[2]
    return bool(
        difflib.get_close_matches(normalized, [KERNEL_REPO_ID], n=1, cutoff=0.85)
        or difflib.get_close_matches(tail, [KERNEL_REPO_ID.rpartition("/")[2]], n=1, cutoff=0.85)
    )


def _install_remap_guard() -> None:
    """Wrap ``GptOssPreTrainedModel._check_and_adjust_attn_implementation``: no silent remaps."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    original = GptOssPreTrainedModel._check_and_adjust_attn_implementation
    if getattr(original, "_hf_gptoss_rl", False):
        return

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        requested = attn_implementation.removeprefix("paged|") if isinstance(attn_implementation, str) else None
        compatible = getattr(self, "_compatible_flash_implementations", None)
        remapped = requested is not None and "flash" in requested and compatible is not None
        remapped = remapped and requested not in compatible
        if remapped and _misspelling_of_the_id(requested):
            raise ValueError(
                f'attn_implementation="{attn_implementation}" is not a registered implementation; did you mean '
                f'"{KERNEL_REPO_ID}"? (transformers would replace it with another flash kernel of '
                f"{type(self).__name__}, one without the sink gradient on CUDA)"
            )
        result = original(self, attn_implementation, *args, **kwargs)
        if remapped and result != attn_implementation:
            warnings.warn(
                f'transformers replaced attn_implementation="{attn_implementation}" with "{result}" for '
                f"{type(self).__name__}, which only runs the flash kernels it lists in "
                f"_compatible_flash_implementations ({compatible}). For training with the sink gradient, request "
                f'"{KERNEL_REPO_ID}" explicitly.',
                AttentionRemapWarning,
                stacklevel=3,
            )
        return result

    _check_and_adjust_attn_implementation._hf_gptoss_rl = True
    GptOssPreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionRemapWarning",
    "KERNEL_REPO_ID",
    "build_local_kernel",
    "import_kernel_sources",
    "kernels_usable",
    "load_kernel",
]
