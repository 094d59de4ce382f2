"""Cold start: sampling_evolve.py (GRPO + evolution of all-wrong groups) against grpo.py, from a harder
built-in setting where the base model solves few problems, at the same budget of SAMPLED tokens (evolution's
extra tokens counted). Prints both held-out pass@1 curves side by side against the tokens each had sampled.

    python tests/bench_sampling_evolve.py                       # arith:20-99, 8 steps of sampling_evolve
    python tests/bench_sampling_evolve.py --steps 4 --eval-every 2 --eval-problems 16

How the budgets are matched: sampling_evolve runs --steps steps first; its total of sampled tokens
(group samples + evolution children) is the budget. grpo.py then gets as many steps as that budget buys
at the group-sampling cost per step measured in the first run (same problems, same seed, same flags), so the
two totals agree to within about one step; both totals are printed. Evaluation points are every --eval-every
steps of each run, so they fall at different token counts: read the curves against the tokens column.
Any other flag (e.g. --lr, --group-size) is passed to both scripts."""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import sampling_evolve  # noqa: E402


def curve(folder, summary):
    """[(step, cumulative sampled tokens, held-out pass@1)] from a run's metrics.jsonl and summary."""
    points, tokens = [(0, 0, summary["pass@1_before"])], 0
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    for r in records:
        tokens += r.get("tokens_sampled_total", r["tokens_sampled"])
        if "eval_pass@1" in r:
            points.append((r["step"], tokens, r["eval_pass@1"]))
    points.append((records[-1]["step"], tokens, summary["pass@1_after"]))
    return points, records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="arith:20-99")
    parser.add_argument("--steps", type=int, default=8, help="steps of sampling_evolve.py (grpo.py: same tokens)")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-problems", type=int, default=32)
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args, rest = parser.parse_known_args()
    out = args.output_dir or tempfile.mkdtemp(prefix="bench_sampling_evolve_")
    common = ["--dataset", args.dataset, "--eval-every", str(args.eval_every),
              "--eval-problems", str(args.eval_problems), *rest]

    evolve_dir = os.path.join(out, "sampling_evolve")
    evolve = sampling_evolve.main([*common, "--steps", str(args.steps), "--output-dir", evolve_dir])
    evolve_points, records = curve(evolve_dir, evolve)
    budget = evolve_points[-1][1]
    per_step = sum(r["tokens_sampled"] for r in records) / len(records)  # grpo's own cost of a step
    grpo_steps = max(1, round(budget / per_step))

    grpo_dir = os.path.join(out, "grpo")
    baseline = grpo.main([*common, "--steps", str(grpo_steps), "--output-dir", grpo_dir])
    grpo_points, _ = curve(grpo_dir, baseline)

    print(f"\n{args.dataset}: held-out pass@1 against sampled tokens (same seed, same problems); "
          f"sampling_evolve rescued {evolve['rescued_groups']} of {evolve['all_wrong_groups']} all-wrong groups, "
          f"trained {evolve['evolved_trained']} evolved samples, evolution cost {evolve['evolve_tokens']} tokens")
    print(f"{'sampling_evolve':^32} | {'grpo':^32}")
    print(f"{'step':>6} {'tokens':>10} {'pass@1':>8}       | {'step':>6} {'tokens':>10} {'pass@1':>8}")
    for i in range(max(len(evolve_points), len(grpo_points))):
        left = "{:>6} {:>10} {:>8.3f}      ".format(*evolve_points[i]) if i < len(evolve_points) else " " * 32
        right = "{:>6} {:>10} {:>8.3f}".format(*grpo_points[i]) if i < len(grpo_points) else ""
        print(f"{left} | {right}")
    print(f"total sampled tokens: sampling_evolve {budget}, grpo {grpo_points[-1][1]} "
          f"(ratio {grpo_points[-1][1] / max(budget, 1):.2f}); wall seconds: sampling_evolve "
          f"{evolve['train_seconds']:.0f}, grpo {baseline['train_seconds']:.0f} (training loop only)")
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"sampling_evolve": evolve_points, "grpo": grpo_points, "budget": budget,
                   "rescued_groups": evolve["rescued_groups"], "all_wrong_groups": evolve["all_wrong_groups"]}, f)
    print(f"curves saved in {out}/bench.json")


if __name__ == "__main__":
    main()
