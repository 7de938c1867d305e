"""Registration has one home: `hf_gptoss_rl.register()`, called once by the package's `__init__`.

Importing a submodule (`hf_gptoss_rl.attention`, `.experts`, `.sequence_parallel`, ...) must leave transformers
untouched, as transformers' own `integrations/` modules do; `register()` adds exactly the project's names, and a
second call changes nothing. Each check runs in a fresh interpreter, where nothing was registered yet.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hf_gptoss_rl"

# What the checks snapshot: transformers' registries (name -> object) and the module attributes a registration may
# replace (the GPT-OSS model class, the hub-kernel loader, the experts and mask modules).
_SNAPSHOT = r"""
import importlib, importlib.util, json, pkgutil, sys, types

from transformers import AttentionInterface
from transformers.integrations import hub_kernels, moe
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss

def snapshot():
    state = {}
    for name, registry in (("attention", AttentionInterface._global_mapping),
                           ("mask", ALL_MASK_ATTENTION_FUNCTIONS._global_mapping),
                           ("experts", moe.ALL_EXPERTS_FUNCTIONS._global_mapping)):
        for key, value in registry.items():
            state[f"{name}:{key}"] = id(value)
    for module in (hub_kernels, moe, modeling_gpt_oss):
        for key, value in vars(module).items():
            state[f"{module.__name__}.{key}"] = id(value)
    for key, value in vars(modeling_gpt_oss.GptOssPreTrainedModel).items():
        state[f"GptOssPreTrainedModel.{key}"] = id(value)
    state["compatible"] = repr(modeling_gpt_oss.GptOssPreTrainedModel._compatible_flash_implementations)
    return state

def changed(before, after):
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
"""

# The package as a namespace without its __init__: `import hf_gptoss_rl.<sub>` then runs the submodule alone.
_SUBMODULES_ALONE = (
    _SNAPSHOT
    + r"""
package = types.ModuleType("hf_gptoss_rl")
package.__path__ = [PACKAGE_DIR]
sys.modules["hf_gptoss_rl"] = package
before = snapshot()
names = sorted(m.name for m in pkgutil.iter_modules([PACKAGE_DIR]))
report = {"imported": [], "changed": {}}
for name in names:
    start = snapshot()
    importlib.import_module(f"hf_gptoss_rl.{name}")
    report["imported"].append(name)
    diff = changed(start, snapshot())
    if diff:
        report["changed"][name] = diff

# now the real package: its __init__ runs register() once
spec = importlib.util.spec_from_file_location(
    "hf_gptoss_rl", PACKAGE_DIR + "/__init__.py", submodule_search_locations=[PACKAGE_DIR]
)
real = importlib.util.module_from_spec(spec)
sys.modules["hf_gptoss_rl"] = real
spec.loader.exec_module(real)
after_import = snapshot()
report["registered_by_import"] = changed(before, after_import)
report["returned"] = real.register()
report["changed_by_second_call"] = changed(after_import, snapshot())
print(json.dumps(report))
"""
)


def _run(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code.replace("PACKAGE_DIR", repr(str(PACKAGE)))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_submodules_register_nothing_and_register_adds_exactly_the_project_names():
    report = _run(_SUBMODULES_ALONE)
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert set(report["imported"]) == modules  # every submodule was imported on its own
    assert report["changed"] == {}, f"importing these submodules changed transformers: {report['changed']}"

    registered = set(report["registered_by_import"])
    kernel_id = "hf-gptoss-rl/sink-flash-attn3"
    assert {
        f"attention:{kernel_id}",
        f"mask:{kernel_id}",
        "attention:ulysses_sp",
        "mask:ulysses_sp",
        "experts:memory_efficient",
        "compatible",
        "GptOssPreTrainedModel._compatible_flash_implementations",
        "GptOssPreTrainedModel._check_and_adjust_attn_implementation",
        "transformers.integrations.hub_kernels.load_and_register_attn_kernel",
    } == registered
    assert report["returned"] == {
        "attn_implementation": [kernel_id, "ulysses_sp"],
        "experts_implementation": ["memory_efficient"],
    }
    # idempotent: a second register() replaces no registered object and wraps nothing twice
    assert report["changed_by_second_call"] == []


def test_no_submodule_calls_a_registry_at_import():
    """The same rule, read from the source: no module-level statement of a submodule registers or calls
    `register()` (a registration inside a function, run on demand, is fine)."""
    import ast

    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
                continue
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target = ast.unparse(func)
            if name == "register" and not target.startswith("torch.library"):
                offenders.append(f"{path.name}:{node.lineno}: {target}()")
    assert not offenders, offenders
