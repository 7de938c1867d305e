"""`docs/architecture.md` matches the tree: every module appears in its folder map, every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
# top-level folders whose Python files the folder map must account for
MAPPED = ("hf_gptoss_rl", "trl_ext", "benchmarks", "scripts", "kernels_hub")
# where a backticked token is taken as a repository path
ROOTS = (*MAPPED, "tests", "examples", "docs", "data")


def _paths_named() -> set[str]:
    tokens = re.findall(r"`([^`\s]+)`", DOC.read_text())
    return {t for t in tokens if t.split("/", 1)[0] in ROOTS and "/" in t and not re.search(r"[<>{}*]", t)}


def _modules() -> list[str]:
    found = []
    for top in MAPPED:
        for path in sorted((REPO / top).rglob("*")):
            rel = path.relative_to(REPO)
            if path.suffix not in (".py", ".sh") or "__pycache__" in rel.parts or "_kernels_hub" in rel.parts:
                continue
            if path.name == "__init__.py" and rel.parent.as_posix() != "hf_gptoss_rl":
                continue  # a package's __init__ is covered by its folder's entry
            found.append(rel.as_posix())
    return found


def _covered(module: str, named: set[str]) -> bool:
    parts = module.split("/")
    ancestors = {"/".join(parts[:i]) + "/" for i in range(2, len(parts))}
    if parts[0] in ("benchmarks", "kernels_hub") and len(parts) > 1:
        ancestors.add(parts[0] + "/")  # one entry for the benchmark package / the kernel tree's own folders
    return module in named or bool(ancestors & named)


def test_every_module_is_in_the_folder_map():
    named = _paths_named()
    missing = [m for m in _modules() if not _covered(m, named)]
    assert not missing, f"add these to the folder map of docs/architecture.md: {missing}"


def test_every_path_named_exists():
    missing = sorted(p for p in _paths_named() if not (REPO / p.rstrip("/")).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
