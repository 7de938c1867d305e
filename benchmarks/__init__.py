"""Benchmark scripts, one per area; each writes `docs/benchmarks/<area>.{md,json,png}`.

Run them from the repository root with the project installed (`pip install -e ".[dev]"`), either as files
(`python benchmarks/moe.py`) or as modules (`python -m benchmarks.moe`). Shared helpers (random-weight GPT-OSS models,
the sink-dropping attention, the project's attention without `kernels`) live in `hf_gptoss_rl.testing`.
"""
