"""``code_interpreter``: ReTool's Python tool (verl-recipe ``retool/``) on a sandbox backend (local by default, or SandboxFusion)."""

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
    ``max_output_chars`` with a ``[... output truncated ...]`` marker; timeouts, memory kills, signals, a full disk
    quota and a non-zero exit status are noted in brackets.
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
        return await self._execute(arguments, self.timeout_s)

    async def call_with_timeout(self, arguments: dict, timeout_s: float) -> str:
        """The agent loop's entry point: ``timeout_s`` bounds the program's own run time (the lower of it and the
        tool's ``timeout_s`` applies); the wait for a free sandbox slot is bounded separately by the backend
        (``queue_timeout_s``), so a call that waited in the queue is never reported as timed out."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        return await self._execute(arguments, min(self.timeout_s, float(timeout_s)))

    async def _execute(self, arguments: dict, timeout_s: float) -> str:
        code = self.validate_arguments(arguments)["code"]
        program = wrap_last_expression(extract_code(code))
        if not program.strip():
            raise ToolError("code_interpreter: the code is empty")
        result = await self.backend.run_code(
            program,
            timeout_s=timeout_s,
            memory_mb=self.memory_mb,
            # bytes read from the process: enough for max_output_chars of UTF-8 plus the marker decision
            max_output_bytes=4 * self.max_output_chars + 4,
        )
        return self.format_result(result, timeout_s=timeout_s)

    def format_result(self, result: SandboxResult, *, timeout_s: float | None = None) -> str:
        """stdout + stderr, truncated to ``max_output_chars``, then bracketed notes: output truncated, timed out,
        killed for memory, killed by a signal the program caused, disk quota reached, the exit status when not 0."""
        if result.error:
            raise ToolError(f"code_interpreter: sandbox error: {result.error}")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
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
        killed_by = result.killed_by
        if killed_by == "cpu_limit":
            notes.append(f"[process killed: CPU time limit of {timeout_s:g} s reached]")
        elif result.timed_out or killed_by == "timeout":
            notes.append(f"[execution timed out after {timeout_s:g} s]")
        elif killed_by == "memory_limit":
            notes.append(f"[process killed: memory limit of {self.memory_mb} MiB exceeded]")
        elif result.signal is not None and killed_by != "output_limit":
            try:
                sig = signal.Signals(result.signal).name
            except ValueError:
                sig = f"signal {result.signal}"
            if killed_by == "program":
                notes.append(f"[process terminated by {sig}, raised by the program itself (not a sandbox limit)]")
            else:
                notes.append(f"[process terminated by {sig}]")
        if result.oom_kills and killed_by != "memory_limit":
            notes.append(
                f"[{result.oom_kills} process(es) of the program killed: memory limit of {self.memory_mb} MiB exceeded]"
            )
        if result.disk_full:
            quota = result.isolation.get("disk_quota")
            size = f" of {quota / 2**20:g} MiB" if quota else ""
            notes.append(f"[disk quota{size} for the working directory exceeded (size or number of files)]")
        if result.exit_code not in (None, 0):
            notes.append(f"[exit status {result.exit_code}]")
        if notes:
            if text and not text.endswith("\n"):
                text += "\n"
            text += "\n".join(notes)
        return text if text else "[no output]"
