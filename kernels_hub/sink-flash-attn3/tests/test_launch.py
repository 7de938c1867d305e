"""``_launch``: direct launches of compiled kernels must run exactly what ``kernel[grid](...)`` runs, and only with
the Triton releases they were written for (any other launches through ``kernel[grid](...)``, with the same results)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "torch-ext" / "sink_flash_attn3"


def _launch_module(triton_version=None):
    """A private copy of ``_launch``, as it is with the installed Triton, or as it would be with ``triton_version``
    installed (its gate reads ``triton.__version__`` once, at import)."""
    spec = importlib.util.spec_from_file_location("_sink_flash_attn3_launch_under_test", PACKAGE_DIR / "_launch.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        if triton_version is not None:
            patch.setattr(triton, "__version__", triton_version)
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "version, layout",
    [
        ("3.6.0", "generated"),
        ("3.6.0+git1a2b3c", "generated"),
        ("3.7.1", "generic"),
        ("3.9.0", "generic"),
        ("3.8.0", None),  # never checked: kernel[grid]
        ("3.10.0", None),
        ("4.0.0", None),
        ("3.5.1", None),
        ("nightly", None),
    ],
)
def test_direct_launches_only_with_the_releases_they_were_written_for(version, layout):
    launch = _launch_module(triton_version=version)
    assert launch.direct_layout(version) == launch.DIRECT_LAYOUT == layout


def _triton_specialization(arg):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _sample_args(launch):
    ints = [*range(-3, 70), 2**31 - 16, 2**31 - 1, 2**31, 2**32, -(2**31), -(2**31) - 1]
    storage = torch.empty(4096, dtype=torch.float32)
    tensors = [
        storage.view(dtype)[offset:]
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32)
        for offset in range(0, 9)
    ]
    tiles = []
    base = torch.empty(64 * 256, dtype=torch.bfloat16).view(64, 256)
    for rows, (block, cols) in itertools.product((64, 63, 1), ((64, 64), (32, 64), (64, 128))):
        tiles.append(launch.Tile(base[:rows], (rows, 256), (256, 1), (block, cols)))
    return [*ints, 0.5, 1.0, 3.0, True, False, None, *tensors, *tiles]


def test_args_key_is_at_least_as_fine_as_triton_specialization():
    # Two calls whose arguments share _args_key must compile to the same kernel: Triton's own specialization of the
    # arguments (type string and attribute: alignment, divisibility by 16, the value 1) must agree within each key.
    # A Triton that starts specializing on something the key does not hold fails here.
    launch = _launch_module()
    groups: dict = {}
    for arg in _sample_args(launch):
        triton_arg = launch._descriptor_object(arg) if type(arg) is launch.Tile else arg
        groups.setdefault(launch._args_key([arg]), set()).add(_triton_specialization(triton_arg))
    for key, specializations in groups.items():
        assert len(specializations) == 1, f"key {key} covers different Triton specializations {specializations}"
    assert len(groups) > 10  # the samples do exercise several keys


def test_args_key_rejects_unknown_argument_types():
    launch = _launch_module()
    with pytest.raises(TypeError, match="unsupported kernel argument type list"):
        launch._args_key([1, [1, 2]])


def test_kernels_that_are_not_compiled_launch_through_their_grid():
    # Under TRITON_INTERPRET=1 kernels are InterpretedFunction objects with no compiled kernel: every launch takes
    # kernel[grid], with Tile arguments turned into Triton's descriptors, and nothing is recorded
    launch = _launch_module()
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    tile = launch.Tile(torch.empty(64, 32), (64, 32), (32, 1), (16, 32))
    launch.launch(Kernel(), (2, 1, 1), 3, None, tile, BLOCK=16)
    (grid, args, kwargs), *more = calls
    assert not more and grid == (2, 1, 1) and args[:2] == (3, None) and kwargs == {"BLOCK": 16}
    from triton.tools.tensor_descriptor import TensorDescriptor

    assert isinstance(args[2], TensorDescriptor) and args[2].base is tile.base
    assert (list(args[2].shape), list(args[2].strides), list(args[2].block_shape)) == ([64, 32], [32, 1], [16, 32])
    assert launch._RECORDS == {}


class _CFunction:
    """Stands for a function of a C extension module (no ``__code__``) and records its calls."""

    def __init__(self, module):
        self.__module__ = module
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _expand_descriptor(arg, meta):
    return [f"map<{meta}>", *arg.shape, *arg.strides]


def _fake_compiled(generic=False, base_format="iiiKKppOOOOOO", make_tensordesc_arg=None):
    """A compiled kernel shaped like Triton's: a launcher object from a driver module whose ``launch`` wraps a C
    launcher to expand descriptors, and the driver's ``make_tensordesc_arg``. Triton 3.6's (``generic=False``) wraps
    the launcher generated for the kernel (module ``__triton_launcher``); Triton 3.7+'s (``generic=True``) wraps the
    driver's one ``utils.launch`` and keeps the argument annotations and the signature it takes. The C launcher
    records what it is called with."""
    driver = types.ModuleType("_fake_triton_driver")
    if generic:
        driver.make_tensordesc_arg = make_tensordesc_arg or (lambda arg, meta, _: _expand_descriptor(arg, meta))
        c_launch = _CFunction("cuda_utils")
    else:
        driver._BASE_ARGS_FORMAT = base_format
        driver.make_tensordesc_arg = make_tensordesc_arg or _expand_descriptor
        c_launch = _CFunction("__triton_launcher")

    def wrap_handle_tensordesc(launcher):
        def inner(*args):
            return launcher(*args)

        return inner

    launcher = type("CudaLauncher", (), {"__module__": driver.__name__})()
    launcher.launch = wrap_handle_tensordesc(c_launch)
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
    if generic:
        launcher.arg_annotations, launcher.kernel_signature = "annotations", b"signature"
    metadata = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, tensordesc_meta=["m0", "m1"])
    packed = (4, 1, 0) if generic else "packed"
    compiled = types.SimpleNamespace(function=77, packed_metadata=packed, metadata=metadata, run=launcher)
    return driver, compiled, c_launch.calls


def _fake_kernel():
    def param(name, default=inspect.Parameter.empty):
        return types.SimpleNamespace(name=name, default=default, has_default=default is not inspect.Parameter.empty)

    names = ("a_desc", "x", "b_desc", "n", "BLOCK", "HAS_SINK", "EXTRA")
    return types.SimpleNamespace(
        __name__="fake_kernel", params=[*map(param, names[:-1]), param("EXTRA", default=5)], pre_run_hooks=[]
    )


@pytest.mark.parametrize("generic", [False, True], ids=["generated launcher", "generic launcher"])
def test_direct_launch_arguments_match_the_launcher_layout(monkeypatch, generic):
    # Triton 3.6's generated launcher: the 13 base arguments, then every kernel parameter in signature order, each
    # descriptor expanded in place by the driver (with its own metadata), constexprs and defaults last. Triton 3.7+'s
    # utils.launch: its 13 base arguments, the launcher's annotations and signature, then those parameters as a list.
    launch = _launch_module()
    driver, compiled, calls = _fake_compiled(generic)
    monkeypatch.setitem(sys.modules, driver.__name__, driver)
    x = torch.empty(8)
    a = launch.Tile(torch.empty(4, 16), (4, 16), (16, 1), (2, 16))
    b = launch.Tile(torch.empty(6, 16), (6, 16), (16, 1), (3, 16))
    args = (a, x, b, 7)
    layout = "generic" if generic else "generated"
    direct = launch._record(compiled, _fake_kernel(), args, {"BLOCK": 64, "HAS_SINK": True}, layout)
    assert direct is not None
    direct((3, 2, 1), 1234, args)
    params = ["map<m0>", 4, 16, 16, 1, x, "map<m1>", 6, 16, 16, 1, 7, 64, True, 5]
    if generic:
        expected = (3, 2, 1, 1234, 77, False, True, (4, 1, 0), None, None, None, None, None, "annotations", b"signature",
                    params)  # fmt: skip
    else:
        expected = (3, 2, 1, 1234, 77, False, True, None, None, "packed", None, None, None, *params)
    assert calls == [expected]


def test_a_descriptor_expander_that_reads_more_keeps_the_standard_path(monkeypatch):
    # a make_tensordesc_arg whose third parameter is used could make maps that a record must not keep
    launch = _launch_module()
    driver, compiled, calls = _fake_compiled(generic=True, make_tensordesc_arg=lambda arg, meta, stream: [arg])
    monkeypatch.setitem(sys.modules, driver.__name__, driver)
    args = (launch.Tile(torch.empty(4, 16), (4, 16), (16, 1), (2, 16)), torch.empty(8), None, 7)
    with pytest.warns(RuntimeWarning, match="launch through kernel\\[grid\\]"):
        assert launch._record(compiled, _fake_kernel(), args, {"BLOCK": 64, "HAS_SINK": True}, "generic") is None
    assert calls == []


def test_direct_launch_passes_what_the_installed_triton_launcher_passes(monkeypatch):
    # The installed Triton's own CudaLauncher (its driver's C functions faked: no GPU here) against the direct path,
    # on one kernel signature with two descriptors: the C launcher must receive the same arguments from both.
    nvidia = pytest.importorskip("triton.backends.nvidia.driver")
    if hasattr(nvidia, "_BASE_ARGS_FORMAT"):
        pytest.skip(f"triton {triton.__version__} generates a launcher per kernel (the fake-compiled tests cover it)")
    launch = _launch_module()
    if launch.DIRECT_LAYOUT is None:
        pytest.skip(f"triton {triton.__version__} is not a release the direct launches are written for")
    assert launch.DIRECT_LAYOUT == "generic"
    utils_launch = _CFunction("cuda_utils")

    def fill_tma_descriptor_tiled(address, swizzle, elem_size, elem_type, block, shape, strides, padding):
        return ("map", address, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)

    utils = types.SimpleNamespace(
        launch=utils_launch,
        build_signature_metadata=lambda kinds: ",".join(kinds).encode(),
        fill_tma_descriptor_tiled=fill_tma_descriptor_tiled,
    )
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(utils=utils))
    monkeypatch.setattr(nvidia, "PyKernelArg", lambda nested_tuple, type: (type, nested_tuple), raising=False)
    for name in ("ARG_CONSTEXPR", "ARG_KERNEL", "ARG_TUPLE"):
        monkeypatch.setattr(nvidia, name, name, raising=False)
    kernel = _fake_kernel()
    names = [param.name for param in kernel.params]
    kinds = [
        "tensordesc<bf16[2, 16]>",
        "*fp32",
        "tensordesc<bf16[4, 16]>",
        "i32",
        "constexpr",
        "constexpr",
        "constexpr",
    ]
    src = types.SimpleNamespace(
        constants={}, signature=dict(zip(names, kinds)), fn=types.SimpleNamespace(arg_names=names)
    )
    metadata = types.SimpleNamespace(
        tensordesc_meta=[
            dict(swizzle=3, elem_size=2, elem_type=5, block_size=[2, 16], fp4_padded=False),
            dict(swizzle=2, elem_size=2, elem_type=5, block_size=[4, 16], fp4_padded=False),
        ],
        num_ctas=1,
        global_scratch_size=0,
        global_scratch_align=1,
        profile_scratch_size=0,
        profile_scratch_align=1,
        launch_cooperative_grid=False,
        launch_pdl=False,
        instrumentation_mode="",
    )
    launcher = nvidia.CudaLauncher(src, metadata)
    compiled = types.SimpleNamespace(function=77, packed_metadata=(4, 1, 1024), metadata=metadata, run=launcher)
    x = torch.empty(8)
    a = launch.Tile(torch.empty(4, 16, dtype=torch.bfloat16), (4, 16), (16, 1), (2, 16))
    b = launch.Tile(torch.empty(6, 16, dtype=torch.bfloat16), (6, 16), (16, 1), (4, 16))
    standard = (launch._descriptor_object(a), x, launch._descriptor_object(b), 7, 64, True, 5)
    launcher(3, 2, 1, 1234, 77, compiled.packed_metadata, None, None, None, *standard)  # as CompiledKernel.run does
    direct = launch._record(compiled, kernel, (a, x, b, 7), {"BLOCK": 64, "HAS_SINK": True})
    assert direct is not None, f"triton {triton.__version__}: no direct launcher"
    direct((3, 2, 1), 1234, (a, x, b, 7))
    (via_triton, via_direct) = utils_launch.calls
    assert via_direct[:-1] == via_triton[:-1]
    assert [v if v is not x else "x" for v in via_direct[-1]] == [v if v is not x else "x" for v in via_triton[-1]]
    assert via_triton[-1][0][0] == "map" and len(via_triton[-1]) > 9  # descriptors were expanded, x passed through


def test_unknown_launcher_layout_keeps_the_standard_path_and_warns_once(monkeypatch):
    launch = _launch_module()
    driver, compiled, calls = _fake_compiled(base_format="iiiKKOO")  # another Triton's launcher
    monkeypatch.setitem(sys.modules, driver.__name__, driver)
    args = (launch.Tile(torch.empty(4, 16), (4, 16), (16, 1), (2, 16)), torch.empty(8), None, 7)
    with pytest.warns(RuntimeWarning, match="launch through kernel\\[grid\\]"):
        assert launch._record(compiled, _fake_kernel(), args, {"BLOCK": 64, "HAS_SINK": True}, "generated") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch._record(compiled, _fake_kernel(), args, {"BLOCK": 64, "HAS_SINK": True}, "generated") is None
    assert calls == []


def _recording_launch(monkeypatch, launch, compiled=None):
    """``launch`` with a fake Triton 3.6 compiled kernel behind ``kernel[grid]`` (as a CUDA machine would have it);
    ``launch`` a copy of ``_launch`` (``_launch_module``), whose globals the fakes replace. Returns the kernel, the
    direct launcher's calls and the grids of ``kernel[grid]``'s calls with their arguments."""
    driver, fake, calls = _fake_compiled()
    compiled = compiled or fake
    monkeypatch.setitem(sys.modules, driver.__name__, driver)
    standard = []

    class FakeJIT(types.SimpleNamespace):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: standard.append((grid, args, kwargs)) or compiled

    monkeypatch.setattr(launch, "_RECORDS", {})
    monkeypatch.setattr(launch, "JITFunction", FakeJIT)
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1234)
    return FakeJIT(**vars(_fake_kernel())), calls, standard


def test_an_unlisted_triton_launches_every_kernel_through_its_grid(monkeypatch):
    # With a Triton release the direct path was not written for, every launch takes kernel[grid] (one warning): the
    # launcher's internals are never read, and kernel[grid] gets the arguments the direct path's first launch gives it
    direct_launch = _launch_module(triton_version="3.6.0")
    fallback = _launch_module(triton_version="3.8.0")

    class Unreadable:  # a compiled kernel whose launcher must not be looked at
        def __getattr__(self, name):
            raise AssertionError(f"the fallback read the compiled kernel's {name}")

    base, x = torch.empty(4, 16), torch.empty(8)
    seen = {}
    for name, launch in (("direct", direct_launch), ("fallback", fallback)):
        tile = launch.Tile(base, (4, 16), (16, 1), (2, 16))  # (each copy of the module has its own Tile class)
        args = (tile, x, tile, 7)
        kernel, calls, standard = _recording_launch(
            monkeypatch, launch, compiled=Unreadable() if name == "fallback" else None
        )
        sites = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                launch.launch_at(sites, "site", kernel, (3, 2, 1), *args, BLOCK=64, HAS_SINK=True)
        seen[name] = (calls, standard, [str(w.message) for w in caught])
    calls, standard, warned = seen["fallback"]
    assert calls == [] and len(standard) == 3 and fallback._RECORDS == {}
    assert len(warned) == 1 and "triton 3.8.0" in warned[0] and "3.6, 3.7, 3.9" in warned[0], warned
    direct_calls, direct_standard, direct_warned = seen["direct"]
    assert len(direct_standard) == 1 and len(direct_calls) == 2 and not direct_warned
    (grid, first_args, first_kwargs), *_ = direct_standard
    for grid_b, args_b, kwargs_b in standard:
        assert grid_b == grid and kwargs_b == first_kwargs
        assert [type(a) for a in args_b] == [type(a) for a in first_args]
        for a, b in zip(args_b, first_args):
            if hasattr(a, "base"):  # Triton's descriptor objects, built from the same Tile
                assert (
                    a.base is b.base and list(a.shape) == list(b.shape) and list(a.block_shape) == list(b.block_shape)
                )
            else:
                assert a is b or a == b


def test_launch_at_reuses_a_site_and_its_tensor_maps(monkeypatch):
    launch = _launch_module(triton_version="3.6.0")
    kernel, calls, standard = _recording_launch(monkeypatch, launch)
    expanded = []
    driver = sys.modules["_fake_triton_driver"]
    make = driver.make_tensordesc_arg
    monkeypatch.setattr(driver, "make_tensordesc_arg", lambda arg, meta: expanded.append(meta) or make(arg, meta))
    a_base, b_base = torch.empty(4, 16), torch.empty(6, 16)
    a = launch.Tile(a_base, (4, 16), (16, 1), (2, 16))
    b = launch.Tile(b_base, (6, 16), (16, 1), (2, 16))
    sites = {}
    for _ in range(3):
        launch.launch_at(sites, "site", kernel, (3, 2, 1), a, torch.empty(8), b, 7, BLOCK=64, HAS_SINK=True)
    assert [grid for grid, *_ in standard] == [(3, 2, 1)] and len(calls) == 2  # kernel[grid] first, then direct
    assert sorted(expanded) == ["m0", "m1"]  # each tensor map encoded once
    monkeypatch.setattr(launch, "_args_key", lambda args: pytest.fail("a reused site computed the key"))
    other = launch.Tile(torch.empty(4, 16), (4, 16), (16, 1), (2, 16))  # another address: its own map
    launch.launch_at(sites, "site", kernel, (3, 2, 1), other, torch.empty(8), b, 7, BLOCK=64, HAS_SINK=True)
    assert sorted(expanded) == ["m0", "m0", "m1"] and len(calls) == 3


def test_launch_at_compiles_with_fma_contraction(monkeypatch):
    # asked for explicitly: Triton's default turns it off from 3.10
    launch = _launch_module(triton_version="3.6.0")
    kernel, calls, standard = _recording_launch(monkeypatch, launch)
    seen = []
    monkeypatch.setattr(type(kernel), "__getitem__", lambda self, grid: lambda *a, **kw: seen.append(kw))
    tile = launch.Tile(torch.empty(4, 16), (4, 16), (16, 1), (2, 16))
    launch.launch_at({}, "site", kernel, (1, 1, 1), tile, torch.empty(8), tile, 7, BLOCK=64, HAS_SINK=True)
    assert seen == [{"enable_fp_fusion": True, "BLOCK": 64, "HAS_SINK": True}]


def test_launch_at_keeps_hooks_and_debug_knobs(monkeypatch):
    launch = _launch_module(triton_version="3.6.0")
    kernel, calls, standard = _recording_launch(monkeypatch, launch)
    sites = {}
    tile = launch.Tile(torch.empty(4, 16), (4, 16), (16, 1), (2, 16))
    args = (tile, torch.empty(8), tile, 7)
    launch.launch_at(sites, "site", kernel, (1, 1, 1), *args, BLOCK=64, HAS_SINK=True)
    launch.launch_at(sites, "site", kernel, (1, 1, 1), *args, BLOCK=64, HAS_SINK=True)
    assert len(standard) == 1 and len(calls) == 1
    monkeypatch.setattr(launch, "_hooks_installed", lambda: True)  # a profiler's launch hooks see every launch
    launch.launch_at(sites, "site", kernel, (1, 1, 1), *args, BLOCK=64, HAS_SINK=True)
    assert len(standard) == 2 and len(calls) == 1
    monkeypatch.setattr(launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(launch, "_debug_knobs", lambda: (True, ""))  # TRITON_DEBUG: another compiled kernel
    launch.launch_at(sites, "site", kernel, (1, 1, 1), *args, BLOCK=64, HAS_SINK=True)
    assert len(standard) == 3 and len(calls) == 1
    launch.launch_at(sites, "site", kernel, (1, 1, 1), *args, BLOCK=64, HAS_SINK=True)
    assert len(standard) == 3 and len(calls) == 2


def test_checked_sites_refuse_a_record_of_other_arguments(monkeypatch):
    launch = _launch_module(triton_version="3.6.0")
    kernel, calls, standard = _recording_launch(monkeypatch, launch)
    sites = {}
    tile = launch.Tile(torch.empty(4, 16), (4, 16), (16, 1), (2, 16))
    launch.launch_at(sites, "site", kernel, (1, 1, 1), tile, torch.empty(8), tile, 7, BLOCK=64, HAS_SINK=True)
    launch.launch_at(sites, "site", kernel, (1, 1, 1), tile, torch.empty(8), tile, 16, BLOCK=64, HAS_SINK=True)
    with launch.checking_sites(), pytest.raises(AssertionError, match="reused a record of other arguments"):
        # 16 instead of 7: another key (unchecked above, the site's record launched it)
        launch.launch_at(sites, "site", kernel, (1, 1, 1), tile, torch.empty(8), tile, 16, BLOCK=64, HAS_SINK=True)
    launch.launch_at(sites, "site", kernel, (1, 1, 1), tile, torch.empty(8), tile, 16, BLOCK=64, HAS_SINK=True)


# ----------------------------------------------------------------------------------------------------------
# CUDA: the same outputs, bit for bit, through direct launches as through kernel[grid]
# ----------------------------------------------------------------------------------------------------------
def _kernels_package():
    from hf_gptoss_rl.attention import import_kernel_sources

    kernel = import_kernel_sources()
    return (
        kernel,
        importlib.import_module(f"{kernel.__name__}.triton_kernels"),
        importlib.import_module(f"{kernel.__name__}._launch"),
    )


def _package_for_triton(version):
    """A private copy of the kernel package as it would be with Triton ``version`` installed (``_launch`` reads
    ``triton.__version__`` once, at import), and its ``_launch``."""
    name = f"_sink_flash_attn3_triton_{version.replace('.', '_')}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, PACKAGE_DIR / "__init__.py", submodule_search_locations=[str(PACKAGE_DIR)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(triton, "__version__", version)
            spec.loader.exec_module(package)
            importlib.import_module(f"{name}._launch")
    return sys.modules[name], sys.modules[f"{name}._launch"]


CUDA_CASES = [
    (torch.bfloat16, 1000, 128, "auto", True),  # Triton forward (TMA tiles), Gluon dK/dV + dQ
    (torch.bfloat16, 2500, None, "auto", False),  # fused backward (sm_90)
    (torch.bfloat16, 8192, None, "auto", True),  # Gluon forward (sm_90, from 2k queries)
    (torch.bfloat16, 1000, None, "triton", True),  # Triton kernels only, TMA tiles
    (torch.float32, 700, 128, "triton", True),  # fp32: pointer loads in the backward
]


def _cuda_step(kernel, dtype, S, window, backend, deterministic, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(1, S, h, 64, device="cuda", generator=g).to(dtype) for h in (64, 8, 8, 64))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = torch.randn(64, device="cuda", generator=g).requires_grad_()
    window_size = (-1, -1) if window is None else (window - 1, 0)

    def step():
        out = kernel.flash_attn_func(
            q, k, v, causal=True, window_size=window_size, s_aux=sinks, deterministic=deterministic, backend=backend
        )
        return (out.detach(), *torch.autograd.grad(out, (q, k, v, sinks), dout))

    return step


def _assert_same(deterministic, what, pairs):
    for name, a, b in pairs:
        if deterministic or name in ("out", "dk", "dv"):
            assert torch.equal(a, b), f"{name} differs between {what}"
        else:  # the fused backward adds dQ and dsink with atomics: equal up to their summation order
            assert (a.float() - b.float()).norm() <= 1e-3 * a.float().norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, S, window, backend, deterministic", CUDA_CASES)
def test_cuda_direct_launches_match_standard_launches(monkeypatch, dtype, S, window, backend, deterministic):
    kernel, tk, launch = _kernels_package()
    assert launch.DIRECT_LAYOUT is not None, f"triton {triton.__version__}: no direct launches to check"
    launch._RECORDS.clear()
    direct_calls = []
    call = launch._Direct.__call__
    monkeypatch.setattr(launch._Direct, "__call__", lambda self, *a: direct_calls.append(1) or call(self, *a))
    step = _cuda_step(kernel, dtype, S, window, backend, deterministic, seed=S)
    with launch.checking_sites():  # every reused launch site must match the full key's record
        standard = step()
        assert not direct_calls and launch._RECORDS, "the first call of each kernel must go through kernel[grid]"
        assert all(launch._RECORDS.values()), f"a kernel kept Triton's launcher on triton {triton.__version__}"
        direct = step()
        assert len(direct_calls) == len(launch._RECORDS), "the second call must launch every kernel directly"
        again = step()  # the cached call: its launch sites and the records' tensor maps
        assert len(direct_calls) == 2 * len(launch._RECORDS)
    names = ("out", "dq", "dk", "dv", "dsink")
    _assert_same(
        deterministic, "direct and standard launches", [*zip(names, standard, direct), ("out", *again[:1], direct[0])]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, S, window, backend, deterministic", CUDA_CASES)
def test_cuda_fallback_of_an_unlisted_triton_matches_direct_launches(dtype, S, window, backend, deterministic):
    # The package as it is with a Triton release its direct launches were not written for: every launch through
    # kernel[grid](...), none recorded, and the same results as the direct launches of this Triton's package
    kernel, _, launch = _kernels_package()
    fallback, fallback_launch = _package_for_triton("3.8.0")
    assert launch.DIRECT_LAYOUT is not None and fallback_launch.DIRECT_LAYOUT is None
    results = {}
    for name, package in (("direct", kernel), ("fallback", fallback)):
        step = _cuda_step(package, dtype, S, window, backend, deterministic, seed=S + 7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (the fallback's one warning)
            step()
            results[name] = step()  # (the direct package's second call launches directly)
    assert fallback_launch._RECORDS == {} and all(launch._RECORDS.values())
    names = ("out", "dq", "dk", "dv", "dsink")
    _assert_same(deterministic, "the fallback and direct launches", zip(names, results["fallback"], results["direct"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "dtype, S, window, backend, deterministic", [*CUDA_CASES, (torch.bfloat16, 1000, None, "auto", True)]
)
def test_cuda_heads_first_inputs_get_heads_first_gradients(dtype, S, window, backend, deterministic):
    # transformers' layout ([b, s, h, d] views of heads-first states): every kernel writes the gradients in place in
    # that layout (the last case splits the dK/dV grid over the query heads); values as for contiguous inputs
    kernel, _, _ = _kernels_package()
    g = torch.Generator(device="cuda").manual_seed(S + 1)
    states = [torch.randn(1, h, S, 64, device="cuda", generator=g).to(dtype) for h in (64, 8, 8)]
    sinks = torch.randn(64, device="cuda", generator=g).requires_grad_()
    dout = torch.randn(1, S, 64, 64, device="cuda", generator=g).to(dtype)
    window_size = (-1, -1) if window is None else (window - 1, 0)
    results = []
    for heads_first in (True, False):
        leaves = [t.clone().requires_grad_() for t in states]
        q, k, v = (t.transpose(1, 2) if heads_first else t.transpose(1, 2).contiguous() for t in leaves)
        out = kernel.flash_attn_func(
            q, k, v, causal=True, window_size=window_size, s_aux=sinks, deterministic=deterministic, backend=backend
        )
        grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
        if heads_first:
            assert all(gr.stride() == t.stride() for gr, t in zip(grads[:3], (q, k, v)))
        results.append((out, *grads))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), *results):
        if deterministic or name in ("out", "dk", "dv"):
            assert torch.equal(a, b), f"{name} differs between heads-first and contiguous inputs"
        else:  # the fused backward adds dQ and dsink with atomics: equal up to their summation order
            assert (a.float() - b.float()).norm() <= 1e-3 * a.float().norm()
