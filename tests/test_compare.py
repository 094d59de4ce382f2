"""--token-budget (what tests/compare.py equalises) and tests/compare.py itself, at toy sizes."""
import json
import sys
from pathlib import Path

import pytest

import grpo
import passk
import sampling_evolve
import w2spo
import test_grpo
import test_sampling_evolve
import test_w2spo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import compare  # noqa: E402

SCRIPTS = {"grpo": (grpo, test_grpo.tiny_run), "passk": (passk, test_grpo.tiny_run),
           "w2spo": (w2spo, test_w2spo.tiny_run), "sampling_evolve": (sampling_evolve, test_sampling_evolve.tiny_run)}


def step_tokens(record, budget_counts="written"):
    """The tokens per step counted against --token-budget: its tokens_sampled, the count Run.end_step sums (written by
    every model: sampling_evolve's include its evolution rounds' children, w2spo's its branches and continuations),
    and with --budget-counts read+written its tokens_read too (the prompt each sample read)."""
    if budget_counts == "read+written":
        return record["tokens_sampled"] + record["tokens_read"]
    return record["tokens_sampled"]


def metrics(folder):
    return [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("budget_counts", ["written", "read+written"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_token_budget_stops_the_same_run_after_the_step_that_reaches_it(name, budget_counts, tiny_model_dir,
                                                                        tmp_path):
    """A budget one token past step 1's tokens (as --budget-counts counts them) stops the run after step 2: the
    same two steps as the run without a budget (same seed), and the summary counts the steps and tokens done.
    Step 1's tokens alone would not reach it with the other count, where reads are most of the tokens."""
    module, tiny_run = SCRIPTS[name]
    module.main(tiny_run(tiny_model_dir, tmp_path / "whole", "--steps", "3"))
    whole = metrics(tmp_path / "whole")
    assert len(whole) == 3
    assert all(record["tokens_read"] > 0 for record in whole)
    budget = step_tokens(whole[0], budget_counts) + 1
    if budget_counts == "read+written":  # the written tokens of the three steps would not reach it
        assert sum(step_tokens(record) for record in whole) < budget
    summary = module.main(tiny_run(tiny_model_dir, tmp_path / "cut", "--steps", "3", "--token-budget", str(budget),
                                   "--budget-counts", budget_counts))
    cut = metrics(tmp_path / "cut")
    # approx: two runs of one seed agree to float32 rounding, not bit for bit (CPU kernels may sum in any order)
    assert cut == [pytest.approx(record, rel=1e-5, abs=1e-7) for record in whole[:2]]
    assert summary["steps"] == 2
    assert summary["tokens_sampled"] == step_tokens(whole[0]) + step_tokens(whole[1])
    assert summary["tokens_read"] == whole[0]["tokens_read"] + whole[1]["tokens_read"]
    assert step_tokens(whole[0], budget_counts) + step_tokens(whole[1], budget_counts) >= budget
    assert summary["seconds_per_step"] == pytest.approx(summary["train_seconds"] / 2)


@pytest.mark.parametrize("module", [grpo, passk])
def test_tokens_read_are_the_prompt_tokens_of_every_sample(module, tiny_model_dir, tmp_path):
    """Each of the G samples of a prompt reads the prompt once: G x P x its tokens (the tiny task's prompts
    all have the same length: one-digit numbers)."""
    from transformers import AutoTokenizer
    module.main(test_grpo.tiny_run(tiny_model_dir, tmp_path, "--steps", "1"))
    prompt = module.encode_prompt(AutoTokenizer.from_pretrained(tiny_model_dir), "What is 3 - 3?")
    assert metrics(tmp_path)[0]["tokens_read"] == 8 * 4 * len(prompt)


def test_budget_counts_without_a_budget_is_reported(tiny_model_dir, tmp_path, capsys):
    grpo.main(test_grpo.tiny_run(tiny_model_dir, tmp_path, "--steps", "1", "--budget-counts", "read+written"))
    assert "warning: --budget-counts has no effect without --token-budget" in capsys.readouterr().err


def test_negative_token_budget_is_a_one_line_error(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="--token-budget: must be at least 0"):
        grpo.main(test_grpo.tiny_run(tiny_model_dir, tmp_path, "--token-budget", "-5"))


def test_plot_writes_pngs_or_says_how_to_get_matplotlib(tmp_path, capsys):
    train = [{"method": "grpo", "reward_curve": [(10, 0.1), (20, 0.3)], "eval_curve": [(0, 0.1), (20, 0.4)]}]
    search = [{"samples_per_problem": 4 * (r + 1), "rse_solved": 0.5, "rse_baseline_solved": 0.5,
               "evolve_solved": 0.5, "independent_solved": 0.5} for r in range(2)]
    written = compare.plot(train, search, tmp_path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert written == [] and "pip install matplotlib" in capsys.readouterr().err
    else:
        assert [p.name for p in written] == ["train.png", "search.png"]
        assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_search_rows_count_each_distillation_in_the_round_that_reads_its_bank():
    """Issue 28, finding 15: round r's distillation builds round r + 1's bank, so row r holds the solver tokens
    of rounds 0..r and the distiller tokens of rounds 0..r - 1; round 0 draws --first-round-samples."""
    def rse_round(r):  # distinct digits per round and kind, so that any mix-up shows
        return {"pass@1": 0.5, "solved_cumulative": 0.5, "solver_prompt_tokens": 1000 * (r + 1),
                "solver_tokens": 100 * (r + 1), "distill_prompt_tokens": 10 * (r + 1) if r < 2 else 0,
                "distill_tokens": (r + 1) if r < 2 else 0}
    rse = {"rounds": [rse_round(r) for r in range(3)], "samples_per_round": 4,
           "args": {"first_round_samples": 16},
           "baseline": [{"pass@1": 0.5, "solved_cumulative": 0.5, "solver_prompt_tokens": 1000,
                         "solver_tokens": 100} for _ in range(3)]}
    arm = {"solved": 0.5, "tokens_read": 1, "tokens_written": 1}
    evolve = {"rounds": [{"samples_per_problem": 16 + 4 * r, "evolve": arm, "independent": arm,
                          "independent_same_tokens": arm} for r in range(3)]}
    rows = compare.search_rows(rse, evolve)
    assert [row["samples_per_problem"] for row in rows] == [16, 20, 24]
    assert [row["rse_tokens_read"] for row in rows] == [1000, 3010, 6030]
    assert [row["rse_tokens_written"] for row in rows] == [100, 301, 603]
    assert [row["rse_baseline_tokens_read"] for row in rows] == [1000, 2000, 3000]


def test_compare_quick_end_to_end(tmp_path):
    """The real default model, every script as a user runs it, at toy sizes: one table where each training
    run stopped at the first step that reached the same budget, all started from the same pass@1, and the
    two search methods drew the same number of samples per problem in every round; tokens read and written
    so far for every search method and baseline."""
    result = compare.main(["--quick", "--output-dir", str(tmp_path)])
    budget, cap = compare.SETTINGS["quick"]["train"]["--token-budget"], compare.SETTINGS["quick"]["train"]["--steps"]
    rows = {row["method"]: row for row in result["training"]}
    assert sorted(rows) == sorted(name for name, _, _ in compare.TRAINING)
    for name, row in rows.items():
        steps = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(steps) == row["steps"] and row["tokens_sampled"] == sum(step_tokens(r) for r in steps)
        assert row["tokens_sampled"] >= budget or row["steps"] == cap, name
        assert row["tokens_sampled"] - step_tokens(steps[-1]) < budget, name  # stopped at the first crossing
        assert row["eval_curve"][0] == (0, row["pass@1_before"]) and row["peak_rss_gb"] > 0.3
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert row["tokens_sampled"] == summary["tokens_sampled"]  # the script's own budget total
        assert row["tokens_read"] == summary["tokens_read"] > 0  # every script counts them
    assert len({row["pass@1_before"] for row in rows.values()}) == 1  # same seed, weights and problems
    search = result["search"]
    assert len(search) == compare.SETTINGS["quick"]["search"]["rounds"]
    assert all(r["samples_per_problem"] == r["evolve_samples_per_problem"] for r in search)
    arms = ("rse", "rse_baseline", "evolve", "independent", "same_tokens")
    assert all(0 <= r[arm + "_solved"] <= 1 for r in search for arm in arms)
    for arm in arms:  # so far: positive, never falling
        for key in ("_tokens_read", "_tokens_written"):
            values = [r[arm + key] for r in search]
            assert values[0] > 0 and values == sorted(values), (arm, key, values)
    first = search[0]  # round 0 is shared: SamplingEvolve's baselines are its own first samples there
    assert all(first[arm + key] == first["evolve" + key] for arm in ("independent", "same_tokens")
               for key in ("_solved", "_tokens_read", "_tokens_written"))
    assert first["rse_pass@1"] == first["rse_baseline_pass@1"] and first["rse_solved"] == first["rse_baseline_solved"]
    spent = lambda r, arm: r[arm + "_tokens_read"] + r[arm + "_tokens_written"]  # noqa: E731
    assert all(spent(r, "same_tokens") >= spent(r, "evolve") or r["same_tokens_solved"] == 1 for r in search)
    # RSE's tokens written against its own log of solver samples: the baseline's are the solver's alone (its round
    # 0 is RSE's), RSE's add its distiller's replies
    samples = [json.loads(line) for line in (tmp_path / "rse_search" / "trajectories.jsonl").read_text().splitlines()]
    for r, row in enumerate(search):
        solver = sum(t["tokens"] for t in samples if t["method"] == "rse" and t["round"] <= r)
        base = sum(t["tokens"] for t in samples if t["round"] <= r and (t["method"] == "baseline" or t["round"] == 0))
        assert row["rse_baseline_tokens_written"] == base and row["rse_tokens_written"] >= solver
    table = (tmp_path / "compare.md").read_text()
    assert all(f"| {name} |" in table for name in rows) and "SamplingEvolve solved" in table
    assert f"| {rows['sampling_evolve']['tokens_read']} |" in table and "RSE tokens read / written" in table
