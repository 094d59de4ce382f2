"""Side by side: every method on the same task, seed and budget; one table, and plots.

    python tests/compare.py              # the README's table (about 1 hour on a 2-core CPU)
    python tests/compare.py --plot       # also PNGs (needs matplotlib: pip install matplotlib)
    python tests/compare.py --quick      # a few minutes: the same pipeline at toy sizes (what CI runs)
    python tests/compare.py --budget-counts read+written --output-dir runs/compare-read   # see below

Each script runs in its own process, with flags, exactly as a user would run it; its peak memory (the
process's maximum RSS) and wall time are measured from outside, so every method is measured the same way.

Training (grpo.py, passk.py, w2spo.py, sampling_evolve.py --mode train): the same model, seed, task,
prompts x group size, completion length, learning rate and sampled-token budget. --token-budget stops a
run after the step at which the tokens it sampled (wrote) for training reach the budget: each step's
tokens_sampled in metrics.jsonl, what Run.end_step sums. A method that samples more per step
(SamplingEvolve's evolution rounds, W2SPO's continuations) takes fewer optimizer steps. With
--budget-counts read+written every script's --budget-counts is set so, and the budget (read_budget below)
counts the prompt tokens each sample reads too (tokens_read: SamplingEvolve's long evolution prompts,
W2SPO's states), so a method that reads long prompts pays for them.
The task is arith-steps (verifier.py): the model writes a short working before its answer, so W2SPO has a
middle of a trajectory to branch into, and the 135M model leaves all-wrong groups for SamplingEvolve to
rescue. All four evaluate on the same held-out problems before (the same number for all: same seed, same
weights), every --eval-every steps, and after.

Search (rse_search.py, sampling_evolve.py --mode search): no training, the same held-out problems, the
same solver samples per problem (RSE: R rounds x K; SamplingEvolve: K first samples, then C children in
each of R - 1 rounds, with K = C) at the same temperature, with top-p and top-k off for both. Each carries
its own plain-sampling baseline of the same sample count (SamplingEvolve also one of the same tokens read
+ written). Per round: solved so far, and tokens read and written so far, for every method and baseline
(RSE's include its distiller's prompts and replies up to the bank the round read: round r's distillation
builds round r + 1's bank, so it counts from row r + 1 on).

Writes <output-dir>/compare.json (everything), compare.md (the tables), and with --plot train.png and
search.png; each run's own output is under <output-dir>/<method>/.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name, script, method-specific flags (everything else is the same for all)
TRAINING = [("grpo", "grpo.py", []), ("passk", "passk.py", []), ("w2spo", "w2spo.py", []),
            ("sampling_evolve", "sampling_evolve.py", ["--mode", "train"])]
SETTINGS = {  # the shared flags of each size; the README's table comes from "full"
    "full": {"train": {"--prompts-per-step": 8, "--group-size": 8, "--micro-batch": 8, "--max-new-tokens": 48,
                       "--lr": 3e-5, "--token-budget": 15000, "--steps": 30, "--eval-problems": 32,
                       "--eval-samples": 8, "--eval-k": 4, "--eval-every": 3},
             "read_budget": 65000,  # read+written: where grpo.py's 15,000-token run ends (step 16)
             "passk_k": 4,
             "search": {"problems": 20, "rounds": 3, "samples": 4, "max_new_tokens": 48, "temperature": 0.6}},
    "quick": {"train": {"--prompts-per-step": 2, "--group-size": 4, "--micro-batch": 4, "--max-new-tokens": 24,
                        "--lr": 3e-5, "--token-budget": 250, "--steps": 3, "--eval-problems": 2,
                        "--eval-samples": 4, "--eval-k": 2, "--eval-every": 1},
              "read_budget": 1000,
              "passk_k": 2,
              "search": {"problems": 2, "rounds": 2, "samples": 2, "max_new_tokens": 24, "temperature": 0.6}},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Every method on the same budget: one table (see the docstring).")
    parser.add_argument("--quick", action="store_true", help="toy sizes, a few minutes (CI)")
    parser.add_argument("--plot", action="store_true", help="also write train.png and search.png (needs matplotlib)")
    parser.add_argument("--model", default="smollm2-135m", help="the same model for every method")
    parser.add_argument("--dataset", default="arith-steps", help="the same task for every method")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-counts", default="written", choices=["written", "read+written"],
                        help="what every trainer's --token-budget counts (read+written: read_budget)")
    parser.add_argument("--only", nargs="+", default=None,
                        choices=[t[0] for t in TRAINING] + ["rse_search", "evolve_search"],
                        help="run only these (the others are read back from an earlier run's output if there)")
    parser.add_argument("--no-run", action="store_true",
                        help="run nothing: rebuild the tables (and --plot) from an earlier run in --output-dir")
    parser.add_argument("--output-dir", default="runs/compare")
    return parser.parse_args(argv)


def flag_list(flags):
    return [str(x) for key, value in flags.items() for x in (key, value)]


def run_script(script, flags, folder):
    """Run `python script flags --output-dir folder` as a user would (its progress bars on this terminal);
    return (its summary.json, wall seconds, peak RSS in GB of that process alone, from wait4)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / script), *flags, "--output-dir", str(folder)]
    print(f"\n$ {' '.join(command[1:])}", file=sys.stderr, flush=True)
    start = time.time()
    process = subprocess.Popen(command, cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)  # the child's own rusage (RUSAGE_CHILDREN would pool them)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"error: {script} exited with {process.returncode} (its output is above)")
    measured = {"wall_seconds": time.time() - start, "peak_rss_gb": usage.ru_maxrss / 2**20}
    (folder / "measured.json").write_text(json.dumps(measured))
    return json.loads((folder / "summary.json").read_text()), measured


def read_back(folder):
    """An earlier run's results (for --only), or None."""
    if not (folder / "summary.json").exists() or not (folder / "measured.json").exists():
        return None
    return json.loads((folder / "summary.json").read_text()), json.loads((folder / "measured.json").read_text())


def training_row(name, summary, measured, metrics, prompts_per_step):
    """One row of the training table, plus the curves (cumulative sampled tokens -> reward, pass@1)."""
    tokens, reward_curve, eval_curve = 0, [], [(0, summary["pass@1_before"])]
    all_wrong, still_wrong = [], []
    read = sum(record["tokens_read"] for record in metrics) if all("tokens_read" in r for r in metrics) else None
    for record in metrics:
        # what each script counts against --token-budget (Run.end_step's tokens_sampled): every token any
        # model wrote for training
        tokens += record["tokens_sampled"]
        reward_curve.append((tokens, record["reward_mean"]))
        if "eval_pass@1" in record:
            eval_curve.append((tokens, record["eval_pass@1"]))
        if "all_wrong_groups" in record:  # sampling_evolve: counts of the step's prompts, before and after rescue
            all_wrong.append(record["all_wrong_groups"] / prompts_per_step)
            still_wrong.append((record["all_wrong_groups"] - record["rescued_groups"]) / prompts_per_step)
        elif record.get("all_wrong_frac") is not None:
            all_wrong.append(record["all_wrong_frac"])
    eval_curve.append((tokens, summary["pass@1_after"]))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"method": name, "steps": summary["steps"], "tokens_sampled": tokens, "tokens_read": read,
            "evolve_tokens_written": sum(r.get("evolve_tokens_written", 0) for r in metrics)
            if name == "sampling_evolve" else None,
            "pass@1_before": summary["pass@1_before"], "pass@1_after": summary["pass@1_after"],
            "pass@k_before": summary["pass@k_before"], "pass@k_after": summary["pass@k_after"], "k": summary["k"],
            "all_wrong_frac": mean(all_wrong), "all_wrong_after_rescue": mean(still_wrong) if still_wrong else None,
            "seconds_per_step": summary["seconds_per_step"], "train_seconds": summary["train_seconds"],
            "wall_seconds": measured["wall_seconds"], "peak_rss_gb": measured["peak_rss_gb"],
            "reward_curve": reward_curve, "eval_curve": eval_curve}


def search_rows(rse, evolve):
    """Per round: samples per problem so far; for both methods and their baselines the cumulative solved rate and
    tokens read and written so far. RSE's summary counts each round's tokens: its solver's, and its distiller's,
    which builds the NEXT round's bank, so row r sums the solver of rounds 0..r and the distiller of rounds
    0..r - 1 (what was spent to reach row r's solved); its round 0 draws --first-round-samples (K_0), later
    rounds --samples-per-round (K). Its baseline: solver only, round 0 shared. SamplingEvolve's arms are
    cumulative already (round 0 shared by every arm)."""
    rows = []
    so_far = lambda rounds, keys: sum(x[key] for x in rounds for key in keys)  # noqa: E731
    first_round = rse["args"].get("first_round_samples") or rse["samples_per_round"]  # K_0
    for r, rse_row in enumerate(rse["rounds"]):
        evo, baseline = evolve["rounds"][r], rse["baseline"][: r + 1]
        solver, distilled = rse["rounds"][: r + 1], rse["rounds"][:r]  # distillation of round r: for r + 1
        row = {"round": r, "samples_per_problem": first_round + r * rse["samples_per_round"],
               "evolve_samples_per_problem": evo["samples_per_problem"],
               "rse_pass@1": rse_row["pass@1"], "rse_baseline_pass@1": baseline[r]["pass@1"] if baseline else None,
               "rse_solved": rse_row["solved_cumulative"],
               "rse_tokens_read": so_far(solver, ("solver_prompt_tokens",))
               + so_far(distilled, ("distill_prompt_tokens",)),
               "rse_tokens_written": so_far(solver, ("solver_tokens",)) + so_far(distilled, ("distill_tokens",)),
               "rse_baseline_solved": baseline[r]["solved_cumulative"] if baseline else None,
               "rse_baseline_tokens_read": so_far(baseline, ("solver_prompt_tokens",)) if baseline else None,
               "rse_baseline_tokens_written": so_far(baseline, ("solver_tokens",)) if baseline else None}
        for arm, name in (("evolve", "evolve"), ("independent", "independent"),
                          ("independent_same_tokens", "same_tokens")):
            row.update({f"{name}_solved": evo[arm]["solved"], f"{name}_tokens_read": evo[arm]["tokens_read"],
                        f"{name}_tokens_written": evo[arm]["tokens_written"]})
        rows.append(row)
    return rows


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def count(x):
    return "-" if x is None else str(x)


def tables_markdown(train, search, search_meta, budget_counts="written"):
    lines = ["| method | steps | tokens sampled (written) | tokens read | pass@1 % before → after "
             "| pass@k % before → after | all-wrong groups % | s / step | peak RSS GB | wall |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in train:
        wrong = pct(row["all_wrong_frac"])
        if row["all_wrong_after_rescue"] is not None:
            wrong += f" ({pct(row['all_wrong_after_rescue'])} after rescue)"
        written = str(row["tokens_sampled"]) + (f" ({row['evolve_tokens_written']} by evolution)"
                                                if row["evolve_tokens_written"] is not None else "")
        lines.append(f"| {row['method']} | {row['steps']} | {written} | {count(row['tokens_read'])} | "
                     f"{pct(row['pass@1_before'])} → "
                     f"**{pct(row['pass@1_after'])}** | {pct(row['pass@k_before'])} → {pct(row['pass@k_after'])} "
                     f"(k={row['k']}) | {wrong} | {row['seconds_per_step']:.1f} | {row['peak_rss_gb']:.2f} | "
                     f"{row['wall_seconds'] / 60:.1f} min |")
    lines += ["", "Tokens read: the prompt tokens each sample reads; --token-budget counted "
                  + ("tokens sampled." if budget_counts == "written" else "tokens read + sampled.")]
    if search:
        def tokens(row, name):
            return f"{count(row[name + '_tokens_read'])} / {count(row[name + '_tokens_written'])}"
        lines += ["", "| round | samples per problem | RSE pass@1 % (its baseline) | RSE solved % | RSE tokens read / "
                      "written | its plain baseline solved % | its tokens read / written | SamplingEvolve solved % "
                      "| SamplingEvolve tokens read / written | its independent baseline solved % | its tokens read / "
                      "written | its same-tokens baseline solved % | its tokens read / written |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in search:
            lines.append(f"| {row['round']} | {row['samples_per_problem']} | {pct(row['rse_pass@1'])} "
                         f"({pct(row['rse_baseline_pass@1'])}) | {pct(row['rse_solved'])} | {tokens(row, 'rse')} | "
                         f"{pct(row['rse_baseline_solved'])} | {tokens(row, 'rse_baseline')} | "
                         f"{pct(row['evolve_solved'])} | {tokens(row, 'evolve')} | {pct(row['independent_solved'])} | "
                         f"{tokens(row, 'independent')} | {pct(row['same_tokens_solved'])} | "
                         f"{tokens(row, 'same_tokens')} |")
        lines.append("")
        lines.append(f"Search: {search_meta['problems']} held-out problems; wall time RSE "
                     f"{search_meta['rse_wall'] / 60:.1f} min (peak RSS {search_meta['rse_rss']:.2f} GB), "
                     f"SamplingEvolve {search_meta['evolve_wall'] / 60:.1f} min "
                     f"(peak RSS {search_meta['evolve_rss']:.2f} GB). Solved and tokens are so far (cumulative); "
                     f"a token read is a prompt token read by one sample; RSE's tokens include its distiller's "
                     f"prompts and replies for the banks read so far (round r's distillation counts from "
                     f"row r + 1); round 0 is shared by each method and its baselines.")
    return "\n".join(lines) + "\n"


def plot(train, search, folder):
    try:
        import matplotlib
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); the table is written, no PNGs",
              file=sys.stderr)
        return []
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    written = []
    fig, (ax_reward, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    for row in train:
        ax_reward.plot(*zip(*row["reward_curve"]), marker=".", label=row["method"])
        ax_eval.plot(*zip(*row["eval_curve"]), marker="o", label=row["method"])
    ax_reward.set(xlabel="tokens sampled for training", ylabel="train reward (mean, sampled groups)",
                  title="train reward")
    ax_eval.set(xlabel="tokens sampled for training", ylabel="held-out pass@1", title="held-out pass@1")
    for ax in (ax_reward, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "train.png", dpi=110)
    written.append(folder / "train.png")
    if search:
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [row["samples_per_problem"] for row in search]
        for key, label, style in (("rse_solved", "RSE", "o-"), ("rse_baseline_solved", "RSE's plain baseline", "o--"),
                                  ("evolve_solved", "SamplingEvolve", "s-"),
                                  ("independent_solved", "SamplingEvolve's independent baseline", "s--")):
            ax.plot(x, [row[key] for row in search], style, label=label)
        ax.set(xlabel="solver samples per problem", ylabel="solved (cumulative)", title="search, by round",
               ylim=(-0.02, 1.02))
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "search.png", dpi=110)
        written.append(folder / "search.png")
    return written


def main(argv=None):
    args = parse_args(argv)
    size = SETTINGS["quick" if args.quick else "full"]
    out = Path(args.output_dir)
    same = ["--model", args.model, "--dataset", args.dataset, "--seed", str(args.seed)]
    wanted = lambda name: not args.no_run and (args.only is None or name in args.only)  # noqa: E731

    train = []
    for name, script, own in TRAINING:
        own = own + (["--k", str(size["passk_k"])] if name == "passk" else [])
        train_flags = dict(size["train"])
        if args.budget_counts == "read+written":
            train_flags.update({"--token-budget": size["read_budget"], "--budget-counts": "read+written"})
        flags = same + flag_list(train_flags) + own
        result = run_script(script, flags, out / name) if wanted(name) else read_back(out / name)
        if result is None:
            continue
        metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        train.append(training_row(name, *result, metrics, size["train"]["--prompts-per-step"]))

    s = size["search"]
    shared = same + ["--eval-problems", str(s["problems"]), "--max-new-tokens", str(s["max_new_tokens"]),
                     "--temperature", str(s["temperature"])]
    rse_flags = shared + ["--rounds", str(s["rounds"]), "--samples-per-round", str(s["samples"]),
                          "--top-p", "1.0", "--top-k", "0"]
    # K first samples + K children in each later round = RSE's K per round, round for round
    evolve_flags = shared + ["--mode", "search", "--group-size", str(s["samples"]), "--children", str(s["samples"]),
                             "--rounds", str(s["rounds"] - 1)]
    rse = run_script("rse_search.py", rse_flags, out / "rse_search") if wanted("rse_search") \
        else read_back(out / "rse_search")
    evolve = run_script("sampling_evolve.py", evolve_flags, out / "evolve_search") if wanted("evolve_search") \
        else read_back(out / "evolve_search")
    search, search_meta = [], {}
    if rse and evolve:
        search = search_rows(rse[0], evolve[0])
        search_meta = {"problems": rse[0]["problems"], "rse_wall": rse[1]["wall_seconds"],
                       "rse_rss": rse[1]["peak_rss_gb"], "evolve_wall": evolve[1]["wall_seconds"],
                       "evolve_rss": evolve[1]["peak_rss_gb"]}

    befores = {row["method"]: row["pass@1_before"] for row in train}
    if len(set(befores.values())) > 1:  # same seed, same weights, same problems: should never differ
        print(f"warning: the training runs started from different pass@1: {befores}", file=sys.stderr)
    table = tables_markdown(train, search, search_meta, args.budget_counts)
    print("\n" + table)
    import torch
    import transformers
    machine = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
               "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()}
    result = {"settings": {"size": "quick" if args.quick else "full", "model": args.model, "dataset": args.dataset,
                           "seed": args.seed, "budget_counts": args.budget_counts, **size}, "machine": machine, "training": train, "search": search,
              "search_meta": search_meta}
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    (out / "compare.md").write_text(table)
    written = plot(train, search, out) if args.plot else []
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'}" + "".join(f", {p}" for p in written), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
