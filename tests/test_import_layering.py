"""The packages import each other in one direction only, as `docs/architecture.md` ("Packages") says.

The rules live in that page: one paragraph per package ending in "May import: ...". This test reads them, then
parses every module of the package (`ast`, relative imports resolved, imports inside functions included) and fails
on an import of one of this project's packages that the rule does not allow.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PROJECT = ("hf_gptoss_rl", "trl_ext", "benchmarks", "kernels_hub", "tests", "examples", "scripts")

# package (as the page names it) -> the files it covers; the most specific package wins for a file
SCOPES = {
    "hf_gptoss_rl": ["hf_gptoss_rl"],
    "trl_ext": ["trl_ext"],
    "trl_ext/rollout": ["trl_ext/rollout"],
    "trl_ext/weight_sync": ["trl_ext/weight_sync"],
    "trl_ext/tools": ["trl_ext/tools"],
    # the kernel's Hub sources and its build / publish scripts (its own tests load it through hf_gptoss_rl on purpose)
    "kernels_hub/sink-flash-attn3": ["kernels_hub/sink-flash-attn3/torch-ext", "kernels_hub/build_noarch.py",
                                     "kernels_hub/publish.py"],
    "benchmarks": ["benchmarks"],
}  # fmt: skip


def documented_rules(text: str) -> dict[str, set[str]]:
    """{package: the module prefixes it may import} from the page's "**`package`** ... May import: ..." paragraphs."""
    rules = {}
    pattern = r"^\*\*`(?P<pkg>[^`]+)`\*\*(?P<body>.*?)May import: (?P<allowed>.*?)(?:\n\n|\Z)"
    for m in re.finditer(pattern, text, re.S | re.M):
        allowed = set(re.findall(r"`([\w.]+)`", m["allowed"]))
        if not allowed and not m["allowed"].startswith("none"):
            raise ValueError(
                f"docs/architecture.md: the 'May import:' line of {m['pkg']} names nothing: {m['allowed']}"
            )
        rules[m["pkg"]] = allowed
    return rules


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative imports resolved against its package."""
    name, is_package = _module_name(path, root)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
                # `from . import x`: x may be a submodule
                found += [(node.lineno, f"{module}.{a.name}" if not node.module else module) for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _scope_of(rel: str) -> str | None:
    best = None
    for package, prefixes in SCOPES.items():
        for prefix in prefixes:
            if (rel == prefix or rel.startswith(prefix.rstrip("/") + "/")) and (best is None or len(prefix) > best[1]):
                best = (package, len(prefix))
    return best[0] if best else None


def violations(root: Path, rules: dict[str, set[str]]) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel or "/_kernels_hub/" in rel:
            continue
        scope = _scope_of(rel)
        if scope is None:
            continue
        allowed = rules[scope]
        for line, module in imported_modules(path, root):
            if module.split(".")[0] not in PROJECT:
                continue  # the standard library and third-party packages are not layered here
            if _scope_of(module.replace(".", "/")) == scope and scope == "kernels_hub/sink-flash-attn3":
                continue  # the kernel's relative imports of its own modules
            if not any(module == a or module.startswith(a + ".") for a in allowed):
                out.append(f"{rel}:{line}: imports {module} ({scope} may import: {sorted(allowed) or 'none'})")
    return out


def test_every_package_has_its_rule_in_the_architecture_page():
    rules = documented_rules(DOC.read_text())
    assert set(rules) == set(SCOPES), f"docs/architecture.md 'Packages': {sorted(rules)} != {sorted(SCOPES)}"


def test_imports_follow_the_documented_layering():
    found = violations(REPO, documented_rules(DOC.read_text()))
    assert not found, "imports against docs/architecture.md ('Packages'):\n  " + "\n  ".join(found)


def test_a_planted_violation_fails(tmp_path):
    """One bad import per rule kind: the model side reaching for the trainer, a leaf package reaching sideways, the
    kernel reaching for the package that loads it, and a relative import that leaves its package."""
    rules = documented_rules(DOC.read_text())
    planted = {
        "hf_gptoss_rl/experts.py": "def f():\n    from trl_ext import AgenticGRPOTrainer\n",
        "trl_ext/tools/sandbox.py": "from ..rollout import AgentLoop\n",
        "trl_ext/weight_sync/export.py": "import trl_ext.trainer\n",
        "trl_ext/trainer.py": "from benchmarks._cli import ratio\n",
        "kernels_hub/sink-flash-attn3/torch-ext/sink_flash_attn3/__init__.py": "import hf_gptoss_rl.attention\n",
        "hf_gptoss_rl/attention.py": "from . import experts\n",  # allowed: within the package
    }
    for rel, code in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    found = violations(tmp_path, rules)
    assert [f.split(":")[0] for f in found] == sorted(set(planted) - {"hf_gptoss_rl/attention.py"}), found
    assert "imports trl_ext.rollout" in next(f for f in found if f.startswith("trl_ext/tools"))
