"""``code_interpreter``: ReTool's Python tool (FACTS §11) on a sandbox backend (local by default, or SandboxFusion)."""

from __future__ import annotations

import ast
import re
import signal

from .base import Tool, ToolError
from .sandbox import LocalSandbox, SandboxBackend, SandboxResult

__all__ = ["CodeInterpreterTool", "extract_code", "wrap_last_expression"]

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "python3", "py", "py3"}


def extract_code(text: str) -> str:
    """The first fenced ``python`` block of ``text``; else the first fenced block without a language tag; else
    ``text`` itself (raw code)."""
    blocks = _FENCE.findall(text)
    for language, body in blocks:
        if language.lower() in _PYTHON_TAGS:
            return body
    for language, body in blocks:
        if not language:
            return body
    return text


def wrap_last_expression(code: str) -> str:
    """Wrap a bare last expression in ``print(...)`` (as a notebook would show it); leave ``print(...)`` calls,
    statements, and code that does not parse unchanged."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    value = last.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
        return code
    if isinstance(value, ast.Constant) and isinstance(value.value, str) and len(tree.body) == 1 and "\n" in value.value:
        return code  # a lone docstring-like block
    lines = code.splitlines(keepends=True)
    start, end = last.lineno - 1, last.end_lineno - 1
    # ast offsets are UTF-8 byte columns; everything around the expression (indent, "a = 1; ", a comment) is kept
    prefix = lines[start].encode()[: last.col_offset].decode()
    suffix = lines[end].encode()[last.end_col_offset :].decode()
    segment = ast.get_source_segment(code, last)
    return "".join(lines[:start]) + f"{prefix}print({segment}){suffix}" + "".join(lines[end + 1 :])


class CodeInterpreterTool(Tool):
    """Run Python code and return its stdout + stderr (ReTool's ``code_interpreter``).

    The model passes ``{"code": "..."}``. The tool runs the first fenced ``python`` block of that text (or the
    text itself), with a bare last expression wrapped in ``print(...)``, in ``backend`` (a
    :class:`~trl_ext.tools.sandbox.LocalSandbox` by default). The result is stdout followed by stderr, cut to
    ``max_output_chars`` with a ``[... output truncated ...]`` marker; timeouts and kills are noted in brackets.
    """

    name = "code_interpreter"
    description = "A tool for executing Python code. Returns what the code prints (stdout and stderr)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python code to execute."}},
        "required": ["code"],
    }

    def __init__(
        self,
        backend: SandboxBackend | None = None,
        *,
        timeout_s: float = 10.0,
        max_output_chars: int = 4096,
        memory_mb: int = 1024,
        name: str | None = None,
    ):
        if timeout_s <= 0 or max_output_chars <= 0 or memory_mb <= 0:
            raise ValueError("timeout_s, max_output_chars and memory_mb must be positive")
        self.backend = backend if backend is not None else LocalSandbox()
        self.timeout_s = float(timeout_s)
        self.max_output_chars = int(max_output_chars)
        self.memory_mb = int(memory_mb)
        if name:
            self.name = name

    async def __call__(self, arguments: dict) -> str:
        code = self.validate_arguments(arguments)["code"]
        program = wrap_last_expression(extract_code(code))
        if not program.strip():
            raise ToolError("code_interpreter: the code is empty")
        result = await self.backend.run_code(
            program,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            # bytes read from the process: enough for max_output_chars of UTF-8 plus the marker decision
            max_output_bytes=4 * self.max_output_chars + 4,
        )
        return self.format_result(result)

    def format_result(self, result: SandboxResult) -> str:
        """stdout + stderr, truncated to ``max_output_chars``, with bracketed notes for timeouts and kills."""
        if result.error:
            raise ToolError(f"code_interpreter: sandbox error: {result.error}")
        text = result.stdout
        if result.stderr:
            if text and not text.endswith("\n"):
                text += "\n"
            text += result.stderr
        truncated = result.truncated or len(text) > self.max_output_chars
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars]
        notes = []
        if truncated:
            notes.append(f"[... output truncated to {self.max_output_chars} characters ...]")
        if result.timed_out:
            notes.append(f"[execution timed out after {self.timeout_s:g} s]")
        elif result.signal is not None and not truncated:
            try:
                sig = signal.Signals(result.signal).name
            except ValueError:
                sig = str(result.signal)
            hint = " (CPU time limit)" if sig == "SIGXCPU" else " (memory limit?)" if sig == "SIGKILL" else ""
            notes.append(f"[process killed by {sig}{hint}]")
        if notes:
            if text and not text.endswith("\n"):
                text += "\n"
            text += "\n".join(notes)
        return text if text else "[no output]"
