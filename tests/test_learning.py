"""Learning, for real, on every machine: each trainer's default run (SmolLM2-135M-Instruct on the
built-in task, on the CPU), cut to two steps. What one update must do whatever the machine's float
rounding: the log-probs of the trained tokens with A > 0 rise and those with A < 0 fall, measured on
the very batch the update was given, before and after it; and each method's own counters show its
mechanism acting. The held-out rise needs the full default runs (`python tests/run_defaults.py`,
their numbers in the README); CI cannot afford them on the slowest machines."""
import json

import pytest
import torch

import grpo
import passk
import sampling_evolve
import w2spo

SHORT = ["--steps", "2", "--eval-problems", "4", "--eval-samples", "2", "--eval-k", "1"]


def completion_logprobs(module, model, batch, rows, args):
    """log pi(token) of the rows' trained tokens [b, T] and their mask [b, T] (no gradient)."""
    samples = [batch["samples"][i] for i in rows]
    # W2SPO: a row's prompt is its state, its completion the branch (a w2spo.Branch)
    completions = [s.ids if module is w2spo else s["ids"] for s in samples]
    prompts = [batch["prompts"][i] for i in rows]
    with torch.no_grad():
        ids, attention, mask = module.build_batch(prompts, completions, 0)
        logp, _ = module.token_logprobs(model, ids, attention, mask.shape[1],
                                        args.temperature, args.micro_batch)
    return logp, mask.to(logp)


def record_updates(module, monkeypatch):
    """Wrap the script's train_step: for every update, the mean change of the trained tokens'
    log-probs where A > 0 ("up") and where A < 0 ("down"), and the update's own stats."""
    updates, real = [], module.train_step

    def recording(model, optimizer, batch, args, ref_model=None):
        rows = batch["advantages"].nonzero().squeeze(1).tolist()
        before, mask = completion_logprobs(module, model, batch, rows, args)
        stats = real(model, optimizer, batch, args, ref_model)
        after, _ = completion_logprobs(module, model, batch, rows, args)
        change = (after - before) * mask  # [b, T]
        sign = batch["advantages"][rows].to(change)[:, None].sign() * mask  # [b, T]
        updates.append({"up": change[sign > 0].sum().item() / (sign > 0).sum().item(),
                        "down": change[sign < 0].sum().item() / (sign < 0).sum().item(),
                        "stats": stats})
        return stats
    monkeypatch.setattr(module, "train_step", recording)
    return updates


def check_updates(updates):
    assert updates, "no step had a group with mixed rewards"
    for update in updates:
        print(update)
        assert update["up"] > 0, update  # the tokens of completions better than their group
        assert update["down"] < 0, update  # and of those worse than it
        assert update["stats"]["skipped_nonfinite"] == 0


@pytest.mark.parametrize("module", [grpo, passk], ids=["grpo", "passk"])
def test_an_update_pushes_better_completions_up_and_worse_down(module, tmp_path, monkeypatch):
    updates = record_updates(module, monkeypatch)
    summary = module.main(["--output-dir", str(tmp_path), *SHORT])
    check_updates(updates)
    assert summary["steps"] == 2
    if module is passk:
        assert summary["train_k"] == 4


def test_w2spo_trains_the_branches_of_both_models(tmp_path, monkeypatch):
    updates = record_updates(w2spo, monkeypatch)
    summary = w2spo.main(["--output-dir", str(tmp_path), *SHORT])
    check_updates(updates)
    assert summary["tokens_aux"] > 0 and summary["tokens_trained"] > 0
    assert summary["tokens_trained"] < summary["tokens_sampled"]  # the branches only
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in records:  # the auxiliary is off the target's policy, and its weight is bounded
        assert record["aux_log_ratio_mean"] < 0
        assert 0 <= record["aux_capped_frac"] <= 1 and 0 < record["aux_weight_mean"] <= 2


def test_sampling_evolve_evolves_the_all_wrong_groups(tmp_path, monkeypatch):
    updates = record_updates(sampling_evolve, monkeypatch)
    summary = sampling_evolve.main(["--output-dir", str(tmp_path), *SHORT])
    check_updates(updates)
    assert summary["all_wrong_groups"] >= 1 and summary["evolve_tokens_written"] > 0, summary
    assert summary["tokens_read"] > summary["tokens_sampled"]
    assert summary["evolved_trained"] <= 2 * summary["rescued_groups"] <= 2 * summary["all_wrong_groups"]
