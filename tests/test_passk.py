"""Tests for passk.py: the Pass@k advantages (analytic, full, bootstrap), the mixtures with Pass@1,
the flag checks, the docstring's worked table, and one tiny end-to-end step."""
import itertools
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpo  # noqa: E402
import passk  # noqa: E402


def brute_force(rewards, k):
    """Per response: mean over the k-subsets containing it of the subset's GRPO advantage, where the
    subset reward is the max of its members and the normalisation (mean, population std) is over ALL
    C(N, k) subsets. Plain Python floats, no epsilon; 0 where the std is 0."""
    n = len(rewards)
    subsets = list(itertools.combinations(range(n), k))
    scores = [max(rewards[i] for i in s) for s in subsets]
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores))
    out = []
    for i in range(n):
        mine = [(x - mean) / std if std > 0 else 0.0 for s, x in zip(subsets, scores) if i in s]
        out.append(sum(mine) / len(mine))
    return out


def scrambled(n, c, seed):
    """n rewards with c ones at random positions."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [1.0 if order[i] < c else 0.0 for i in range(n)]


# ----------------------------------------------------------------- analytic (Eqs. 11-15)

@pytest.mark.parametrize("n", range(1, 9))
def test_analytic_equals_brute_force_enumeration(n):
    for c in range(n + 1):  # includes all wrong (c = 0) and all right (c = n)
        for k in range(1, n + 1):  # includes k = 1 (GRPO) and k = n
            rewards = scrambled(n, c, seed=100 * n + 10 * c + k)
            got = passk.passk_advantages(torch.tensor(rewards), n, k, eps=0.0)
            assert got.tolist() == pytest.approx(brute_force(rewards, k), abs=1e-5), (n, c, k)


def test_analytic_several_groups_in_one_flat_tensor():
    n, k, cases = 6, 3, [0, 2, 5, 1, 6, 3]
    rewards = [r for j, c in enumerate(cases) for r in scrambled(n, c, seed=j)]  # [P * G], prompt-major
    got = passk.passk_advantages(torch.tensor(rewards), n, k, eps=0.0)
    want = [a for j in range(len(cases)) for a in brute_force(rewards[j * n: (j + 1) * n], k)]
    assert got.shape == (len(cases) * n,)
    assert got.tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_positive_and_negative_advantages_cancel(eps):
    for n in (2, 3, 5, 8, 16, 32, 64):
        for k in sorted({1, 2, 4, 8, n // 2, n} - {0}):
            if k > n:
                continue
            for c in range(n + 1):
                a_pos, a_neg = passk.passk_group_values(n, c, k, eps)
                scale = max(abs(a_pos), abs(a_neg), 1.0)
                assert c * a_pos + (n - c) * a_neg == pytest.approx(0.0, abs=1e-12 * n * scale), (n, c, k)
                # A right answer never does worse than a wrong one, and a wrong one is never rewarded.
                assert a_pos >= 0 >= a_neg


def test_k1_is_grpo():
    """k = 1: a subset is one response, so Pass@k is Pass@1. With the same + 1e-4 epsilon as grpo.py the
    two agree to float rounding; without it (eps=0) it is GRPO with the population std exactly."""
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0.])  # 4 groups of 5
    assert torch.allclose(passk.passk_advantages(rewards, 5, 1), grpo.group_advantages(rewards, 5), atol=1e-6)
    grouped = rewards.view(-1, 5)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)
    exact = torch.where(std > 0, (grouped - grouped.mean(dim=1, keepdim=True)) / std, torch.zeros(()))
    assert torch.allclose(passk.passk_advantages(rewards, 5, 1, eps=0.0), exact.reshape(-1), atol=1e-6)


def test_k_equal_to_group_size_has_no_signal():
    """k = N: the only subset is the whole group, so every group's Pass@k reward is constant."""
    for c in range(9):
        rewards = torch.tensor(scrambled(8, c, seed=c))
        assert passk.passk_advantages(rewards, 8, 8).abs().max() == 0


def test_analytic_worked_example_and_epsilon():
    rewards = torch.tensor([1, 0, 0, 0.])
    assert passk.passk_advantages(rewards, 4, 2, eps=0.0).tolist() == pytest.approx([1, -1 / 3, -1 / 3, -1 / 3])
    # The default + 1e-4 (grpo.py's) only rescales by sigma / (sigma + 1e-4); here sigma = 0.5.
    assert passk.passk_advantages(rewards, 4, 2)[0].item() == pytest.approx(0.5 / (0.5 + 1e-4), rel=1e-6)


def test_analytic_needs_binary_rewards():
    """A reward other than 0 or 1 (a verifier swapped for one that gives partial credit) is a
    one-line error, as every bad input is, not a traceback."""
    with pytest.raises(SystemExit) as exc:
        passk.passk_advantages(torch.tensor([0.5, 0, 1, 0]), 4, 2)
    text = str(exc.value.code)
    assert text.startswith("error:") and "rewards of 0 or 1" in text and "\n" not in text


def test_tiny_all_wrong_share_is_not_lost():
    """N = 64, k = 32, N_neg = 32: only 1 of C(64, 32) ~ 1.8e18 subsets is all wrong, so 1 - R_mean is
    ~5e-19; computing it as 1 - (1 - q) in floats would give exactly 0 and drop the signal."""
    a_pos, a_neg = passk.passk_group_values(64, 32, 32, eps=0.0)
    q = 1 / math.comb(64, 32)
    assert a_pos == pytest.approx(q / math.sqrt(q * (1 - q)), rel=1e-9)
    assert 32 * a_pos + 32 * a_neg == pytest.approx(0.0, abs=1e-15)


# ----------------------------------------------------------------- full sampling (Sec. 2.2)

def test_full_sampling_by_hand():
    # Groups (1,0) (0,0) (1,1) score [1, 0, 1]: mean 2/3, population std sqrt(2)/3.
    hi, lo = (1 / 3) / (math.sqrt(2) / 3 + 1e-4), (-2 / 3) / (math.sqrt(2) / 3 + 1e-4)  # 0.707, -1.414
    got = passk.passk_advantages_full(torch.tensor([1, 0, 0, 0, 1, 1.]), 6, 2)
    assert got.tolist() == pytest.approx([hi, hi, lo, lo, hi, hi], abs=1e-6)
    # G = 7: the same three groups and one leftover response, which gets 0 whatever its reward.
    for last in (0.0, 1.0):
        got = passk.passk_advantages_full(torch.tensor([1, 0, 0, 0, 1, 1, last]), 7, 2)
        assert got.tolist() == pytest.approx([hi, hi, lo, lo, hi, hi, 0.0], abs=1e-6)


def test_full_sampling_edge_cases_and_layout():
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 1.])  # 3 groups of 4
    # k = 1: every response is its own group, which is GRPO.
    assert torch.allclose(passk.passk_advantages_full(rewards, 4, 1), grpo.group_advantages(rewards, 4))
    # k = G (or k > G / 2): a single group, nothing to compare: all 0.
    assert passk.passk_advantages_full(rewards, 4, 4).abs().max() == 0
    assert passk.passk_advantages_full(rewards, 4, 3).abs().max() == 0
    # Prompts are independent: the flat result is the per-prompt results side by side.
    parts = [passk.passk_advantages_full(rewards[i: i + 4], 4, 2) for i in (0, 4, 8)]
    assert torch.equal(passk.passk_advantages_full(rewards, 4, 2), torch.cat(parts))


# ----------------------------------------------------------------- bootstrap (Sec. 2.3, Eq. 6)
# The seed review's objection: Eqs. 14-15 give the MEAN advantage of the subsets containing a response,
# but Eq. 6 SUMS over the subsets drawn; with N_group = G subsets of k, a response is in k of them on
# average, so the bootstrap update is about k times the analytic one, not its "asymptotic form", and it
# grows without bound with N_group. Averaging over a response's subsets (--bootstrap-average) fixes that.

def monte_carlo(n, c, k, reps, num_groups, average, seed=0):
    """Bootstrap advantages of one group drawn `reps` times independently: (mean [G], standard error [G])."""
    rewards = torch.tensor([1.0] * c + [0.0] * (n - c)).repeat(reps)  # reps copies = reps independent draws
    torch.manual_seed(seed)  # the bootstrap draws from torch's global generator (saved by --resume)
    draws = passk.passk_advantages_bootstrap(rewards, n, k, average, num_groups).view(reps, n).double()
    return draws.mean(dim=0), draws.std(dim=0) / math.sqrt(reps)


@pytest.mark.parametrize("n, c, k", [(8, 1, 4), (8, 2, 4), (8, 4, 4), (6, 2, 3), (16, 3, 4), (8, 3, 1)])
def test_bootstrap_with_many_subsets_converges(n, c, k):
    """With many subsets per prompt (1000) the normalisation is that of all subsets, so the averaged
    bootstrap is the analytic value and the sum is (subsets x k / G) times it. Measured: |z| <= 2.2, except
    the right answer of (8, 1, 4) summed: 499.67 vs 500 with a standard error of 0.02 (z = -15, a 0.07% gap).
    The 1% slack covers that: the + 1e-4 epsilon (0.02% at sigma = 0.5) and the O(1/subsets) bias."""
    reps, subsets = 200, 1000
    analytic = passk.passk_advantages(torch.tensor([1.0] * c + [0.0] * (n - c)), n, k, eps=0.0).double()
    for average, scale in ((True, 1.0), (False, subsets * k / n)):
        mean, se = monte_carlo(n, c, k, reps, subsets, average)
        target = scale * analytic
        assert ((mean - target).abs() <= 5 * se + 0.01 * target.abs() + 1e-6).all(), (average, mean, target)


@pytest.mark.parametrize("n, c, k", [(8, 1, 4), (8, 2, 2), (16, 3, 4)])
def test_bootstrap_paper_setting_is_k_times_analytic(n, c, k):
    """N_group = G, 2000 seeded draws. Only approximate: each draw normalises over just G random subsets,
    which biases the expectation. Measured means / (k x analytic) for the sum: 0.89-0.96; averaged /
    analytic: 0.93-1.15. So the claim checked is 'within 20%', while the summed variant against
    analytic (a factor k = 2 or 4 off) or averaged against k x analytic would fail."""
    reps = 2000
    analytic = passk.passk_advantages(torch.tensor([1.0] * c + [0.0] * (n - c)), n, k, eps=0.0).double()
    for average, scale in ((False, k), (True, 1)):
        mean, se = monte_carlo(n, c, k, reps, None, average)
        ratio = mean / (scale * analytic)
        assert ((ratio - 1).abs() <= 0.2 + 5 * se / analytic.abs()).all(), (average, ratio)


def test_bootstrap_paper_setting_misses_when_few_subsets_fail():
    """The bias is large where R_mean is near 1: N = 8, k = 4, c = 4 has only 1 of 70 subsets all wrong,
    so most draws of 8 subsets score all 1 and give 0. Measured: both variants at ~0.31 of their target."""
    analytic = passk.passk_advantages(torch.tensor([1.0] * 4 + [0.0] * 4), 8, 4, eps=0.0).double()
    mean, se = monte_carlo(8, 4, 4, 2000, None, average=True)
    assert (mean / analytic).max() < 0.5 and (mean / analytic).min() > 0.1


def test_bootstrap_mechanics():
    rewards = torch.tensor([1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1.])  # 2 groups of 6
    def draw(average, seed=3):
        torch.manual_seed(seed)
        return passk.passk_advantages_bootstrap(rewards, 6, 3, average)
    assert torch.equal(draw(False), draw(False))  # seeded: reproducible
    assert not torch.equal(draw(False), draw(False, seed=4))
    assert draw(False)[6:].abs().max() == 0  # all right: every subset scores 1
    # The sum of a group's advantages is 0 for every subset, and each subset has k members.
    assert draw(False)[:6].sum().item() == pytest.approx(0.0, abs=1e-5)
    # Averaged = summed / number of subsets holding the response (same draw: same seed).
    summed, averaged = draw(False), draw(True)
    nonzero = averaged != 0
    counts = summed[nonzero] / averaged[nonzero]
    assert torch.allclose(counts, counts.round(), atol=1e-4) and (counts >= 1).all()


# ----------------------------------------------------------------- mixtures (Eq. 18, Sec. 4)

def test_combination_by_hand():
    rewards = torch.tensor([1, 1, 0, 0, 0, 0, 0, 1.])  # c/N = 0.5 and 0.25
    pass1, passk_adv = torch.full((8,), 2.0), torch.full((8,), 10.0)
    got = passk.mix_advantages("combination", pass1, passk_adv, rewards, 4)
    assert got.tolist() == pytest.approx([6.0] * 4 + [4.0] * 4)  # 0.5*10 + 0.5*2, 0.25*10 + 0.75*2
    # With the real advantages of [1, 0, 0, 0], k = 2: 0.25 * [1, -1/3] + 0.75 * [sqrt(3), -1/sqrt(3)].
    rewards = torch.tensor([1, 0, 0, 0.])
    got = passk.mix_advantages("combination", grpo.group_advantages(rewards, 4),
                               passk.passk_advantages(rewards, 4, 2), rewards, 4)
    assert got.tolist() == pytest.approx([0.25 + 0.75 * math.sqrt(3)] + [-1 / 12 - 0.75 / math.sqrt(3)] * 3,
                                         abs=1e-3)
    # The numbers in mix_advantages's comment, G = 8, k = 4: the wrong completion of an easy
    # problem (c = 7) keeps an eighth of A_pass1; the right one of a hard problem (c = 1) mostly A_pass1.
    rewards = torch.tensor([1.0] * 7 + [0.0] + [1.0] + [0.0] * 7)  # c = 7, then c = 1
    pass1, passk_adv = grpo.group_advantages(rewards, 8), passk.passk_advantages(rewards, 8, 4)
    got = passk.mix_advantages("combination", pass1, passk_adv, rewards, 8)
    assert [got[7].item(), got[8].item()] == pytest.approx([-0.331, 2.440], abs=1e-3)  # + 1e-4 eps


def test_adaptive_by_hand():
    pass1 = torch.tensor([1.0, 1, 2, 2, 3, 3, 4, 4])  # 4 problems, G = 2
    passk_adv = -pass1
    # Entropy ranks problems 1 and 2 highest: they get Pass@1, problems 0 and 3 get Pass@k.
    got = passk.mix_advantages("adaptive", pass1, passk_adv, None, 2, torch.tensor([0.1, 0.9, 0.5, 0.3]))
    assert got.tolist() == [-1, -1, 2, 2, 3, 3, -4, -4]
    # Odd count: the top 3 // 2 = 1 gets Pass@1; ties go to the earlier problem.
    got = passk.mix_advantages("adaptive", pass1[:6], passk_adv[:6], None, 2, torch.tensor([0.5, 0.5, 0.2]))
    assert got.tolist() == [1, 1, -2, -2, -3, -3]
    # A single problem always trains on Pass@k.
    assert passk.mix_advantages("adaptive", pass1[:2], passk_adv[:2], None, 2,
                                torch.tensor([9.0])).tolist() == [-1, -1]


def test_flags_pick_the_advantage():
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0.])  # 2 groups of 4
    args = passk.parse_args(["--group-size", "4", "--k", "2"])
    assert args.passk_mode == "analytic" and args.mix == "none"
    analytic, pass1 = passk.passk_advantages(rewards, 4, 2), grpo.group_advantages(rewards, 4)
    assert torch.equal(passk.passk_training_advantages(rewards, args), analytic)
    args.passk_mode = "full"
    assert torch.equal(passk.passk_training_advantages(rewards, args), passk.passk_advantages_full(rewards, 4, 2))
    args.passk_mode, args.mix = "analytic", "combination"
    assert torch.equal(passk.passk_training_advantages(rewards, args),
                       passk.mix_advantages("combination", pass1, analytic, rewards, 4))
    args.mix = "adaptive"
    got = passk.passk_training_advantages(rewards, args, entropy=torch.tensor([0.0, 1.0]))
    assert torch.equal(got, torch.cat([analytic[:4], pass1[4:]]))


# ----------------------------------------------------------------- flags

@pytest.mark.parametrize("argv, message", [
    (["--k", "9"], "--k 9 is larger than --group-size 8"),
    (["--group-size", "4", "--k", "5"], "--k 5 is larger than --group-size 4"),
    (["--k", "0"], "argument --k: must be at least 1"),
    (["--bootstrap-average"], "--bootstrap-average applies to --passk-mode bootstrap only"),
    (["--k", "8"], "--k 8 of --group-size 8 trains nothing"),
    (["--k", "5", "--passk-mode", "full"], "--k 5 of --group-size 8 trains nothing"),
    (["--k", "8", "--passk-mode", "bootstrap"], "trains nothing"),
])
def test_bad_flags_give_one_line_errors(argv, message):
    with pytest.raises(SystemExit) as exc:  # in the flag checks, before data or model are loaded; the
        passk.main(argv + ["--dataset", "/nonexistent.jsonl"])  # missing file makes a broken check fail fast
    text = str(exc.value.code)
    assert message in text and "\n" not in text and text.startswith("error:")


def test_scale_rewards_none_without_mix_warns(capsys):
    """--scale-rewards sets only A_pass1, which only --mix uses: without --mix the flag would change
    nothing, so the run says so at start instead of dropping it silently."""
    passk.parse_args(["--scale-rewards", "none"])
    assert "warning: --scale-rewards none changes nothing without --mix" in capsys.readouterr().err
    for argv in (["--scale-rewards", "none", "--mix", "combination"], ["--scale-rewards", "group"]):
        passk.parse_args(argv)
        assert capsys.readouterr().err == ""


def test_good_flags_pass():
    for argv in (["--k", "8", "--mix", "combination"], ["--k", "1"], ["--k", "4", "--passk-mode", "full"],
                 ["--passk-mode", "bootstrap", "--bootstrap-average"]):
        passk.parse_args(argv)


# ----------------------------------------------------------------- docstring, shared code, end to end

def test_docstring_table_matches_the_code():
    rows = re.findall(r"^\s+(\d+)" + r"\s+(-?\d+\.\d{3})" * 4 + r"\s*$", passk.__doc__, flags=re.M)
    assert [int(r[0]) for r in rows] == list(range(1, 5))
    assert re.search(r"^\s+5-7\s+0\.775 to 0\.378\s+-1\.291 to -2\.646\s+0\s+0\s*$", passk.__doc__,
                     re.M)
    assert all(passk.passk_group_values(8, c, 4, eps=0.0) == (0.0, 0.0) for c in (5, 6, 7))
    easy = [(1 - p) / math.sqrt(p * (1 - p)) for p in (5 / 8, 7 / 8)]  # A_pass1 of a right one
    easy += [-p / math.sqrt(p * (1 - p)) for p in (5 / 8, 7 / 8)]  # and of a wrong one
    assert [f"{x:.3f}" for x in easy] == ["0.775", "0.378", "-1.291", "-2.646"]
    n, k = 8, 4
    for c, *printed in rows:
        c = int(c)
        p = c / n
        a_pos, a_neg = passk.passk_group_values(n, c, k, eps=0.0)
        want = [(1 - p) / math.sqrt(p * (1 - p)), -p / math.sqrt(p * (1 - p)), a_pos, a_neg]
        assert printed == [f"{x:.3f}" for x in want], c


def test_one_training_step_end_to_end(tiny_model_dir, tmp_path):
    """The whole loop with the tiny random model: adaptive mix (the extra entropy pass) over bootstrap."""
    out = tmp_path / "run"
    summary = passk.main(["--model", tiny_model_dir, "--steps", "1", "--prompts-per-step", "2",
                          "--group-size", "4", "--k", "2", "--micro-batch", "8", "--max-new-tokens", "4",
                          "--eval-problems", "2", "--eval-samples", "2", "--eval-k", "2",
                          "--passk-mode", "bootstrap", "--mix", "adaptive", "--output-dir", str(out)])
    assert summary["train_k"] == 2 and summary["passk_mode"] == "bootstrap" and summary["mix"] == "adaptive"
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert 0.0 <= record["frac_zero_adv"] <= 1.0
    assert (out / "final" / "config.json").exists()


def test_problem_entropy(tiny_model_dir):
    model, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    args = passk.parse_args(["--group-size", "2", "--k", "1", "--micro-batch", "3"])
    prompts = [[5, 6, 7], [8, 9]]
    samples = [{"ids": ids} for ids in ([10, 11, 2], [12, 2], [13], [14, 15, 16])]  # P = 2, G = 2
    got = passk.problem_entropy(model, prompts, samples, args)
    # Against a plain full-softmax computation, one sequence at a time (no padding at all).
    want = []
    for i, s in enumerate(samples):
        ids = torch.tensor([prompts[i // 2] + s["ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -len(s["ids"]) - 1: -1] / args.temperature  # [T, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        want.append(-(logp.exp() * logp).sum(-1).mean())
    assert got.shape == (2,)
    assert torch.allclose(got, torch.stack(want).view(2, 2).mean(dim=1), atol=1e-4)


def test_resume_continues_the_bootstrap_draws(tiny_model_dir, tmp_path):
    """The bootstrap's k-subsets come from torch's generator, whose state resume.pt keeps: a run cut
    after step 1 and resumed to step 3 ends with the metrics of the run that went straight through."""
    def run(out, steps, *extra):
        return passk.main(["--model", tiny_model_dir, "--steps", steps, "--prompts-per-step", "2",
                           "--group-size", "4", "--k", "2", "--micro-batch", "8", "--max-new-tokens", "6",
                           "--eval-problems", "2", "--eval-samples", "2", "--eval-k", "2",
                           "--passk-mode", "bootstrap", "--lr", "1e-3", "--save-every", "1",
                           "--output-dir", str(out), *extra])
    whole = run(tmp_path / "whole", "3")
    run(tmp_path / "cut", "1")
    resumed = run(tmp_path / "cut", "3", "--resume")
    drop = ("seconds", "peak_memory", "args")
    assert {k: v for k, v in resumed.items() if not any(d in k for d in drop)} == \
        {k: v for k, v in whole.items() if not any(d in k for d in drop)}
    lines = [[{k: v for k, v in json.loads(line).items() if "seconds" not in k}
              for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] for name in ("whole", "cut")]
    assert lines[0] == lines[1] and [r["step"] for r in lines[1]] == [1, 2, 3]


def test_k1_is_grpo_with_group_scaling_only():
    """--scale-rewards sets A_pass1 of --mix only: at --k 1 the Pass@k advantage is GRPO's with the std
    whatever the flag says, so it is not Dr. GRPO's under --scale-rewards none."""
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1.])  # 2 groups of 4
    for scale in ("group", "none"):
        args = passk.parse_args(["--group-size", "4", "--k", "1", "--scale-rewards", scale])
        got = passk.passk_training_advantages(rewards, args)
        assert torch.allclose(got, grpo.group_advantages(rewards, 4, "group"), atol=1e-6)
    assert not torch.allclose(got, grpo.group_advantages(rewards, 4, "none"), atol=1e-3)


def test_filter_groups_drops_the_groups_pass_at_k_leaves_without_signal(tiny_model_dir, tmp_path, monkeypatch):
    """N = 8, k = 4: a group with c = 5 > N - k has every A = 0 though its rewards differ;
    --filter-groups drops it from the batch (it diluted the normalisers), keeps the c = 1 group."""
    scripted = iter([1.0] * 5 + [0.0] * 3 + [1.0] + [0.0] * 7)  # prompt 1: c = 5; prompt 2: c = 1
    real_reward = passk.verifier.reward
    batches = []
    real_step = passk.train_step
    def recording(model, optimizer, batch, args, ref_model=None):
        batches.append(batch)
        return real_step(model, optimizer, batch, args, ref_model)
    monkeypatch.setattr(passk, "train_step", recording)
    out = tmp_path / "run"
    argv = ["--model", tiny_model_dir, "--steps", "1", "--prompts-per-step", "2", "--micro-batch", "8",
            "--max-new-tokens", "4", "--eval-problems", "2", "--eval-samples", "2", "--eval-k", "2",
            "--filter-groups", "--output-dir", str(out)]
    real_steps = passk.Run.steps
    def steps(run):  # the scripted rewards inside the training steps only, not in the evaluations
        for item in real_steps(run):
            monkeypatch.setattr(passk.verifier, "reward", lambda text, gold: next(scripted))
            yield item
            monkeypatch.setattr(passk.verifier, "reward", real_reward)
    monkeypatch.setattr(passk.Run, "steps", steps)
    passk.main(argv)
    advantages = batches[0]["advantages"]
    assert len(advantages) == 8  # the c = 5 group is gone
    assert advantages.tolist() == pytest.approx([1.0] + [-1 / 7] * 7, abs=1e-3)  # the c = 1 group
