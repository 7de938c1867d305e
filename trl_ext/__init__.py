"""trl_ext: TRL extensions for agentic GRPO on GPT-OSS (multi-turn tool-calling rollouts, SGLang, mismatch fixes)."""

# Trainer side (needs trl; the GPU benchmark machine has no trl, so stay importable without it)
try:
    from .config import AgenticGRPOConfig
    from .trainer import AgenticGRPOTrainer
except ModuleNotFoundError as _missing:  # pragma: no cover - only without trl installed
    if (_missing.name or "").split(".")[0] != "trl":
        raise
from .mismatch import importance_weights, mismatch_metrics
