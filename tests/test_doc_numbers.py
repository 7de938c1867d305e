"""One source per number: every measurement that README.md and docs/*.md quote is rendered from
`docs/benchmarks/*.json` by `scripts/render_docs.py` (CPU, stdlib only).

- The pages match their rendering: a hand-edited number inside a generated region fails, and so does a JSON changed
  without re-rendering.
- Outside the generated regions, a number that looks measured (a time, a size, a rate, a ratio, a percentage, a
  fraction, a decimal, scientific notation, a count with thousands separators) must be listed in `ALLOWED` below,
  with why it is not a measurement: a setting or default, a version, arithmetic from the configuration, a test's
  bound, a goal, a citation. Plain integers (layer counts, steps, ports) are not checked.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "render_docs.py"
sys.path.insert(0, str(REPO / "scripts"))
import render_docs  # noqa: E402

# ------------------------------------------------------------------------------------------- measured-looking tokens

_UNITS = (
    r"(?:ms|µs|us|s|min|minutes?|seconds?|hours?|h|KB|KiB|MB|MiB|GB|GiB|TB|tokens/s|TFLOP/s|GB/s|TB/s|TFLOP|GFLOP"
    r"|PFLOP|%|x|×|nats?|bytes)"
)
_NUM = r"(?<![\w.+-])[~≈]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?"
TOKEN = re.compile(
    rf"{_NUM}\s?{_UNITS}(?![\w/])"  # 3 min, 55 s, 100.9 GiB, 0.48x, 4 %
    r"|(?<![\w.])\d+(?:\.\d+)?e[+-]?\d+(?![\w.])"  # 1e-8
    r"|(?<![\w./])\d+/\d+(?![\w./-])"  # 2/4 (not 4/8-bit)
    r"|(?<![\w.])\d+\.\d+(?![\w.]|\.\d)"  # 0.961 (not 0.5.17)
    r"|(?<![\w.])\d{1,3}(?:,\d{3})+(?![\w.])"  # 20,337
)
# "torch 2.11", "Linux ≥ 5.13": a decimal right after a package name or a comparison is a version
_VERSION_BEFORE = re.compile(
    r"(?i)(transformers|torch|trl|triton|python|linux|kernels|sglang|peft|cuda|accelerate|deepspeed|version|v|≥|>=|<=|<)"
    r"\s*$"
)


def measured_looking(text: str) -> list[tuple[int, str]]:
    """(line, token) of each measured-looking number outside generated regions, HTML comments, inline code and link
    targets. Fenced code blocks are read too: a sample output or a comment in a command can quote a measurement."""
    text = render_docs.REGION.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            line = re.sub(r"`[^`]*`", "", line)
        line = re.sub(r"\]\([^)]*\)|https?://\S+", "]", line)
        for m in TOKEN.finditer(line):
            if re.fullmatch(r"\d+\.\d+", m.group()) and _VERSION_BEFORE.search(line[: m.start()]):
                continue
            found.append((number, m.group()))
    return found


SETTING = "a setting or default"
ARITHMETIC = "arithmetic from the configuration or the model's size"
BOUND = "a bound a test or check asserts, or a guideline"
CITED = "a cited fact (paper, model card, dataset)"
GOAL = "a goal, not a result"

# Per page: each number-looking token that is not a measurement, and why. A token listed here is allowed anywhere on
# its page; `test_every_allowed_token_is_used` keeps the list from outliving the text.
ALLOWED: dict[str, dict[str, str]] = {
    "docs/experts.md": {
        "1.702": SETTING, "7.0": SETTING, "0.25 GiB": ARITHMETIC, "1 GiB": ARITHMETIC, "1.5 GB": ARITHMETIC,
    },
    "docs/quickstart.md": {
        "201,088": ARITHMETIC, "0.05 nats": SETTING, "0.8": SETTING, "30 s": SETTING, "600 s": SETTING,
        "1e-6": SETTING, "42 GB": ARITHMETIC,
    },
    "docs/results.md": {
        "1e-3": SETTING, "7,473": CITED, "1,319": CITED, "201,088": ARITHMETIC, "0.1": SETTING, "3e-3": SETTING,
        "0.015": SETTING, "1e-4": SETTING, "0.2": SETTING, "0.8": SETTING, "0.9": SETTING, "20.9": ARITHMETIC,
        "39 GiB": ARITHMETIC,
        "4,096": SETTING, "32,768": SETTING, "140 GiB": SETTING, "0.40": GOAL, "50 %": GOAL, "1.24 MB": ARITHMETIC,
        "0.4": SETTING, "0.05": SETTING, "0.01": SETTING,
    },
    "docs/rollouts.md": {
        "1.0": SETTING, "0.0": SETTING, "2e-5": BOUND, "0.8": SETTING, "201,088": ARITHMETIC, "7.0": SETTING,
        "120 s": SETTING, "4,096": SETTING, "1e-6": SETTING, "16 MB": ARITHMETIC, "42 GB": ARITHMETIC,
    },
    "docs/sequence_parallel.md": {
        "2e-5": BOUND, "1.0": SETTING, "2 x": SETTING, "39 GiB": ARITHMETIC, "138 KB": ARITHMETIC,
        "2.1 GiB": ARITHMETIC, "200 KB": ARITHMETIC, "0.4 GB": ARITHMETIC, "~2 MB": ARITHMETIC, "8 KiB": ARITHMETIC,
        "1 KiB": ARITHMETIC, "18 KiB": ARITHMETIC, "7/8": ARITHMETIC, "19 GB": ARITHMETIC, "1/2": ARITHMETIC,
        "22 GB": ARITHMETIC, "~22 GFLOP": ARITHMETIC, "3.6": CITED, "~4.5×": ARITHMETIC, "~1 PFLOP": ARITHMETIC,
    },
    "docs/tools.md": {
        "5 s": SETTING, "0.5": SETTING, "128 MiB": SETTING, "64 MiB": SETTING, "2 s": SETTING, "0.5 s": SETTING,
        "10 ms": SETTING, "64 KiB": SETTING, "600 s": SETTING, "30 s": SETTING, "16 ×": ARITHMETIC,
        "19 GiB": ARITHMETIC, "1e3": ARITHMETIC, "1.0": SETTING,
    },
    "docs/trainer.md": {
        "1e-2": BOUND, "1.0": BOUND, "10 %": CITED, "1e-4": BOUND, "0.05": SETTING, "3e-4": SETTING, "0.1": SETTING,
        "0.26": ARITHMETIC, "1.6": ARITHMETIC, "0.49": ARITHMETIC, "~1.24 MB": ARITHMETIC, "76 GiB": ARITHMETIC,
        "140 GiB": SETTING, "~0.39 MB": ARITHMETIC, "80 GiB": SETTING, "1e-8": ARITHMETIC, "1e-5": BOUND,
        "2e-5": BOUND, "201,088": ARITHMETIC, "1e-6": BOUND,
    },
}  # fmt: skip


def _pages(root: Path = REPO) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in render_docs.doc_files(root)}


def unlisted(pages: dict[str, str]) -> list[str]:
    return [
        f"{name}:{line}: {token!r}"
        for name, text in pages.items()
        for line, token in measured_looking(text)
        if token not in ALLOWED.get(name, {})
    ]


# ------------------------------------------------------------------------------------------------------------- tests


def _render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _copy_docs(tmp_path: Path) -> Path:
    """README.md, docs/*.md and the JSON files in a scratch checkout."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    shutil.copy(REPO / "README.md", root / "README.md")
    for page in (REPO / "docs").glob("*.md"):
        shutil.copy(page, root / "docs" / page.name)
    shutil.copytree(REPO / "docs" / "benchmarks", root / "docs" / "benchmarks", ignore=shutil.ignore_patterns("*.png"))
    return root


def test_pages_match_the_benchmark_json():
    proc = _render("--check")
    assert proc.returncode == 0, proc.stderr + "\nRun `python scripts/render_docs.py` and commit the pages."


def test_no_measured_number_outside_generated_regions():
    found = unlisted(_pages())
    assert not found, (
        "numbers that look measured stand outside a generated region (render them from docs/benchmarks/*.json with "
        "scripts/render_docs.py, or list them in ALLOWED with the reason they are not measurements):\n  "
        + "\n  ".join(found)
    )


def test_every_allowed_token_is_used():
    pages = _pages()
    stale = [
        f"{name}: {token!r}"
        for name, tokens in ALLOWED.items()
        for token in tokens
        if token not in {t for _, t in measured_looking(pages.get(name, ""))}
    ]
    assert not stale, f"ALLOWED lists tokens its pages no longer have: {stale}"


def test_a_number_typed_into_prose_fails():
    """The ragged-batch result written by hand where a reader expects it: caught, with page and line."""
    pages = _pages()
    pages["docs/results.md"] = pages["docs/results.md"].replace(
        "**Results.** In the committed runs", "**Results.** A 3.71x speed-up on the ragged batch. In the committed runs"
    )
    assert any(f.startswith("docs/results.md:") and "'3.71x'" in f for f in unlisted(pages)), unlisted(pages)


def test_a_hand_edited_number_in_a_generated_region_fails(tmp_path):
    """Editing a rendered number (the quickstart's wall time) makes the check fail, naming the region."""
    root = _copy_docs(tmp_path)
    page = root / "docs" / "quickstart.md"
    text = page.read_text()
    edited = re.sub(r"\*\*\d+ min \d+ s\*\*", "**2 min 20 s**", text, count=1)
    assert edited != text
    page.write_text(edited)
    proc = _render("--check", "--root", str(root))
    assert proc.returncode == 1 and "docs/quickstart.md: quickstart.timing" in proc.stderr, proc.stderr
    assert _render("--root", str(root)).returncode == 0  # rendering restores it
    assert page.read_text() == text


def test_check_fails_when_a_json_number_changes(tmp_path):
    """Editing a measurement (the MoE layer's train time) makes the committed pages stale until re-rendered."""
    root = _copy_docs(tmp_path)
    moe_path = root / "docs" / "benchmarks" / "moe.json"
    moe = json.loads(moe_path.read_text())
    moe["results"]["32768"]["memory_efficient"]["train_ms"] = 45.04
    moe_path.write_text(json.dumps(moe))
    proc = _render("--check", "--root", str(root))
    assert proc.returncode == 1 and "README.md: readme.table" in proc.stderr, proc.stderr
    assert _render("--root", str(root)).returncode == 0
    assert "| 45.0 ms, " in (root / "README.md").read_text()
    assert _render("--check", "--root", str(root)).returncode == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a <!-- generated:no.such -->1<!-- /generated --> b\n", "no renderer named 'no.such'"),
        ("a <!-- generated:quickstart.accuracy -->1/2\n", "is not closed"),
        ("a 1 <!-- /generated -->\n", "without an opening"),
        ("<!-- generated:quickstart.accuracy -->1/2<!-- /generated --> starts the line\n", "must be a block"),
    ],
)
def test_bad_markers_are_errors_naming_the_place(tmp_path, text, message):
    root = _copy_docs(tmp_path)
    (root / "docs" / "broken.md").write_text(text)
    proc = _render("--check", "--root", str(root))
    assert proc.returncode == 2 and "docs/broken.md" in proc.stderr and message in proc.stderr, proc.stderr


def test_a_missing_json_is_an_error_naming_it(tmp_path):
    root = _copy_docs(tmp_path)
    (root / "docs" / "benchmarks" / "quickstart.json").unlink()
    proc = _render("--check", "--root", str(root))
    assert proc.returncode == 2 and "quickstart.json is missing" in proc.stderr, proc.stderr
