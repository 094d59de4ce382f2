"""Benchmark: the default run with fp32 compute against bf16 compute (autocast; fp32 master weights in both),
over several seeds, in one invocation.

    python tests/bench_precision.py                                   # 3 seeds x (float32, bfloat16)
    python tests/bench_precision.py --seeds 0 1 2 --dtypes float32    # one precision only
    python tests/bench_precision.py --script passk.py -- --steps 4    # flags after -- go to the script

Each run is `python grpo.py --dtype D --seed S` in its own process, one after the other. Printed: per run
the held-out pass@1 before -> after and the mean seconds per step (metrics.jsonl); per precision the mean and
spread (min..max, and the sample std) of the pass@1 gain over the seeds; the bf16 / fp32 ratio of the mean
step time; and whether this CPU has native bf16 instructions (avx512_bf16 or amx_bf16 in /proc/cpuinfo):
without them torch emulates bf16 and autocast is slower, not faster. The rule the README applies: bf16
becomes the CPU default only if the two precisions' mean gains differ by less than the seeds' spread and
the CPU has native bf16."""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def native_bf16():
    try:
        return sorted(set(re.findall(r"\b(avx512_bf16|amx_bf16)\b", Path("/proc/cpuinfo").read_text())))
    except OSError:
        return []


def run(script, dtype, seed, extra, folder):
    out = Path(folder) / f"{dtype}_{seed}"
    subprocess.run([sys.executable, str(ROOT / script), "--dtype", dtype, "--seed", str(seed),
                    "--output-dir", str(out), *extra], check=True, cwd=ROOT)
    summary = json.loads((out / "summary.json").read_text())
    return {"dtype": dtype, "seed": seed, "before": summary["pass@1_before"], "after": summary["pass@1_after"],
            "gain": summary["pass@1_after"] - summary["pass@1_before"], "step_s": summary["seconds_per_step"],
            "peak_gb": summary["peak_memory_gb"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", default="grpo.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("extra", nargs="*", help="after --: flags for the script")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for dtype in args.dtypes:
            for seed in args.seeds:
                rows.append(run(args.script, dtype, seed, args.extra, folder))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.script} {' '.join(args.extra)}; native bf16 on this CPU: {native_bf16() or 'no'}")
    print(f"{'compute':<10}{'seed':>5}{'pass@1 before':>15}{'after':>8}{'gain':>8}{'s/step':>9}{'peak GB':>9}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['seed']:>5}{r['before']:>15.3f}{r['after']:>8.3f}{r['gain']:>+8.3f}"
              f"{r['step_s']:>9.1f}{r['peak_gb']:>9.2f}")
    means = {}
    for dtype in args.dtypes:
        gains = [r["gain"] for r in rows if r["dtype"] == dtype]
        steps = [r["step_s"] for r in rows if r["dtype"] == dtype]
        means[dtype] = (statistics.mean(gains), statistics.mean(steps))
        spread = f"{min(gains):+.3f}..{max(gains):+.3f}" + (f", std {statistics.stdev(gains):.3f}"
                                                            if len(gains) > 1 else "")
        print(f"{dtype}: pass@1 gain mean {means[dtype][0]:+.3f} ({spread}); {means[dtype][1]:.1f} s per step")
    if len(means) == 2:
        print(f"bf16 / fp32: step time {means['bfloat16'][1] / means['float32'][1]:.2f}x; mean gain difference "
              f"{means['bfloat16'][0] - means['float32'][0]:+.3f}")


if __name__ == "__main__":
    main()
