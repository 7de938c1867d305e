"""The CPU quickstart, measured: runs ``accelerate launch examples/grpo_retool.py`` as `docs/quickstart.md` tells a
user to, and records what it printed and how long it took.

The example's lines that `docs/quickstart.md` shows (the accuracy before and after each stage, one line per GRPO
step, the cold start's last log dicts) and the run's wall and CPU time go into ``quickstart.json``;
``scripts/render_docs.py`` renders the quickstart's sample output and its timing sentence from that file, so the page
shows one real run. No GPU: the example's defaults build a tiny GPT-OSS and use the embedded engine.

    python benchmarks/quickstart.py --out docs/benchmarks            # a few minutes on a 2-core CPU
    python benchmarks/quickstart.py --out DIR -- --max_steps 2        # arguments after -- go to the example

Writes ``quickstart.{json,md}``; exits non-zero when the example fails or prints none of the lines it should.
"""

from __future__ import annotations

if __package__ in (None, ""):
    import _bootstrap  # noqa: F401  (python benchmarks/quickstart.py: the repository root on sys.path)

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._cli import OUT_HELP, REPO, exit_if_failed, machine, output_dir, without_local_paths

NAMES = ("quickstart.json", "quickstart.md")
EXAMPLE = "examples/grpo_retool.py"
# The lines of the example's output that the quickstart shows, in the order it prints them.
SHOWN = re.compile(r"^(\[(before the cold start|cold start|before GRPO|after GRPO)\] |step \d+ \| |done: )")
SCORE = re.compile(
    r"^\[(?P<stage>[^\]]+)\] .*accuracy (?P<correct>\d+)/(?P<n>\d+) \| tool-call rate (?P<tool_rate>[\d.]+) \| "
    r"tool calls that ran (?P<tool_ok>[\d.]+|n/a) \| final answers (?P<final>[\d.]+)"
)
COLD_START = re.compile(r"^\[cold start\] (?P<problems>\d+) problems practised in (?P<seconds>[\d.]+) s")
DONE = re.compile(r"^done: (?P<steps>\d+) steps in (?P<seconds>[\d.]+) s")
STEP = re.compile(r"^step (?P<step>\d+) \| (?P<rest>.*)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="stop the example after this long (a failure)")
    p.add_argument("--from-json", type=Path, default=None, help="no run: render this quickstart.json again")
    p.add_argument("example_args", nargs="*", help="arguments for the example (after --)")
    return p.parse_args(argv)


def parse_output(stdout: str) -> dict:
    """The shown lines of the example's output and the values the quickstart quotes from them."""
    lines = stdout.splitlines()
    shown = [line.rstrip() for line in lines if SHOWN.match(line)]
    # the cold start's last loss dict and its summary dict (TRL's SFTTrainer logs), printed before "[cold start]"
    cold_end = next((i for i, line in enumerate(lines) if COLD_START.match(line)), len(lines))
    dicts = [line.rstrip() for line in lines[:cold_end] if line.startswith("{'")]
    loss_dicts = [d for d in dicts if d.startswith("{'loss'")]
    summary = [d for d in dicts if d.startswith("{'train_runtime'")]
    scores = {}
    for line in shown:
        m = SCORE.match(line)
        if m:
            scores[m["stage"]] = {
                "correct": int(m["correct"]),
                "n": int(m["n"]),
                "tool_call_rate": float(m["tool_rate"]),
                "tool_calls_that_ran": None if m["tool_ok"] == "n/a" else float(m["tool_ok"]),
                "final_answers": float(m["final"]),
            }
    steps = []
    for line in shown:
        m = STEP.match(line)
        if m:
            fields = dict(part.rsplit(" ", 1) for part in m["rest"].split(" | "))
            steps.append({"step": int(m["step"]), **{k: float(v) for k, v in fields.items()}})
    cold = next((COLD_START.match(line) for line in shown if COLD_START.match(line)), None)
    done = next((DONE.match(line) for line in shown if DONE.match(line)), None)
    return {
        "lines": shown,
        "cold_start_log": [*loss_dicts[-1:], *summary[-1:]],
        "scores": scores,
        "steps": steps,
        "cold_start_s": float(cold["seconds"]) if cold else None,
        "cold_start_problems": int(cold["problems"]) if cold else None,
        "done_s": float(done["seconds"]) if done else None,
        "grpo_steps": int(done["steps"]) if done else None,
    }


def failures(result: dict) -> list[str]:
    out = []
    if result["returncode"] != 0:
        out.append(f"the example exited with {result['returncode']}: {result.get('stderr_tail', '')[-500:]}")
    for stage in ("before the cold start", "before GRPO", "after GRPO"):
        if stage not in result["scores"]:
            out.append(f"no [{stage}] line in the example's output")
    if result["grpo_steps"] is None or not result["steps"]:
        out.append("no GRPO step line or no final 'done:' line in the example's output")
    return out


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def render(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Quickstart run (`examples/grpo_retool.py` on CPU)",
        "",
        f"`{result['command']}` on {m['cores']} cores of {m['cpu']} (load average {result['load_before']:.2f} at the "
        f"start), torch {m['torch']}, transformers {m['transformers']}, trl {m['trl']}; {result['date']}. "
        f"Wall time {_minutes(result['wall_s'])}, {_minutes(result['cpu_s'])} of user + system CPU time; exit status "
        f"{result['returncode']}.",
        "",
        "```",
        *result["lines"][:1],
        *result["cold_start_log"],
        *result["lines"][1:],
        "```",
        "",
    ]
    if result.get("failures"):
        lines += ["## Failures", "", *[f"- {f}" for f in result["failures"]], ""]
    return "\n".join(lines)


def run(args) -> dict:
    example = REPO / EXAMPLE
    command = [sys.executable, "-m", "accelerate.commands.launch", str(example), *args.example_args]
    load_before = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # a fresh working folder: the example's default output_dir (outputs/grpo_retool) holds no earlier run there
    with tempfile.TemporaryDirectory(prefix="quickstart_") as cwd:
        try:
            proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=args.timeout_s)
            stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout, stderr, code = exc.stdout or "", f"timed out after {args.timeout_s:.0f} s", -1
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "command": " ".join(["accelerate launch", EXAMPLE, *map(shlex.quote, args.example_args)]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "load_before": load_before,
        "wall_s": wall,
        "cpu_s": cpu,
        "returncode": code,
        "stderr_tail": stderr[-2000:] if code != 0 else "",
        **parse_output(stdout),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = output_dir(args.out, *NAMES)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        result = run(args)
    result = without_local_paths(result)
    result["failures"] = failures(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / NAMES[0]).write_text(json.dumps(result, indent=1) + "\n")
    (out / NAMES[1]).write_text(render(result))
    print(render(result))
    exit_if_failed("benchmarks/quickstart.py", result["failures"], out)
    return result


if __name__ == "__main__":
    main()
