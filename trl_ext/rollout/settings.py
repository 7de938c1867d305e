"""Rollout defaults, each written once: `AgentLoop` and `SGLangEngine` take them as keyword defaults, and
`AgenticGRPOConfig`'s flat fields (`max_turns`, `tool_timeout_s`, `max_tool_output_chars`, `rollout_concurrency`,
`sglang_*`) take theirs from here.
"""

from __future__ import annotations

MAX_TURNS = 8
"""Most assistant turns (generate calls) per trajectory."""

TOOL_TIMEOUT_S = 30.0
"""Wall-clock limit of one tool call."""

MAX_TOOL_OUTPUT_CHARS = 4096
"""Tool output longer than this is cut before it is rendered back to the model."""

MAX_CONCURRENCY = 64
"""Most trajectories generating at once (`AgentLoop`), most requests in flight (`SGLangEngine`)."""

SGLANG_TIMEOUT_S = 600.0
"""Overall deadline of one SGLang request: connecting, waiting and reading the whole answer."""

SGLANG_RETRY_DEADLINE_S = 120.0
"""How long a failed SGLang request keeps being retried: long enough to span a server restart."""

SGLANG_READY_TIMEOUT_S = 600.0
"""Start-up wait for every SGLang server to answer ``GET /health`` (loading gpt-oss-120b takes minutes)."""

SGLANG_LOG_EVERY_S = 30.0
"""Period of the log lines while waiting for servers and while requests are in flight."""
