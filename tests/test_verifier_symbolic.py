"""Tests for verifier.py's symbolic tier: true and false pairs for each addition
(scientific notation, radicals, exact sums and products, polynomials, trigonometry,
relations, units with exponents, long decimals), the two refusals, the known
misses, and its guards."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import verifier  # noqa: E402
from verifier import is_equiv, reward  # noqa: E402

TRUE = {
    "scientific": [
        ("3\\times10^{5}", "300000"), ("3 \\cdot 10^5", "300000"), ("3e5", "300000"),
        ("3E+05", "3\\times 10^{5}"), ("3.0 x 10^5", "3e5"), ("3 × 10^5", "300000"),
        ("2.5\\times 10^{-3}", "\\frac{1}{400}"), ("-1.5e-2", "-0.015"), ("10^{-3}", "0.001"),
        ("6.02\\times10^{23}", "602000000000000000000000"), ("1.0e0", "1"),
    ],
    "radicals": [
        ("\\sqrt{8}", "2\\sqrt{2}"), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("3\\sqrt{12}", "6\\sqrt{3}"), ("\\sqrt{18}", "2\\sqrt{2}+\\sqrt{2}"),
        ("\\sqrt{\\frac{1}{3}}", "\\frac{\\sqrt{3}}{3}"), ("\\sqrt{0.5}", "\\frac{\\sqrt2}{2}"),
        ("\\frac{1}{\\sqrt{2}-1}", "1+\\sqrt{2}"), ("\\sqrt{2}\\cdot\\sqrt{6}", "2\\sqrt{3}"),
        ("\\frac{\\sqrt{6}}{\\sqrt{3}}", "\\sqrt2"), ("(1+\\sqrt{3})^2", "4+2\\sqrt{3}"),
        ("\\sqrt[2]{50}", "5\\sqrt{2}"), ("2\\sqrt{2}, \\sqrt{27}", "3\\sqrt{3}, \\sqrt{8}"),
        ("(\\sqrt{8}, 1)", "(2\\sqrt{2}, 1)"), ("x = \\sqrt{12}", "2\\sqrt{3}"),
        ("\\frac{\\sqrt{3}}{2}\\pi", "\\frac{\\pi\\sqrt{3}}{2}"),
    ],
    "polynomials": [
        ("(x+1)^2", "x^2+2x+1"), ("(r+5)^2", "(r+5)(r+5)"),
        ("\\frac{x}{7}+\\frac{2}{7}", "\\frac{x+2}{7}"),
        ("x^2 + 2*x - (-1)", "x^2+2x+1"), ("2x+ 1+x^2", "y = x^2+2x+1"), ("\\frac{1}{2}x", "\\frac{x}{2}"),
        ("0.5x", "\\frac{x}{2}"), ("\\pi r^2", "r^2\\pi"), ("2\\pi", "\\pi+\\pi"), ("x^{-1}", "\\frac{1}{x}"),
        ("\\frac{1}{x}+\\frac{1}{y}", "\\frac{x+y}{x\\cdot y}"), ("\\frac{a}{b}", "\\frac{2a}{2b}"),
        ("a_{3}+a_{3}", "2a_{3}"), ("\\sin(x)+\\sin(x)", "2\\sin(x)"), ("\\sin^2(x)", "\\sin(x)\\sin(x)"),
        ("F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k", "F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}"),
        ("\\sum_{k=\\frac{1}{2}}^{n} 2k", "\\sum_{k=\\frac{1}{2}}^{n} (k+k)"),
        ("x^{1+1}", "x^2"), ("x^{+2}", "x^{2}"), ("x/-2", "-\\frac{x}{2}"),  # an exponent is a value
    ],
    "trigonometry": [
        ("\\sec^2(y)", "\\tan^2(y)+1"), ("\\sin^2(x)+\\cos^2(x)+x", "1+x"),
        ("\\tan(x)", "\\frac{\\sin(x)}{\\cos(x)}"), ("\\sin^4(x)-\\cos^4(x)", "\\sin^2(x)-\\cos^2(x)"),
        ("\\cot(\\theta)", "\\frac{1}{\\tan(\\theta)}"), ("\\csc^2(x)-\\cot^2(x)+x", "x+1"),
    ],
    "relations": [
        ("-x > -1", "x < 1"), ("-x >= -1", "x \\leq 1"), ("5 = x", "x = 5"), ("x - 5 = 0", "x = 5"),
        ("y=-\\frac{1}{2}x+\\frac{3}{4}", "2x+4y-3=0"), ("x^2/16 + y^2/12 = 1/4", "x^2/4 + y^2/3 = 1"),
        ("-34x-45y+20z-100=0", "34x+45y-20z+100=0"), ("y = 2x", "x = \\frac{y}{2}"),
        ("x + y < 1", "2x + 2y < 2"), ("x + y \\geq 1", "1 \\le x + y"),
    ],
    "units": [
        ("5\\text{ m}^2", "5"), ("5 \\mathrm{cm}^{3}", "5"), ("5 cm^2", "5"), ("12\\text{ m}^{-1}", "12"),
        ("\\frac{1}{2}\\text{ m}^2", "0.5"), ("3\\text{ km}^2.", "3"), ("7 \\mathrm{m}^2", "7 \\text{m}^{2}"),
    ],
    "long decimals": [
        ("0.0833333333333333", "\\frac{1}{12}"), ("4.123105625617661", "\\sqrt{17}"),
        ("1.41421356237", "\\sqrt{2}"), ("0.666666666666", "\\frac{2}{3}"),
        ("0.7071067811865476", "\\frac{1}{\\sqrt{2}}"),
    ],
}

FALSE = {  # different values: never equal
    "scientific": [
        ("3e5", "3e6"), ("3\\times10^{5}", "30000"), ("3.1e5", "3e5"), ("3e-5", "3e5"),
        ("1e1000000", "1"), ("1e1000000", "1e999999"), ("3x10^5", "3x"), ("2e", "2"),
    ],
    "radicals": [
        ("\\sqrt{8}", "2\\sqrt{3}"), ("\\sqrt{2}+\\sqrt{3}", "\\sqrt{5}"), ("\\sqrt{2}", "2"),
        ("\\frac{1}{\\sqrt{2}}", "\\sqrt{2}"), ("2\\sqrt{2}", "\\sqrt{2}^2"), ("\\sqrt{-4}", "2"),
        ("\\sqrt[3]{8}", "\\sqrt{8}"), ("3\\sqrt{12}", "6\\sqrt{2}"), ("1-\\sqrt{2}", "\\sqrt{2}-1"),
        ("(\\sqrt{8}, 1)", "(1, 2\\sqrt{2})"), ("4.123105625617661", "\\sqrt{18}"),
    ],
    "polynomials": [
        ("(x+1)^2", "x^2+x+1"), ("(x+1)^2", "x^2+1"), ("\\frac{x}{7}+\\frac{2}{7}", "\\frac{x+3}{7}"),
        ("\\infty - \\infty + x", "x"), ("2x+ 1+x^2", "y = x^2+2x"), ("AZYUK2A", "2AZYUKA"),
        ("\\pi", "3.14159265358979"), ("F_{n-1}F_k", "F_kF_{n-2}"), ("1/2x", "\\frac{x}{2}"),
        ("x2", "2x"), ("x^23", "x^{23}"), ("3\\frac{1}{2}\\sqrt{2}", "1.5\\sqrt{2}"),
        ("x^{1+2}", "x^2"), ("x^{2.5}", "x^2"), ("\\sum_{k=0}^{n} k", "\\sum_{k=1}^{n} k"),
    ],
    "trigonometry": [
        ("\\sin^2(x)", "\\cos^2(x)"), ("\\sin^2(x)+\\cos^2(y)+x", "1+x"), ("\\sec(x)", "\\cos(x)"),
        ("\\tan^2(x)+1", "\\sec^2(y)"), ("\\sin(x)", "\\sin(2x)"),
    ],
    "relations": [
        ("x < 1", "x > 1"), ("x + y < 1", "-x - y < -1"), ("x + y < 1", "x + y <= 1"),
        ("y=2x+1", "2x-y-1=0"), ("x = 5", "y = 5"), ("7 = 11a+c", "11a+c"), ("-x > -1", "x > 1"),
        ("x = 5", "x^2 = 25"), ("x = 5", "x^2 - 5x = 0"),
    ],
    "units": [
        ("5 x^2", "5"), ("5\\text{ m}^2", "25"), ("3\\mathrm{i}^2", "3"), ("2 e^2", "2"),
        ("5\\text{ m}^2", "6"), ("x\\text{ m}^2", "5"),
    ],
    "long decimals": [
        ("0.333", "\\frac{1}{3}"), ("0.33333333333", "\\frac{1}{3}"), ("0.333333333335", "\\frac{1}{3}"),
        ("0.125000000001", "\\frac{1}{8}"), ("1.4142135624", "\\sqrt{2}"),
        ("0.0833333333333333", "0.0833333333333334"), ("0.0833333333333333", "x"),
    ],
}

REFUSED = {  # equal in value, refused on purpose (see verifier's docstring)
    "arithmetic is not an answer": [
        ("2+3", "5"), ("2 + 3", "1 + 4"), ("2\\cdot 3", "6"), ("\\sqrt{4}", "2"), ("\\sqrt{4}", "1+1"),
        ("\\frac{\\sqrt{8}}{\\sqrt{2}}", "2"), ("7 + 12", "19"), ("x - x + 5", "5"), ("(5, 2+3)", "(5, 5)"),
        ("2^{10}-24", "1000"), ("\\sin^2(x)+\\cos^2(x)", "1"), ("2 = 2", "3 = 3"),
    ],
    "one unknown: the equation is not its solution": [
        ("x = 5", "2x = 10"), ("x < 1", "3x < 3"), ("x = 5", "-3x = -15"),
    ],
}

MISSED = {  # equal, but outside the tier today: pinned so a change is noticed
    "limits": [
        ("x(x+1)", "x^2+x"),  # a letter before "(" is read as a function: f(x) is not f*x
        ("xy", "yx"),  # a word is one symbol
        ("i^2", "-1"), ("e^{i\\pi}", "-1"),  # i, e and \pi are free symbols
        ("\\frac{x}{y} = 1", "x - y = 0"),  # a relation's denominators must be constants
        ("\\sin(2x)", "2\\sin(x)\\cos(x)"), ("\\sqrt[3]{8}\\,x", "2x"), ("x^{1/2}", "\\sqrt{x}"),
    ],
}


def _pairs(table):
    return [pytest.param(p, g, id=f"{kind}: {p} | {g}") for kind, rows in table.items() for p, g in rows]


@pytest.mark.parametrize("pred, gold", _pairs(TRUE))
def test_symbolic_true(pred, gold):
    assert is_equiv(pred, gold)
    assert is_equiv(gold, pred)
    assert reward(f"So the answer is $\\boxed{{{pred}}}$.", gold) == 1.0


@pytest.mark.parametrize("pred, gold", _pairs(FALSE) + _pairs(REFUSED) + _pairs(MISSED))
def test_symbolic_false(pred, gold):
    assert not is_equiv(pred, gold)
    assert not is_equiv(gold, pred)


@pytest.mark.parametrize("text, expected", [
    ("the answer is 3e5", "3e5"), ("it is 1.5E-3.", "1.5E-3"), ("so 3 \\times 10^{5} m", "3 \\times 10^{5}"),
    ("we get 3 \\cdot 10^5", "3 \\cdot 10^5"), ("about 6 × 10^{-2}", "6 × 10^{-2}"),
    ("H2e5 and 7", "7"), ("3e4f", "3"), ("x = 2e", "2"), ("2 \\times 10 = 20", "20"),
])
def test_extract_scientific_notation(text, expected):
    assert verifier.extract_answer(text) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    ("so 3 \\times 10^{5} m", "300000", 1.0), ("the answer is 3e5", "3 \\cdot 10^{5}", 1.0),
    ("the answer is 3e5", "30000", 0.0), ("we get 3 \\cdot 10^5", "5", 0.0),
])
def test_reward_scientific_notation(completion, gold, expected):
    assert reward(completion, gold) == expected


def test_symbolic_tier_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(verifier, "SYMBOLIC", False)
    assert not is_equiv("\\sqrt{8}", "2\\sqrt{2}")
    assert not is_equiv("(x+1)^2", "x^2+2x+1")
    assert not is_equiv("0.0833333333333333", "\\frac{1}{12}")
    assert is_equiv("3e5", "300000")  # scientific notation and units are plain numbers
    assert is_equiv("5\\text{ m}^2", "5")


def test_arith_task_answers_unchanged():
    # the built-in task: copying the question's sum is never rewarded, the sum is
    problems = verifier.load_problems("arith", "test")
    for p in problems[:50]:
        a, b = (int(x) for x in p["question"].split("What is ")[1].split("?")[0].split(" + "))
        assert reward(f"\\boxed{{{a} + {b}}}", p["answer"]) == 0.0
        assert reward(f"{a} + {b} = {a + b}", p["answer"]) == 1.0


@pytest.mark.parametrize("pred, gold", [
    ("(x+y+z+w)^{32}", "(w+x+y+z)^{32}"),  # too many terms: refused, not expanded
    ("(99999999999999999999x+1)^{32}", "(1+99999999999999999999x)^{32}"),
    ("x^{1000000}", "x^{999999}"), ("10^{1000000}", "10^{999999}"), ("1e999999999", "1e999999998"),
    ("\\sqrt{999999999989}", "\\sqrt{999999999989}+0"),  # a prime radicand near MAX_RADICAND
    ("\\sqrt{" + "9" * 40 + "}", "3\\sqrt{" + "1" * 40 + "}"),  # above MAX_RADICAND: refused
    ("(" * 150 + "x" + ")" * 150, "x"),
    ("\\sqrt{" * 60 + "2" + "}" * 60, "2"),
    ("+".join(f"\\frac{{1}}{{x+{i}}}" for i in range(25)), "+".join(f"\\frac{{1}}{{{i}+x}}" for i in range(25))),
    (", ".join(f"(x+{i})^{{8}}" for i in range(100)), ", ".join(f"(x+{i + 1})^{{8}}" for i in range(100))),
    ("x+" * 149 + "x", "150x"),
    ("5 cm" + "^2" * 4000, "5"), ("5\\text{ m}" + "^{2}" * 2000, "5"), ("3" + "\\times 10^{5}" * 1000, "3"),
])
def test_symbolic_guards_are_fast(pred, gold):
    start = time.perf_counter()
    results = {is_equiv(pred, gold), is_equiv(gold, pred)}
    elapsed = time.perf_counter() - start
    assert len(results) == 1, "the two argument orders disagree"
    assert elapsed < 1.0, f"took {elapsed:.2f}s"


def test_symbolic_guard_values():
    assert not is_equiv("x^{1000000}", "x^{999999}")
    assert is_equiv("\\sqrt{999999999989}", "\\sqrt{999999999989}+0")  # trial division to n^(1/3)
    # a prime squared (999983^2) is found too; alone it is a rational (refusal 1)
    assert is_equiv("\\sqrt{999966000289}\\,x", "999983x")
    assert not is_equiv("\\sqrt{999966000289}", "999983")
    assert is_equiv("x+" * 149 + "x", "150x")
