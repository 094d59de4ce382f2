"""Answer checking for RLVR (reinforcement learning with verifiable rewards).

The rule: a completion's final answer is the content of its last ``\\boxed{...}``
(or ``\\fbox{...}``); if it has none, the last number in its text. The reward is
1.0 when that answer is equivalent to the gold answer, else 0.0.

Equivalence is exact and deliberately conservative. Numbers are compared as exact
rationals (0.5 == 1/2, but 0.333 != 1/3); formatting noise is removed (LaTeX
spacing, \\text{}, unit words, %, $, degrees, \\left/\\right, thousands
separators); tuples, intervals, sets and lists are compared element by element;
anything else is compared as a normalised string. An unusual but correct answer
may be marked wrong; a wrong answer should never be marked right.

Also here: feedback(), pass_at_k() and load_problems() (a built-in synthetic
arithmetic task, or JSONL files). Only the standard library is used.
"""
from __future__ import annotations

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
            "≠": "\\ne ", "·": "\\cdot ", "π": "\\pi ", "±": "\\pm ",
            "\u00a0": " "}
_SPACING_RE = re.compile(r"\\\\|\\!\s*|\\[,:; ]|\\q?quad(?![A-Za-z])|~|\{,\}")
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


def _strip_units(t: str) -> str:
    """'5 apples' -> '5': drop trailing words (2+ letters, after a space)."""
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
        return ("str", _squash(s))
    value = _number(s)
    if value is not None:
        return ("num", value)
    rel = _relation(s)
    if rel:
        lhs, op, rhs = rel
        if op == "\\approx":  # "x \approx 11" -> 11; "\frac{1}{3} \approx 0.33" -> 1/3
            return _parse(rhs if _is_name(lhs) else lhs, depth + 1)
        if _is_name(lhs):  # "x = 5" and "5" are the same answer
            return ("eq", _squash(lhs), _parse(rhs, depth + 1))
    for tag, sep in (("union", "\\cup"), ("list", ",")):
        parts = _split_top(s, sep)
        if len(parts) > 1:
            return (tag, [_parse(p, depth + 1) for p in parts])
    if s.startswith("\\pm") and not s[3:4].isalpha():
        value = _number(s[3:])
        if value is not None:  # "\pm 2" is the set {-2, 2}, never just 2
            return ("list", [("num", -value), ("num", value)])
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
    return ("str", _canonical(t))


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
            return a[1] == b[1] and _same(a[2], b[2])
        return _same(a[2], b) if a[0] == "eq" else _same(a, b[2])
    if a[0] != b[0]:
        return False
    if a[0] in ("num", "str"):
        return a[1] == b[1]
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
