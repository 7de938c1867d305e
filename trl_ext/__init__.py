"""trl_ext: TRL extensions for agentic GRPO on GPT-OSS (multi-turn tool-calling rollouts, SGLang, mismatch fixes).

Exports are resolved lazily (PEP 562): ``import trl_ext.tools`` or ``trl_ext.rollout`` does not import trl, and the
trainer side is only imported when ``AgenticGRPOConfig`` / ``AgenticGRPOTrainer`` are first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "AgenticGRPOConfig": ".config",
    "AgenticGRPOTrainer": ".trainer",
    "importance_sampling_ratio": ".mismatch",
    "mismatch_metrics": ".mismatch",
}

__all__ = ["AgenticGRPOConfig", "AgenticGRPOTrainer", "importance_sampling_ratio", "mismatch_metrics"]

if TYPE_CHECKING:  # pragma: no cover
    from .config import AgenticGRPOConfig
    from .mismatch import importance_sampling_ratio, mismatch_metrics
    from .trainer import AgenticGRPOTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
