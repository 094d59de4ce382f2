"""Benchmark: the default run with fp32 compute vs bf16 compute (autocast; fp32 master weights in both).

    python tests/bench_precision.py [--script grpo.py] [extra flags for the script...]

Runs `python grpo.py --dtype float32` and then `--dtype bfloat16`, each in its own process (so each
peak RSS is its own), one after the other in one invocation, with the same seed and flags. Prints for
both: seconds a step spent sampling and updating (means over the steps, from metrics.jsonl), peak
memory, held-out pass@1 before and after; then the bf16 / fp32 ratios. Pick --dtype auto's CPU default
(CPU_AUTO_DTYPE) from this: the faster one that still learns as much."""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script, dtype, extra, folder):
    out = Path(folder) / dtype
    subprocess.run([sys.executable, str(ROOT / script), "--dtype", dtype, "--output-dir", str(out), *extra],
                   check=True, cwd=ROOT)
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sample = sum(r["sample_seconds"] for r in steps) / len(steps)
    step = sum(r["step_seconds"] for r in steps) / len(steps)
    return {"sample_s": sample, "update_s": step - sample, "step_s": step, "peak_gb": summary["peak_memory_gb"],
            "pass1_before": summary["pass@1_before"], "pass1_after": summary["pass@1_after"],
            "compute": summary["compute_dtype"]}


def main():
    argv = sys.argv[1:]
    script = "grpo.py"
    if argv[:1] == ["--script"]:
        script, argv = argv[1], argv[2:]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for dtype in ("float32", "bfloat16"):
            results[dtype] = run(script, dtype, argv, folder)
    print(f"\n{script} {' '.join(argv)}")
    print(f"{'compute':<10}{'sample s/step':>15}{'update s/step':>15}{'step s':>9}{'peak GB':>9}{'pass@1 before':>15}"
          f"{'pass@1 after':>14}")
    for dtype, r in results.items():
        print(f"{dtype:<10}{r['sample_s']:>15.1f}{r['update_s']:>15.1f}{r['step_s']:>9.1f}{r['peak_gb']:>9.2f}"
              f"{r['pass1_before']:>15.3f}{r['pass1_after']:>14.3f}")
    f32, b16 = results["float32"], results["bfloat16"]
    print(f"ratios bf16/fp32: sampling {b16['sample_s'] / f32['sample_s']:.2f}, update "
          f"{b16['update_s'] / f32['update_s']:.2f}, step {b16['step_s'] / f32['step_s']:.2f}, "
          f"peak memory {b16['peak_gb'] / f32['peak_gb']:.2f}; pass@1 gain fp32 "
          f"{f32['pass1_after'] - f32['pass1_before']:+.3f}, bf16 {b16['pass1_after'] - b16['pass1_before']:+.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
