"""grpo.py vs w2spo.py at the same sampled-token budget, side by side.

The paper's claim (arXiv 2607.16205): at the same sampling budget, fewer all-wrong groups and a
faster step than GRPO. This runs both scripts for real on the same model, seed and task (default:
SmolLM2-135M-Instruct on arith-steps, --max-new-tokens 48, 8 prompts x G = 8 per step): grpo.py for
--steps steps, then w2spo.py with --token-budget set to what GRPO sampled (it stops after the step
that reaches it). It prints sampled and trained tokens, all-wrong and zero-std group fractions,
held-out pass@1 and, the cost measure, seconds of training per 1,000 sampled tokens (train_seconds:
sampling and updates, evaluation excluded).

    python tests/bench_w2spo.py                                  # 6 GRPO steps
    python tests/bench_w2spo.py --steps 2 --eval-problems 8      # a quick look
    python tests/bench_w2spo.py -- --aux-is clip                 # flags after -- go to both scripts
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
import w2spo  # noqa: E402


def mean_of(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="GRPO's optimizer steps")
    parser.add_argument("--eval-problems", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("extra", nargs="*", help="flags for both scripts (after --)")
    args = parser.parse_args()
    common = ["--dataset", "arith-steps", "--max-new-tokens", "48", "--eval-problems",
              str(args.eval_problems), "--seed", str(args.seed), *args.extra]
    out = Path(tempfile.mkdtemp(prefix="bench_w2spo_"))
    g = grpo.main([*common, "--steps", str(args.steps), "--output-dir", str(out / "grpo")])
    w = w2spo.main([*common, "--steps", "1000", "--token-budget", str(g["tokens_sampled"]),
                    "--output-dir", str(out / "w2spo")])
    logs = [[json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("grpo", "w2spo")]
    rows = [("steps", g["steps"], w["steps"]),
            ("tokens sampled", g["tokens_sampled"], w["tokens_sampled"]),
            ("  of which auxiliary", 0, w["tokens_aux"]),
            ("tokens trained", "whole rows", w["tokens_trained"]),
            ("sequences trained (A != 0)", *(sum(r.get("trained_sequences", 0) for r in log)
                                             for log in logs)),
            ("all-wrong group fraction", *(mean_of(log, "all_wrong_frac") for log in logs)),
            ("zero-std group fraction", *(mean_of(log, "frac_zero_std") for log in logs)),
            ("pass@1 before", g["pass@1_before"], w["pass@1_before"]),
            ("pass@1 after", g["pass@1_after"], w["pass@1_after"]),
            ("seconds / step", g["seconds_per_step"], w["seconds_per_step"]),
            ("seconds / 1k sampled tokens", *(1000 * s["train_seconds"] / s["tokens_sampled"]
                                              for s in (g, w)))]
    print(f"\n{'':30s} {'grpo.py':>12s} {'w2spo.py':>12s}")
    for name, a, b in rows:
        print(f"{name:30s}", *(f"{v:12.3f}" if isinstance(v, float) else f"{v!s:>12s}" for v in (a, b)))
    print(f"(outputs in {out})")


if __name__ == "__main__":
    main()
