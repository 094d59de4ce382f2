"""grpo.py vs w2spo.py from the same model, seed, task and step schedule, side by side.

The paper's claim (arXiv 2607.16205): at the same sampling budget, fewer all-wrong groups and a
faster step than GRPO. This runs both scripts for real (default: SmolLM2-135M-Instruct on
arith-steps, --max-new-tokens 48, 8 prompts x G = 8 per step) and prints sampled tokens, all-wrong
group fraction, held-out pass@1 before/after and seconds per step. Both sample with the same
--prompts-per-step and --group-size; w2spo's prefix-sharing groups sample fewer tokens per step, so it
gets extra steps (--match-budget, default on) until its sampled tokens reach GRPO's.

    python tests/bench_w2spo.py                          # ~20 minutes on 2 CPU cores
    python tests/bench_w2spo.py --steps 3 --eval-problems 16   # a quick look
"""
import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
import w2spo  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="GRPO optimizer steps")
    parser.add_argument("--eval-problems", type=int, default=32)
    parser.add_argument("--no-match-budget", action="store_true", help="same number of steps for both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("extra", nargs="*", help="flags passed to both scripts (after --)")
    args = parser.parse_args()
    common = ["--dataset", "arith-steps", "--max-new-tokens", "48", "--eval-problems", str(args.eval_problems),
              "--seed", str(args.seed), *args.extra]
    out = Path(tempfile.mkdtemp(prefix="bench_w2spo_"))

    # GRPO's metrics have no all-wrong fraction: observe the rewards it hands to group_advantages.
    seen = []
    original = grpo.group_advantages

    def observed(rewards, group_size, scale="group"):
        grouped = rewards.view(-1, group_size)
        seen.append((grouped.sum(dim=1) == 0).float().mean().item())
        return original(rewards, group_size, scale)

    grpo.group_advantages = observed
    g = grpo.main([*common, "--steps", str(args.steps), "--output-dir", str(out / "grpo")])
    grpo.group_advantages = original
    g_records = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    g_tokens = sum(r["tokens_sampled"] for r in g_records)

    steps = args.steps
    if not args.no_match_budget:  # one probe step's tokens decide how many steps reach GRPO's budget
        probe = w2spo.main([*common, "--steps", "1", "--eval-problems", "1", "--eval-samples", "1", "--eval-k", "1",
                            "--output-dir", str(out / "probe")])
        per_step = json.loads((out / "probe" / "metrics.jsonl").read_text().splitlines()[0])["tokens_sampled"]
        steps = max(1, round(g_tokens / per_step))
        print(f"w2spo probe step sampled {per_step} tokens; GRPO sampled {g_tokens} in {args.steps} steps "
              f"-> w2spo runs {steps} steps", file=sys.stderr)
        del probe
    w = w2spo.main([*common, "--steps", str(steps), "--output-dir", str(out / "w2spo")])
    w_records = [json.loads(line) for line in (out / "w2spo" / "metrics.jsonl").read_text().splitlines()]
    w_tokens = sum(r["tokens_sampled"] for r in w_records)

    rows = [("steps", args.steps, steps),
            ("tokens sampled", g_tokens, w_tokens),
            ("  of which auxiliary", 0, w["aux_tokens"]),
            ("sequences trained (A != 0)", sum(r.get("trained_sequences", 0) for r in g_records),
             sum(r.get("trained_sequences", 0) for r in w_records)),
            ("tokens trained", "whole rows", w["trained_tokens"]),
            ("all-wrong group fraction", sum(seen) / len(seen), w["all_wrong_frac_mean"]),
            ("zero-std group fraction", sum(r["frac_zero_std"] for r in g_records) / len(g_records),
             sum(r.get("frac_zero_std", 0) for r in w_records) / len(w_records)),
            ("pass@1 before", g["pass@1_before"], w["pass@1_before"]),
            ("pass@1 after", g["pass@1_after"], w["pass@1_after"]),
            ("seconds / step", g["seconds_per_step"], w["seconds_per_step"]),
            ("seconds / 1k sampled tokens", 1000 * g["train_seconds"] / g_tokens, 1000 * w["train_seconds"] / w_tokens)]
    print(f"\n{'':30s} {'grpo.py':>12s} {'w2spo.py':>12s}")
    for name, a, b in rows:
        fmt = lambda v: f"{v:12.3f}" if isinstance(v, float) and not math.isnan(v) else f"{str(v):>12s}"
        print(f"{name:30s} {fmt(a)} {fmt(b)}")
    print(f"(outputs in {out})")


if __name__ == "__main__":
    main()
