"""The generated build tree (layout, metadata, loaders old and new) and the publishing plan, offline."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernels_ci

KERNEL_DIR = Path(__file__).resolve().parents[1]
REPO_ID = "hf-gptoss-rl/sink-flash-attn3"


def load_build_noarch():
    return load_script("build_noarch")


def load_publish():
    return load_script("publish")


def load_script(stem: str):
    """``kernels_hub/<stem>.py`` (a script, not a package) imported by path."""
    name = f"_sink_flash_attn3_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, KERNEL_DIR.parent / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_build_tree_layout_and_metadata(built_kernel_repo):
    build = built_kernel_repo / "build"
    assert sorted(p.name for p in build.iterdir()) == ["torch-cpu", "torch-cuda"]
    sources = sorted(p.name for p in (KERNEL_DIR / "torch-ext" / "sink_flash_attn3").glob("*.py"))
    ids = set()
    for backend in ("cpu", "cuda"):
        variant = build / f"torch-{backend}"
        assert sorted(p.name for p in variant.glob("*.py")) == sources  # one source of truth, copied verbatim
        for name in sources:
            assert (variant / name).read_bytes() == (KERNEL_DIR / "torch-ext" / "sink_flash_attn3" / name).read_bytes()
        meta = json.loads((variant / "metadata.json").read_text())
        assert meta["name"] == "sink-flash-attn3" and meta["version"] == 1 and meta["license"] == "Apache-2.0"
        assert meta["backend"] == {"type": backend} and meta["python-depends"] == []
        assert meta["id"].startswith("_sink_flash_attn3_")
        ids.add(meta["id"])
        assert (variant / "sink_flash_attn3" / "__init__.py").is_file()
    assert len(ids) == 1


def test_metadata_parses_with_kernels(built_kernel_repo):
    kernels = pytest.importorskip("kernels")
    meta = kernels.Metadata.read_from_file(built_kernel_repo / "build" / "torch-cpu" / "metadata.json")
    assert meta.name.python_name == "sink_flash_attn3"


def test_get_local_kernel_and_get_kernel_with_local_kernels(kernel, hub_kernel):
    for module in (kernel, hub_kernel):
        assert callable(module.flash_attn_func) and callable(module.flash_attn_varlen_func)
        assert module.__name__.startswith("_sink_flash_attn3_")  # imported under the hashed id by `kernels`


def test_old_client_shim_imports_the_variant(built_kernel_repo):
    """Older `kernels` clients import build/<variant>/<python_name>/__init__.py."""
    shim = built_kernel_repo / "build" / "torch-cpu" / "sink_flash_attn3" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_old_client_sink_flash_attn3", shim)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.flash_attn_varlen_func)


def test_build_replaces_a_stale_tree(tmp_path):
    out = tmp_path / "build"
    (out / "torch-universal").mkdir(parents=True)
    load_build_noarch().build(KERNEL_DIR, out)
    assert sorted(p.name for p in out.iterdir()) == ["torch-cpu", "torch-cuda"]
    assert not list(tmp_path.glob(".build-*")) and not list(tmp_path.glob(".old-build-*"))


@pytest.fixture
def kernel_copy(tmp_path) -> Path:
    """A copy of the kernel source repo (so planning the publication never writes into the checkout)."""
    repo = tmp_path / "sink-flash-attn3"
    shutil.copytree(KERNEL_DIR, repo, ignore=shutil.ignore_patterns("build", "__pycache__", "tests"))
    return repo


def test_publish_dry_run_plan(kernel_copy, capsys):
    publish = load_publish()
    plan = publish.main([str(kernel_copy), "--dry-run"])
    assert plan.repo_id == REPO_ID and plan.revision == "v1"
    assert [method for method, _ in plan.operations] == ["create_repo", "create_branch", "upload_folder"]
    create_repo, create_branch, upload = (kwargs for _, kwargs in plan.operations)
    assert create_repo["repo_type"] == create_branch["repo_type"] == upload["repo_type"] == "kernel"
    assert create_branch["branch"] == upload["revision"] == "v1"
    assert upload["folder_path"] == str(kernel_copy.resolve())
    assert "README.md" in plan.files and "build.toml" in plan.files
    for backend in ("cpu", "cuda"):
        assert f"build/torch-{backend}/metadata.json" in plan.files
        assert f"build/torch-{backend}/__init__.py" in plan.files
    assert not any("tests/" in f or "__pycache__" in f or f.endswith(".pyc") for f in plan.files)
    printed = capsys.readouterr().out
    assert "upload_folder(" in printed and "build/torch-cuda/metadata.json" in printed


def test_publish_executes_the_planned_operations_in_order(kernel_copy):
    """execute() calls exactly the planned HfApi methods (a recording stand-in for HfApi: no network)."""
    publish = load_publish()
    plan = publish.plan_publish(kernel_copy, repo_id="someone/sink-flash-attn3", revision="v1")
    calls = []

    class RecordingApi:
        def __getattr__(self, method):
            return lambda **kwargs: calls.append((method, kwargs))

    publish.execute(plan, api=RecordingApi())
    assert calls == plan.operations
    assert all(kwargs["repo_id"] == "someone/sink-flash-attn3" for _, kwargs in calls)


def test_model_card_front_matter():
    from huggingface_hub.repocard import RepoCard

    card = RepoCard.load(KERNEL_DIR / "README.md")
    assert card.data.library_name == "kernels" and card.data.license == "apache-2.0"
    assert "kernels" in card.data.tags
    assert 'attn_implementation="hf-gptoss-rl/sink-flash-attn3"' in card.text
    assert "get_kernel(" in card.text


def test_python_310_reads_build_toml_with_the_declared_tomli(monkeypatch):
    """Without `tomllib` (Python 3.10) build_noarch.py reads build.toml with `tomli`, which the project declares
    for exactly those Pythons."""
    from packaging.requirements import Requirement

    toml = load_build_noarch().tomllib  # tomllib, or tomli on Python 3.10
    with open(KERNEL_DIR.parents[1] / "pyproject.toml", "rb") as f:
        deps = [Requirement(d) for d in toml.load(f)["project"]["dependencies"]]
    (tomli,) = [r for r in deps if r.name == "tomli"]
    assert tomli.marker.evaluate({"python_version": "3.10"}) and not tomli.marker.evaluate({"python_version": "3.11"})

    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "tomli", toml)  # stands in for the tomli package (same API)
    spec = importlib.util.spec_from_file_location("_build_noarch_py310", KERNEL_DIR.parent / "build_noarch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.tomllib is toml
    assert module.read_build_toml(KERNEL_DIR)["repo_id"] == REPO_ID
