"""SamplingEvolve's search against independent sampling over seeds, and the prompt variants that lost.

    python tests/bench_sampling_evolve.py                          # the script's prompt, 3 seeds
    python tests/bench_sampling_evolve.py --variants script old chat no-ruled-out latest-parents
    python tests/bench_sampling_evolve.py --seeds 0 --problems 8 --rounds 1    # a quick look

Each (variant, seed) is one `sampling_evolve.py --mode search` run on the same held-out problems
(--problems of the built-in task), in this process, with the variant's evolution prompt swapped in.
For every round it reports the share of problems solved by evolution, by independent samples of the
bare prompt at the same number of samples and at the same tokens read + written, as the mean over
seeds and the spread (lowest and highest), then the tokens each arm read and wrote (means).

Variants (the script's own is `script`):
  script          sampling_evolve.py as it is
  old             the earlier prompt: parents best reward first, then the latest failures (one per
                  final answer), "Write a new, improved solution. Do not repeat an answer marked
                  incorrect. The problem again: <x>", no ruled-out list, copied labels scored
  chat            the attempts replayed as a conversation (x, each attempt as the assistant's turn,
                  its verdict + "Try again." as the user's); parents as in the script
  no-ruled-out    the script's prompt without the ruled-out list
  latest-parents  the script's prompt with the earlier parent choice (best first, then latest)
  no-parents      the ruled-out list alone (the script's --n-parents 0)
Any other flag is passed to every run (e.g. --children 2, --temperature 0.7).
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sampling_evolve as se  # noqa: E402
import verifier  # noqa: E402

SCRIPT = {name: getattr(se, name) for name in ("evolution_prompt", "drop_copied_scaffold",
                                               "select_parents", "ruled_out")}


def latest_parents(db, n_parents):
    """The earlier choice: the best reward first (the latest among ties), then the latest failures,
    skipping one whose final answer was already picked."""
    best = max(db, key=lambda node: (node.reward, node.id))
    picked, answers = [best], {best.answer}
    for node in reversed(db):
        if len(picked) < n_parents and node.reward < 1 and node.answer not in answers:
            picked.append(node)
            answers.add(node.answer)
    return picked[:n_parents]


def old_prompt(tokenizer, question, db, args):
    parents = latest_parents(db, args.n_parents)
    parts = [question, "", se.HEADER]
    for node in parents:
        parts += ["", "Attempt:", se.shown_attempt(node.text, args.max_attempt_chars),
                  f"Verdict: {node.feedback}"]
    parts += ["", "Write a new, improved solution. Do not repeat an answer marked incorrect. "
                  f"The problem again: {question}"]
    return se.encode_prompt(tokenizer, "\n".join(parts), args.system_prompt), parents


def chat_prompt(tokenizer, question, db, args):
    parents = se.select_parents(db, args.n_parents)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": question})
    for node in reversed(parents):  # a conversation runs oldest first
        messages += [{"role": "assistant",
                      "content": se.shown_attempt(node.text, args.max_attempt_chars)},
                     {"role": "user", "content": f"{node.feedback} Try again."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"], parents


def keep_all(tokenizer, ids):
    return ids, tokenizer.decode(ids, skip_special_tokens=True), False


VARIANTS = {
    "script": {},
    "old": {"evolution_prompt": old_prompt, "drop_copied_scaffold": keep_all},
    "chat": {"evolution_prompt": chat_prompt},
    "no-ruled-out": {"ruled_out": lambda db, limit=None: []},
    "latest-parents": {"select_parents": latest_parents},
    "no-parents": {"flags": ["--n-parents", "0"]},
}


def run(variant, seed, args, rest, out):
    for name, function in SCRIPT.items():
        setattr(se, name, VARIANTS[variant].get(name, function))
    cuts, drop = [], se.drop_copied_scaffold

    def counted(tokenizer, ids):  # how many children copied a label (the trees only say truncated)
        kept = drop(tokenizer, ids)
        cuts.append(kept[2])
        return kept
    se.drop_copied_scaffold = counted
    folder = os.path.join(out, f"{variant}_seed{seed}")
    flags = ["--mode", "search", "--rounds", str(args.rounds), "--eval-problems", str(args.problems),
             "--seed", str(seed), "--output-dir", folder, *VARIANTS[variant].get("flags", []), *rest]
    summary = se.main(flags)
    trees = [json.loads(line) for line in open(os.path.join(folder, "evolution_trees.jsonl"))]
    children = [node for tree in trees for node in tree["nodes"] if node["round"] > 0]
    shown = [{n["answer"] for n in tree["nodes"] if n["reward"] < 1 and n["answer"]} for tree in trees]
    repeats = sum(1 for tree, wrong in zip(trees, shown) for node in tree["nodes"]
                  if node["round"] > 0 and node["answer"] in wrong
                  and any(n["answer"] == node["answer"] for n in tree["nodes"]
                          if n["round"] < node["round"]))
    summary["children"] = {"total": len(children), "right": sum(n["reward"] >= 1 for n in children),
                           "no_answer": sum(n["answer"] is None for n in children),
                           "repeat_wrong": repeats, "copied_labels": sum(cuts)}
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["script"], choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--problems", type=int, default=20, help="held-out problems")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-dir", help="default: a temporary folder")
    args, rest = parser.parse_known_args()
    out = args.output_dir or tempfile.mkdtemp(prefix="bench_sampling_evolve_")
    results = {}
    for variant in args.variants:
        for seed in args.seeds:
            results[f"{variant}_seed{seed}"] = summary = run(variant, seed, args, rest, out)
            with open(os.path.join(out, "bench.json"), "w") as f:
                json.dump(results, f, indent=1)
            print(f"{variant} seed {seed}: children {summary['children']}", flush=True)
    arms = ("evolve", "independent", "independent_same_tokens")
    print(f"\n{args.problems} held-out problems ({verifier.ARITH_TEMPLATE}), seeds {args.seeds}: "
          "share solved, mean [lowest, highest] over seeds; tokens read + written (means)")
    print(f"{'variant':<15} {'round':>5} {'samples':>7} | {'evolve':^19} | {'independent':^19} | "
          f"{'same tokens':^19} | {'evolve':^13} | {'independent':^13} | {'same tokens':^13}")
    for variant in args.variants:
        runs = [results[f"{variant}_seed{seed}"]["rounds"] for seed in args.seeds]
        for r, row in enumerate(runs[0]):
            solved = [[rounds[r][arm]["solved"] for rounds in runs] for arm in arms]
            tokens = [[(rounds[r][arm]["tokens_read"], rounds[r][arm]["tokens_written"])
                       for rounds in runs] for arm in arms]
            print(f"{variant:<15} {row['round']:>5} {row['samples_per_problem']:>7} | " + " | ".join(
                f"{np.mean(s):.3f} [{min(s):.2f}, {max(s):.2f}]" for s in solved) + " | " + " | ".join(
                "{:>6.0f}+{:<6.0f}".format(*np.mean(t, axis=0)) for t in tokens))
    print(f"runs saved in {out}")


if __name__ == "__main__":
    main()
