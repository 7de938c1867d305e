"""Benchmark scripts, one per area; each writes `docs/benchmarks/<area>.{md,json,png}`.

Run them from the repository root with the project installed (`pip install -e ".[dev]"`), either as files
(`python benchmarks/moe.py`) or as modules (`python -m benchmarks.moe`). Shared helpers live in the library:
random-weight GPT-OSS models in `hf_gptoss_rl.model_builders`, the sink-dropping attention and the project's attention
without `kernels` in `hf_gptoss_rl.attention_variants`, the SGLang server launch in `trl_ext.sglang_serve`; what the
scripts share on the command line (and the report header) lives in `benchmarks/_cli.py`:

- without `--out`, a script writes into `docs/benchmarks/` only while its report is not there yet; to replace a
  committed report, name the folder (`--out docs/benchmarks`);
- a run that fails (an exception, a failed check or target, a worker that crashed) exits non-zero, after writing its
  report.
"""
