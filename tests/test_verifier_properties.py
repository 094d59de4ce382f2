"""Property-based tests for verifier.py (hypothesis, a test-only dependency).

Every property runs a fixed number of derandomized examples, so CI sees the same
inputs on every run; the whole file takes a few seconds. To hunt for new bugs:
    VERIFIER_FUZZ_EXAMPLES=5000 pytest tests/test_verifier_properties.py
runs that many fresh random examples a property (a failure prints its input)."""
from __future__ import annotations

import itertools
import math
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from hypothesis import HealthCheck, given, settings  # test-only dependency: pip install hypothesis
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import verifier  # noqa: E402
from verifier import extract_answer, is_equiv, pass_at_k, reward  # noqa: E402

# derandomize: the examples are a fixed function of the test, so CI is deterministic
FUZZ = int(os.environ.get("VERIFIER_FUZZ_EXAMPLES", "0"))
FAST = settings(max_examples=FUZZ or 300, deadline=None, derandomize=not FUZZ, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
FEW = settings(FAST, max_examples=FUZZ or 100)

# LaTeX-ish pieces: glued together they make the half-formed answers models write
PIECES = ["\\boxed{", "\\fbox{", "{", "}", "\\{", "\\}", "(", ")", "[", "]", "\\frac", "\\dfrac",
          "\\sqrt", "\\sqrt[3]", "^", "_", "\\", "\\\\", "x", "y", "e", "i", "\\pi", "\\infty",
          "0", "1", "2", "3", "9", "10", "1000", ".", ",", "-", "+", "*", "/", "=", "<", ">",
          "\\le", "\\ge", "\\cdot", "\\times", "\\text{", "\\mathrm{", " m}", "cm", "^{2}",
          "e5", "E-3", "10^{", "\\sum_{", "\\sin", "\\left(", "\\right)", "\\pm", "\\cup",
          "$", "%", "\\%", "°", "−", "·", "×", " ", "\n", "and", "\\begin{pmatrix}", "&",
          "\\end{pmatrix}", "|", "!", "'", "~", "\\,", "\\!", "{,}", "π", "√", "é", "😀", "\x00"]
latexish = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)
any_text = st.one_of(latexish, st.text(max_size=200),
                     st.text(alphabet="0123456789{}\\^_.,-+/()x ", max_size=120))


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{fn.__name__}{args!r} took {elapsed:.2f}s"
    return result


@FAST
@given(any_text, any_text)
def test_never_raises_and_returns_fast(text, gold):
    answer = _timed(extract_answer, text)
    assert answer is None or isinstance(answer, str)
    assert _timed(reward, text, gold) in (0.0, 1.0)
    assert isinstance(_timed(is_equiv, text, gold), bool)
    assert isinstance(_timed(is_equiv, answer, text), bool)


@FAST
@given(any_text)
def test_every_extracted_answer_equals_itself(text):
    answer = extract_answer(text)
    if answer is None:
        return
    # "non-empty" means something is left once formatting is removed: "\text{}",
    # "$" or "\," are empty answers, and an empty answer never matches.
    if verifier._clean(answer):
        assert is_equiv(answer, answer)
        assert reward(text, answer) == 1.0
    else:
        assert not is_equiv(answer, answer)


def _variants(a: str):
    """Same answer, other spelling: spaces, math delimiters, a box, \\left/\\right."""
    return st.sampled_from([a, f" {a} ", f"${a}$", f"\\boxed{{{a}}}", a.replace("(", "\\left("),
                            a.replace(" ", ""), a + "."])


@FAST
@given(st.one_of(st.tuples(any_text, any_text),
                 any_text.flatmap(lambda a: st.tuples(st.just(a), _variants(a)))))
def test_is_equiv_is_symmetric(pair):
    a, b = pair
    assert is_equiv(a, b) == is_equiv(b, a)


# ---------------------------------------------------------- wrong numbers


def _decimal(q: Fraction) -> str | None:
    """The exact decimal spelling of q, or None when it has none."""
    den, twos, fives = q.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return None
    places = max(twos, fives)
    digits = str(abs(q.numerator) * 10**places // q.denominator).rjust(places + 1, "0")
    body = digits if not places else digits[:-places] + "." + digits[-places:]
    return ("-" if q < 0 else "") + body


def _spellings(q: Fraction) -> list[str]:
    sign, a = ("-" if q < 0 else ""), abs(q)
    out = [f"{sign}\\frac{{{a.numerator}}}{{{a.denominator}}}", f"{sign}{a.numerator}/{a.denominator}",
           f"{sign}\\dfrac{{{a.numerator}}}{{{a.denominator}}}",
           f"\\frac{{{q.numerator}}}{{{q.denominator}}}"]
    dec = _decimal(q)
    if dec is not None:
        out += [dec, f"${dec}$", f"{dec}\\text{{ cm}}^2"]
        mantissa = dec.lstrip("-")
        if "." not in mantissa:
            out += [f"{sign}{mantissa}.0", f"{sign}{int(mantissa):,}"]
        out += [f"{sign}{mantissa}e0", f"{sign}{mantissa} \\times 10^{{0}}", f"{sign}{mantissa}E+00"]
        if "." not in mantissa and mantissa.endswith("00") and mantissa != "00":
            out.append(f"{sign}{mantissa[:-2]}\\times10^{{2}}")
    return out


# |values| < 10^4 and denominators <= 1000, so two different values differ by at
# least 1e-6 and the long-decimal rule (12+ significant digits, see verifier) is
# never what decides: every pair below must be told apart exactly.
fractions = st.builds(Fraction, st.integers(-10**6, 10**6), st.integers(1, 1000)).filter(
    lambda q: abs(q) < 10**4)
ints = st.integers(-10**6, 10**6).map(Fraction)
numbers = st.one_of(ints, fractions, st.sampled_from([Fraction(0), Fraction(1, 2), Fraction(-1)]))


@FAST
@given(numbers, numbers, st.data())
def test_a_wrong_number_never_matches(p, q, data):
    a = data.draw(st.sampled_from(_spellings(p)))
    b = data.draw(st.sampled_from(_spellings(q)))
    assert is_equiv(a, b) == (p == q), (a, b)
    assert reward(f"The answer is \\boxed{{{a}}}.", b) == (1.0 if p == q else 0.0)


@FAST
@given(numbers, numbers)
def test_arithmetic_is_not_an_answer(a, b):
    # "What is a + b?" must not be answered by copying "a + b" (the symbolic tier's
    # refusal 1); the value itself is accepted.
    spell = lambda q: str(q) if q.denominator == 1 else f"\\frac{{{q.numerator}}}{{{q.denominator}}}"
    for op, value in (("+", a + b), ("-", a - b), ("\\cdot", a * b)):
        assert not is_equiv(f"{spell(a)} {op} {spell(b)}", spell(value))
        # the refusal holds between two spellings as arithmetic too
        assert not is_equiv(f"{spell(a)} {op} {spell(b)}", f"1 \\cdot {spell(value)} + 0")


# ----------------------------------------------------------- symbolic tier

square_free = st.sampled_from([2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19, 21, 22, 23, 30])
small = st.integers(1, 30)


@FEW
@given(small, small, square_free, square_free)
def test_radicals_simplify_exactly(a, m, r, s):
    # a*sqrt(m^2 r) == (a m) sqrt(r); a different square-free radicand never matches
    assert is_equiv(f"{a}\\sqrt{{{m * m * r}}}", f"{a * m}\\sqrt{{{r}}}")
    assert is_equiv(f"\\frac{{{a}}}{{\\sqrt{{{r}}}}}", f"\\frac{{{a}\\sqrt{{{r}}}}}{{{r}}}")
    assert is_equiv(f"{a}\\sqrt{{{r}}}+{m}\\sqrt{{{r}}}", f"{a + m}\\sqrt{{{r}}}")
    assert is_equiv(f"{a}\\sqrt{{{m * m * r}}}", f"{a * m}\\sqrt{{{s}}}") == (r == s)
    assert not is_equiv(f"{a}\\sqrt{{{r}}}", f"{a + 1}\\sqrt{{{r}}}")
    assert not is_equiv(f"\\sqrt{{{r}}}+\\sqrt{{{s}}}", f"\\sqrt{{{r + s}}}")


@FEW
@given(st.integers(-9, 9), st.integers(-9, 9), st.integers(1, 9))
def test_polynomial_identities(a, b, c):
    lhs = f"(x+{a})(x+{b})".replace("+-", "-")
    rhs = f"x^2+{a + b}x+{a * b}".replace("+-", "-")
    assert is_equiv(lhs, rhs)  # expanded and factored forms of one polynomial
    assert not is_equiv(lhs, f"{rhs}+{c}")  # another polynomial
    assert not is_equiv(lhs, f"x^2+{a + b + c}x+{a * b}".replace("+-", "-"))
    assert is_equiv(f"y = {rhs}", lhs) and not is_equiv(f"y = {rhs}", f"{rhs}+{c}")


@FEW
@given(st.integers(1, 99), st.integers(-30, 30), st.integers(-30, 30))
def test_scientific_notation(m, e, f):
    value = Fraction(m) * Fraction(10) ** e
    forms = [f"{m}e{e}", f"{m}E{e:+03d}", f"{m}\\times10^{{{e}}}", f"{m} \\cdot 10^{{{e}}}",
             f"{m}.0 x 10^{{{e}}}"]
    exact = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    for form in forms:
        assert is_equiv(form, exact)
        assert is_equiv(form, f"{m}e{f}") == (e == f)


# Random expression trees, rendered to LaTeX and evaluated at points: whatever the
# symbolic tier calls equal must have the same value at every point, else it has
# invented an identity. Pairs: independent trees, a tree and itself with sums and
# products commuted (equal), a tree and itself with one leaf changed (usually not).
LEAVES = ["x", "y", "\\pi", "\\sin(x)", "\\cos(x)", "\\sqrt{2}", "\\sqrt{8}", "\\sqrt{3}",
          "\\sqrt{12}", "0", "1", "2", "3", "7"]
_VALUES = {"\\sin(x)": lambda v: math.sin(v["x"]), "\\cos(x)": lambda v: math.cos(v["x"]),
           "x": lambda v: v["x"], "y": lambda v: v["y"], "\\pi": lambda v: v["pi"]}
trees = st.recursive(
    st.sampled_from(LEAVES),
    lambda kids: st.tuples(st.sampled_from(["+", "-", "*", "/"]), kids, kids)
    | st.tuples(st.just("^"), kids, st.integers(0, 3)),
    max_leaves=6)


def _render(t, flips=()):
    """LaTeX for tree t; flips[i] swaps the operands of the i-th + or * met."""
    flips = list(flips)

    def go(t):
        if isinstance(t, str):
            return t
        op, a, b = t
        if op == "^":
            return f"({go(a)})^{{{b}}}"
        left, right = go(a), go(b)
        if op in "+*" and flips and flips.pop():
            left, right = right, left
        return {"+": f"({left}+{right})", "-": f"({left}-{right})", "*": f"{left}\\cdot {right}",
                "/": f"\\frac{{{left}}}{{{right}}}"}[op]
    return go(t)


def _evaluate(t, v):
    if isinstance(t, str):
        return _VALUES[t](v) if t in _VALUES else (
            math.sqrt(int(t[6:-1])) if t.startswith("\\sqrt") else int(t))
    op, a, b = t
    if op == "^":
        return _evaluate(a, v) ** b
    x, y = _evaluate(a, v), _evaluate(b, v)
    return {"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else math.nan}[op]


def _mutate(t, leaf, path):
    if isinstance(t, str) or not path:
        return leaf
    op, a, b = t
    if op == "^":
        return (op, _mutate(a, leaf, path[1:]), b)
    return (op, _mutate(a, leaf, path[1:]), b) if path[0] else (op, a, _mutate(b, leaf, path[1:]))


tree_pairs = st.one_of(
    st.tuples(trees, trees),
    st.tuples(trees, st.lists(st.booleans(), max_size=8)).map(lambda p: (p[0], p[0], p[1])),
    st.tuples(trees, st.sampled_from(LEAVES), st.lists(st.booleans(), max_size=6)).map(
        lambda p: (p[0], _mutate(*p), ())))


@FAST
@given(tree_pairs)
def test_symbolic_equal_means_equal_values(pair):
    a, b, *flips = pair
    a_tex, b_tex = _render(a), _render(b, *flips)
    if not is_equiv(a_tex, b_tex):
        return
    for point in ({"x": 0.37, "y": -1.21, "pi": 2.9}, {"x": 1.93, "y": 0.58, "pi": -0.7}):
        try:
            va, vb = _evaluate(a, point), _evaluate(b, point)
        except (ZeroDivisionError, OverflowError):
            continue
        if math.isfinite(va) and math.isfinite(vb):
            assert math.isclose(va, vb, rel_tol=1e-7, abs_tol=1e-9), (a_tex, b_tex)


@FAST
@given(trees, st.lists(st.booleans(), max_size=8))
def test_symbolic_rewritings_are_equal(t, flips):
    a = _render(t)
    if verifier._symbolic(verifier._clean(a)) is None or len(a) > 200:
        return  # outside the tier (e.g. a division by zero) or near its length guard
    # "+ z" (z appears nowhere else) keeps the value from being a rational constant,
    # which is refused on purpose
    assert is_equiv(f"{a}+z", f"z+{_render(t, flips)}")
    assert is_equiv(f"{a}+z", f"z+\\frac{{2\\cdot {a}}}{{2}}")
    assert not is_equiv(f"{a}+z", f"{a}+z+1")


# ------------------------------------------------------------------ pass@k


@FAST
@given(st.integers(1, 12).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.booleans(), min_size=n, max_size=n),
                        st.integers(1, n))))
def test_pass_at_k_is_the_mean_over_k_subsets(args):
    n, correct, k = args
    subsets = list(itertools.combinations(correct, k))
    brute = sum(any(s) for s in subsets) / len(subsets)
    assert pass_at_k(n, sum(correct), k) == pytest.approx(brute, abs=1e-12)
