"""Tool interface: FunctionTool schemas and argument checks, CodeInterpreterTool's ReTool semantics."""

import asyncio
import sys
import time

import pytest

from hf_gptoss_rl.harmony import get_harmony_encoding, render_prompt
from trl_ext.tools import CodeInterpreterTool, FunctionTool, LocalSandbox, SandboxResult, Tool, ToolError
from trl_ext.tools.code_interpreter import extract_code, wrap_last_expression
from trl_ext.tools.sandbox import SandboxBackend


def call(tool, arguments):
    return asyncio.run(tool(arguments))


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


async def lookup(city: str) -> dict:
    """Look up a city.

    Args:
        city: the city's name
    """
    await asyncio.sleep(0)
    return {"city": city, "population": 3}


def test_function_tool_schema_from_type_hints_and_docstring():
    tool = FunctionTool(add)
    assert tool.spec() == {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "the first addend"},
                "b": {"type": "integer", "description": "the second addend"},
            },
            "required": ["a"],
        },
    }
    text = get_harmony_encoding().decode(render_prompt([{"role": "user", "content": "hi"}], tools=[tool]))
    assert "type add = (_: {" in text and "// the first addend" in text


def test_function_tool_calls_sync_and_async():
    assert call(FunctionTool(add), {"a": 1}) == "3"
    assert call(FunctionTool(add), {"a": 1, "b": 5}) == "6"
    assert call(FunctionTool(lookup), {"city": "Paris"}) == '{"city": "Paris", "population": 3}'
    custom = FunctionTool(
        lambda text: text.upper(),
        name="shout",
        description="Upper-case text.",
        parameters={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    )
    assert call(custom, {"text": "hi"}) == "HI"


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "missing required argument"),
        ({"a": 1, "c": 3}, "unknown argument"),
        ({"a": "1"}, "must be integer"),
        ({"a": True}, "must be integer"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_function_tool_rejects_bad_arguments(arguments, message):
    with pytest.raises(ToolError, match=message):
        call(FunctionTool(add), arguments)


def test_function_tool_needs_a_schema():
    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="cannot derive a JSON schema"):
        FunctionTool(undocumented)
    with pytest.raises(TypeError):
        FunctionTool(42)


def test_tool_errors_propagate():
    def fails(x: int) -> int:
        """Always fails.

        Args:
            x: ignored
        """
        raise ToolError("no such record")

    with pytest.raises(ToolError, match="no such record"):
        call(FunctionTool(fails), {"x": 1})


@pytest.mark.parametrize(
    "source, expected",
    [
        ("x = 1\nx", "x = 1\nprint(x)"),
        ("a = 1; a * 2", "a = 1; print(a * 2)"),
        ("print(3)", "print(3)"),
        ("for i in range(3):\n    i", "for i in range(3):\n    i"),
        ("x = [1,\n     2]\nsum(x)  # total\n", "x = [1,\n     2]\nprint(sum(x))  # total\n"),
        ("import math\nmath.pi\n", "import math\nprint(math.pi)\n"),
        ("x = 'é'; x", "x = 'é'; print(x)"),
        ("def f(:\n  pass", "def f(:\n  pass"),
        ("", ""),
    ],
)
def test_wrap_last_expression(source, expected):
    assert wrap_last_expression(source) == expected


def test_extract_code():
    assert extract_code("Let me compute:\n```python\nprint(1)\n```\nand\n```python\nprint(2)\n```") == "print(1)\n"
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```bash\nls\n```\n```python\nprint(4)\n```") == "print(4)\n"
    assert extract_code("print(5)") == "print(5)"


class ScriptedBackend(SandboxBackend):
    def __init__(self, result):
        self.result, self.calls = result, []

    async def run_code(self, code, *, timeout_s, memory_mb, max_output_bytes):
        self.calls.append(dict(code=code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes))
        return self.result


def test_code_interpreter_formats_results():
    backend = ScriptedBackend(SandboxResult("out\n", "Traceback...\nValueError: x\n", 1, False, False))
    tool = CodeInterpreterTool(backend, timeout_s=5, max_output_chars=100, memory_mb=300)
    assert call(tool, {"code": "```python\n1 + 1\n```"}) == "out\nTraceback...\nValueError: x\n[exit status 1]"
    assert backend.calls == [dict(code="print(1 + 1)\n", timeout_s=5.0, memory_mb=300, max_output_bytes=404)]
    assert tool.spec()["name"] == "code_interpreter" and tool.spec()["parameters"]["required"] == ["code"]

    long = CodeInterpreterTool(ScriptedBackend(SandboxResult("y" * 500, "", None, False, True)), max_output_chars=100)
    text = call(long, {"code": "x"})
    assert text.startswith("y" * 100) and "y" * 101 not in text and "output truncated to 100 characters" in text
    slow = CodeInterpreterTool(ScriptedBackend(SandboxResult("partial", "", None, True, False)), timeout_s=2)
    assert call(slow, {"code": "x"}) == "partial\n[execution timed out after 2 s]"
    silent = CodeInterpreterTool(ScriptedBackend(SandboxResult("", "", 0, False, False)))
    assert call(silent, {"code": "x = 1"}) == "[no output]"
    broken = CodeInterpreterTool(ScriptedBackend(SandboxResult("", "", None, False, False, error="HTTP 503")))
    with pytest.raises(ToolError, match="sandbox error: HTTP 503"):
        call(broken, {"code": "x"})
    with pytest.raises(ToolError, match="missing required argument"):
        call(silent, {"source": "x"})
    with pytest.raises(ToolError, match="empty"):
        call(silent, {"code": "```python\n```"})


@pytest.mark.parametrize(
    "result, expected",
    [
        (SandboxResult("", "", 3, False, False), "[exit status 3]"),
        (SandboxResult("", "", 0, False, False), "[no output]"),
        (
            SandboxResult("", "", None, False, False, signal=9, killed_by="memory_limit", oom_kills=1),
            "[process killed: memory limit of 300 MiB exceeded]",
        ),
        (
            SandboxResult("", "", None, False, False, signal=9, killed_by="program"),
            "[process terminated by SIGKILL, raised by the program itself (not a sandbox limit)]",
        ),
        (
            SandboxResult("", "", None, False, False, signal=11, killed_by="program"),
            "[process terminated by SIGSEGV, raised by the program itself (not a sandbox limit)]",
        ),
        (SandboxResult("", "", None, False, False, signal=9, killed_by="unknown"), "[process terminated by SIGKILL]"),
        (
            SandboxResult("p", "", None, True, False, signal=24, killed_by="cpu_limit"),
            "p\n[process killed: CPU time limit of 5 s reached]",
        ),
        (
            SandboxResult("", "", 0, False, False, oom_kills=2),
            "[2 process(es) of the program killed: memory limit of 300 MiB exceeded]",
        ),
        (
            SandboxResult(
                "",
                "OSError: [Errno 28] No space left on device\n",
                1,
                False,
                False,
                disk_full=True,
                isolation={"disk_quota": 8 * 2**20},
            ),
            "OSError: [Errno 28] No space left on device\n[disk quota of 8 MiB for the working directory exceeded "
            "(size or number of files)]\n[exit status 1]",
        ),
    ],
    ids=["exit", "silent", "memory", "self-kill", "crash", "unknown-signal", "cpu", "child-oom", "disk"],
)
def test_code_interpreter_tells_the_model_why(result, expected):
    tool = CodeInterpreterTool(ScriptedBackend(result), timeout_s=5, memory_mb=300)
    assert call(tool, {"code": "x"}) == expected


def test_call_with_timeout_bounds_the_programs_run_time_only():
    backend = ScriptedBackend(SandboxResult("ok\n", "", 0, False, False))
    tool = CodeInterpreterTool(backend, timeout_s=10)
    assert asyncio.run(tool.call_with_timeout({"code": "print(1)"}, 3)) == "ok\n"
    assert asyncio.run(tool.call_with_timeout({"code": "print(1)"}, 30)) == "ok\n"
    assert [c["timeout_s"] for c in backend.calls] == [3.0, 10.0]  # the lower of the loop's and the tool's
    with pytest.raises(ValueError):
        asyncio.run(tool.call_with_timeout({"code": "print(1)"}, 0))

    async def slow(x: int) -> int:
        """Sleep.

        Args:
            x: ignored
        """
        await asyncio.sleep(5)
        return x

    with pytest.raises(asyncio.TimeoutError):  # the default hook bounds the whole call
        asyncio.run(FunctionTool(slow).call_with_timeout({"x": 1}, 0.05))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox is Linux-only")
def test_agent_loop_tool_timeout_ignores_the_sandbox_queue():
    """Five concurrent code_interpreter calls share one sandbox slot; each runs 0.4 s under the loop's 1.5 s
    tool_timeout_s. The last one waits over 1.6 s for its slot and must still succeed: only its own run counts."""
    from types import SimpleNamespace

    from trl_ext.rollout.agent_loop import AgentLoop
    from trl_ext.rollout.types import SamplingParams

    tool = CodeInterpreterTool(LocalSandbox(max_processes=4, max_concurrency=1), timeout_s=10, memory_mb=256)
    loop = AgentLoop(None, [tool], sampling=SamplingParams(max_new_tokens=8), tool_timeout_s=1.5)
    call_ = SimpleNamespace(
        name="code_interpreter",
        recipient="functions.code_interpreter",
        parsed_arguments=lambda: {"code": "import time\ntime.sleep(0.4)\nprint('ran')"},
    )

    async def main():
        return await asyncio.gather(*[loop._run_tool(call_) for _ in range(5)])

    t = time.monotonic()
    assert asyncio.run(main()) == [("ran\n", None)] * 5
    assert time.monotonic() - t > 2.0  # so the last call waited longer than tool_timeout_s
    hung = SimpleNamespace(
        name="code_interpreter",
        recipient="functions.code_interpreter",
        parsed_arguments=lambda: {"code": "while True: pass"},
    )
    result, error = asyncio.run(loop._run_tool(hung))
    assert error is None and result == "[execution timed out after 1.5 s]"  # the program's run, bounded by the loop


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox is Linux-only")
def test_code_interpreter_on_local_sandbox():
    tool = CodeInterpreterTool(LocalSandbox(max_processes=4), timeout_s=5, max_output_chars=200, memory_mb=512)
    assert call(tool, {"code": "```python\nimport math\nx = math.factorial(10)\nx\n```"}) == "3628800\n"
    out = call(tool, {"code": "1 / 0"})
    assert "ZeroDivisionError" in out and out.startswith("Traceback") and out.endswith("[exit status 1]")
    assert "[execution timed out after 1 s]" in asyncio.run(
        CodeInterpreterTool(LocalSandbox(), timeout_s=1)({"code": "while True: pass"})
    )
    flood = call(tool, {"code": "print('z' * 100000)"})
    assert flood.startswith("z" * 200) and "output truncated to 200 characters" in flood and len(flood) < 300


def test_custom_tool_subclass():
    class Echo(Tool):
        name, description = "echo", "Echo the text."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

        async def __call__(self, arguments):
            return self.validate_arguments(arguments)["text"]

    assert call(Echo(), {"text": "hi"}) == "hi"
    with pytest.raises(ToolError, match="must be string"):
        call(Echo(), {"text": 3})
