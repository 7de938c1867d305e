"""Tool interface for the agent loop: a name, a JSON schema, and an async call that returns text for the model."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["ToolError", "Tool", "FunctionTool"]


class ToolError(Exception):
    """A failure the model should see: the message is returned to the model as the tool result."""


class Tool(ABC):
    """A tool the model can call through harmony's ``functions`` namespace.

    Subclasses set ``name``, ``description`` and ``parameters`` (the JSON schema of the arguments object) and
    implement ``__call__``. Raise :class:`ToolError` for bad arguments or failures the model should read about;
    any other exception is a bug in the tool (the agent loop reports it to the model too, but logs it as such).
    """

    name: str
    description: str
    parameters: dict

    def spec(self) -> dict:
        """``{"name", "description", "parameters"}``, as ``hf_gptoss_rl.harmony.render_prompt(tools=...)`` takes."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    @abstractmethod
    async def __call__(self, arguments: dict) -> str:
        """Run the tool on parsed JSON arguments and return the text the model reads."""

    def rng_state(self) -> dict | None:
        """The state of the random generators the tool's results depend on (None: none). A tool that draws random
        numbers returns it here and restores it in `load_rng_state`; the trainer saves it in every checkpoint."""
        return None

    def load_rng_state(self, state: dict) -> None:
        """Restore what `rng_state` returned."""
        raise ValueError(f"tool {self.name!r} keeps no generator state, but a checkpoint holds one: {sorted(state)}")

    async def call_with_timeout(self, arguments: dict, timeout_s: float) -> str:
        """Run the tool with at most ``timeout_s`` seconds of its own run time (what the agent loop calls); raises
        ``TimeoutError`` past it. This default bounds the whole call. Tools that first wait for a shared resource
        (:class:`~trl_ext.tools.CodeInterpreterTool` waits for a free sandbox slot) override it so that the wait,
        bounded on its own, does not count: a call that never ran must not be reported as timed out."""
        return await asyncio.wait_for(self(arguments), timeout=timeout_s)

    def validate_arguments(self, arguments: Any) -> dict:
        """Check ``arguments`` against the top level of ``parameters``: an object, required keys present, no
        unknown keys (unless ``additionalProperties`` allows them), and JSON types of the declared properties."""
        if not isinstance(arguments, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}")
        schema = self.parameters or {}
        properties = schema.get("properties") or {}
        missing = [k for k in schema.get("required") or [] if k not in arguments]
        if missing:
            raise ToolError(f"{self.name}: missing required argument(s): {', '.join(missing)}")
        if schema.get("additionalProperties", False) is False:
            unknown = [k for k in arguments if k not in properties]
            if unknown:
                allowed = ", ".join(properties) or "none"
                raise ToolError(f"{self.name}: unknown argument(s): {', '.join(unknown)} (allowed: {allowed})")
        for key, value in arguments.items():
            expected = (properties.get(key) or {}).get("type")
            if expected and not _json_type_matches(value, expected):
                raise ToolError(f"{self.name}: argument {key!r} must be {expected}, got {type(value).__name__}")
        return arguments

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def _json_type_matches(value: Any, expected: str | list) -> bool:
    if isinstance(expected, list):
        return any(_json_type_matches(value, e) for e in expected)
    types = _JSON_TYPES.get(expected)
    if types is None:  # a type this light check does not know: accept
        return True
    if isinstance(value, bool) and expected in ("integer", "number"):
        return False
    return isinstance(value, types)


class FunctionTool(Tool):
    """A plain Python callable (sync or async) as a tool.

    The JSON schema comes from ``transformers.utils.get_json_schema`` (type hints + Google-style docstring with an
    ``Args:`` section) unless ``parameters`` is given. Arguments are validated before the call; the return value is
    converted to text (``str`` as is, anything else as JSON). Sync functions run in a worker thread so they do not
    block other trajectories.

        def add(a: int, b: int) -> int:
            \"\"\"Add two integers.

            Args:
                a: first addend
                b: second addend
            \"\"\"
            return a + b

        tool = FunctionTool(add)
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: dict | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"FunctionTool needs a callable, got {type(fn).__name__}")
        self.fn = fn
        schema = None
        if parameters is None or description is None:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(fn)["function"]
            except Exception as e:
                if parameters is None:
                    raise ValueError(
                        f"cannot derive a JSON schema for {getattr(fn, '__name__', fn)!r} ({e}); add type hints and a "
                        "docstring with an Args: section, or pass parameters="
                    ) from e
        self.name = name or (schema or {}).get("name") or getattr(fn, "__name__", None)
        if not self.name:
            raise ValueError("FunctionTool needs a name= for callables without __name__")
        self.description = description if description is not None else (schema or {}).get("description", "")
        self.parameters = parameters if parameters is not None else schema["parameters"]
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004

    async def __call__(self, arguments: dict) -> str:
        arguments = self.validate_arguments(arguments)
        if self._is_async:
            result = await self.fn(**arguments)
        else:
            result = await asyncio.get_running_loop().run_in_executor(None, functools.partial(self.fn, **arguments))
            if inspect.isawaitable(result):
                result = await result
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(result)
