"""Tools for agentic rollouts: a sandboxed ``code_interpreter`` (ReTool semantics), a SandboxFusion client and plain
Python callables as tools. See ``docs/tools.md`` for the sandbox's exact isolation guarantees."""

from .base import FunctionTool, Tool, ToolError
from .code_interpreter import CodeInterpreterTool
from .sandbox import LocalSandbox, SandboxBackend, SandboxResult, remove_tree, sweep_stale, usable_cpus
from .sandbox_fusion import SandboxFusionBackend

__all__ = [
    "Tool",
    "ToolError",
    "FunctionTool",
    "CodeInterpreterTool",
    "LocalSandbox",
    "SandboxBackend",
    "SandboxFusionBackend",
    "SandboxResult",
    "remove_tree",
    "sweep_stale",
    "usable_cpus",
]
