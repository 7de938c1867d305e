#!/usr/bin/env python
"""Publish a noarch kernel to the Hugging Face Hub as a ``kernel`` repo, at branch ``v1``.

    python kernels_hub/publish.py kernels_hub/sink-flash-attn3 --dry-run   # print the plan, no network
    python kernels_hub/publish.py kernels_hub/sink-flash-attn3             # build, then upload (needs a token)

Steps: regenerate ``build/`` from ``torch-ext/`` (``build_noarch.py``), then with ``huggingface_hub``:
``create_repo(repo_type="kernel", exist_ok=True)``, ``create_branch(branch="v1", exist_ok=True)`` and
``upload_folder(repo_type="kernel", revision="v1")`` of the build tree, the sources, ``build.toml`` and the
README (the model card). ``kernels.get_kernel(repo_id, version=1)`` resolves the ``v1`` branch. The repo id and
the version come from ``build.toml`` (``[general.hub] repo-id``, ``[general] version``). ``--dry-run`` prints the
exact operations and the file list and touches nothing but the local build.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

KERNELS_HUB = Path(__file__).resolve().parent
# What a kernel repo on the Hub holds: the loadable build, its sources and the model card.
ALLOW_PATTERNS = ["build/**", "torch-ext/**", "build.toml", "README.md", "LICENSE"]
IGNORE_PATTERNS = ["**/__pycache__/**", "*.pyc", "**/.build-*/**"]


def _build_noarch():
    name = "_kernels_hub_build_noarch"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, KERNELS_HUB / "build_noarch.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass
class PublishPlan:
    """The Hub operations, in order, as ``(HfApi method name, keyword arguments)``, and the files uploaded."""

    repo_id: str
    revision: str
    operations: list[tuple[str, dict]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"publish to https://huggingface.co/kernels/{self.repo_id} (revision {self.revision})"]
        for method, kwargs in self.operations:
            args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            lines.append(f"  HfApi().{method}({args})")
        lines.append(f"  {len(self.files)} files:")
        lines.extend(f"    {path}" for path in self.files)
        return "\n".join(lines)


def plan_publish(
    kernel_dir: str | Path,
    repo_id: str | None = None,
    revision: str | None = None,
    private: bool = False,
    build: bool = True,
) -> PublishPlan:
    """Builds ``<kernel_dir>/build`` (unless ``build=False``) and returns the publishing plan (no network)."""
    from huggingface_hub.utils import filter_repo_objects

    kernel_dir = Path(kernel_dir).resolve()
    builder = _build_noarch()
    general = builder.read_build_toml(kernel_dir)
    repo_id = repo_id or general["repo_id"]
    if not repo_id:
        raise ValueError("no repo id: pass --repo-id or set [general.hub] repo-id in build.toml")
    revision = revision or f"v{general.get('version', 1)}"
    if build:
        builder.build(kernel_dir)
    if not (kernel_dir / "build").is_dir():
        raise FileNotFoundError(f"{kernel_dir}/build does not exist: build first (drop --no-build)")
    relpaths = sorted(p.relative_to(kernel_dir).as_posix() for p in kernel_dir.glob("**/*") if p.is_file())
    files = list(filter_repo_objects(relpaths, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    operations = [
        ("create_repo", dict(repo_id=repo_id, repo_type="kernel", private=private, exist_ok=True)),
        ("create_branch", dict(repo_id=repo_id, repo_type="kernel", branch=revision, exist_ok=True)),
        (
            "upload_folder",
            dict(
                repo_id=repo_id,
                repo_type="kernel",
                revision=revision,
                folder_path=str(kernel_dir),
                allow_patterns=ALLOW_PATTERNS,
                ignore_patterns=IGNORE_PATTERNS,
                commit_message=f"Upload {general['name']} (noarch build: {', '.join(general['backends'])})",
            ),
        ),
    ]
    return PublishPlan(repo_id=repo_id, revision=revision, operations=operations, files=files)


def execute(plan: PublishPlan, api=None):
    """Runs the plan's operations with ``huggingface_hub.HfApi`` (token from the usual HF login/env)."""
    from huggingface_hub import HfApi

    api = api or HfApi()
    result = None
    for method, kwargs in plan.operations:
        result = getattr(api, method)(**kwargs)
    return result


def main(argv: list[str] | None = None) -> PublishPlan:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel_dir", nargs="?", default=KERNELS_HUB / "sink-flash-attn3")
    parser.add_argument("--repo-id", default=None, help="Hub repo id (default: build.toml [general.hub] repo-id)")
    parser.add_argument("--revision", default=None, help="branch to upload to (default: v<version> = v1)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--no-build", action="store_true", help="upload the existing build/ as is")
    parser.add_argument("--dry-run", action="store_true", help="print the operations and files; no network")
    args = parser.parse_args(argv)
    plan = plan_publish(args.kernel_dir, args.repo_id, args.revision, args.private, build=not args.no_build)
    print(plan.describe())
    if not args.dry_run:
        info = execute(plan)
        print(f"uploaded: {getattr(info, 'commit_url', info)}")
    return plan


if __name__ == "__main__":
    main()
