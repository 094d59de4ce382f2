"""Tests for verifier.py: extraction, equivalence, reward/feedback, pass@k,
problem loading, adversarial inputs, and the labelled public cases."""
from __future__ import annotations

import functools
import itertools
import json
import math
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import verifier  # noqa: E402
from verifier import (  # noqa: E402
    extract_answer, feedback, is_equiv, load_problems, pass_at_k, reward)

# ----------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\fbox{7}", "7"),
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("\\boxed{a{b{c}}d}", "a{b{c}}d"),  # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
    ("\\boxed 5", "5"),
    ("thus $\\boxed 12$.", "12"),
    ("\\boxed {3}", "3"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last box wins
    ("\\boxed{1} and finally \\fbox{3}", "3"),
    ("\\boxed{2} then \\boxed{9", "2"),  # an unclosed last box is skipped
    ("\\boxed{ 12 }", "12"),
    ("The answer is \\boxed{}.", ""),  # an empty box is still the final answer
    ("\\boxed{" * 50 + "x" + "}" * 50, "x"),
])
def test_extract_boxed(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("2 + 2 = 4", "4"),
    ("The answer is 5.", "5"),
    ("It costs 1,000.99 dollars", "1,000.99"),
    ("we get 12,345,678 in total", "12,345,678"),
    ("value: 3.14159", "3.14159"),
    ("value is .5", ".5"),
    ("the result is -3", "-3"),
    ("the result is −3", "-3"),  # unicode minus
    ("so x = -7.", "-7"),
    ("5 - 3", "3"),  # a binary minus is not a sign
    ("about 3/4 of them", "3/4"),
    ("it is $\\frac{1}{2}$", "\\frac{1}{2}"),
    ("try [30], then [45].", "45"),
    ("roots 2,3", "3"),  # not a thousands group
    ("first 10, then 20 apples", "20"),
    ("$14{,}916$", "14{,}916"),
    ("an unclosed \\boxed{12", "12"),  # no complete box: fall back to numbers
])
def test_extract_last_number(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "no digits here", "x2 and H2O", None, "\\boxed"])
def test_extract_nothing(text):
    assert extract_answer(text) is None


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize("pred, gold", [
    ("5", "5"), ("5.0", "5"), ("005", "5"), ("-0", "0"), ("+5", "5"),  # integers
    ("0.5", "1/2"), (".5", "0.5"), ("2.50", "5/2"),  # decimals
    ("\\frac{1}{2}", "1/2"), ("\\dfrac{3}{4}", "0.75"), ("\\tfrac{3}{4}", "3/4"),  # fractions
    ("\\frac12", "0.5"), ("\\frac 1 2", "1/2"), ("\\frac3{4}", "3/4"), ("-\\frac{10}{9}", "-10/9"),
    ("\\frac{-8}{-4}", "2"), ("6/4", "3/2"), ("918\\frac{1}{2}", "918.5"),
    ("7,425,000", "7425000"), ("1 000", "1000"), ("1{,}000", "1000"),  # thousands
    ("16,\\!386.20", "16386.2"), ("11,\\! 111,\\! 100", "11111100"),
    ("50\\%", "50"), ("50%", "50"), ("28 percent", "28\\%"),  # percent
    ("\\$10", "10"), ("$10$", "10"), ("10$", "10"),  # dollars and math delimiters
    ("5 apples", "5"), ("5\\text{ cm}", "5"), ("10\\text{ units}", "10"),  # units
    ("\\frac{1}{3}\\text{ meters}", "1/3"), ("\\text{Evelyn}", "Evelyn"),
    ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("90°", "90"), ("90 degrees", "90"),  # degrees
    ("x = 5", "5"), ("5", "x=5"), ("k = \\frac{1}{3}", "1/3"), ("(p,q)=(3,2)", "(3, 2)"),
    ("x \\in [-2,7]", "[-2, 7]"), ("f(x) = 3", "3"),
    ("1\\,000", "1000"), ("5\\!", "5"), ("\\;5", "5"),
    ("\\quad 5", "5"), ("~5", "5"), ("\\qquad 5\\,", "5"),  # spacing commands
    ("\\left(1, 2\\right)", "(1,2)"), ("\\left[0, 1\\right)", "[0,1)"),
    ("(1, 2, 3)", "(1,2,3)"), ("(1, 4.5)", "(1,\\frac{9}{2})"),  # tuples
    ("[0,1)", "[0, 1)"), ("(1, +\\infty)", "(1,\\infty)"),  # intervals
    ("\\{1,2\\}", "\\{2,1\\}"), ("{1,2}", "{2,1}"), ("\\{-2, 2\\}", "\\pm 2"),  # sets
    ("[-1, 2) \\cup (3, 4]", "(3,4] \\cup [-1,2)"),  # unions
    ("6 \\text{ and } 8", "6, 8"), ("19, 46, and 82", "19, 46, \\text{ and } 82"),
    ("\\sqrt 2+\\sqrt 5", "\\sqrt{2}+\\sqrt{5}"), ("\\frac94\\pi", "\\frac{9}{4}\\pi"),
    ("\\text{(C)}", "C"), ("\\mathrm{E}", "E"), ("\\textbf{A}", "A"),
    ("x \\geq 5", "x >= 5"), ("5 \\geq x", "x \\leq 5"),
    ("\\begin{bmatrix}1 & 0\\\\0 & 1\\end{bmatrix}", "\\begin{pmatrix}1&0\\\\0&1\\end{pmatrix}"),
    ("\\boxed{24}", "24"), ("2^3", "8"), ("-5", "−5"), ("12:00", "12:00"),
    ("x^2 + 2*x + 1", "x^2+2x+1"), ("a_{37} = 19, \\quad a_3 = 2", "a_3 = 2, a_{37} = 19"),
])
def test_equiv_true(pred, gold):
    assert is_equiv(pred, gold)
    assert is_equiv(gold, pred)  # the comparison is symmetric


@pytest.mark.parametrize("pred, gold", [
    ("-2", "2"), ("10", "100"), ("\\pm 2", "2"), ("0.333", "1/3"), ("0.3333333", "\\frac{1}{3}"),
    ("(1,2]", "[1,2]"), ("(0,9)", "[0,9)"), ("(1,2)", "(2,1)"), ("{1,3}", "(3,1)"),
    ("5.001", "5"), ("2x", "2"), ("2 x", "2"), ("2\\pi", "2"), ("2 pi", "2"), ("4\\sqrt{2}", "4"),
    ("32, 349", "32349"), ("1,2", "12"), ("-1,2", "-1.2"), ("1 2", "12"),
    ("x = 5", "y = 5"), ("x = 6", "5"), ("7 = 11a+c", "11a+c"), ("a + 3z = 0", "0"),
    ("x > 5", "x < 5"), ("x \\geq 5", "x \\leq 5"), ("10%", "0.2"), ("100", "10\\text{ units}"),
    ("AZYUK2A", "2"), ("oddd", "odd"), ("d", "\\text{E}"), ("e", "E"), ("12:00", "1:00"),
    ("1", "-[0,1)"), ("\\sqrt{67}", "\\sqrt{67},-\\sqrt{85}"), ("10, 4, 2", "4, 12, 2"),
    ("(1,2),(3,4)", "(1,2)"), ("3\\frac{1}{2}", "3.25"), ("2^3", "6"), ("10^{1000000}", "10"),
    ("1/0", "0"), ("NaN", "nan"), ("inf", "-inf"), ("\\frac{64}{400}", "\\frac{63}{400}"),
    ("1112122_3", "1112112_3"), ("[1, 2, 4]", "[1, 2, 3]"),
])
def test_equiv_false(pred, gold):
    assert not is_equiv(pred, gold)
    assert not is_equiv(gold, pred)


@pytest.mark.parametrize("pred, gold", [
    ("", ""), ("  ", "   "), ("", "0"), ("0", ""), (None, "1"), ("1", None),
    ("\\boxed{}", "\\boxed{}"), ("\\boxed{42}", "\\boxed{}"), ("42", "\\boxed"),
])
def test_equiv_empty_never_matches(pred, gold):
    assert is_equiv(pred, gold) is False


def test_docstring_examples():
    # the worked examples in verifier.py's docstrings are documentation: keep them true
    import doctest
    result = doctest.testmod(verifier)
    assert result.attempted >= 3 and result.failed == 0


# ------------------------------------------------------------ reward/feedback


@pytest.mark.parametrize("completion, gold, expected", [
    ("Thus the answer is \\boxed{4}.", "4", 1.0),
    ("Thus the answer is \\boxed{5}.", "4", 0.0),
    ("<think>2 + 2 = 4</think> The answer is 4.", "4", 1.0),  # last-number fallback
    ("I think it is 4, no wait, 5", "4", 0.0),
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("\\boxed{12,000}", "12000", 1.0),
    ("no answer at all", "4", 0.0),
    ("", "4", 0.0),
    ("The answer is \\boxed{}.", "", 0.0),
    ("#### 72", "72", 1.0),
])
def test_reward(completion, gold, expected):
    result = reward(completion, gold)
    assert isinstance(result, float) and result == expected


def test_feedback_messages():
    assert "No final answer" in feedback("I am not sure.", "4")
    assert "\\boxed{}" in feedback("I am not sure.", "4")
    assert feedback("\\boxed{12}", "12") == "The final answer 12 is correct."
    assert feedback("\\boxed{12}", "13") == "The final answer 12 is incorrect."
    assert "empty" in feedback("\\boxed{}", "13")
    long = feedback("\\boxed{" + "x" * 500 + "}", "13")
    assert len(long) < 100 and "..." in long


@pytest.mark.parametrize("completion, gold", [
    ("So the answer is \\boxed{12}.", "7391"),
    ("Clearly 5.", "7391"),
    ("I give up.", "7391"),
    ("\\boxed{\\frac{1}{3}}", "\\frac{13}{17}"),
    ("\\boxed{Briana}", "Evelyn"),
    ("\\boxed{(1, 2)}", "(8, 9)"),
])
def test_feedback_never_reveals_gold(completion, gold):
    message = feedback(completion, gold)
    assert reward(completion, gold) == 0.0
    assert gold not in message
    assert message.endswith(".") and message.count(". ") == 0  # one sentence


# --------------------------------------------------------------------- pass@k


def _brute_pass_at_k(n, c, k):
    """Share of k-subsets of n samples (the first c correct) with a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            expected = _brute_pass_at_k(n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
            closed = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)


@pytest.mark.parametrize("n, c, k, expected", [
    (10, 0, 1, 0.0), (10, 0, 10, 0.0), (10, 10, 1, 1.0), (10, 10, 10, 1.0),
    (10, 3, 1, 0.3), (100, 37, 1, 0.37), (5, 4, 2, 1.0), (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_pass_at_k_edges(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_large_n():
    value = pass_at_k(1000, 3, 500)
    assert math.isfinite(value) and 0.0 <= value <= 1.0
    assert value == pytest.approx(1 - math.comb(997, 500) / math.comb(1000, 500))
    assert 0.0 <= pass_at_k(10**6, 1, 10) <= 1.0


@pytest.mark.parametrize("n, c, k", [
    (5, 2, 0), (5, 2, 6), (5, -1, 1), (5, 6, 1), (0, 0, 1), (5.0, 2, 1), ("5", 2, 1)])
def test_pass_at_k_invalid(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# ------------------------------------------------------------- load_problems


def _solve(question):
    m = re.search(r"What is (-?\d+) ([-+*]) (-?\d+)\?", question)
    assert m, question
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_arith_splits_disjoint_and_correct():
    train, test = load_problems("arith", "train"), load_problems("arith", "test")
    assert train and test
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    size = verifier.ARITH_MAX - verifier.ARITH_MIN + 1
    assert len(train) + len(test) == size * size * len(verifier.ARITH_OPS)
    for p in train + test:
        assert set(p) == {"question", "answer"}
        assert p["answer"] == str(_solve(p["question"]))


def test_arith_disjoint_for_every_seed():
    test = {p["question"] for p in load_problems("arith", "test", seed=1)}
    for seed in range(5):
        assert not test & {p["question"] for p in load_problems("arith", "train", seed=seed)}


def test_arith_seeding():
    assert load_problems("arith", seed=3) == load_problems("arith", seed=3)
    a, b = load_problems("arith", seed=0), load_problems("arith", seed=1)
    assert a != b and sorted(map(str, a)) == sorted(map(str, b))  # same set, other order


def test_arith_n():
    train, test = load_problems("arith"), load_problems("arith", "test")
    assert load_problems("arith", n=10) == train[:10]
    assert load_problems("arith", n=0) == []
    many = load_problems("arith", n=len(train) * 2 + 5)  # train repeats
    assert len(many) == len(train) * 2 + 5
    assert {p["question"] for p in many} == {p["question"] for p in train}
    assert len(load_problems("arith", "test", n=10**6)) == len(test)  # test is capped


def test_arith_range_and_constants(monkeypatch):
    problems = load_problems("arith:1-50", "train") + load_problems("arith:1-50", "test")
    assert len(problems) == 50 * 50
    monkeypatch.setattr(verifier, "ARITH_OPS", ("+", "-", "*"))
    monkeypatch.setattr(verifier, "ARITH_MAX", 9)
    problems = load_problems("arith") + load_problems("arith", "test")
    assert len(problems) == 3 * 9 * 9
    for p in problems:
        assert p["answer"] == str(_solve(p["question"]))


@pytest.mark.parametrize("spec, split", [
    ("arith", "validation"), ("arith", "TRAIN"), ("nonsense", "train"), ("arith:5-1", "train")])
def test_load_problems_bad_arguments(spec, split):
    with pytest.raises(ValueError):
        load_problems(spec, split)


def _write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_basic(tmp_path):
    path = _write(tmp_path, "data.jsonl", [
        json.dumps({"question": "1+1?", "answer": "2", "extra": 1}), "",
        json.dumps({"question": "2+2?", "answer": 4}), "   ",
        json.dumps({"question": "3+3?", "answer": "6"})])
    problems = load_problems(str(path))
    assert problems == [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"},
                        {"question": "3+3?", "answer": "6"}]
    assert load_problems(path, n=2) == problems[:2]  # a Path works; first n in file order
    assert load_problems(str(path), split="test", seed=7) == problems  # split/seed ignored


def test_jsonl_field_names_and_gsm8k(tmp_path):
    path = _write(tmp_path, "gsm.jsonl", [
        json.dumps({"problem": "How many?", "solution": "3 * 400 = 1200\n#### 1,200"}),
        json.dumps({"problem": "And now?", "solution": "#### -7"})])
    problems = load_problems(str(path), question_field="problem", answer_field="solution")
    assert problems == [{"question": "How many?", "answer": "1200"},
                        {"question": "And now?", "answer": "-7"}]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"question": "q"}), "answer"),
    (json.dumps({"answer": "1"}), "question"),
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"question": "q", "answer": "1"})
    path = _write(tmp_path, "data.jsonl", [good, "", bad_line, good])
    with pytest.raises(ValueError) as info:
        load_problems(str(path))
    assert "data.jsonl line 3" in str(info.value) and message in str(info.value)


def test_jsonl_missing_and_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_problems(str(tmp_path / "missing.jsonl"))
    empty = _write(tmp_path, "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="contains no problems"):
        load_problems(str(empty))


# ---------------------------------------------------------------- robustness

ADVERSARIAL = {
    "1MB digits": "9" * 1_000_000,
    "1MB digits boxed": "\\boxed{" + "9" * 1_000_000 + "}",
    "nested braces": "\\boxed{" * 10_000 + "1" + "}" * 10_000,
    "unclosed braces": "\\boxed{" * 10_000 + "1",
    "stray closers": "}" * 10_000 + "\\boxed{1" + "{" * 10_000,
    "nested parens": "(" * 5_000 + "1" + ")" * 5_000,
    "huge power": "10^{1000000}",
    "huge fraction": "\\frac{" + "9" * 5000 + "}{" + "7" * 5000 + "}",
    "long decimal": "0." + "3" * 9000,
    "long list": ", ".join(str(i) for i in range(3000)),
    "NaN": "NaN", "inf": "inf", "-inf": "-inf", "unicode minus": "−5",
    "empty": "", "blank": "   \n\t ", "backslashes": "\\" * 5000, "None": None,
}
CALLS = {
    "extract_answer": lambda x: extract_answer(x),
    "is_equiv(x, gold)": lambda x: is_equiv(x, "1"),
    "is_equiv(pred, x)": lambda x: is_equiv("1", x),
    "is_equiv(x, x)": lambda x: is_equiv(x, x),
    "reward(x, gold)": lambda x: reward(x, "1"),
    "reward(completion, x)": lambda x: reward("\\boxed{1}", x),
    "feedback(x, gold)": lambda x: feedback(x, "1"),
    "feedback(completion, x)": lambda x: feedback("\\boxed{1}", x),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("name", ADVERSARIAL)
def test_adversarial_inputs_are_fast_and_safe(name, call):
    start = time.perf_counter()
    result = CALLS[call](ADVERSARIAL[name])
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{call} took {elapsed:.2f}s on {name}"
    if call.startswith("is_equiv"):
        assert isinstance(result, bool)
    elif call.startswith("reward"):
        assert result in (0.0, 1.0)
    elif call.startswith("feedback"):
        assert isinstance(result, str) and result


def test_adversarial_values():
    assert extract_answer(ADVERSARIAL["nested braces"]) == "1"
    assert is_equiv(ADVERSARIAL["1MB digits"], ADVERSARIAL["1MB digits"])
    assert not is_equiv(ADVERSARIAL["1MB digits"], "9" * 999_999)
    assert not is_equiv("10^{1000000}", "10^{999999}")
    assert is_equiv("−5", "-5")


# -------------------------------------------------------------- public cases

THRESHOLDS = {"core": 0.98, "extraction": 0.95}
EXTENDED_FLOOR = 0.93  # a regression guard just below the level reached (bench_verifier_cases.py)


def _cases_path() -> Path:
    return ROOT / "tests" / "verifier_cases" / "public_cases.jsonl"  # tests/verifier_cases/README.md


@functools.lru_cache(maxsize=1)
def _run_public_cases():
    """Run every case once: {tier: [(id, ok, got, expected, seconds, error)]}."""
    path = _cases_path()
    if not path.is_file():
        return None
    results = defaultdict(list)
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        case = json.loads(line)
        fn = getattr(verifier, case.get("fn") or {"equiv": "is_equiv", "reward": "reward"}[case["kind"]])
        first = case["pred"] if "pred" in case else case.get("completion")
        args = (first,) if fn is extract_answer else (first, case["gold"])
        start, error, got = time.perf_counter(), None, None
        try:
            got = fn(*args)
        except Exception as e:  # recorded, so the failing ids can be listed
            error = repr(e)
        seconds = time.perf_counter() - start
        if fn is reward and got is not None:
            got = got == 1.0
        ok = error is None and seconds < 2.0 and (case["expected"] is None or got == case["expected"])
        results[case["tier"]].append((case["id"], ok, got, case["expected"], seconds, error))
    summary = ", ".join(f"{t} {sum(r[1] for r in rs)}/{len(rs)}" for t, rs in sorted(results.items()))
    print(f"public cases agreement: {summary}")
    return results


def _public_results():
    results = _run_public_cases()
    if results is None:
        pytest.fail(f"public verifier cases not found at {_cases_path()}")
    return results


@pytest.mark.parametrize("tier", sorted(THRESHOLDS))
def test_public_cases_agreement(tier):
    rows = _public_results()[tier]
    assert rows, f"no {tier} cases in the public file"
    failing = [r[0] for r in rows if not r[1]]
    rate = 1 - len(failing) / len(rows)
    assert rate >= THRESHOLDS[tier], f"{tier}: {rate:.1%} < {THRESHOLDS[tier]:.0%}; failing: {failing}"


def test_public_cases_extended_regression():
    rows = _public_results()["extended"]
    failing = [r[0] for r in rows if not r[1]]
    assert 1 - len(failing) / len(rows) >= EXTENDED_FLOOR, f"extended failing: {failing}"


def test_public_cases_no_false_positives():
    false_positives = [r[0] for rows in _public_results().values() for r in rows
                       if r[3] is False and r[2] is True]
    assert not false_positives, f"returned True on pairs labelled False: {false_positives}"


def test_public_cases_robustness():
    rows = _public_results()["robustness"]
    assert rows, "no robustness cases in the public file"
    failing = [f"{r[0]} ({r[5] or f'{r[4]:.2f}s, got {r[2]!r}'})" for r in rows if not r[1]]
    assert not failing, f"robustness cases failing: {failing}"
