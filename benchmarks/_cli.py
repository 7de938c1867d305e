"""What every benchmark script does the same way on its command line: where its report goes, and its exit status.

Output folder: ``--out DIR`` writes there, replacing what is there (naming the folder is the permission, ``--out
docs/benchmarks`` included). Without ``--out`` the report goes to ``docs/benchmarks/`` only if none of the files the
run writes exists there yet: a committed report is never replaced by a default. The check runs before anything is
measured.

Exit status: a run that failed (an exception, a failed check or target, a worker that crashed) exits non-zero, after
its report is written.

Ratios: every report states a comparison the same way, `ratio(ours, peer)` = this project's time (or memory) ÷ the
peer's, so below 1 means this project takes less (`RATIO_RULE` says so in the reports and the README).

Local paths: a report names no folder of the machine that wrote it (`without_local_paths`), so its commands read the
same for every reader.

Header and cells: `environment()` (versions, device, source commit) heads every report, `machine()` a CPU run's; the
command of a run is recorded as `command_line` writes it; `fmt` writes a table cell, `md_table` a table, `figure` a
plot, `grouped_bars` its bars. GPU timings: `gpu_time_and_peak` (time and peak memory of a call), `rel_error`.

SGLang: the scripts that launch servers take the flags of `trl_ext.sglang_serve.ServerManager.add_arguments` and
build their servers' manager with `ServerManager.from_args`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "docs" / "benchmarks"
OUT_HELP = "report folder (default: docs/benchmarks/, only while the report is not there yet; name it to replace one)"


RATIO_RULE = "ratio = this project's time (or memory) ÷ the peer's, so below 1 is faster (or smaller)"


def ratio(ours: float, peer: float) -> str:
    """``ours ÷ peer`` as the reports print it (``0.48x``): the one direction of every comparison."""
    return f"{ours / peer:.2f}x"


def output_dir(out: str | Path | None, *names: str) -> Path:
    """The folder to write ``names`` (the report's files) into: ``out`` when given, else `REPORTS`, which must not
    hold any of them yet (SystemExit naming the way to replace them on purpose)."""
    if out is not None:
        return Path(out)
    existing = [name for name in names if (REPORTS / name).exists()]
    if existing:
        shown = ", ".join(str((REPORTS / name).relative_to(REPO)) for name in existing)
        raise SystemExit(
            f"refusing to overwrite {shown}: without --out, a benchmark never replaces a report in docs/benchmarks/. "
            "Pass --out docs/benchmarks to replace the report on purpose, or --out DIR to write elsewhere."
        )
    return REPORTS


def exit_if_failed(script: str, failures: list[str], out: str | Path | None = None) -> None:
    """SystemExit (status 1) listing ``failures``, if any: call it once the report is written."""
    if failures:
        where = f" (report in {out})" if out is not None else ""
        raise SystemExit(f"{script}: {len(failures)} failure(s){where}:\n  " + "\n  ".join(failures))


def _local_roots() -> list[tuple[str, str]]:
    """(folder, placeholder) of the places a run's paths point to that no reader shares, most specific first."""
    roots = [(str(REPO), ".")]
    temp = {os.path.realpath(tempfile.gettempdir()), tempfile.gettempdir(), "/tmp", "/var/tmp"}
    roots += [(t.rstrip("/"), "$TMPDIR") for t in sorted(temp, key=len, reverse=True) if t.rstrip("/")]
    home = os.path.expanduser("~")
    if home not in ("", "/"):
        roots.append((home.rstrip("/"), "~"))
    return roots


def without_local_paths(report, named: dict | None = None):
    """``report`` (JSON-like: dicts, lists, strings) with this machine's paths replaced by placeholders, so that
    committed reports and the commands in them name no folder of the machine that wrote them.

    ``named`` maps a path to its placeholder (``{model_dir: "MODEL_DIR"}``); those go first. Then paths inside the
    repository become relative (``./docs/...``), paths under the temporary folder ``$TMPDIR/...`` and paths under the
    home folder ``~/...``. A report written elsewhere (a saved JSON re-rendered here) is cleaned by the same rules,
    ``/tmp`` included. Strings are rewritten wherever they are, keys left as they are."""
    pairs = [(str(path).rstrip("/"), placeholder) for path, placeholder in (named or {}).items() if path]
    pairs.sort(key=lambda pair: len(pair[0]), reverse=True)
    # a root matches as a whole path component: /tmpfoo and /opt/tmp/x are not under /tmp
    patterns = [(re.compile(rf"(?<![\w./-]){re.escape(path)}(?=/|\b|$)"), ph) for path, ph in pairs]
    patterns += [(re.compile(rf"(?<![\w./-]){re.escape(root)}(?=/|[\s'\"`:;,)]|$)"), ph) for root, ph in _local_roots()]

    def clean(value):
        if isinstance(value, str):
            for pattern, placeholder in patterns:
                value = pattern.sub(lambda _m, ph=placeholder: ph, value)
            return value
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(clean(v) for v in value)
        return value

    return clean(report)


def git_commit() -> str | None:
    """The short commit of the checkout the benchmarks run from; outside a git checkout (a copy of the sources), the
    ``GIT_COMMIT`` environment variable, as CI systems set it, else None."""
    if not (REPO / ".git").exists():
        return os.environ.get("GIT_COMMIT") or None
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def installed_versions(*distributions: str) -> dict:
    """The installed version (None if absent) of each of ``distributions``, named as pip names it, keyed with
    underscores (``flash-attn-4`` -> ``flash_attn_4``)."""
    versions = {}
    for dist in distributions:
        try:
            versions[dist.replace("-", "_")] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist.replace("-", "_")] = None
    return versions


def environment(*distributions: str) -> dict:
    """Versions, device and source commit, for the report header; then `installed_versions` of ``distributions``."""
    import torch
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    for name in ("triton", "peft", "kernels"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    info["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    info["commit"] = git_commit()
    return info | installed_versions(*distributions)


def fmt(value, spec: str = ".3g") -> str:
    """A table cell: numbers formatted, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return format(value, spec)


def md_table(header: list[str], rows=()) -> list[str]:
    """The lines of a markdown table: ``header``, its rule, then one line per row of cells."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(map(str, r))} |" for r in rows)]


@contextlib.contextmanager
def figure(path: str | Path, nrows: int = 1, ncols: int = 1, figsize=(10, 4), dpi: int = 110, **subplots):
    """``(fig, axes)`` of a new matplotlib figure (Agg backend; ``subplots``: more arguments of `plt.subplots`), laid
    out and saved to ``path`` at the end of the ``with`` block, and closed in any case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def grouped_bars(ax, groups, series: dict) -> None:
    """Bars on ``ax``: one group per entry of ``groups``, one bar per series in each (``series``: {label: one value
    per group}; a value that is not a number, such as "OOM", drawn as 0), the groups named under their middles."""
    width = 0.8 / max(len(series), 1)
    for j, (label, values) in enumerate(series.items()):
        heights = [v if isinstance(v, float) else 0.0 for v in values]
        ax.bar([i + j * width for i in range(len(groups))], heights, width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], [str(g) for g in groups])


def gpu_time_and_peak(fn, reset=lambda: None, warmup: int = 25, rep: int = 100):
    """(median ms of `triton.testing.do_bench`, peak GiB) of ``fn`` on the current GPU, after one warm-up call. Peak:
    `max_memory_allocated` during one call minus what was allocated just before it; ``reset`` (dropping gradients)
    runs before that baseline and at the end. Out of memory: ("OOM", "OOM"), the memory freed."""
    import gc

    import torch
    from triton.testing import do_bench

    try:
        fn()  # warm-up / compile
        torch.cuda.synchronize()
        reset()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    except torch.OutOfMemoryError:
        ms = peak = "OOM"
    reset()
    if ms == "OOM":
        gc.collect()
        torch.cuda.empty_cache()
    return ms, peak


def command_line(script: str, argv: list[str] | None, *, omit_out: bool = False) -> str:
    """``python benchmarks/<script>.py ARGS`` as this run was started (``argv``: the arguments, None: `sys.argv`;
    ``omit_out``: without ``--out DIR``, where the report went)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if omit_out:
        args = [
            a
            for i, a in enumerate(args)
            if a != "--out" and not a.startswith("--out=") and args[i - 1 : i] != ["--out"]
        ]
    return f"python benchmarks/{script}.py {shlex.join(args)}".strip()


def rel_error(x, ref) -> float:
    """The relative L2 error of the tensor ``x`` against ``ref``, in float64."""
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def machine() -> dict:
    """What a CPU run's time depends on: the CPU, the cores this process may use, the versions."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = models[0] if models else platform.processor() or platform.machine()
    versions = installed_versions("torch", "transformers", "trl", "accelerate")
    return {"cpu": cpu, "cores": cores, "python": platform.python_version(), **versions}
