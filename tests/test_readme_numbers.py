"""The README's benchmark table is rendered from `docs/benchmarks/*.json` by `scripts/render_readme.py`: it must
match the JSON files exactly, so a number can only change by re-running a benchmark (CPU, stdlib only)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "render_readme.py"


def _render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_readme_table_matches_the_benchmark_json():
    proc = _render("--check")
    assert proc.returncode == 0, proc.stderr + "\nRun `python scripts/render_readme.py` and commit README.md."


def test_check_fails_when_a_json_number_changes(tmp_path):
    """Editing a measurement (here the MoE layer's train time) makes the committed README stale."""
    bench = tmp_path / "benchmarks"
    shutil.copytree(REPO / "docs" / "benchmarks", bench, ignore=shutil.ignore_patterns("*.png", "*.md"))
    moe = json.loads((bench / "moe.json").read_text())
    moe["results"]["32768"]["memory_efficient"]["train_ms"] = 45.04
    (bench / "moe.json").write_text(json.dumps(moe))
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    assert _render("--check", "--readme", str(readme), "--benchmarks", str(bench)).returncode == 1
    assert _render("--readme", str(readme), "--benchmarks", str(bench)).returncode == 0
    assert "| 45.0 ms, " in readme.read_text()
    assert _render("--check", "--readme", str(readme), "--benchmarks", str(bench)).returncode == 0


def test_missing_markers_are_an_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    proc = _render("--check", "--readme", str(readme))
    assert proc.returncode != 0 and "markers" in proc.stderr
