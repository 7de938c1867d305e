"""trl_ext: TRL extensions for agentic GRPO on GPT-OSS (multi-turn tool-calling rollouts, SGLang, mismatch fixes)."""
