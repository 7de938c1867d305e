"""Kernel launches with less host time per call than ``kernel[grid](...)``.

``kernel[grid](*args)`` does a lot of Python work on every call. ``JITFunction.run`` binds and specializes every
argument to find the compiled kernel. A Gluon ``TensorDescriptor`` validates itself when it is built. The launcher
then encodes each descriptor into a CUDA tensor map. On an H200 host with Triton 3.6, that was 57 µs for one dQ
launch with 4 prebuilt descriptors, and 80 µs with new ones; the same launch through the compiled launcher took
9 µs. One forward + backward launches 4 or 5 kernels. So on sliding-window layers and on short sequences the host,
not the GPU, sets the time of an attention call.

``launch(fn, grid, *args, **constexprs)`` does the first launch of each specialization through ``fn[grid]``. That
compiles the kernel, or finds it in Triton's cache, and returns the ``CompiledKernel``. The call stores that
kernel under a key. Later calls with the same key call the kernel's compiled launcher directly. PyTorch Inductor
does the same in ``torch/_inductor/runtime/static_triton_launcher.py``, but that launcher refuses tensor-descriptor
arguments.

The key holds everything Triton specializes a kernel on:

- the type of each argument;
- for a tensor, its dtype and whether its address is 16-byte aligned;
- for an int, whether it is 1, whether it is a multiple of 16, and whether it fits in 32 bits;
- for a descriptor, its dtype, block shape, layout and padding;
- the constexpr and launch-option keywords, and Triton's debug knobs.

Two calls with the same key therefore run the same compiled kernel that ``fn[grid]`` would pick.

TMA descriptors are passed as ``Tile`` tuples, not as Triton's descriptor objects. The fast path encodes them with
the launcher's own ``make_tensordesc_arg``; the first launch of a key turns them into Triton's
``TensorDescriptor`` objects.

The direct call reads Triton internals that a release may change without notice: the launcher object's closure (the
C function it wraps) and that function's argument layout. So it is confined to the Triton releases it was written
for and checked against (``DIRECT_LAYOUTS``); with any other release (``DIRECT_LAYOUT`` None) every launch goes
through the public ``kernel[grid](...)``, and the first one warns once, naming the version. Standard launches also
remain for every call when:

- the interpreter runs (``TRITON_INTERPRET=1``: no compiled kernel);
- a launch hook is installed (Triton's profiler), so the hooks see every launch;
- a kernel needs a scratch allocation (or Triton's sanitizer instruments it);
- the launcher of a listed release does not have the layout expected of it (warned once, as above).

The two launcher layouts:

- ``"generated"``, Triton 3.6: a C launcher generated per kernel (module ``__triton_launcher``). It takes
  ``_BASE_ARGS_FORMAT``'s 13 arguments, then the kernel's arguments flattened, each descriptor expanded in place.
- ``"generic"``, Triton 3.7 (the GPU tests) and 3.9 (``tests/test_launch.py`` against that release's own
  ``CudaLauncher``): one C launcher for every kernel, the driver's ``utils.launch``. It takes 15 arguments, the
  last two the kernel's argument annotations and signature that the ``CudaLauncher`` object built once, then the
  flattened arguments as one sequence.

Two further savings for callers that launch the same kernels many times:

- ``launch_at(sites, site, fn, grid, ...)`` skips the key. ``sites`` is a dict the caller keeps with state it caches
  per input signature (shapes, strides, dtypes, alignment, parameters: whatever determines every argument's key). A
  site's record is then reused as it is.
- A record keeps the tensor maps it encoded, by base address and geometry. A map holds nothing else (no tensor), and
  PyTorch's caching allocator hands the same addresses back from step to step, so most descriptors are encoded once.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import warnings
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import triton
from triton.runtime.jit import JITFunction

__all__ = ["DIRECT_LAYOUT", "DIRECT_LAYOUTS", "Tile", "checking_sites", "current_device", "launch", "launch_at"]

# (major, minor) of each Triton release the direct path was written for -> its launcher layout (module docstring)
DIRECT_LAYOUTS = MappingProxyType({(3, 6): "generated", (3, 7): "generic", (3, 9): "generic"})


def direct_layout(version: str) -> str | None:
    """The launcher layout this module calls directly with Triton ``version``; None: ``kernel[grid](...)`` only."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return DIRECT_LAYOUTS.get((int(match[1]), int(match[2]))) if match else None


_TRITON_VERSION = triton.__version__
DIRECT_LAYOUT = direct_layout(_TRITON_VERSION)


class Tile(NamedTuple):
    """A TMA descriptor argument: ``base`` viewed as ``shape`` / ``strides`` (elements), tiles of ``block_shape``.

    ``layout`` is the NVMMA shared layout of a Gluon descriptor. ``None`` means a Triton
    ``triton.tools.tensor_descriptor.TensorDescriptor``. The field names are those of Triton's descriptor
    classes, so the launcher's ``make_tensordesc_arg`` reads a ``Tile`` directly.
    """

    base: torch.Tensor
    shape: tuple
    strides: tuple
    block_shape: tuple
    layout: Any = None
    padding: str = "zero"
    round_f32_to_tf32: bool = False  # (Triton 3.7+; read by its make_tensordesc_arg)


def _descriptor_object(tile: Tile):
    # (Triton 3.6's descriptor classes have no round_f32_to_tf32: passed only when set)
    extra = {"round_f32_to_tf32": True} if tile.round_f32_to_tf32 else {}
    if tile.layout is None:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

        return TensorDescriptor(
            tile.base, list(tile.shape), list(tile.strides), list(tile.block_shape), tile.padding, **extra
        )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

    return TensorDescriptor(
        tile.base, list(tile.shape), list(tile.strides), list(tile.block_shape), tile.layout, tile.padding, **extra
    )


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _args_key(args) -> tuple:
    """What Triton's specialization reads from the runtime arguments (a superset of it), one entry per argument.

    A descriptor's layout enters by identity (hashing a layout costs about as much as the rest of the key), as does
    the kernel in ``launch``; the record made for a key keeps both alive (``_Direct``)."""
    key = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append((arg == 1, arg % 16 == 0, _I32_MIN <= arg <= _I32_MAX))
        elif kind is Tile:
            key.append((arg.base.dtype, arg.block_shape, id(arg.layout), arg.padding, arg.round_f32_to_tf32))
        elif kind is float or kind is bool or arg is None:
            key.append(kind)
        elif isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        else:
            raise TypeError(f"sink_flash_attn3: unsupported kernel argument type {kind.__name__}")
    return tuple(key)


def _hooks_installed() -> bool:
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _debug_knobs() -> tuple:
    return (triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)


class _Launcher(NamedTuple):
    """How to call one compiled kernel's C launcher (see the module docstring for the two layouts)."""

    raw_launch: Any  # the C function
    expand: Any  # descriptor -> [tensor map, *shape, *strides] (the driver's make_tensordesc_arg), or None
    generic: bool  # Triton 3.7+'s utils.launch: arguments as one sequence after the annotations and signature
    annotations: Any = None
    signature: Any = None


class _Direct:
    """One compiled kernel and its compiled launcher, called without ``JITFunction.run``."""

    __slots__ = (
        "function",
        "packed_metadata",
        "raw_launch",
        "generic",
        "annotations",
        "signature",
        "cooperative",
        "pdl",
        "tail",
        "tiles",
        "expand",
        "layouts",
        "kernel",
        "debug",
        "maps",
    )

    def __init__(self, compiled, fn, args: tuple, constexprs: dict, launcher: _Launcher):
        if launcher.expand is None and any(type(arg) is Tile for arg in args):
            raise TypeError("descriptor arguments without the driver's make_tensordesc_arg")
        self.function = compiled.function
        self.packed_metadata = compiled.packed_metadata
        self.raw_launch = launcher.raw_launch
        self.generic = launcher.generic
        self.annotations = launcher.annotations
        self.signature = launcher.signature
        self.cooperative = compiled.run.launch_cooperative_grid
        self.pdl = compiled.run.launch_pdl
        self.expand = launcher.expand
        # the key holds id(fn) and the layouts' ids: the record keeps those objects alive, so no other object can take
        # one of their ids while the key is in use
        self.kernel = fn
        self.layouts = tuple(arg.layout for arg in args if type(arg) is Tile)
        # the kernel parameters after the positional arguments, in signature order: the constexpr keywords and the
        # defaults (the launcher takes every parameter, and skips the constexprs)
        tail = []
        for param in fn.params[len(args) :]:
            if param.name in constexprs:
                tail.append(constexprs[param.name])
            elif param.has_default:
                tail.append(param.default)
            else:
                raise TypeError(f"{fn.__name__}: no value for parameter {param.name}")
        self.tail = tuple(tail)
        # (position, launcher metadata) of each descriptor argument, last first
        positions = [index for index, arg in enumerate(args) if type(arg) is Tile]
        meta = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(positions)
        if len(meta) != len(positions):
            raise TypeError(f"{len(positions)} descriptor arguments, launcher metadata for {len(meta)}")
        self.tiles = tuple(reversed(list(zip(positions, meta))))
        self.debug = _debug_knobs()
        # (position, address, shape, strides) -> a descriptor expanded into its tensor map and geometry
        self.maps: dict = {}

    def __call__(self, grid, stream, args):
        values = list(args)
        maps = self.maps
        for index, meta in self.tiles:  # (from the last, so the earlier positions stay put)
            tile = values[index]
            if meta is None:  # (no tensor map: the launcher takes the base tensor itself, which is never kept)
                values[index : index + 1] = self.expand(tile, meta)
                continue
            key = (index, tile.base.data_ptr(), tile.shape, tile.strides)
            expanded = maps.get(key)
            if expanded is None:
                if len(maps) >= _MAPS_MAX:
                    maps.clear()
                expanded = maps[key] = self.expand(tile, meta)
            values[index : index + 1] = expanded
        if self.generic:
            values.extend(self.tail)
            self.raw_launch(
                grid[0], grid[1], grid[2], stream, self.function, self.cooperative, self.pdl, self.packed_metadata,
                None, None, None, None, None, self.annotations, self.signature, values,
            )  # fmt: skip
            return
        self.raw_launch(
            grid[0], grid[1], grid[2], stream, self.function, self.cooperative, self.pdl, None, None,
            self.packed_metadata, None, None, None, *values, *self.tail,
        )  # fmt: skip


try:  # what Triton's CUDA driver reads (torch.cuda.current_stream builds a Stream object per call, and
    # torch.cuda.current_device re-checks CUDA's initialization: a launch only happens once CUDA runs)
    from torch._C import _cuda_getCurrentRawStream as _current_stream
    from torch._C import _cuda_getDevice as current_device
except ImportError:  # pragma: no cover - CPU-only builds of PyTorch

    def _current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def current_device() -> int:
        return torch.cuda.current_device()


_KNOBS = hasattr(triton, "knobs")  # (Triton 3.4+; older versions launch through kernel[grid] only)
_RECORDS: dict = {}
_RECORDS_MAX = 4096
_MAPS_MAX = 64  # tensor maps kept per record
_LOCK = threading.Lock()
_UNSUPPORTED: dict = {}  # the Triton version whose launcher keeps kernel[grid] (warned once)


# Triton 3.6's generated launcher (module "__triton_launcher"): this base format, then the kernel's arguments flattened,
# each descriptor expanded by the driver's make_tensordesc_arg(arg, metadata).
_BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
_LAUNCHER_MODULE = "__triton_launcher"


def _descriptor_expander(driver):
    """The driver's ``make_tensordesc_arg`` as a function of (descriptor, metadata), or None.

    Triton 3.9's takes a third parameter, which its CUDA driver leaves unused (named ``_``): the tensor map depends on
    the descriptor and its metadata only, which is what lets a record keep its maps. Any other signature is refused."""
    expand = getattr(driver, "make_tensordesc_arg", None)
    code = getattr(expand, "__code__", None)
    if code is None:
        return None
    if code.co_argcount == 2:
        return expand
    if code.co_argcount == 3 and code.co_varnames[2] == "_":
        return lambda arg, meta: expand(arg, meta, None)
    return None


def _wrapped_launcher(wrapped):
    """The C launcher ``wrapped`` calls: itself, or the ``launcher`` its descriptor-expanding closure holds (a Python
    function has ``__code__``, a function of a C extension module does not)."""
    if callable(wrapped) and not hasattr(wrapped, "__code__"):
        return wrapped
    code, closure = getattr(wrapped, "__code__", None), getattr(wrapped, "__closure__", None)
    if code is None or closure is None:
        return None
    raw = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure))).get("launcher")
    return raw if callable(raw) and not hasattr(raw, "__code__") else None


def _raw_launcher(compiled, layout: str) -> _Launcher | None:
    """How to call ``compiled``'s C launcher directly in ``layout``, or None where the launcher does not have it."""
    launcher = getattr(compiled, "run", None)
    driver = sys.modules.get(type(launcher).__module__)
    raw = _wrapped_launcher(getattr(launcher, "launch", None))
    if raw is None:
        return None
    expand = _descriptor_expander(driver)
    if layout == "generated":  # Triton 3.6
        generated = getattr(raw, "__module__", None) == _LAUNCHER_MODULE
        ok = getattr(driver, "_BASE_ARGS_FORMAT", None) == _BASE_ARGS_FORMAT and generated
        return _Launcher(raw, expand, False) if ok else None
    # "generic", Triton 3.7+: the CudaLauncher object keeps the argument annotations and the signature for utils.launch
    annotations = getattr(launcher, "arg_annotations", None)
    signature = getattr(launcher, "kernel_signature", None)
    if annotations is None or not isinstance(signature, bytes) or getattr(launcher, "gsan_enabled", False):
        return None
    return _Launcher(raw, expand, True, annotations, signature)


def _warn_standard(reason: str) -> None:
    if not _UNSUPPORTED:
        _UNSUPPORTED["triton"] = _TRITON_VERSION
        warnings.warn(
            f"sink_flash_attn3: with triton {_TRITON_VERSION} the kernels launch through kernel[grid](...), "
            f"which costs more host time per call ({reason})",
            RuntimeWarning,
            stacklevel=5,
        )


def _record(compiled, fn, args, constexprs, layout: str | None = DIRECT_LAYOUT):
    """A direct launcher for ``compiled`` in ``layout``, or None where this launch must keep Triton's standard
    path."""
    if layout is None:  # (a Triton release the direct path was not written for: its internals are never read)
        _warn_standard(f"direct launches are written for Triton releases {_release_names()} only")
        return None
    metadata = getattr(compiled, "metadata", None)
    if metadata is None or getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0):
        return None
    try:
        found = _raw_launcher(compiled, layout)
        if found is not None:
            return _Direct(compiled, fn, args, constexprs, found)
        reason = f"its launcher does not have the {layout} layout this package calls directly"
    except Exception as exc:  # noqa: BLE001 - a launcher this module does not know: the standard path, once warned
        reason = f"{type(exc).__name__}: {exc}"
    _warn_standard(reason)
    return None


def _release_names() -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in DIRECT_LAYOUTS)


def _record_key(fn, device: int, args, constexprs: dict) -> tuple:
    """The key of ``launch``'s records: everything the compiled kernel and its launch depend on."""
    return (id(fn), device, _args_key(args), tuple(constexprs.items()), _debug_knobs())


def launch(fn, grid: tuple, *args, **constexprs):
    """``fn[grid](*args, **constexprs)`` with ``Tile`` arguments for TMA descriptors; see the module docstring.

    Returns the direct launcher this call used or recorded, None where Triton's standard path ran."""
    # (under TRITON_INTERPRET=1 the kernels are InterpretedFunction objects: no compiled kernel to call)
    if not (_KNOBS and isinstance(fn, JITFunction)) or fn.pre_run_hooks or _hooks_installed():
        key = None
    elif DIRECT_LAYOUT is None:  # (a Triton release the direct path was not written for: its internals stay unread)
        _warn_standard(f"direct launches are written for Triton releases {_release_names()} only")
        key = None
    else:
        device = current_device()
        key = _record_key(fn, device, args, constexprs)
        direct = _RECORDS.get(key, False)
        if direct:
            direct(grid, _current_stream(device), args)
            return direct
    standard = [_descriptor_object(a) if type(a) is Tile else a for a in args]
    compiled = fn[grid](*standard, **constexprs)
    if key is None:
        return None
    direct = _RECORDS.get(key, False)
    if direct is False:
        direct = _record(compiled, fn, args, constexprs) if compiled is not None else None
        with _LOCK:
            if len(_RECORDS) >= _RECORDS_MAX:
                _RECORDS.clear()
            _RECORDS[key] = direct
    return direct


# Within ``checking_sites()``: every launch_at hit also computes the full key and checks that it finds the same record.
_CHECK_SITES = False


@contextlib.contextmanager
def checking_sites():
    """Within the block, every reuse of a ``launch_at`` site also computes the launch's full key and raises if that
    key's record is not the site's: a check (for tests, it costs the host time sites save) that a caller's ``sites``
    belong to one input signature."""
    global _CHECK_SITES
    previous, _CHECK_SITES = _CHECK_SITES, True
    try:
        yield
    finally:
        _CHECK_SITES = previous


# Compile options of every kernel launched through launch_at. FMA contraction: the kernels were written and measured
# with it (the softmax's scale and running max are one FFMA per score). Triton 3.9 warns that its default turns it
# off from 3.10 (TRITON_DEFAULT_FP_FUSION); asking for it keeps the compiled kernels what they are on every release.
# TRITON_FORCE_DISABLE_FP_FUSION still turns it off.
_COMPILE_OPTIONS = {"enable_fp_fusion": True}


def launch_at(sites: dict, site, fn, grid: tuple, *args, **constexprs) -> None:
    """``launch`` through a record the caller keeps in ``sites`` under ``site``.

    ``sites`` must belong to one input signature of the caller: every argument's entry in the key (``_args_key``) and
    every constexpr must follow from it. Launch hooks and debug knobs are checked on every call, as ``launch`` does.
    The kernel compiles with ``_COMPILE_OPTIONS`` besides the caller's constexprs and launch options."""
    direct = sites.get(site)
    if direct is not None and direct.debug == _debug_knobs() and not _hooks_installed():
        device = current_device()
        if _CHECK_SITES:
            key = _record_key(fn, device, args, {**_COMPILE_OPTIONS, **constexprs})
            if _RECORDS.get(key) is not direct:
                raise AssertionError(f"{fn.__name__}: launch site {site!r} reused a record of other arguments")
        direct(grid, _current_stream(device), args)
        return
    sites[site] = launch(fn, grid, *args, **_COMPILE_OPTIONS, **constexprs)
