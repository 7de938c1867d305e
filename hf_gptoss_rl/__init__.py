"""hf_gptoss_rl: transformers patches that make GPT-OSS RL training stable, fast and memory-lean.

Importing the package registers, through transformers' own interfaces:
- the sink-aware flash attention kernel as ``attn_implementation="hf-gptoss-rl/sink-flash-attn3"``;
- the memory-efficient experts as ``experts_implementation="memory_efficient"``.
"""

__version__ = "0.1.0"

from . import attention as attention  # registers attn_implementation="hf-gptoss-rl/sink-flash-attn3"
from . import experts as experts  # registers experts_implementation="memory_efficient"
from .sequence_parallel import (  # registers attn_implementation="ulysses_sp" (sink-aware Ulysses SP)
    disable_sequence_parallel,
    enable_sequence_parallel,
    gather_outputs,
    get_sequence_parallel_group,
    sequence_parallel_disabled,
    sequence_parallel_logprobs,
    sequence_parallel_mesh,
    shard_inputs,
)

__all__ = [
    "attention",
    "disable_sequence_parallel",
    "enable_sequence_parallel",
    "experts",
    "gather_outputs",
    "get_sequence_parallel_group",
    "sequence_parallel_disabled",
    "sequence_parallel_logprobs",
    "sequence_parallel_mesh",
    "shard_inputs",
]
