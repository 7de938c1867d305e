"""Benchmark scripts, one per area; each writes `docs/benchmarks/<area>.{md,json,png}`.

Run them from the repository root with the project installed (`pip install -e ".[dev]"`), either as files
(`python benchmarks/moe.py`) or as modules (`python -m benchmarks.moe`). Shared helpers (random-weight GPT-OSS models,
the sink-dropping attention, the project's attention without `kernels`) live in `hf_gptoss_rl.testing`; what the
scripts share on the command line lives in `benchmarks/_cli.py`:

- without `--out`, a script writes into `docs/benchmarks/` only while its report is not there yet; to replace a
  committed report, name the folder (`--out docs/benchmarks`);
- a run that fails (an exception, a failed check or target, a worker that crashed) exits non-zero, after writing its
  report.
"""
