"""Answer checking for RLVR (reinforcement learning with verifiable rewards).

The rule: a completion's final answer is the content of its last ``\\boxed{...}``
(or ``\\fbox{...}``); if it has none, the last number in its text (3e5 and
3 \\times 10^{5} are one number). The reward is 1.0 when that answer is equivalent
to the gold answer, else 0.0.

Equivalence is exact and deliberately conservative. Numbers are compared as exact
rationals (0.5 == 1/2, 3e5 == 3\\times10^{5} == 300000, but 0.333 != 1/3);
formatting noise is removed (LaTeX spacing, \\text{}, unit words also with an
exponent as in 5\\text{ m}^2, %, $, degrees, \\left/\\right, thousands
separators); tuples, intervals, sets and lists are compared element by element.
An unusual but correct answer may be marked wrong; a wrong answer should never be
marked right.

Symbolic tier (SYMBOLIC = True; standard library only): anything else is read
into an exact rational function over rationals and square roots, with each word
(xy is one symbol, x y two), Greek letter, f(x), \\sin(x) or nested root a free
symbol, and compared exactly: \\sqrt{8} == 2\\sqrt{2}, \\frac{1}{\\sqrt{2}} ==
\\frac{\\sqrt{2}}{2}, (x+1)^2 == x^2+2x+1, \\sec^2(y) == \\tan^2(y)+1, y = 2x+1 == 2x-y+1 = 0
(a relation may be scaled by a constant: positive for an inequality). A decimal
with 12+ significant digits matches a value without a finite decimal expansion to
within one unit in its last place (0.0833333333333333 == 1/12). It never calls
arithmetic an answer: 2+3 != 5 and \\sqrt{4} != 2 (a rational must be written as a
number), and in one unknown 2x = 10 != x = 5 (only 5 = x or x - 5 = 0). When it
cannot read an answer it falls back to the string comparison. Equal is not
simplified: where a task asks to simplify or factor, \\sqrt{8} or x^2+2x+1 copied
from the question is rewarded, so set SYMBOLIC = False there.

Also here: feedback(), pass_at_k() and load_problems() (a built-in synthetic
arithmetic task, or JSONL files). Only the standard library is used.
"""
from __future__ import annotations

import functools
import json
import math
import operator
import os
import random
import re
import zlib
from fractions import Fraction

# Synthetic arithmetic task (read at call time, so callers may override them).
ARITH_MIN = 1
ARITH_MAX = 20
ARITH_OPS = ("+",)
ARITH_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
ARITH_TEST_PERCENT = 20  # share of operand pairs held out for the test split
# "arith-steps": the same problems and split, with a prompt that makes a small model write a short
# working before the number (SmolLM2-135M-Instruct: ~50 tokens, ~15% correct), so that a completion
# has a middle (w2spo.py branches inside it).
ARITH_STEPS_TEMPLATE = "What is {a} {op} {b}? Add them step by step, then give the final number."

# Guards that keep every check fast on adversarial input.
MAX_ANSWER_CHARS = 10_000  # longer answers are only compared as plain strings
MAX_DIGITS = 1_000  # longer numbers are compared as strings, never converted
MAX_DEPTH = 20  # deeper nesting of tuples/sets is compared as a string
MAX_PAIRS = 10_000  # element comparisons allowed for unordered collections

# ----------------------------------------------------------------- extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_RE = re.compile(r"\\[{}]|[{}]")  # escaped braces (set notation) are skipped
_SPACES_RE = re.compile(r"\s*")
_TOKEN_RE = re.compile(r"[^\s$]+")
_LAST_NUMBER_RE = re.compile(
    r"""(?<![\w.])[-−+]?                          # not inside a word or number
    (?: \\[dtc]?frac(?:\{\d+\}|\d)(?:\{\d+\}|\d)  # \frac{3}{4}, \frac34
      | (?: \d{1,3}(?:(?:,|\{,\}|,\\!)\d{3})+     # 1,000 / 1{,}000 / 1,\!000
          | \d+ ) (?:\.\d+)? (?:/\d+)?            # 12, 1.5, 3/4
          (?: [eE][+-]?\d+(?!\w|\.\d)             # 3e5, 1.5E-3
            | \s*(?:\\times|\\cdot|×)\s*10\^(?:\{[+-]?\d+\}|\d) )?  # 3 \times 10^{5}
      | \.\d+ )                                   # .5
    (?!\d)""",
    re.VERBOSE,
)


def _boxed_content(text: str) -> str | None:
    """Content of the last complete \\boxed{...}/\\fbox{...} or "\\boxed 5"."""
    ends = [m.end() for m in _BOX_RE.finditer(text)]
    if not ends:
        return None
    # One linear pass pairs every brace, so nesting depth costs no recursion
    # and trying earlier boxes (when the last is unclosed) stays cheap.
    closing, stack = {}, []
    for m in _BRACE_RE.finditer(text, ends[0]):
        if m.group() == "{":
            stack.append(m.start())
        elif m.group() == "}" and stack:
            closing[stack.pop()] = m.start()
    for end in reversed(ends):
        i = _SPACES_RE.match(text, end).end()
        if i < len(text) and text[i] == "{":
            if i in closing:
                return text[i + 1 : closing[i]].strip()
        elif i > end:  # "\boxed 5": one token after whitespace
            token = _TOKEN_RE.match(text, i)
            if token and token.group().rstrip(".,;:"):
                return token.group().rstrip(".,;:")
    return None


def extract_answer(text) -> str | None:
    """The final answer of a completion: last \\boxed{}, else last number, else None."""
    try:
        text = "" if text is None else str(text)
        boxed = _boxed_content(text)
        if boxed is not None:
            return boxed
        last = None
        for last in _LAST_NUMBER_RE.finditer(text):
            pass
        return None if last is None else last.group().replace("−", "-")
    except Exception:  # a reward function must never crash a training run
        return None


# -------------------------------------------------------------- normalisation

_UNICODE = {"−": "-", "∞": "\\infty ", "°": "", "≤": "\\le ", "≥": "\\ge ",
            "≠": "\\ne ", "·": "\\cdot ", "×": "\\times ", "π": "\\pi ", "±": "\\pm ",
            "\u00a0": " "}
_SPACING_RE = re.compile(r"\\\\|\\!\s*|\\[,:; ]|\\q?quad(?![A-Za-z])|~|\{,\}")
# "5\\text{ m}^2", "5 \\mathrm{cm}^{3}": a unit with an exponent after a number
# (not \\mathrm{i}^2 or e^2, which are numbers); unit words alone are dropped later.
_UNIT_POWER_RE = re.compile(
    r"(?<=[\d}])\s*\\(?:text|textrm|mathrm|mbox)\s*\{\s*(?![ie]\s*\})[A-Za-z]{1,5}\s*\}"
    r"\s*\^\s*(?:\{\s*-?\d\s*\}|-?\d)[\s.]*$")
_TEXT_RE = re.compile(
    r"\\(?:text(?:bf|it|rm|normal|tt|sf|up)?|math(?:rm|bf|it|sf|tt|bb|cal)|mbox"
    r"|operatorname|boldsymbol)\s*\{([^{}]*)\}")
_CLEANUPS = [  # (pattern, replacement), applied in order by _clean()
    (r"(?<!\\)\\\\(?=(?:[dtc]?frac|sqrt)(?![A-Za-z]))", r"\\"),  # "\\frac" typo
    (r"\\(?:left|right|[bB]ig[lr]?|displaystyle)(?![A-Za-z])\.?", ""),
    (r"\\\$", ""), (r"\$|\\[()\[\]]", " "),  # currency, then math delimiters
    (r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])", ""),
    (r"\\?%", ""),  # "28\%" means 28 here, as in the labelled data
    (r"\\[dtc]frac(?![A-Za-z])", r"\\frac"),
    (r"\\frac\s*([^\s{}\\])\s*([^\s{}\\])", r"\\frac{\1}{\2}"),  # \frac12
    (r"\\frac\s*([^\s{}\\])\s*\{", r"\\frac{\1}{"),  # \frac3{4}
    (r"\\(frac|sqrt)\s+\{", r"\\\1{"),
    (r"\\sqrt\s*([^\s{}\\\[])", r"\\sqrt{\1}"),  # \sqrt3, \sqrt 3
    (r"\\geq?(?:slant)?(?![A-Za-z])", ">="), (r"\\leq?(?:slant)?(?![A-Za-z])", "<="),
    (r"\\neq?(?![A-Za-z])", "!="), (r"\\gt(?![A-Za-z])", ">"), (r"\\lt(?![A-Za-z])", "<"),
    (r"\\begin\{[bB]?matrix\}|[(\[]\s*\\begin\{array\}\{[^{}]*\}", r"\\begin{pmatrix}"),
    (r"\\end\{[bB]?matrix\}|\\end\{array\}\s*[)\]]", r"\\end{pmatrix}"),
    (r"(\d)\s*(?:\*|\\cdot)\s*(?=[A-Za-z])", r"\1"),  # 2*x -> 2x
    (r" ?,? ?\b(?:and|or)\b ?", ","),  # "6 and 8", "(1,2) or (2,1)" are lists
    (r";", ","),
]
_CLEANUPS = [(re.compile(p), r) for p, r in _CLEANUPS]


def _spacing(m: re.Match) -> str:
    # "\\\\" is a matrix row break, not spacing; "11,\\! 111" is one number.
    tok = m.group()
    return {"\\\\": tok, "{,}": ","}.get(tok, "" if tok.startswith("\\!") else " ")


def _clean(s: str) -> str:
    """Strip formatting from an answer; structure (brackets, commas) is kept."""
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    s = re.sub(r"\s+", " ", s)  # single spaces keep every \s* below linear
    s = _SPACING_RE.sub(_spacing, s)
    s = _UNIT_POWER_RE.sub("", s)
    for _ in range(5):  # \text{...} may be nested a few levels
        s, count = _TEXT_RE.subn(r" \1 ", s)
        if not count:
            break
    s = re.sub(r"\s+", " ", s)
    for pattern, repl in _CLEANUPS:
        s = pattern.sub(repl, s)
    return re.sub(r"\s+", " ", s).strip().rstrip(" .\\").strip()


def _squash(s: str) -> str:
    """Drop spaces, except before a digit after a digit or comma: "1 2" must not
    become "12", and "32, 349" is a list, not the number 32,349."""
    return re.sub(r"(?<![\d,]) | (?!\d)", "", re.sub(r"\s+", " ", s.strip()))


# -------------------------------------------------------------------- numbers

_NUM_RE = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d*)(?:\.(\d*))?")
_RATIO_RES = [re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}"), re.compile(r"([\d.]+)/([+-]?[\d.]+)")]
_MIXED_RE = re.compile(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_POWER_RE = re.compile(r"(\d+)\^(?:\{(\d+)\}|(\d))")
_SCI_RE = re.compile(  # 3e5, 3E+05, 3\times10^{5}, 3\cdot10^5, 3.0x10^5, 10^{-3}
    r"(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,9})"
    r"|(?:(\d+(?:\.\d*)?|\.\d+)(?:\\times|\\cdot|\*|x))?10\^(?:\{([+-]?\d{1,9})\}|(\d))")
_UNIT_EXP_RE = re.compile(r"(?<=[A-Za-z]{2}) ?\^ ?(?:\{ ?-?\d ?\}|-?\d)$")
_NOT_UNITS = {"pi", "inf", "infty", "infinity", "sqrt", "sin", "cos", "tan", "cot",
              "sec", "csc", "log", "ln", "exp", "mod", "pmod", "and", "or", "times",
              "cdot", "is", "to", "i", "e"}


def _plain_number(t: str) -> Fraction | None:
    """Integer or decimal with optional sign and thousands separators."""
    m = _NUM_RE.fullmatch(t)
    if not m:
        return None
    whole, frac = re.sub("[ ,]", "", m.group(2)), m.group(3) or ""
    if not (whole or frac) or len(whole) + len(frac) > MAX_DIGITS:
        return None  # huge numbers stay strings: int() of them is slow or refused
    value = Fraction(int(whole or "0") * 10 ** len(frac) + int(frac or "0"), 10 ** len(frac))
    return -value if m.group(1) == "-" else value


def _strip_units(t: str, exponent: bool = True) -> str:
    """'5 apples' -> '5': drop trailing words (2+ letters, after a space);
    the last may carry an exponent: '5 cm^2' -> '5'."""
    bare = _UNIT_EXP_RE.sub("", t) if exponent else t
    if bare != t:  # the exponent goes only with the unit word it follows
        stripped = _strip_units(bare, exponent=False)
        return stripped if stripped != bare else t
    i = len(t)
    while i and (t[i - 1] == " " or (t[i - 1].isascii() and t[i - 1].isalpha())):
        i -= 1
    words = t[i:].split()
    if not words or not t[i:].startswith(" ") or t[i - 1 : i] == "\\":
        return t
    if len(words[0]) < 2 or any(w.lower() in _NOT_UNITS for w in words):
        return t
    return t[:i].rstrip()


def _number(s: str) -> Fraction | None:
    """Exact value of a numeric answer, or None when it is not a plain number."""
    t = _strip_units(s.strip())
    value = _plain_number(t)  # before squashing, so "1 000" stays one number
    t = _squash(t)
    if value is not None or " " in t:
        return value
    sign, t = (-1, t[1:]) if t.startswith("-") else (1, t.lstrip("+"))
    value = _plain_number(t)  # "- 5" once squashed
    if value is not None:
        return sign * value
    for ratio in _RATIO_RES:  # \frac{a}{b} and a/b
        if m := ratio.fullmatch(t):
            num, den = _plain_number(m.group(1)), _plain_number(m.group(2))
            return sign * num / den if num is not None and den else None
    if m := _MIXED_RE.fullmatch(t):  # 918\frac{1}{2} is a mixed number
        whole, num, den = (_plain_number(g) for g in m.groups())
        ok = whole is not None and num is not None and den and num < den
        return sign * (whole + num / den) if ok else None
    if m := _SCI_RE.fullmatch(t):  # scientific notation: an exact number too
        mantissa = _plain_number(m.group(1) or m.group(3) or "1")
        exp = int(m.group(2) or m.group(4) or m.group(5))
        if mantissa is not None and abs(exp) <= MAX_DIGITS:  # 1e1000000 stays a string
            return sign * mantissa * Fraction(10) ** exp
    if m := _POWER_RE.fullmatch(t):  # 2^3 == 8, but 10^{1000000} stays a string
        exp = int((m.group(2) or m.group(3))[:9])
        if len(m.group(1)) <= MAX_DIGITS and len(m.group(1)) * exp <= MAX_DIGITS:
            return sign * Fraction(int(m.group(1)) ** exp)
    return None


# ------------------------------------------------------------------ structure


def _split_top(s: str, sep: str) -> list[str]:
    """Split at `sep` outside brackets; an unbalanced string is not split."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return [s]
        elif depth == 0 and s.startswith(sep, i) and not (
                sep[-1].isalpha() and s[i + len(sep) : i + len(sep) + 1].isalpha()):
            parts.append(s[start:i])
            start = i = i + len(sep)
            continue
        i += 1
    return [s] if depth else parts + [s[start:]]


def _enclosed(s: str):
    """(open, body, close) when one bracket pair wraps the whole string."""
    opening = "\\{" if s.startswith("\\{") and s.endswith("\\}") else s[:1]
    closing = "\\}" if opening == "\\{" else s[-1:]
    if (len(s) < 2 * len(opening) or opening not in ("(", "[", "{", "\\{")
            or closing[-1] not in ")]}" or (opening[-1] == "{") != (closing[-1] == "}")):
        return None
    depth = 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if depth <= 0 and len(opening) - 1 <= i < len(s) - 1:
            return None  # "(1,2) \cup (3,4)": the first bracket closes early
    return (opening, s[len(opening) : -len(closing)], closing) if depth == 0 else None


def _is_name(lhs: str) -> bool:
    """A variable-like left-hand side: x, f(x), (p,q), a_{3}, |AB|, A:B."""
    t = re.sub(r"_\{[^{}]*\}|_\w", "", lhs).replace(" ", "")
    return bool(re.fullmatch(r"[A-Za-z\\{}()|:,']+", t)) and bool(re.search("[A-Za-z]", t))


def _relation(s: str):
    """(lhs, rel, rhs) for a single top-level '=', '\\in' or '\\approx'."""
    found, depth = [], 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if depth:
            continue
        if c in "<>":
            return None  # an inequality: keep it whole
        if c == "=" and s[i - 1 : i] not in ("!", "=") and s[i + 1 : i + 2] != "=":
            found.append((i, 1, "="))
        elif c == "\\":
            for rel in ("\\in", "\\approx"):
                nxt = s[i + len(rel) : i + len(rel) + 1]
                if s.startswith(rel, i) and not nxt.isalpha():
                    found.append((i, len(rel), rel))
    if len(found) != 1:
        return None
    i, n, rel = found[0]
    lhs, rhs = s[:i].strip(), s[i + n :].strip()
    return (lhs, rel, rhs) if lhs and rhs else None


def _parse(s: str, depth: int = 0):
    """Turn a cleaned answer into a small tree of tagged tuples for _same()."""
    s = s.strip().rstrip(" .").strip()
    if not s:
        return None
    if depth > MAX_DEPTH:
        return ("str", _squash(s), None)
    value = _number(s)
    if value is not None:
        return ("num", value, s)
    rel = _relation(s)
    if rel:
        lhs, op, rhs = rel
        if op == "\\approx":  # "x \approx 11" -> 11; "\frac{1}{3} \approx 0.33" -> 1/3
            return _parse(rhs if _is_name(lhs) else lhs, depth + 1)
        if _is_name(lhs):  # "x = 5" and "5" are the same answer
            return ("eq", _squash(lhs), _parse(rhs, depth + 1), s)
    for tag, sep in (("union", "\\cup"), ("list", ",")):
        parts = _split_top(s, sep)
        if len(parts) > 1:
            return (tag, [_parse(p, depth + 1) for p in parts])
    if s.startswith("\\pm") and not s[3:4].isalpha():
        value = _number(s[3:])
        if value is not None:  # "\pm 2" is the set {-2, 2}, never just 2
            return ("list", [("num", -value, None), ("num", value, None)])
    wrapped = _enclosed(s)
    if wrapped:
        opening, body, closing = wrapped
        items = _split_top(body, ",")
        if opening == "\\{" or (opening == "{" and len(items) > 1):
            return ("list", [_parse(p, depth + 1) for p in items])  # a set
        if len(items) > 1:  # tuple or interval: order and brackets matter
            return ("seq", opening + closing, [_parse(p, depth + 1) for p in items])
        if opening + closing in ("()", "{}"):  # redundant grouping: "(C)" is "C"
            return _parse(body, depth + 1)
    t = _squash(s)
    if t.count("<") == 2 and ">" not in t and "!" not in t:  # a < x < b
        m = re.fullmatch(r"([^<]+)<(=?)([^<=][^<]*)<(=?)([^<=][^<]*)", t)
        if m and _is_name(m.group(3)):
            ends = ("[" if m.group(2) else "(") + ("]" if m.group(4) else ")")
            return ("seq", ends, [_parse(m.group(1), depth + 1), _parse(m.group(5), depth + 1)])
    m = re.fullmatch(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", t)
    if m:
        rows = [r for r in m.group(1).split("\\\\") if r]
        return ("matrix", [[_parse(c, depth + 1) for c in r.split("&")] for r in rows])
    return ("str", _canonical(t), s)


def _canonical(t: str) -> str:
    """Final string form: no leading '+', and 'a > b' written as 'b < a'."""
    t = (t[1:] if t.startswith("+") else t).replace(", ", ",")
    rels = re.findall(r"<=|>=|!=|<|>", t)
    if len(rels) == 1 and rels[0][0] == ">":
        lhs, rhs = t.split(rels[0], 1)
        t = rhs + "<" + rels[0][1:] + lhs
    return t


def _same(a, b) -> bool:
    if a is None or b is None:
        return False
    if a[0] == "eq" or b[0] == "eq":
        if a[0] == b[0]:  # both name a variable: the names must agree too
            same = a[1] == b[1] and _same(a[2], b[2])
        else:
            same = _same(a[2], b) if a[0] == "eq" else _same(a, b[2])
        return same or _symbolic_same(a, b)  # y = 2x is the line 2x - y = 0
    if a[0] != b[0]:
        return {a[0], b[0]} == {"num", "str"} and _symbolic_same(a, b)
    if a[0] in ("num", "str"):
        return a[1] == b[1] or _symbolic_same(a, b)
    if a[0] == "seq":
        return a[1] == b[1] and len(a[2]) == len(b[2]) and all(map(_same, a[2], b[2]))
    if a[0] == "matrix":
        return [len(r) for r in a[1]] == [len(r) for r in b[1]] and all(
            all(map(_same, ra, rb)) for ra, rb in zip(a[1], b[1]))
    # "list" (sets, bare lists, \pm) and "union": order and repeats don't matter
    xs, ys = a[1], b[1]
    if len(xs) * len(ys) > MAX_PAIRS:
        return False
    return all(any(_same(x, y) for y in ys) for x in xs) and all(
        any(_same(x, y) for x in xs) for y in ys)


# ------------------------------------------------------------- symbolic tier
#
# An answer that is not a plain number is read into an exact rational function:
# numerator and denominator are polynomials whose terms are
#     coefficient (a Fraction) * sqrt(radicand) * monomial,
# stored as {(monomial, radicand): coefficient}, the radicand a square-free
# integer and the monomial a sorted tuple of (atom, exponent). Square roots of
# distinct square-free integers are linearly independent over the rationals, so
# this form is canonical: 2\sqrt{2}, \sqrt{8} and \frac{4}{\sqrt{2}} all become
# {((), 2): 2}. Atoms (x, \pi, F_{n}, f(x), \sin(x), a nested root) are free
# symbols, so an identity found here holds whatever value they stand for: the
# tier can miss an equivalence (i^2, sin 2x, \sqrt{x}^2), it cannot invent one. The one
# identity added is sin^2 + cos^2 = 1 (see _pythagoras). Two deliberate refusals
# keep it from rewarding unfinished work, see _symbolic_leaves.

SYMBOLIC = True  # False: only the exact number/structure rules above
MAX_SYMBOLIC_CHARS = 300  # longer answers are not read symbolically
MAX_TERMS = 100  # terms in one polynomial (so (a+b+c)^32 is refused)
MAX_POWER = 32  # largest integer exponent that is expanded
MAX_RADICAND = 10**12  # \sqrt{n} is simplified by trial division up to n^(1/3)
MAX_BITS = 4_000  # size of a coefficient's numerator or denominator
MAX_WORK = 100_000  # term products per answer, and per comparison
APPROX_DIGITS = 12  # a decimal this precise may stand for an irrational value

_GREEK = frozenset(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu "
    "nu xi pi rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi "
    "Sigma Phi Psi Omega".split())
_FUNCTIONS = frozenset(
    "sin cos tan sec csc cot arcsin arccos arctan sinh cosh tanh log ln lg exp".split())
_SYM_TOKEN_RE = re.compile(
    r"\s*(?:(\d+(?:\.\d*)?|\.\d+)"  # number
    r"|\\([A-Za-z]+)"  # command
    r"|([A-Za-z]+(?:_(?:\{[^{}]*\}|[A-Za-z0-9]))?)"  # word, with a subscript: F_{n-1}
    r"|(<=|>=|[-+*/^(){}\[\]=<>_]))")  # operator
_DECIMAL_RE = re.compile(r"[+-]?\d*\.\d+")
_ONE = ((), 1)  # the key of the constant term
_POLY_ONE = {_ONE: Fraction(1)}  # the polynomial 1 (never modified in place)


class _Unsupported(Exception):
    """Raised inside the symbolic reader: the answer stays outside the tier."""


def _check(p: dict) -> dict:
    if len(p) > MAX_TERMS:
        raise _Unsupported("too many terms")
    for (_, rad), c in p.items():
        if (c.numerator.bit_length() > MAX_BITS or c.denominator.bit_length() > MAX_BITS
                or rad.bit_length() > 256):
            raise _Unsupported("coefficient too large")
    return p


def _const(q) -> dict:
    return {_ONE: Fraction(q)} if q else {}


def _scale(p: dict, q: Fraction) -> dict:
    return _check({k: c * q for k, c in p.items()}) if q else {}


def _add(p: dict, q: dict, sign: int = 1) -> dict:
    out = dict(p)
    for k, c in q.items():
        c = out.get(k, 0) + sign * c
        if c:
            out[k] = c
        else:
            out.pop(k, None)
    return _check(out)


def _mul(p: dict, q: dict, work: list) -> dict:
    work[0] += len(p) * len(q)
    if work[0] > MAX_WORK:
        raise _Unsupported("too much work")
    out = {}
    for (m1, r1), c1 in p.items():
        for (m2, r2), c2 in q.items():
            # sqrt(r1)*sqrt(r2) = g*sqrt(r1*r2/g^2): square-free again, no factoring
            g = math.gcd(r1, r2)
            mono = dict(m1)
            for atom, e in m2:
                mono[atom] = mono.get(atom, 0) + e
            key = (tuple(sorted(mono.items())), (r1 // g) * (r2 // g))
            c = out.get(key, 0) + c1 * c2 * g
            if c:
                out[key] = c
            else:
                out.pop(key, None)
    return _check(_pythagoras(out))


def _pythagoras(p: dict) -> dict:
    """Rewrite sin(u)^2 as 1 - cos(u)^2 until every sine has exponent 0 or 1: the
    unique form of p modulo sin^2 + cos^2 = 1, so sec^2 and tan^2 + 1 agree."""
    if not any(e > 1 and a.startswith("\\sin(") for (mono, _) in p for a, e in mono):
        return p
    out, todo = {}, list(p.items())
    while todo:
        (mono, rad), c = todo.pop()
        powers = dict(mono)
        sine = next((a for a, e in mono if e > 1 and a.startswith("\\sin(")), None)
        if sine is None:
            out = _add(out, {(mono, rad): c})
            continue
        powers[sine] -= 2
        cosine = "\\cos(" + sine[len("\\sin("):]
        rest = tuple(sorted((a, e) for a, e in powers.items() if e))
        powers[cosine] = powers.get(cosine, 0) + 2
        todo += [((rest, rad), c), ((tuple(sorted((a, e) for a, e in powers.items() if e)), rad), -c)]
        if len(todo) > MAX_TERMS:
            raise _Unsupported("too many terms")
    return out


@functools.lru_cache(maxsize=1024)
def _square_free(n: int) -> tuple[int, int]:
    """(a, b) with n == a*a*b and b square-free; n <= MAX_RADICAND."""
    if n > MAX_RADICAND:
        raise _Unsupported("radicand too large")
    outside, inside, p = 1, 1, 2
    while p * p * p <= n:  # every prime up to the cube root ...
        if n % p == 0:
            e = 0
            while n % p == 0:
                n, e = n // p, e + 1
            outside, inside = outside * p ** (e // 2), inside * p ** (e % 2)
        p += 1 if p == 2 else 2
    # ... leaves 1, q, q*r or q*q, with q and r primes above it
    root = math.isqrt(n)
    return (outside * root, inside) if root * root == n else (outside, inside * n)


def _rat(v):
    """The value as a Fraction when it is a rational constant, else None."""
    num, den = v
    if not num:
        return Fraction(0)
    k = next(iter(den))
    if k not in num:
        return None
    c = num[k] / den[k]
    return c if num == _scale(den, c) else None


def _is_const(v) -> bool:
    return all(mono == () for p in v for mono, _ in p)


def _key(v) -> str:
    """A fixed spelling of a value, used to name atoms such as \\sqrt{x+1}."""
    num, den = v
    q = _rat((den, _POLY_ONE))  # a rational denominator is folded in
    if q is not None:
        num, den = _scale(num, 1 / q), _POLY_ONE
    return repr((sorted(num.items()), sorted(den.items())))


class _Reader:
    """Recursive descent over one cleaned answer: relation, sum, product, power."""

    def __init__(self, text: str):
        self.toks, i, text = [], 0, text.strip()
        while i < len(text):
            m = _SYM_TOKEN_RE.match(text, i)
            if not m or m.end() == i:
                raise _Unsupported(f"unexpected {text[i:i + 10]!r}")
            kind = ("num", "cmd", "word", "op")[m.lastindex - 1]
            self.toks.append((kind, m.group(m.lastindex)))
            i = m.end()
        self.i, self.depth, self.work = 0, 0, [0]

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, kind=None, value=None):
        tok = self.peek()
        if tok[0] is None or kind not in (None, tok[0]) or value not in (None, tok[1]):
            raise _Unsupported(f"expected {value or kind}, got {tok[1]!r}")
        self.i += 1
        return tok

    def accept(self, value) -> bool:
        if self.peek() == ("op", value):
            self.i += 1
            return True
        return False

    def sign(self) -> int:
        if self.accept("-"):
            return -1
        self.accept("+")
        return 1

    # values are (numerator, denominator) pairs of polynomials
    def add(self, a, b, sign=1):
        if a[1] == b[1]:
            return _add(a[0], b[0], sign), a[1]
        return (_add(_mul(a[0], b[1], self.work), _mul(b[0], a[1], self.work), sign),
                _mul(a[1], b[1], self.work))

    def mul(self, a, b):
        return _mul(a[0], b[0], self.work), _mul(a[1], b[1], self.work)

    def div(self, a, b):
        if not b[0]:
            raise _Unsupported("division by zero")
        return _mul(a[0], b[1], self.work), _mul(a[1], b[0], self.work)

    def power(self, v, k: int):
        if k < 0:
            v, k = self.div((_POLY_ONE, _POLY_ONE), v), -k
        if k > MAX_POWER or (k == 0 and not v[0]):
            raise _Unsupported("exponent")
        out = (_POLY_ONE, _POLY_ONE)
        while k:  # square and multiply
            if k & 1:
                out = self.mul(out, v)
            k >>= 1
            if k:
                v = self.mul(v, v)
        return out

    def relation(self):
        lhs, op, rhs = self.sum(), None, None
        kind, val = self.peek()
        if kind == "op" and val in ("=", "<", ">", "<=", ">="):
            self.i += 1
            op, rhs = val, self.sum()
        if self.peek()[0] is not None:
            raise _Unsupported(f"trailing {self.peek()[1]!r}")
        return op, lhs, rhs

    def sum(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Unsupported("too deep")
        sign = self.sign()
        value = self.product()
        if sign == -1:
            value = (_scale(value[0], Fraction(-1)), value[1])
        while self.peek() in (("op", "+"), ("op", "-")):
            sign = 1 if self.take()[1] == "+" else -1
            value = self.add(value, self.product(), sign)
        self.depth -= 1
        return value

    def starts_factor(self) -> bool:
        kind, val = self.peek()
        return kind in ("num", "word") or (kind == "cmd" and val not in ("cdot", "times")) or (
            kind == "op" and val in "({")

    def product(self):
        value = self.factor()
        while True:
            tok = self.peek()
            if tok in (("op", "*"), ("cmd", "cdot"), ("cmd", "times")):
                self.i += 1
                value = self.mul(value, self.factor())
            elif tok == ("op", "/"):
                self.i += 1
                value = self.div(value, self.atom_power())
                if self.starts_factor():
                    raise _Unsupported("1/2x is ambiguous")
            elif self.starts_factor():
                if tok[0] == "num":
                    raise _Unsupported("x2, 2 3: a number after a factor is no product")
                if tok == ("cmd", "frac") and self.toks[self.i - 1][0] == "num":
                    raise _Unsupported("3\\frac{1}{2} is a mixed number, not a product")
                value = self.mul(value, self.factor())
            else:
                return value

    def factor(self):
        if self.accept("-"):
            value = self.factor()
            return _scale(value[0], Fraction(-1)), value[1]
        self.accept("+")
        return self.atom_power()

    def atom_power(self):
        value = self.primary()
        if self.accept("^"):
            value = self.power(value, self.exponent())
        return value

    def exponent(self) -> int:
        if self.accept("{"):
            sign = self.sign()
            digits = self.take("num")[1]
            self.take("op", "}")
        else:  # x^23 is x^2 * 3 in LaTeX: only one digit binds
            sign, digits = 1, self.take("num")[1]
            if len(digits) != 1:
                raise _Unsupported("x^23 is ambiguous")
        if not digits.isdigit() or len(digits) > 3:
            raise _Unsupported("non-integer exponent")
        return sign * int(digits)

    def braced(self):
        self.take("op", "{")
        value = self.sum()
        self.take("op", "}")
        return value

    def raw(self) -> str:
        """A group's tokens as written, e.g. the bounds of a sum."""
        if not self.accept("{"):
            return self.take()[1]
        out, depth = [], 1
        while depth:
            kind, val = self.take()
            if kind == "op" and val in "{}":
                depth += 1 if val == "{" else -1
            out.append(val)
        return "{" + " ".join(out)

    def atom(self, name: str):
        return {(((name, 1),), 1): Fraction(1)}, _POLY_ONE

    def primary(self):
        kind, val = self.take()
        if kind == "num":
            if len(val) > MAX_DIGITS:
                raise _Unsupported("number too long")
            return _const(Fraction(val)), _POLY_ONE
        if kind == "word":
            if self.peek() == ("op", "("):  # f(x) is a function, never f*x
                self.i += 1
                arg = self.sum()
                self.take("op", ")")
                return self.atom(f"{val}({_key(arg)})")
            return self.atom(val)
        if kind == "op" and val in "({":
            value = self.sum()
            self.take("op", ")" if val == "(" else "}")
            return value
        if kind == "cmd" and val == "sqrt":
            if self.accept("["):
                if self.take("num")[1] != "2":
                    raise _Unsupported("only square roots")
                self.take("op", "]")
            return self.sqrt(self.braced())
        if kind == "cmd" and val == "frac":
            return self.div(self.braced(), self.braced())
        if kind == "cmd" and val in _GREEK:
            return self.atom("\\" + val)
        if kind == "cmd" and val in ("sum", "prod"):  # the bounds name it, the body follows
            bounds = "".join(op + self.raw() for op in "_^" if self.accept(op))
            return self.atom(f"\\{val}{bounds}({_key(self.product())})")
        if kind == "cmd" and val in _FUNCTIONS:
            k = self.exponent() if self.accept("^") else 1
            if self.peek() not in (("op", "("), ("op", "{")) or k < 1:
                raise _Unsupported("a function needs a bracketed argument")
            close = ")" if self.take()[1] == "(" else "}"
            arg = _key(self.sum())
            self.take("op", close)
            sin, cos = self.atom(f"\\sin({arg})"), self.atom(f"\\cos({arg})")
            value = {"sec": (_POLY_ONE, cos[0]), "csc": (_POLY_ONE, sin[0]), "tan": (sin[0], cos[0]),
                     "cot": (cos[0], sin[0])}.get(val) or self.atom(f"\\{val}({arg})")
            return self.power(value, k)
        raise _Unsupported(f"unknown {val!r}")

    def sqrt(self, v):
        q = _rat(v)
        if q is None:  # \sqrt{x+1}, \sqrt{\sqrt{2}+1}: an atom named by its content
            return self.atom(f"\\sqrt{{{_key(v)}}}")
        if q < 0:
            raise _Unsupported("square root of a negative number")
        # sqrt(p/q) = sqrt(p*q)/q, and sqrt(p*q) = a*sqrt(b) with b square-free
        outside, inside = _square_free(q.numerator * q.denominator)
        return {((), inside): Fraction(outside, q.denominator)} if q else {}, _POLY_ONE


@functools.lru_cache(maxsize=4096)
def _symbolic(text: str):
    """("expr", value) or ("rel", op, D) with D < 0, D <= 0 or D = 0; None when
    the answer is outside the tier (see _Reader)."""
    if not text or len(text) > MAX_SYMBOLIC_CHARS:
        return None
    try:
        reader = _Reader(text)
        op, lhs, rhs = reader.relation()
        if op is None:
            return ("expr", lhs)
        if op in (">", ">="):  # a > b is b < a
            op, lhs, rhs = "<" + op[1:], rhs, lhs
        num, den = reader.add(lhs, rhs, -1)
        q = _rat((den, _POLY_ONE))
        if q is None:  # x/y = 1 is not y-x = 0 where y = 0: keep denominators constant
            return None
        return ("rel", op, _scale(num, 1 / q))
    except (_Unsupported, ValueError, ZeroDivisionError, RecursionError):
        return None


def _atoms(p: dict) -> set:
    return {atom for mono, _ in p for atom, _ in mono}


def _approx(p: dict, digits: int = 60) -> Fraction:
    """A constant polynomial's value to about `digits` decimals."""
    scale = 10 ** digits
    return sum((c * Fraction(math.isqrt(r * scale * scale), scale) for (_, r), c in p.items()),
               Fraction(0))


def _terminates(q: Fraction) -> bool:
    """Whether q has a finite decimal expansion (its denominator is 2^i 5^j)."""
    den = q.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def _approx_same(a, b) -> bool:
    """A long decimal (a) against an exact value without a finite decimal expansion
    (b: 1/12, \\sqrt{17}): equal to within one unit in the decimal's last place, as
    a printed float is (0.0833333333333333 for 1/12). 0.125000000001 is never 1/8."""
    if a[0] != "num" or b[0] not in ("num", "str") or not (a[2] and b[2]):
        return False
    text = _squash(a[2])
    if not _DECIMAL_RE.fullmatch(text) or _DECIMAL_RE.fullmatch(_squash(b[2])):
        return False
    if len(re.sub(r"\D", "", text).lstrip("0")) < APPROX_DIGITS:
        return False  # 0.333 is not 1/3
    if b[0] == "num":
        value = b[1]
    else:
        sym = _symbolic(b[2])
        if not sym or sym[0] != "expr" or not _is_const(sym[1]):
            return False
        value = _rat(sym[1])
    if value is not None and _terminates(value):
        return False
    if value is None:  # irrational: to 60 decimals, far below the tolerance
        den = _approx(sym[1][1])
        if abs(den) < Fraction(1, 10**20):
            return False
        value = _approx(sym[1][0]) / den
    return abs(a[1] - value) <= Fraction(1, 10 ** len(text.split(".")[1]))


def _proportional(p: dict, q: dict):
    """c with p == c*q (a rational), or None."""
    if not p or not q:
        return None
    k = next(iter(q))
    c = p.get(k, 0) / q[k]
    return c if c and p == _scale(q, c) else None


def _symbolic_same(a, b) -> bool:
    """Leaves a and b (num, str or eq) that the exact rules found different."""
    if not SYMBOLIC or a[0] not in ("num", "str", "eq") or b[0] not in ("num", "str", "eq"):
        return False
    if a[0] == b[0] == "eq" and a[1] == b[1]:
        return False  # x = 5 vs x = \sqrt{25}: the right-hand sides were compared
    try:
        return _symbolic_leaves(a, b)
    except _Unsupported:  # a guard tripped while comparing: not shown equal
        return False


def _symbolic_leaves(a, b) -> bool:
    if _approx_same(a, b) or _approx_same(b, a):
        return True
    if "num" in (a[0], b[0]) or not (a[-1] and b[-1]):
        return False  # a plain number is only ever equal to an exact number
    x, y = _symbolic(a[-1]), _symbolic(b[-1])
    if not x or not y or x[0] != y[0]:
        return False
    if x[0] == "expr":
        (n1, d1), (n2, d2), work = x[1], y[1], [0]
        same = n1 == n2 if d1 == d2 else _mul(n1, d2, work) == _mul(n2, d1, work)
        # Refusal 1: a rational value written as arithmetic (2+3, \sqrt{4}, 2\cdot 3)
        # is not the number 5 or 2 or 6: "What is 2+3?" must not be answered "2+3".
        return same and _rat(x[1]) is None
    # Relations: D1 = c*D2 with c > 0 (c != 0 for an equation: both sides may swap).
    (op1, p1), (op2, p2) = x[1:], y[1:]
    c = _proportional(p1, p2)
    if op1 != op2 or c is None or not _atoms(p1):
        return False
    if len(_atoms(p1) | _atoms(p2)) == 1:
        # Refusal 2: in one unknown, 2x = 10 is the question and x = 5 its answer,
        # so only a rewriting that keeps the scale counts (5 = x, -x > -1 for x < 1).
        return c == 1 or (op1 == "=" and c == -1)
    return c > 0 or op1 == "="


def _unbox(s: str) -> str:
    """Gold answers are sometimes stored as \\boxed{...}: compare the content."""
    inner = _boxed_content(s) if "\\boxed" in s or "\\fbox" in s else None
    return s if inner is None else inner


def is_equiv(pred, gold) -> bool:
    """Whether two final answers are the same (exactly; see the module docstring)."""
    try:
        pred, gold = ("" if x is None else str(x) for x in (pred, gold))
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            a, b = "".join(pred.split()), "".join(gold.split())
            return bool(a) and a == b
        a, b = _clean(_unbox(pred)), _clean(_unbox(gold))
        if not a or not b:
            return False  # an empty answer never matches, not even an empty gold
        if _squash(a) == _squash(b):
            return True
        return _same(_parse(a), _parse(b))
    except Exception:  # never crash training; fall back to an exact comparison
        try:
            return bool(str(pred).strip()) and str(pred).strip() == str(gold).strip()
        except Exception:
            return False


def reward(completion, gold) -> float:
    """1.0 when the completion's final answer matches `gold`, else 0.0."""
    answer = extract_answer(completion)
    return 1.0 if answer is not None and is_equiv(answer, gold) else 0.0


def feedback(completion, gold) -> str:
    """One sentence on the final answer; it never quotes the gold answer."""
    try:
        answer = extract_answer(completion)
        if answer is None:
            return "No final answer was found; end with the answer in \\boxed{}."
        shown = " ".join(answer.split())
        if not shown:
            return "The final answer is empty; put the answer inside \\boxed{}."
        if len(shown) > 50:
            shown = shown[:47] + "..."
        verdict = "correct" if is_equiv(answer, gold) else "incorrect"
        return f"The final answer {shown} is {verdict}."
    except Exception:
        return "The final answer could not be checked."


# ---------------------------------------------------------------- evaluation


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021).

    1 - C(n-c, k) / C(n, k), computed as a product so large n cannot overflow.
    """
    try:
        n, c, k = (operator.index(x) for x in (n, c, k))
    except TypeError:
        raise ValueError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}") from None
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ------------------------------------------------------------------- problems

_ARITH_FNS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def load_problems(spec, split="train", n=None, seed=0, *,
                  question_field="question", answer_field="answer") -> list[dict]:
    """Problems as [{"question": str, "answer": str}].

    spec "arith" (or "arith:MIN-MAX"): the synthetic arithmetic task. Operand
    pairs are assigned to train or test by a fixed hash, so the splits are
    disjoint for every seed; `seed` only shuffles. n=None returns the whole
    split; a larger n repeats the train split, and is capped for test.
    "arith-steps" (or "arith-steps:MIN-MAX"): the same problems and split,
    worded with ARITH_STEPS_TEMPLATE (asks for brief steps, then the number).

    spec a path to a JSONL file: one {"question": ..., "answer": ...} object a
    line (field names configurable). GSM8K answers "... #### 1,234" become
    "1234". `split` and `seed` are ignored; n takes the first n in file order.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be None or a non-negative integer, got {n!r}")
    spec = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    if not isinstance(spec, str):
        raise ValueError(f"problem spec must be a string, got {type(spec).__name__}")
    m = re.fullmatch(r"arith(-steps)?(?::(\d+)-(\d+))?", spec.strip())
    if m:
        low, high = (int(m.group(2)), int(m.group(3))) if m.group(2) else (ARITH_MIN, ARITH_MAX)
        return _arith_problems(low, high, split, n, seed, ARITH_STEPS_TEMPLATE if m.group(1) else None)
    if spec.endswith(".jsonl") or os.path.isfile(spec):
        return _jsonl_problems(spec, n, question_field, answer_field)
    raise ValueError(f"unknown problem spec {spec!r}: expected 'arith', 'arith:MIN-MAX', "
                     "'arith-steps', 'arith-steps:MIN-MAX' or the path of a JSONL file")


def _arith_problems(low, high, split, n, seed, template=None):
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if low > high:
        raise ValueError(f"arith operand range is empty: {low}-{high}")
    unknown = [op for op in ARITH_OPS if op not in _ARITH_FNS]
    if unknown:
        raise ValueError(f"unsupported ARITH_OPS {unknown}; supported: {sorted(_ARITH_FNS)}")
    problems = []
    for op in ARITH_OPS:
        for a in range(low, high + 1):
            for b in range(low, high + 1):
                # a+b and b+a share a key, so a test question is never a
                # reordering of a train question.
                key = (min(a, b), max(a, b)) if op in "+*" else (a, b)
                test = zlib.crc32(f"{key[0]},{op},{key[1]}".encode()) % 100 < ARITH_TEST_PERCENT
                if test == (split == "test"):
                    problems.append({"question": (template or ARITH_TEMPLATE).format(a=a, op=op, b=b),
                                     "answer": str(_ARITH_FNS[op](a, b))})
    if not problems:
        raise ValueError(f"arith {low}-{high} {split} split contains no problems; widen the range")
    rng = random.Random(seed)
    rng.shuffle(problems)
    if n is None or n <= len(problems) or split == "test":
        return problems[:n]
    out = list(problems)
    while len(out) < n:  # train: repeat the split, reshuffled each pass
        rng.shuffle(problems)
        out.extend(dict(p) for p in problems)
    return out[:n]


def _jsonl_problems(path, n, question_field, answer_field):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"problem file not found: {path}")
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for field in (question_field, answer_field):
                if field not in row:
                    raise ValueError(f"{where}: missing field {field!r}")
            question, answer = row[question_field], row[answer_field]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: field {question_field!r} must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(f"{where}: field {answer_field!r} must be a string or number")
            answer = str(answer)
            if "####" in answer:  # GSM8K: the solution ends "#### 1,234"
                answer = answer.rsplit("####", 1)[1].replace(",", "")
            if not answer.strip():
                raise ValueError(f"{where}: field {answer_field!r} is empty")
            problems.append({"question": question, "answer": answer.strip()})
    if not problems:
        raise ValueError(f"{path} contains no problems")
    return problems if n is None else problems[:n]
