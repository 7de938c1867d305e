"""Rollout engines (embedded transformers, SGLang HTTP, SGLang in-process) and the harmony agent loop.

engine = EmbeddedEngine.from_policy(model)            # or SGLangEngine("http://127.0.0.1:30000")
loop = AgentLoop(engine, tools, sampling=SamplingParams(max_new_tokens=1024))
trajectories = loop.run_batch_sync([render_prompt(messages, tools=specs) for messages in batch])
"""

from .agent_loop import AgentLoop, run_sync
from .embedded import EmbeddedEngine
from .engine import RolloutEngine
from .recovery import RolloutServerLostError
from .sglang import SGLangEngine, SGLangError, SGLangOfflineEngine, SGLangResponseError, SGLangUnavailableError
from .types import GenerationOutput, SamplingParams, ToolCallRecord, Trajectory, rollout_seed

__all__ = [
    "AgentLoop",
    "EmbeddedEngine",
    "GenerationOutput",
    "RolloutEngine",
    "RolloutServerLostError",
    "SGLangEngine",
    "SGLangError",
    "SGLangOfflineEngine",
    "SGLangResponseError",
    "SGLangUnavailableError",
    "SamplingParams",
    "ToolCallRecord",
    "Trajectory",
    "rollout_seed",
    "run_sync",
]
