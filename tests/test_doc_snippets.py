"""Every ```python block of README.md and docs/**/*.md runs, on a CPU, offline.

A block that cannot run here (it needs a CUDA GPU, a server, several processes or the Hub) is marked in the markdown
by the line right before its fence:

    <!-- snippet: skip (needs a CUDA GPU) -->

and the reason in the parentheses is required. Each block runs alone, in a fresh Python process started in an empty
folder, with the Hub offline (`HF_HUB_OFFLINE=1`, so a block that would download fails fast instead of waiting), and
may use top-level `await`, as in Jupyter or `python -m asyncio`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"<!--\s*snippet:(?P<body>.*?)-->", re.DOTALL)
SKIP = re.compile(r"^\s*skip\s*\((?P<reason>[^()]*\S[^()]*)\)\s*$")
PYTHON_INFOS = {"python", "py", "python3"}
TIMEOUT_S = 240

# runs one snippet; top-level `await` is allowed, as in Jupyter and `python -m asyncio`
RUNNER = """
import ast, asyncio, inspect, sys
source = open(sys.argv[1]).read()
code = compile(source, sys.argv[2], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
namespace = {"__name__": "__main__"}
result = eval(code, namespace)
if inspect.iscoroutine(result):
    asyncio.run(result)
"""


@dataclass
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    marker: str | None  # the body of the `<!-- snippet: ... -->` comment right before the fence, if any

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _previous_nonblank(lines: list[str], index: int) -> str | None:
    for j in range(index - 1, -1, -1):
        if lines[j].strip():
            return lines[j]
    return None


def extract_snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of one markdown file (fences of 3+ backticks or tildes, CommonMark-style)."""
    lines = path.read_text().splitlines()
    snippets, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        info = match["info"].strip().split()
        end = i + 1
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        if info and info[0].lower() in PYTHON_INFOS:
            body = [line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1 : end]]
            previous = _previous_nonblank(lines, i)
            marker = MARKER.search(previous) if previous else None
            snippets.append(Snippet(path, i + 1, "\n".join(body) + "\n", marker["body"].strip() if marker else None))
        i = end + 1
    return snippets


SNIPPETS = [snippet for path in MARKDOWN for snippet in extract_snippets(path)]


def _skip_reason(snippet: Snippet) -> str | None:
    if snippet.marker is None:
        return None
    match = SKIP.match(snippet.marker)
    return match["reason"].strip() if match else None


def test_snippets_are_found():
    assert SNIPPETS, "no ```python block in README.md or docs/"
    assert any(_skip_reason(s) is None for s in SNIPPETS), "every snippet is skipped"


def test_every_marker_is_a_skip_with_a_reason():
    """`<!-- snippet: ... -->` comments: only `skip (reason)`, and each sits right before a ```python block."""
    problems = []
    attached = {(s.path, s.line) for s in SNIPPETS if s.marker is not None}
    for path in MARKDOWN:
        text = path.read_text()
        lines = text.splitlines()
        for match in MARKER.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            if not SKIP.match(match["body"]):
                problems.append(f"{path.relative_to(REPO)}:{line}: {match.group(0)!r} is not 'snippet: skip (reason)'")
                continue
            following = next((j for j in range(line, len(lines)) if lines[j].strip()), None)
            if following is None or (path, following + 1) not in attached:
                problems.append(
                    f"{path.relative_to(REPO)}:{line}: the skip marker is not right before a ```python block"
                )
    assert not problems, "\n".join(problems)


def test_extract_snippets_reads_markers_and_fences(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- snippet: skip (needs a CUDA GPU) -->\n```python\nimport cuda\n```\n\n"
        "```bash\necho no\n```\n\n````py\nprint('```')\n````\n\n<!-- snippet: skip () -->\n```python\ny\n```\n"
    )
    found = extract_snippets(doc)
    assert [(s.line, s.code) for s in found] == [
        (3, "x = 1\n"), (8, "import cuda\n"), (16, "print('```')\n"), (21, "y\n")
    ]  # fmt: skip
    assert [_skip_reason(s) for s in found] == [None, "needs a CUDA GPU", None, None]
    assert found[3].marker == "skip ()"  # a skip without a reason is not a skip


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet, tmp_path):
    reason = _skip_reason(snippet)
    if reason is not None:
        pytest.skip(f"marked in the markdown: {reason}")
    source = tmp_path / "snippet.py"
    source.write_text(snippet.code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(source), snippet.id],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, (
        f"{snippet.id} failed (mark it `<!-- snippet: skip (reason) -->` only if it cannot run on a CPU offline):\n"
        f"{snippet.code}\n--- stdout ---\n{result.stdout[-2000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
