"""The README's table of default runs: each script with no flags, one after the other, alone.

    python tests/run_defaults.py                       # all five (about an hour on a 2-core CPU)
    python tests/run_defaults.py grpo w2spo            # some of them
    python tests/run_defaults.py --table-only          # re-print the table from runs already made

Each run is `python <script>.py --output-dir <out>/<name>` in its own process; its wall time and
peak memory (the child's maximum RSS) are measured from outside. The table is printed and written
to <out>/defaults.md, every figure beside what produced it.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["grpo", "passk", "w2spo", "sampling_evolve", "rse_search"]


def run(name, out):
    """One default run; returns {"wall_seconds", "peak_rss_gb"} and saves it beside the run."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(folder / "stderr.log", "w") as log:
        child = subprocess.Popen([sys.executable, str(ROOT / f"{name}.py"), "--output-dir", str(folder)],
                                 cwd=ROOT, stderr=log, stdout=log)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage: ru_maxrss in KiB
    if code := os.waitstatus_to_exitcode(status):
        sys.exit(f"error: {name}.py exited with {code}; see {folder / 'stderr.log'}")
    measured = {"wall_seconds": time.time() - start, "peak_rss_gb": usage.ru_maxrss / 2**20}
    (folder / "measured.json").write_text(json.dumps(measured))
    return measured


def pct(x):
    return f"{100 * x:.1f}%"


def row(name, out):
    """One line of the table from a run's summary.json and measured.json."""
    folder = out / name
    s = json.loads((folder / "summary.json").read_text())
    m = json.loads((folder / "measured.json").read_text())
    cost = f"{m['wall_seconds'] / 60:.1f} min, {m['peak_rss_gb']:.1f} GB"
    if name == "rse_search":
        first, last = s["rounds"][0], s["rounds"][-1]
        base = s["baseline"][-1] if s["baseline"] else None
        shown = (f"pass@1 round 0 → {last['round']}: {pct(first['pass@1'])} → **{pct(last['pass@1'])}**"
                 + (f" (baseline {pct(base['pass@1'])})" if base else "")
                 + f"; solved {pct(last['solved_cumulative'])}"
                 + (f" (baseline {pct(base['solved_cumulative'])})" if base else ""))
        return f"| `python rse_search.py` | {s['problems']} problems, {len(s['rounds'])} rounds | {shown} | {cost} |"
    k = s["k"]
    shown = (f"pass@1 {pct(s['pass@1_before'])} → **{pct(s['pass@1_after'])}**, pass@{k} "
             f"{pct(s['pass@k_before'])} → {pct(s['pass@k_after'])}")
    what = f"{s['steps']} steps, {s['args']['eval_problems']} held-out problems"
    return f"| `python {name}.py` | {what} | {shown} | {cost}, {s['seconds_per_step']:.1f} s per step |"


def main(argv=None):
    parser = argparse.ArgumentParser(description="The README's default-run table (see the docstring).")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"which scripts (default: all of {', '.join(SCRIPTS)})")
    parser.add_argument("--output-dir", default="runs/defaults")
    parser.add_argument("--table-only", action="store_true", help="do not run: tabulate earlier runs")
    args = parser.parse_args(argv)
    out = Path(args.output_dir).resolve()
    if unknown := [name for name in args.names if name not in SCRIPTS]:
        parser.error(f"unknown script(s) {unknown}: choose from {SCRIPTS}")
    args.names = args.names or SCRIPTS
    for name in [] if args.table_only else args.names:
        print(f"{name}: {run(name, out)}", flush=True)
    lines = ["| command | run | held-out result | wall time, peak memory |", "|---|---|---|---|"]
    lines += [row(name, out) for name in SCRIPTS if (out / name / "measured.json").exists()]
    table = "\n".join(lines)
    print(table)
    (out / "defaults.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
