"""What every benchmark script does the same way on its command line: where its report goes, and its exit status.

Output folder: ``--out DIR`` writes there, replacing what is there (naming the folder is the permission, ``--out
docs/benchmarks`` included). Without ``--out`` the report goes to ``docs/benchmarks/`` only if none of the files the
run writes exists there yet: a committed report is never replaced by a default. The check runs before anything is
measured.

Exit status: a run that failed (an exception, a failed check or target, a worker that crashed) exits non-zero, after
its report is written.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "docs" / "benchmarks"
OUT_HELP = "report folder (default: docs/benchmarks/, only while the report is not there yet; name it to replace one)"


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
