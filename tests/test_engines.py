"""The methods inside TRL 1.16 and verl 0.9.1 (tests/engines/): each adapter against the real engine.

Equalities on one fixed batch (same log-probs, advantages, masks; fp32, within 1e-6 where the two
sides share the log-probs, else the stated tolerance), the documented differences shown to be exactly
those, and short CPU runs: Pass@k in TRL on two processes, W2SPO and SamplingEvolve in TRL for two
steps each. Skipped when an engine is not installed, unless RLVR_REQUIRE_ENGINES=1 (CI sets it), where
a missing engine is a failure. Install: tests/README.md ("The engines")."""
import importlib
import json
import math
import os
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import grpo
import passk
import verifier
import w2spo
from conftest import build_tiny_model

ENGINES = Path(__file__).resolve().parent / "engines"
sys.path.insert(0, str(ENGINES))
REQUIRED = os.environ.get("RLVR_REQUIRE_ENGINES") == "1"
INSTALL = ("pip install -r tests/engines/requirements.txt && "
           "pip install --no-deps -r tests/engines/requirements-no-deps.txt")


def need(module):
    """The engine's module; a skip with the install line, or (RLVR_REQUIRE_ENGINES=1) a failure."""
    if REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed ({INSTALL})")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random Llama of conftest, its tokenizer, and its folder (fp32)."""
    folder = build_tiny_model(tmp_path_factory.mktemp("engines_tiny"))
    model, tokenizer = grpo.load_model(folder, torch.float32, "cpu")
    return model, tokenizer, folder


@pytest.fixture(scope="module")
def tiny_aux(tmp_path_factory):
    """Another tiny random Llama (same tokenizer, other weights): W2SPO's auxiliary in the tests."""
    return build_tiny_model(tmp_path_factory.mktemp("engines_tiny_aux"), seed=1)


def fixed_batch(vocab_size, pad_id, seed=0, lengths=((5, 6), (7, 3), (4, 5), (6, 1))):
    """Random prompts and completions of the given (prompt, completion) lengths, as grpo.py's
    build_batch lays them out: ids, attention [B, L + T], completion mask [B, T], L."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n, _ in lengths]
    completions = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for _, n in lengths]
    ids, attention, mask = grpo.build_batch(prompts, completions, pad_id)
    return ids, attention, mask, ids.shape[1] - mask.shape[1]


def nearby(logp, scale, seed):
    """Log-probs near `logp` (detached): an old policy or a reference a little away from it."""
    return logp.detach() + scale * torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def max_gap(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ============================================================================== GRPO on TRL

def trl_trainer(model, tokenizer, args, tmp_path, **overrides):
    """TRL's GRPOTrainer with trl_grpo.grpo_config(args) (+ overrides), in train mode."""
    need("trl")
    import trl_grpo
    from datasets import Dataset
    from trl import GRPOTrainer
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}] * 8)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, train_dataset=rows,
                          reward_funcs=trl_grpo.reward_function(tokenizer, args),
                          args=trl_grpo.grpo_config(args, str(tmp_path / "trl"), **overrides))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # the Trainer sets it per step; one here
    return trainer


def trl_loss(trainer, ids, attention, mask, L, advantages, old, ref=None):
    """TRL's own _compute_loss (it runs the forward itself) on the fixed batch."""
    inputs = dict(prompt_ids=ids[:, :L], prompt_mask=attention[:, :L], completion_ids=ids[:, L:],
                  completion_mask=mask, advantages=advantages, old_per_token_logps=old,
                  num_items_in_batch=mask.sum())
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return trainer._compute_loss(trainer.model, inputs)


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_grpo_loss_on_trl_equals_ours(tiny, tmp_path, loss_agg, beta):
    """GRPOTrainer._compute_loss with the mapped settings = policy_loss + aggregate_loss (value and
    gradient), ratios on both sides of the clip range."""
    model, tokenizer, folder = tiny
    args = grpo.parse_args(["--model", folder, "--loss-agg", loss_agg, "--beta", str(beta),
                            "--group-size", "4", "--prompts-per-step", "1", "--micro-batch", "4",
                            "--max-new-tokens", "6"])
    trainer = trl_trainer(model, tokenizer, args, tmp_path)
    ids, attention, mask, L = fixed_batch(model.config.vocab_size, tokenizer.pad_token_id)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    model.zero_grad()
    logp = grpo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, 4)[0]  # [B, T]
    old, ref = nearby(logp, 0.3, 1), nearby(logp, 0.5, 2)  # ratios about 0.5 to 2
    token_loss = grpo.policy_loss(logp, old, advantages, args.eps_low, args.eps_high,
                                  ref if beta else None, beta)[0]
    ours = grpo.aggregate_loss(token_loss, mask, loss_agg, mask.sum(), 4, args.max_new_tokens)
    ours.backward()
    ours_grads = grads(model)
    model.zero_grad()
    theirs = trl_loss(trainer, ids, attention, mask, L, advantages, old, ref if beta else None)
    theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert max_gap(ours_grads, grads(model)) < 1e-6
    model.zero_grad()


def test_trl_bias_corrected_kl_is_ours_times_the_ratio(tiny, tmp_path):
    """TRL's default use_bias_correction_kl=True multiplies k3 by rho = pi_theta / pi_old: the loss
    differs from ours by exactly beta x token-mean(k3 (rho - 1))."""
    model, tokenizer, folder = tiny
    args = grpo.parse_args(["--model", folder, "--beta", "0.1", "--group-size", "4",
                            "--prompts-per-step", "1", "--micro-batch", "4", "--max-new-tokens", "6"])
    corrected = trl_trainer(model, tokenizer, args, tmp_path, use_bias_correction_kl=True)
    ids, attention, mask, L = fixed_batch(model.config.vocab_size, tokenizer.pad_token_id)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    with torch.no_grad():
        logp = grpo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, 4)[0]
        old, ref = nearby(logp, 0.3, 1), nearby(logp, 0.5, 2)
        _, _, k3 = grpo.policy_loss(logp, old, advantages, 0.2, 0.28, ref, 0.1)
        ratio = torch.exp(logp - old)
        gap = 0.1 * grpo.aggregate_loss(k3 * (ratio - 1), mask, "token-mean", mask.sum(), 4, 6)
        theirs = trl_loss(corrected, ids, attention, mask, L, advantages, old, ref)
        ours_mapped = trl_loss(trl_trainer(model, tokenizer, args, tmp_path), ids, attention, mask, L,
                               advantages, old, ref)
    assert abs(gap.item()) > 1e-3  # the batch shows the difference
    assert abs((theirs - ours_mapped).item() - gap.item()) < 1e-6


@pytest.mark.parametrize("scale", ["group", "none"])
def test_trl_group_advantage_is_ours_with_bessels_correction(tiny, tmp_path, scale):
    """TRL's advantage, from its own _generate_and_score_completions on fixed rows and rewards:
    scale "none" = ours; "group" = ours x (std_G + 1e-4) / (std_{G-1} + 1e-4), TRL's std divides
    by G - 1 (sqrt((G - 1) / G) of ours away from the 1e-4)."""
    need("trl")
    from datasets import Dataset
    from trl import GRPOTrainer
    import trl_grpo
    model, tokenizer, folder = tiny
    G = 4
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # three groups of 4
    questions = ["a?", "b?", "c?"]

    def rollout(prompts, trainer):  # fixed rows: the prompt's ids, a two-token completion
        rows = [tokenizer(p[-1]["content"])["input_ids"] for p in prompts]
        return {"prompt_ids": rows, "completion_ids": [[5, 6]] * len(rows),
                "logprobs": [[0.0, 0.0]] * len(rows), "fixed_reward": rewards[: len(rows)]}

    args = grpo.parse_args(["--model", folder, "--scale-rewards", scale, "--group-size", str(G),
                            "--prompts-per-step", "3", "--micro-batch", "12"])
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "answer": "0"}
                                 for q in questions])
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, train_dataset=dataset,
                          reward_funcs=lambda completions, fixed_reward, **_: fixed_reward,
                          rollout_func=rollout,
                          args=trl_grpo.grpo_config(args, str(tmp_path / "trl")))
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(row) for row in dataset for _ in range(G)])
    r = torch.tensor(rewards)
    ours = grpo.group_advantages(r, G, scale)
    if scale == "group":
        std_g = r.view(-1, G).std(dim=1, unbiased=False).repeat_interleave(G)
        std_bessel = r.view(-1, G).std(dim=1).repeat_interleave(G)
        ours = ours * (std_g + 1e-4) / (std_bessel + 1e-4)
        assert (out["advantages"][:4] / grpo.group_advantages(r, G)[:4] - math.sqrt(3 / 4)).abs().max() < 1e-3
    torch.testing.assert_close(out["advantages"], ours, atol=1e-6, rtol=0)


def test_trl_adapters_refuse_what_trl_cannot_carry(tiny):
    need("trl")
    import trl_grpo
    import trl_w2spo
    folder = tiny[2]
    with pytest.raises(SystemExit, match="error: --filter-groups has no TRL equivalent"):
        trl_grpo.refuse_unmapped(grpo.parse_args(["--filter-groups"]), grpo.parse_args([]))
    for flags, message in ((["--aux-is", "clip"], "--aux-is clip has no TRL equivalent"),
                           (["--beta", "0.1"], "--beta with auxiliary branches has no TRL")):
        args = w2spo.parse_args(["--model", folder, "--output-dir", str(Path(folder) / "w"), *flags])
        with pytest.raises(SystemExit, match=message):
            trl_w2spo.w2spo_config(args, str(Path(folder) / "w"))


def test_trl_skips_the_optimizer_step_when_no_row_has_a_gradient(tiny, tmp_path):
    """Two steps on one group of fixed completions, rewards forced: the first with signal, the
    second with every reward 0, so every A is 0 (beta = 0). grpo.train_step forwards no row then and
    skips optimizer.step, so AdamW's momentum moves nothing; the TRL trainer of trl_grpo.py does the
    same: the weights after step 2 are those after step 1, and AdamW counted one step."""
    need("trl")
    import trl_grpo
    from datasets import Dataset
    from transformers import TrainerCallback
    folder, G = tiny[2], 4
    args = grpo.parse_args(["--model", folder, "--group-size", str(G), "--prompts-per-step", "1",
                            "--micro-batch", str(G), "--steps", "2", "--lr", "1e-3"])
    step_rewards = [[1.0, 0.0, 0.0, 0.0], [0.0] * G]  # step 2: all wrong, every A = 0
    model, tokenizer = grpo.load_model(folder, torch.float32, "cpu")
    prompt = grpo.encode_prompt(tokenizer, "1 + 1?")
    completions = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for text in ("2", "3", "11", "no")]
    before = [p.detach().clone() for p in model.parameters()]
    # grpo.py: train_step on each step's batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ours = []
    for rewards in step_rewards:
        batch = {"prompts": [prompt] * G, "samples": [{"ids": ids} for ids in completions],
                 "advantages": grpo.group_advantages(torch.tensor(rewards), G)}
        grpo.train_step(model, optimizer, batch, args)
        ours.append([p.detach().clone() for p in model.parameters()])
    assert max_gap(before, ours[0]) > 0 and max_gap(ours[0], ours[1]) == 0
    assert all(state["step"] == 1 for state in optimizer.state.values())
    # TRL: the same two steps through trainer.train(), the rows given by a rollout_func
    model, tokenizer = grpo.load_model(folder, torch.float32, "cpu")
    theirs = []

    class AfterStep(TrainerCallback):
        def on_step_end(self, *_, model=None, **__):
            theirs.append([p.detach().clone() for p in model.parameters()])

    def rollout(prompts, trainer):
        return {"prompt_ids": [prompt] * len(prompts), "completion_ids": completions,
                "logprobs": [[0.0] * len(ids) for ids in completions],
                "forced_reward": step_rewards[trainer.state.global_step]}

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "1 + 1?"}],
                                  "answer": "2"}])
    trainer = trl_grpo.GRPOTrainerSkippingEmptySteps(
        model=model, processing_class=tokenizer, train_dataset=dataset, rollout_func=rollout,
        reward_funcs=lambda completions, forced_reward, **_: forced_reward,
        args=trl_grpo.grpo_config(args, str(tmp_path / "trl")), callbacks=[AfterStep()])
    trainer.train()
    assert trainer.state.global_step == 2
    assert max_gap(before, theirs[0]) > 0  # step 1 moved the weights
    assert max_gap(theirs[0], theirs[1]) == 0  # step 2 did not
    assert all(state["step"] == 1 for state in trainer.optimizer.state.values())


R1_TRACES = {"6 x 7 = 42. So the answer is 42.": 0.0,  # the thinking never closed: no answer
             "6 x 7 = 42.\n</think>\n\nThe answer is 42.": 1.0}


def r1_completions(tokenizer):
    """R1_TRACES as the model writes them (its EOS last), each checked to earn from grpo.py's
    completion_text the reward R1_TRACES gives it."""
    written = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for text in R1_TRACES]
    x = grpo.encode_prompt(tokenizer, "What is 6 x 7?")
    assert tokenizer.decode(x).endswith("<｜Assistant｜><think>\n")  # the template opens it
    ours = [verifier.reward(grpo.completion_text(tokenizer, x, ids), "42") for ids in written]
    assert ours == list(R1_TRACES.values())
    return written


def test_trl_reward_reads_an_open_thinking_as_grpo_py_does(r1_distill_dir, tmp_path):
    """DeepSeek-R1-Distill's template leaves <think> open in the prompt, so grpo.py reads each
    completion after "<think>": "...So the answer is 42." (gold 42) earns 0, a trace that closes
    </think> and then answers earns 1. So do TRL's rewards (GRPOTrainer._calculate_rewards) with
    trl_grpo's reward function, which trl_passk uses too."""
    need("trl")
    import trl_grpo
    from datasets import Dataset
    from trl import GRPOTrainer
    model, tokenizer = grpo.load_model(r1_distill_dir, torch.float32, "cpu")
    written = r1_completions(tokenizer)
    args = grpo.parse_args(["--model", r1_distill_dir, "--group-size", "2",
                            "--prompts-per-step", "1", "--micro-batch", "2"])
    prompt = [{"role": "user", "content": "What is 6 x 7?"}]
    rows = [{"prompt": prompt, "answer": "42"}] * 2
    trainer = GRPOTrainer(model=model, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(rows),
                          reward_funcs=trl_grpo.reward_function(tokenizer, args),
                          args=trl_grpo.grpo_config(args, str(tmp_path / "trl")))
    texts = tokenizer.batch_decode(written, skip_special_tokens=True)  # as TRL decodes them
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    rewards = trainer._calculate_rewards(rows, [prompt] * 2, completions, written)  # [2, 1]
    assert rewards[:, 0].tolist() == list(R1_TRACES.values())


# ============================================================================== GRPO on verl

def verl_actor_loss(config, logp, old, advantages, mask, ref=None, rows=None):
    """verl's actor loss (verl.workers.utils.losses.ppo_loss, what its engine workers train with) on
    rows of the fixed batch, laid out as verl's engine hands it over: every sequence's tokens packed
    (no padding), the log-prob of response token j at the position before it; the normalisers
    (tokens, sequences) those of the whole batch, as verl's engine sets them for each micro-batch."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils
    from verl.workers.utils.losses import ppo_loss
    rows = list(range(len(logp))) if rows is None else rows
    B, T, P = len(rows), logp.shape[1], 2  # P: a prompt of two tokens (verl needs one at least)
    packed = torch.cat([torch.cat([logp.new_zeros(P - 1), logp[i, : int(mask[i].sum())],
                                   logp.new_zeros(1)]) for i in rows])  # [all tokens]
    advantages_bt = advantages[rows, None] * mask[rows]  # [b, T]: verl's advantages are per token
    fields = {"prompts": torch.ones(B, P, dtype=torch.long),
              "responses": torch.ones(B, T, dtype=torch.long),
              "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), mask[rows].long()], 1),
              "response_mask": mask[rows].long(), "old_log_probs": old[rows],
              "advantages": advantages_bt}
    if ref is not None:
        fields["ref_log_prob"] = ref[rows]
    data = TensorDict(fields, batch_size=[B])
    tensordict_utils.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()),
                                       global_batch_size=len(logp))
    return ppo_loss(config, {"log_probs": packed}, data)[0]


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_grpo_loss_on_verl_equals_ours(tiny, loss_agg, beta):
    """verl's actor loss with verl_grpo.actor_config(args) = policy_loss + aggregate_loss, on the
    whole batch and as the sum of two micro-batches (ratios within (0.5, 2), k3 below 10)."""
    need("verl")
    import verl_grpo
    model, tokenizer, folder = tiny
    args = grpo.parse_args(["--model", folder, "--loss-agg", loss_agg, "--beta", str(beta),
                            "--max-new-tokens", "6"])
    ids, attention, mask, L = fixed_batch(model.config.vocab_size, tokenizer.pad_token_id)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    logp = grpo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, 4)[0].detach()
    logp.requires_grad_(True)
    old, ref = nearby(logp, 0.3, 1), nearby(logp, 0.5, 2)
    token_loss = grpo.policy_loss(logp, old, advantages, args.eps_low, args.eps_high,
                                  ref if beta else None, beta)[0]
    ours = grpo.aggregate_loss(token_loss, mask, loss_agg, mask.sum(), 4, args.max_new_tokens)
    ours_grad, = torch.autograd.grad(ours, logp)
    config = verl_grpo.actor_config(args)
    theirs = verl_actor_loss(config, logp, old, advantages, mask, ref if beta else None)
    theirs_grad, = torch.autograd.grad(theirs, logp)
    halves = sum(verl_actor_loss(config, logp, old, advantages, mask, ref if beta else None, rows)
                 for rows in ([0, 1], [2, 3]))
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert abs(ours.item() - halves.item()) < 1e-6
    assert (ours_grad - theirs_grad).abs().max().item() < 1e-6


def test_verl_differences_are_exactly_the_documented_ones(tiny):
    """Dual clip: where A < 0 and rho > clip_ratio_c (3), verl's token loss is 3 |A|, ours rho |A|;
    low_var_kl: a token's k3 is clamped at 10; GRPO's advantage through verl's own dispatch: Bessel's
    correction and 1e-6 in place of 1e-4, nothing else (norm_adv_by_std_in_grpo=False: ours)."""
    need("verl")
    import numpy as np
    import verl_grpo
    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage
    mask = torch.ones(2, 2)
    logp = torch.zeros(2, 2)
    old = torch.log(torch.tensor([[1 / 5.0, 1.0], [1.0, 1.0]]))  # row 0, token 0: rho = 5
    advantages = torch.tensor([-1.0, 0.5])
    config = verl_grpo.actor_config(grpo.parse_args([]))  # no KL: the dual clip alone
    ours = grpo.aggregate_loss(grpo.policy_loss(logp, old, advantages, 0.2, 0.28)[0], mask,
                               "token-mean", 4, 2, 32)
    theirs = verl_actor_loss(config, logp, old, advantages, mask)
    assert abs((ours - theirs).item() - (5.0 - 3.0) * 1.0 / 4) < 1e-6  # one token: 5 |A| vs 3 |A|
    # low_var_kl's clamp: ref - logp = 3 gives k3 = e^3 - 4 = 16.09; verl counts 10
    ref = torch.tensor([[3.0, 0.1], [0.0, -0.2]])
    kl_config = verl_grpo.actor_config(grpo.parse_args(["--beta", "1.0"]))
    old = logp.clone()  # rho = 1: the surrogate equal, the KL alone differs
    ours = grpo.aggregate_loss(grpo.policy_loss(logp, old, advantages, 0.2, 0.28, ref, 1.0)[0], mask,
                               "token-mean", 4, 2, 32)
    theirs = verl_actor_loss(kl_config, logp, old, advantages, mask, ref)
    assert abs((ours - theirs).item() - (math.exp(3) - 4 - 10) / 4) < 1e-5
    # GRPO's advantage by verl's compute_advantage, rows of two uids interleaved
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # groups of 4, in grpo.py's order
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    for norm, scale in ((True, "group"), (False, "none")):
        data = DataProto.from_dict(
            tensors={"token_level_rewards": torch.stack([r[order], torch.zeros(8)], 1),
                     "response_mask": torch.ones(8, 2)},
            non_tensors={"uid": np.array([f"p{i // 4}" for i in order.tolist()], dtype=object)})
        out = compute_advantage(data, AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=norm)
        theirs = out.batch["advantages"][:, 0]
        ours = grpo.group_advantages(r, 4, scale)[order]
        if norm:
            grouped = r.view(-1, 4)
            std_g = grouped.std(dim=1, unbiased=False).repeat_interleave(4)[order]
            std_bessel = grouped.std(dim=1).repeat_interleave(4)[order]
            ours = ours * (std_g + 1e-4) / (std_bessel + 1e-6)
        torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=0)


# ============================================================================== Pass@k on verl

PASSK_SETTINGS = [dict(passk_mode="analytic"), dict(passk_mode="full"),
                  dict(passk_mode="bootstrap"), dict(passk_mode="bootstrap", passk_bootstrap_average=True),
                  dict(passk_mode="analytic", passk_mix="combination")]


@pytest.mark.parametrize("settings", PASSK_SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("norm", [True, False])
def test_passk_on_verl_dispatch_equals_passk(settings, norm):
    """verl's own compute_advantage with algorithm.adv_estimator=passk_training, on a DataProto whose
    uids group the samples, returns passk.py's advantages (every token of a row, zeros past it)."""
    need("verl")
    import numpy as np
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage
    import verl_passk
    G, P, T, k = 8, 4, 5, 4
    g = torch.Generator().manual_seed(3)
    rewards = (torch.rand(P * G, generator=g) < torch.tensor([0.15, 0.4, 0.7, 0.95]).repeat_interleave(G)
               ).float()  # [P * G], groups of G consecutive, from hard to easy
    lengths = torch.randint(1, T + 1, (P * G,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [B, T]
    token_rewards = torch.zeros(P * G, T)
    token_rewards[torch.arange(P * G), lengths - 1] = rewards  # verl: the reward on the last token
    deterministic = settings["passk_mode"] != "bootstrap"
    # verl's rows of one uid are together, prompts in any order; deterministic modes: shuffled whole
    order = (torch.randperm(P * G, generator=g) if deterministic else
             torch.arange(P * G).view(P, G)[torch.tensor([2, 0, 3, 1])].reshape(-1))
    uids = np.array([f"prompt-{i // G}" for i in order.tolist()], dtype=object)
    config = OmegaConf.create({"adv_estimator": verl_passk.NAME, "norm_adv_by_std_in_grpo": norm,
                               "passk_k": k, **settings})
    data = DataProto.from_dict(tensors={"token_level_rewards": token_rewards[order],
                                        "response_mask": mask[order]}, non_tensors={"uid": uids})
    torch.manual_seed(11)  # bootstrap's random k-subsets: the same draw on both sides
    theirs = compute_advantage(data, adv_estimator=verl_passk.NAME, config=config).batch["advantages"]
    args = Namespace(group_size=G, k=k, passk_mode=settings["passk_mode"],
                     bootstrap_average=settings.get("passk_bootstrap_average", False),
                     mix=settings.get("passk_mix", "none"), scale_rewards="group" if norm else "none")
    positions = {}  # group -> the positions of its rows in verl's batch, in the batch's order
    for position, i in enumerate(order.tolist()):
        positions.setdefault(i // G, []).append(position)
    grouped = torch.tensor([p for rows in positions.values() for p in rows])  # groups as met
    torch.manual_seed(11)
    expected = torch.empty(P * G)
    expected[grouped] = passk.passk_training_advantages(rewards[order][grouped], args)
    expected = expected[:, None] * mask[order]  # [B, T] in verl's row order
    if settings == {"passk_mode": "analytic"}:  # the closed form ignores the order of rows
        torch.testing.assert_close(expected[:, 0], passk.passk_advantages(rewards, G, k)[order])
    assert expected.abs().max() > 0.1  # the batch has signal
    torch.testing.assert_close(theirs, expected, atol=1e-6, rtol=0)


def test_passk_on_verl_default_trainer_gives_padding_rows_zero():
    """verl 0.9.1's default trainer (v1) pads a batch that is not a multiple of its data-parallel
    and mini-batch sizes with rows under one new uid, f"pad{uuid4().hex}", whose response mask and
    reward are 0 (padding_utils: upsample_batch_to_divisible_size and
    construct_minimal_padding_template), and its balancing reorders the rows; then its advantage
    step calls compute_advantage_for_multi_trajectories. Through that function, 3 padding rows
    among three interleaved groups of 8: the padding rows get A = 0, every real row passk.py's
    advantage."""
    need("verl")
    import uuid
    import numpy as np
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories
    import verl_passk
    G, P, T, k, pads = 8, 3, 5, 4, 3
    g = torch.Generator().manual_seed(5)
    rewards = (torch.rand(P * G, generator=g) < torch.tensor([0.2, 0.5, 0.8]).repeat_interleave(G)
               ).float()  # [P * G], groups of G consecutive
    lengths = torch.randint(1, T + 1, (P * G,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [P * G, T]
    token_rewards = torch.zeros(P * G, T)
    token_rewards[torch.arange(P * G), lengths - 1] = rewards  # verl: the reward on the last token
    source = {"responses": torch.ones(T, dtype=torch.long), "response_mask": mask[0],
              "rm_scores": token_rewards[0]}
    template, tag = construct_minimal_padding_template(source, {}, eos_token_id=2)
    assert tag["is_padding"] and template["response_mask"].sum() == 0
    pad_mask = torch.zeros(pads, T)  # padded to the batch's responses, as to_padded_tensor does
    pad_mask[:, :1] = template["response_mask"]
    pad_rewards = torch.zeros(pads, T)
    pad_rewards[:, :1] = template["rm_scores"]
    pad_uid = f"pad{uuid.uuid4().hex}"  # upsample_batch_to_divisible_size's uid for its rows
    uids = [str(uuid.uuid4()) for _ in range(P)]  # the trainer's uids, one per prompt
    order = torch.randperm(P * G + pads, generator=g)  # real rows 0..P G - 1, then the padding
    all_uids = [uids[i // G] if i < P * G else pad_uid for i in order.tolist()]
    keys = [f"{uid}_0_0" if i < P * G else f"{uid}_{i - P * G}_0"  # {uid}_{session}_{index}
            for uid, i in zip(all_uids, order.tolist())]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.cat([token_rewards, pad_rewards])[order],
                 "response_mask": torch.cat([mask, pad_mask])[order]},
        non_tensors={"uid": np.array(all_uids, dtype=object)})
    config = OmegaConf.create({"adv_estimator": verl_passk.NAME, "norm_adv_by_std_in_grpo": True,
                               "passk_k": k})
    out = compute_advantage_for_multi_trajectories(data, batch_keys=keys,
                                                   adv_estimator=verl_passk.NAME, num_repeat=G,
                                                   config=config)
    ours = torch.cat([passk.passk_advantages(rewards, G, k), torch.zeros(pads)])  # [P G + pads]
    expected = (ours[:, None] * torch.cat([mask, pad_mask]))[order]  # [B, T] in verl's order
    assert ours.abs().max() > 0.1 and (order[:-1] >= P * G).any()  # signal; padding in between
    torch.testing.assert_close(out.batch["advantages"], expected, atol=1e-6, rtol=0)


# ============================================================================== Pass@k on TRL, 2 processes

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_two_processes(script, *flags, **env):
    """script with flags under accelerate's multi-process launcher: two CPU processes over gloo
    (with --cpu accelerate's simple launcher would start one)."""
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(script),
               *flags]
    done = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]


def test_passk_on_trl_two_processes(tmp_path):
    """accelerate's multi-process launcher, two CPU processes over gloo, the default model on the
    built-in task, 2 steps: every advantage TRL's loss used is passk.py's closed form for its group
    (the group's G completions as TRL grouped them), and each update moved the log-probs of the
    A > 0 tokens up and of the A < 0 tokens down."""
    need("trl")
    model_dir = passk.resolve_model_path("smollm2-135m")  # converted once, before two processes
    log = tmp_path / "updates.jsonl"
    G, k = 8, 4
    accelerate_two_processes(ENGINES / "trl_passk.py", "--seed", "2", "--steps", "2",
                             "--prompts-per-step", "2", "--group-size", str(G), "--k", str(k),
                             "--micro-batch", "8", "--eval-problems", "1", "--eval-samples", "1",
                             "--eval-k", "1", "--output-dir", str(tmp_path / "run"),
                             "--check-updates", str(log), RLVR_CACHE=os.path.dirname(model_dir))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((r["step"], r["process"]) for r in records) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    table = {c: passk.passk_group_values(G, c, k) for c in range(G + 1)}
    moved = 0
    for step in (1, 2):
        groups = {}
        for record in records:
            if record["step"] == step:
                for row in record["rows"]:
                    groups.setdefault(tuple(row["prompt"]), []).append(row)
        assert sorted(map(len, groups.values())) == [G, G]  # two prompts, G rows each
        for rows in groups.values():
            a_pos, a_neg = table[int(sum(row["reward"] for row in rows))]
            for row in rows:
                assert abs(row["advantage"] - (a_pos if row["reward"] else a_neg)) < 1e-6
    for record in records:
        if record["up"] is not None:
            assert record["up"] > 0, record
            moved += 1
        if record["down"] is not None:
            assert record["down"] < 0, record
    assert moved >= 1  # at least one update had A > 0 tokens to move


FORCED_PASSK = """import os
import sys

sys.path.insert(0, {engines!r})
import trl_grpo  # noqa: E402
import trl_passk  # noqa: E402


def reward_function(tokenizer, args):
    def forced_reward(completions, **_):  # this process's rows: only process 0's first is right
        first = os.environ["RANK"] == "0"
        return [1.0 if first and row == 0 else 0.0 for row in range(len(completions))]
    return forced_reward


trl_grpo.reward_function = reward_function  # the rewards forced, everything else trl_passk's
trl_passk.main(sys.argv[1:])
"""


def test_passk_on_trl_two_processes_gathers_a_group_split_between_them(tiny, tmp_path):
    """trl_passk.py on two processes, one group of G = 8 whose rows are split between them
    (micro-batch 4), the tiny model, one step; rewards forced: process 0's first row is right,
    every other row wrong, so process 1 holds no right answer of the group. Every advantage TRL's
    loss used is passk.py's closed form for the whole group (c = 1 of 8), on process 1 too, where
    its own rows alone would give 0."""
    need("trl")
    G, k = 8, 4
    script = tmp_path / "forced_passk.py"
    script.write_text(FORCED_PASSK.format(engines=str(ENGINES)))
    log = tmp_path / "updates.jsonl"
    accelerate_two_processes(script, "--model", tiny[2], "--steps", "1", "--prompts-per-step", "1",
                             "--group-size", str(G), "--k", str(k), "--micro-batch", "4",
                             "--max-new-tokens", "8", "--eval-problems", "1",
                             "--eval-samples", "1", "--eval-k", "1",
                             "--output-dir", str(tmp_path / "run"), "--check-updates", str(log))
    records = {r["process"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert sorted(records) == [0, 1] and all(r["step"] == 1 for r in records.values())
    prompts = {process: {tuple(row["prompt"]) for row in r["rows"]} for process, r in records.items()}
    assert len(records[0]["rows"]) == len(records[1]["rows"]) == G // 2
    assert prompts[0] == prompts[1] and len(prompts[0]) == 1  # the one group, on both processes
    assert [row["reward"] for row in records[0]["rows"]].count(1.0) == 1
    assert [row["reward"] for row in records[1]["rows"]] == [0.0] * (G // 2)  # none right here
    a_pos, a_neg = passk.passk_group_values(G, 1, k)
    assert a_pos > 0 > a_neg  # not the 0 of an all-wrong group
    for record in records.values():
        for row in record["rows"]:
            assert abs(row["advantage"] - (a_pos if row["reward"] else a_neg)) < 1e-6


# ============================================================================== W2SPO on TRL

class FixedRollouts:
    """The target's sampler, except that its first call, the P rollouts q of sample_groups, returns
    the given rows (ids); every later call samples."""

    def __init__(self, sampler, rows):
        self.sampler, self.rows = sampler, rows

    def __getattr__(self, name):  # stop_ids, model, backend: the sampler's own
        return getattr(self.sampler, name)

    def generate(self, prompts, n, *args, **options):
        if self.rows is None:
            return self.sampler.generate(prompts, n, *args, **options)
        rows, self.rows = self.rows, None
        assert len(rows) == len(prompts) and n == 1
        return [{"ids": ids, "truncated": self.sampler.stop_ids.isdisjoint(ids),
                 "sampler_logprobs": None} for ids in rows]


def w2spo_trainer(tiny, aux, tmp_path, aux_is, forced_rewards=None, steps=2, loss_agg="token-mean",
                  micro_batch=8, rollouts=None):
    """trl_w2spo.build_trainer on the tiny model, another tiny model the auxiliary (sampled at 0.7,
    so that many of its tokens lie outside the clip range), P = 2, G = 4; with forced_rewards the
    branches' rewards are replaced (the random model is never right); with rollouts (the P rows
    of ids) the target's rollouts q are those rows (FixedRollouts)."""
    need("trl")
    import trl_w2spo
    model, tokenizer, folder = tiny
    args = w2spo.parse_args(["--model", folder, "--aux-model", aux, "--aux-temperature", "0.7",
                             "--dataset", "arith", "--aux-is", aux_is, "--loss-agg", loss_agg,
                             "--steps", str(steps), "--prompts-per-step", "2", "--group-size", "4",
                             "--branch-len", "4", "--max-new-tokens", "12",
                             "--micro-batch", str(micro_batch),
                             "--output-dir", str(tmp_path / "w2spo")])

    class Rollout(trl_w2spo.BranchRollout):
        def samplers(self, trainer):
            target, aux_sampler = super().samplers(trainer)
            return (target if rollouts is None else FixedRollouts(target, rollouts)), aux_sampler

        def __call__(self, prompts, trainer):
            rows = super().__call__(prompts, trainer)
            if forced_rewards:  # a prompt without a branch point keeps its rows' 0 (A = 0)
                rows["w2spo_reward"] = [forced_rewards[i % len(forced_rewards)] if any(mask)
                                        else 0.0 for i, mask in enumerate(rows["env_mask"])]
            return rows

    class Recording(trl_w2spo.W2SPOTrainer):
        """Keeps each loss's inputs and the gradient that reached TRL's per-token log-probs."""
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.batches, self.token_grads, self.had_aux = [], [], []

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(*a, **kw)
            if logps.requires_grad:
                logps.retain_grad()
                self.trained_logps = logps
            return logps, entropies, aux

        def _compute_loss(self, model, inputs):
            batch = {key: value for key, value in inputs.items() if torch.is_tensor(value)}
            self.batches.append(batch)
            if self.model.training:  # before the update: the weights that sampled the batch
                self.had_aux.append(check_weights(batch, self.accelerator.unwrap_model(model), args))
            return super()._compute_loss(model, inputs)

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)  # backward included
            self.token_grads.append(self.trained_logps.grad.clone())
            return loss

    trl_w2spo.BranchRollout, original = Rollout, trl_w2spo.BranchRollout
    try:
        trainer, rollout = trl_w2spo.build_trainer(args, Recording)
    finally:
        trl_w2spo.BranchRollout = original
    return trainer, rollout, args


def check_weights(batch, model, args):
    """On a batch TRL is about to train, with the weights that sampled it: TRL's pi_old =
    w2spo.py's (branch_logprobs), TRL's per-token weights = w2spo.importance_weights. True when the
    batch has auxiliary tokens."""
    rows = range(len(batch["advantages"]))
    branch = batch["tool_mask"].bool() & batch["completion_mask"].bool()  # [B, T]
    states = [batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist() for i in rows]
    ids = [batch["completion_ids"][i][branch[i]].tolist() for i in rows]
    kept = [i for i in rows if ids[i]]  # rows with a branch (not a prompt without a branch point)
    if not kept:
        return False
    width = max(len(ids[i]) for i in kept)
    ours_old = w2spo.branch_logprobs(model, [states[i] for i in kept], [ids[i] for i in kept],
                                     args.temperature, args)[0]  # [b, width]
    sampled = batch["sampling_per_token_logps"]  # pi_aux on auxiliary tokens, NaN elsewhere
    theirs_old, aux_logp = torch.zeros(len(kept), width), torch.zeros(len(kept), width)
    is_aux = torch.zeros(len(kept), width, dtype=torch.bool)
    real = torch.zeros(len(kept), width, dtype=torch.bool)
    weights_trl = torch.ones(len(kept), width)
    ratio = batch.get("importance_sampling_ratio")  # [B, T] (token_*) or [B, 1] (sequence_*)
    for j, i in enumerate(kept):
        n = len(ids[i])  # the branch is the completion's first n tokens
        if "old_per_token_logps" in batch:  # TRL computes pi_old where it corrects
            theirs_old[j, :n] = batch["old_per_token_logps"][i, :n]
        aux_logp[j, :n] = torch.nan_to_num(sampled[i, :n])
        is_aux[j, :n] = ~torch.isnan(sampled[i, :n])
        real[j, :n] = True
        if ratio is not None:
            weights_trl[j, :n] = ratio[i, :n] if ratio.shape[1] > 1 else ratio[i, 0]
    if "old_per_token_logps" in batch:
        assert (ours_old - theirs_old)[real].abs().max() < 1e-5  # two forward passes, one policy
    log_ratio = torch.where(is_aux, ours_old - aux_logp, 0.0)  # log pi_old / pi_aux
    ours_w = w2spo.importance_weights(log_ratio, is_aux, args.aux_is, args.is_cap)
    assert (ours_w - weights_trl)[real].abs().max() < 1e-5
    return bool(is_aux.any())


def w2spo_loss(model, batch, args, pad_id):
    """w2spo.py's loss on a batch of TRL's, as train_step computes it: the rows with a branch (the
    K G rows of sample_groups; a prompt without a branch point has none), each forwarded as s + y
    only (the continuation never), TRL's advantages, the normalisers of those rows."""
    branch = batch["tool_mask"].bool() & batch["completion_mask"].bool()  # [B, T]
    kept = [i for i in range(len(branch)) if branch[i].any()]
    states = [batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist() for i in kept]
    ids = [batch["completion_ids"][i][branch[i]].tolist() for i in kept]
    ids_t, attention, mask = grpo.build_batch(states, ids, pad_id)  # mask [K G, T]
    logp = w2spo.token_logprobs(model, ids_t, attention, mask.shape[1], args.temperature,
                                len(kept))[0]  # [K G, T]
    sampled = batch["sampling_per_token_logps"][kept, : mask.shape[1]]  # pi_aux, NaN: the target's
    is_aux = ~torch.isnan(sampled) & mask.bool()
    log_ratio = torch.where(is_aux, logp.detach() - torch.nan_to_num(sampled), 0.0)
    weights = w2spo.importance_weights(log_ratio, is_aux, args.aux_is, args.is_cap)
    token_loss = w2spo.policy_loss(logp, logp.detach(), batch["advantages"][kept], args.eps_low,
                                   args.eps_high, weights=weights)[0]
    return w2spo.aggregate_loss(token_loss, mask, args.loss_agg, mask.sum(), len(kept),
                                args.branch_len)


def check_gradient(batch, token_grad):
    """The gradient that reached TRL's per-token log-probs: on branch tokens only, and on every
    branch token of a row with A != 0. True when some row had A != 0."""
    branch = batch["tool_mask"].bool() & batch["completion_mask"].bool()  # [B, T]
    trained = token_grad != 0  # [B, T]
    assert not (trained & ~branch).any()  # no gradient outside the branches
    signal = (batch["advantages"] != 0)[:, None] & branch
    assert trained[signal].all()
    return bool(signal.any())


@pytest.mark.parametrize("aux_is", ["truncated", "branch", "none"])
def test_w2spo_on_trl_weights_and_mask_equal_ours(tiny, tiny_aux, tmp_path, aux_is):
    """A step of TRL's GRPOTrainer fed by trl_w2spo's rollout (the tiny model; rewards forced, one
    right target and one right auxiliary branch per group): TRL's per-token weights = w2spo.py's
    importance_weights, gradient on branch tokens only; TRL's loss (value and gradient) = w2spo.py's
    policy_loss with those weights over the branch tokens, on TRL's advantages."""
    trainer, rollout, args = w2spo_trainer(tiny, tiny_aux, tmp_path, aux_is, forced_rewards=[1.0, 0.0, 1.0, 0.0],
                                           steps=1)
    model = trainer.accelerator.unwrap_model(trainer.model)
    rows = [dict(row) for row in trainer.train_dataset.select(range(2)) for _ in range(4)]
    model.train()
    batch = trainer._generate_and_score_completions(rows)
    assert (batch.get("importance_sampling_ratio") is not None) == (aux_is != "none")
    trainer.current_gradient_accumulation_steps = 1
    model.zero_grad()
    theirs = trainer._compute_loss(trainer.model, batch)
    theirs.backward()
    theirs_grads = grads(model)
    assert check_gradient(batch, trainer.trained_logps.grad)
    assert check_weights(batch, model, args)
    model.zero_grad()
    ours = w2spo_loss(model, batch, args, tiny[1].pad_token_id)
    ours.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert max_gap(grads(model), theirs_grads) < 1e-6
    model.zero_grad()


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_w2spo_on_trl_loss_equals_ours_when_a_prompt_has_no_branch_point(tiny, tiny_aux, tmp_path,
                                                                         loss_agg):
    """P = 2 prompts whose rollouts are fixed: the first's 12 tokens long, the second's a lone EOS,
    which leaves no branch point, so TRL gets G rows that train nothing for it. One optimizer step
    as TRL runs it, two micro-batches of 4 (gradient accumulation 2): the sum of TRL's two losses
    and their gradient equal w2spo.py's loss over the K G = 4 rows of the first prompt alone, for
    every --loss-agg."""
    model, tokenizer, folder = tiny
    written = tokenizer("12 + 30 = 42, so", add_special_tokens=False)["input_ids"][:12]
    trainer, rollout, args = w2spo_trainer(tiny, tiny_aux, tmp_path, "truncated",
                                           forced_rewards=[1.0, 0.0, 1.0, 0.0], steps=1,
                                           loss_agg=loss_agg, micro_batch=4,
                                           rollouts=[written, [tokenizer.eos_token_id]])
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.train()
    rows = [dict(row) for row in trainer.train_dataset.select(range(2)) for _ in range(4)]
    trainer.current_gradient_accumulation_steps = 2  # what the Trainer sets for this step
    model.zero_grad()
    batches, theirs = [], 0.0
    for step in range(2):  # TRL's own split of the generation batch into its micro-batches
        trainer._step = step
        batches.append(trainer._prepare_inputs(rows))
        loss = trainer._compute_loss(trainer.model, batches[-1])
        loss.backward()  # the micro-batches' gradients add up, as in the Trainer
        theirs += loss.item()
    theirs_grads = grads(model)
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask",
            "advantages", "sampling_per_token_logps")
    batch = {key: torch.cat([part[key] for part in batches]) for key in keys}  # the 8 rows
    branched = (batch["tool_mask"] * batch["completion_mask"]).sum(dim=1) > 0  # [8]
    assert rollout.stats[-1]["skipped_prompts"] == 1 and branched.sum() == 4
    model.zero_grad()
    ours = w2spo_loss(model, batch, args, tokenizer.pad_token_id)
    ours.backward()
    assert max(g.abs().max().item() for g in grads(model)) > 1e-4  # the step has signal
    assert abs(ours.item() - theirs) < 1e-6
    assert max_gap(grads(model), theirs_grads) < 1e-6
    model.zero_grad()


def test_w2spo_on_trl_cannot_carry_clip_or_weighted_kl(tiny, tiny_aux, tmp_path):
    """What TRL cannot express, on one batch: (1) --aux-is clip takes the ratio against pi_aux on
    auxiliary tokens; TRL's ratio there is pi_theta / pi_old (its own forward): its loss is
    w2spo.py's `truncated`, not `clip`. (2) --beta: w2spo.py weighs k3 by v = min(pi_old / pi_aux, C)
    on auxiliary tokens; TRL adds beta k3 unweighted: its loss is ours with v = 1."""
    trainer, rollout, args = w2spo_trainer(tiny, tiny_aux, tmp_path, "truncated", forced_rewards=[1.0, 0.0, 1.0, 0.0],
                                           steps=1)
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.train()
    rows = [dict(row) for row in trainer.train_dataset.select(range(2)) for _ in range(4)]
    batch = trainer._generate_and_score_completions(rows)
    trainer.current_gradient_accumulation_steps = 1
    mask = batch["completion_mask"] * batch["tool_mask"]  # [B, T]: branch tokens
    sampled = batch["sampling_per_token_logps"]
    is_aux = ~torch.isnan(sampled) & mask.bool()
    ref = nearby(batch["old_per_token_logps"], 1.0, 4)
    trainer.beta = 1.0  # TRL's own KL term, its reference log-probs given
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, dict(batch, ref_per_token_logps=ref))
        logp = batch["old_per_token_logps"]  # TRL's forward at these weights: rho = 1
        log_ratio = torch.where(is_aux, logp - torch.nan_to_num(sampled), 0.0)
        w = w2spo.importance_weights(log_ratio, is_aux, "truncated", args.is_cap)
        v = w  # w2spo.py's k3 weight v = min(pi_old / pi_aux, C): w's value under truncated
        A = batch["advantages"]

        def ours(old, kl_weights):
            loss = w2spo.policy_loss(logp, old, A, args.eps_low, args.eps_high, ref, 1.0,
                                     weights=w if old is logp else 1.0, kl_weights=kl_weights)[0]
            return w2spo.aggregate_loss(loss, mask, "token-mean", mask.sum(), len(A), args.branch_len)
        clip_old = torch.where(is_aux, torch.nan_to_num(sampled), logp)  # --aux-is clip: pi_aux
        unweighted_kl = ours(logp, 1.0)
    assert abs(theirs.item() - unweighted_kl.item()) < 1e-5  # TRL: truncated, k3 unweighted
    assert abs(theirs.item() - ours(logp, v).item()) > 1e-4  # not w2spo.py's v k3
    assert abs(theirs.item() - ours(clip_old, 1.0).item()) > 1e-3  # not --aux-is clip


def test_w2spo_on_trl_two_steps(tiny, tiny_aux, tmp_path):
    """Two optimizer steps of TRL's GRPOTrainer with trl_w2spo's rollout and TRL's token_truncate
    correction (the tiny model, rewards forced): on every batch trained, TRL's pi_old and weights are
    w2spo.py's, gradient reached the branch tokens only, and the weights changed."""
    trainer, rollout, args = w2spo_trainer(tiny, tiny_aux, tmp_path, "truncated", forced_rewards=[0.0, 1.0, 1.0, 0.0])
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2 and len(trainer.batches) == 2
    assert all(trainer.had_aux)  # checked as each batch was trained (Recording._compute_loss)
    for batch, token_grad in zip(trainer.batches, trainer.token_grads):
        assert check_gradient(batch, token_grad)
    assert len(rollout.stats) == 2 and all(s["tokens_aux"] > 0 for s in rollout.stats)
    assert max_gap(before, [p.detach() for p in model.parameters()]) > 0


# ============================================================================== SamplingEvolve on TRL

class ScriptedSampler:
    """A sampler whose samples are written in advance: script(prompt ids, n) gives each prompt's n
    completions (ids, each ending with a stop id); everything else is the real sampler's."""

    def __init__(self, sampler, script):
        self.sampler, self.script = sampler, script

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def generate(self, prompts, n, *args, **options):  # prompt-major, as Sampler.generate
        return [{"ids": ids, "truncated": False, "sampler_logprobs": None}
                for prompt in prompts for ids in self.script(prompt, n)]


def sampling_evolve_trainer(args, script, trainer_class):
    """trl_sampling_evolve.build_trainer, its rollout's samples (first pass, children) scripted."""
    import trl_sampling_evolve
    trainer, rollout = trl_sampling_evolve.build_trainer(args, trainer_class)
    real = rollout.sampler  # the rollout's own sampler of pi_theta, wrapped
    rollout.sampler = lambda trainer: ScriptedSampler(real(trainer), script)
    return trainer, rollout


def test_sampling_evolve_on_trl_reads_an_open_thinking_as_sampling_evolve_py_does(r1_distill_dir,
                                                                                 tmp_path):
    """trl_sampling_evolve's rollout scores its samples as sampling_evolve.py does: on
    DeepSeek-R1-Distill's template, which leaves <think> open, "...So the answer is 42." earns 0
    and a trace that closes </think> and then answers earns 1."""
    need("trl")
    import sampling_evolve
    import trl_grpo
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"question": "What is 6 x 7?", "answer": "42"}) + "\n")
    args = sampling_evolve.parse_args(["--model", r1_distill_dir, "--dataset", str(data),
                                       "--steps", "1", "--prompts-per-step", "1",
                                       "--group-size", "2", "--micro-batch", "2",
                                       "--max-evolved", "1",
                                       "--output-dir", str(tmp_path / "se")])
    trainer, rollout = sampling_evolve_trainer(args, lambda prompt, n: traces,
                                               trl_grpo.GRPOTrainerSkippingEmptySteps)
    traces = r1_completions(trainer.processing_class)  # the two samples of the group
    rows = rollout([dict(trainer.train_dataset[0])["prompt"]] * 2, trainer)
    assert rows["evolve_reward"] == list(R1_TRACES.values())


def test_sampling_evolve_on_trl_rescues_every_group(tiny, tmp_path):
    """One step of TRL's GRPOTrainer with trl_sampling_evolve's rollout on the tiny model, the
    samples scripted: every first-pass sample has no answer (each group all wrong), and the first
    child of every evolution prompt E(x, S) writes the gold answer. Each group is rescued in round
    1, and TRL trained each rescued child as an answer to the bare prompt x with A > 0 (GRPO's,
    TRL's Bessel-corrected std)."""
    need("trl")
    import sampling_evolve
    import trl_grpo
    folder, P, G = tiny[2], 2, 2
    args = sampling_evolve.parse_args(["--model", folder, "--steps", "1",
                                       "--prompts-per-step", str(P), "--group-size", str(G),
                                       "--micro-batch", str(P * G),
                                       "--rounds", "2", "--children", "2", "--max-evolved", "1",
                                       "--output-dir", str(tmp_path / "se")])
    tokenizer = tiny[1]
    answers = {row["prompt"][-1]["content"]: row["answer"]
               for row in trl_grpo.training_dataset(args)}

    def written(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def script(prompt, n):
        text = tokenizer.decode(prompt)
        if sampling_evolve.INSTRUCTION.split("{")[0] not in text:  # a bare prompt x: no answer
            return [written("I do not know.")] * n
        gold = next(gold for question, gold in answers.items() if question in text)
        return [written(f"The answer is {gold}.")] + [written("No idea.")] * (n - 1)

    class Recording(trl_grpo.GRPOTrainerSkippingEmptySteps):
        batches = []

        def _compute_loss(self, model, inputs):
            self.batches.append({key: value for key, value in inputs.items() if torch.is_tensor(value)})
            return super()._compute_loss(model, inputs)

    trainer, rollout = sampling_evolve_trainer(args, script, Recording)
    trainer.train()
    assert trainer.state.global_step == 1 and len(Recording.batches) == 1
    stats, batch = rollout.stats[0], Recording.batches[0]
    assert stats["all_wrong_groups"] == stats["rescued_groups"] == len(stats["rescued"]) == P
    rows = range(len(batch["advantages"]))
    trained = [(batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist(),
                batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist(),
                batch["advantages"][i].item()) for i in rows]  # TRL shuffled the rows
    for child in stats["rescued"]:  # in TRL's batch: under the bare prompt x, with A > 0
        advantages = [a for prompt, ids, a in trained
                      if prompt == child["prompt"] and ids == child["ids"]]
        assert advantages and min(advantages) > 0, child
