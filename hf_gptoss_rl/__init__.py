"""hf_gptoss_rl: transformers patches that make GPT-OSS RL training stable, fast and memory-lean.

Importing the package registers, through transformers' own interfaces:
- the sink-aware flash attention kernel as ``attn_implementation="hf-gptoss-rl/sink-flash-attn3"``;
- the memory-efficient experts as ``experts_implementation="memory_efficient"``.
"""

__version__ = "0.1.0"
