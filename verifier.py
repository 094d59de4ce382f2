r"""Answer checking for RLVR (reinforcement learning with verifiable rewards).

A trainer needs a reward it can trust: reward() is 1.0 when a completion's final answer is
equivalent to the gold answer, else 0.0. The final answer is the content of the last \boxed{...}
(or \fbox{...}), or else the last number in the text, where 3e5 and 3 \times 10^{5} are one
number. Only the text after the last </think> is read, so thinking is never the answer, and a
<think> block never closed (out of tokens) holds none. is_equiv() compares in two tiers:
- The exact tier (_clean, _parse, _same) removes formatting (LaTeX spacing, \text{}, units, %, $,
  degrees, thousands separators), compares numbers as exact rationals (0.5 == 1/2, but 0.333 !=
  1/3), reads "x = 5" as 5, and compares tuples, intervals, sets and lists by element.
- The symbolic tier (SYMBOLIC = True, _symbolic_same) reads what the exact tier found different
  into an exact rational function of free symbols and square roots, so \sqrt{8} == 2\sqrt{2},
  (x+1)^2 == x^2+2x+1, \sec^2(y) == \tan^2(y)+1 and y = 2x+1 == 2x-y+1 = 0. A decimal of 12 or
  more digits may stand for an irrational value. Arithmetic is not an answer (2+3 != 5, and in
  one unknown 2x = 10 != x = 5). As equivalence does not check simplification, set SYMBOLIC =
  False where a task asks to simplify or factor (\sqrt{8} copied from the question would pass).

Worked example: reward(r"<think>It is 7.</think> So \boxed{x = \frac{6}{4}\text{ cm}}, about 2
cm.", "1.5"). The 7 inside the thinking is never read, and the box wins over the later 2. Cleaning
leaves "x = \frac{6}{4} cm", parsing reads the equation x = 3/2 (the unit word goes), and x = 3/2
is compared with the gold by its right-hand side: 3/2 equals 1.5, so the reward is 1.0.

The checks are conservative: an unusual but correct answer may be marked wrong, a wrong answer
never right, and no input makes a check slow or raise. Use verifier.reward(completion, gold); the
module also holds feedback(), pass_at_k() and load_problems(), on the standard library alone.
"""
import functools
import itertools
import json
import math
import operator
import os
import random
import re
import zlib
from fractions import Fraction

# The built-in task "arith" asks "What is a + b?"; callers may change these (read at call time).
ARITH_MIN = 1
ARITH_MAX = 20
ARITH_OPS = ("+",)
ARITH_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
ARITH_TEST_PERCENT = 20  # share of operand pairs held out for the test split
# "arith-steps" words the same problems so that a completion has a middle, where w2spo.py branches.
ARITH_STEPS_TEMPLATE = "What is {a} {op} {b}? Add them step by step, then give the final number."
SYMBOLIC = True  # False keeps the exact tier only (numbers, structure, strings)

# ----------------------------------------------------------------------------- public API
def reward(completion, gold) -> float:
    """1.0 when the completion's final answer is equivalent to `gold`, else 0.0."""
    answer = extract_answer(completion)
    return 1.0 if answer is not None and is_equiv(answer, gold) else 0.0

def feedback(completion, gold) -> str:
    """One sentence on the final answer, for a model to read; it never quotes `gold`."""
    try:
        answer = extract_answer(completion)
        if answer is None:
            return "No final answer was found; end with the answer in \\boxed{}."
        if not (text := " ".join(answer.split())):
            return "The final answer is empty; put the answer inside \\boxed{}."
        text = text if len(text) <= 50 else text[:47] + "..."
        return f"The final answer {text} is {'correct' if is_equiv(answer, gold) else 'incorrect'}."
    except Exception:
        return "The final answer could not be checked."

def extract_answer(text) -> str | None:
    r"""The final answer, the last complete \boxed{}'s content, else the last number, else None.

    >>> extract_answer(r"\boxed{1}, no: \boxed{\frac{1}{2}}"), extract_answer("so 3e5 m.")
    ('\\frac{1}{2}', '3e5')
    """
    try:
        text = _after_thinking("" if text is None else str(text))
        if (boxed := _boxed_content(text)) is not None:
            return boxed
        numbers = _LAST_NUMBER_RE.findall(text)
        return numbers[-1].replace("−", "-") if numbers else None
    except Exception:  # a reward function must never crash a training run
        return None

def is_equiv(pred, gold) -> bool:
    """Whether two final answers are the same, by the tiers of the module docstring."""
    try:
        pred, gold = ("" if x is None else str(x) for x in (pred, gold))
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return bool(a := "".join(pred.split())) and a == "".join(gold.split())
        a, b = _clean(pred), _clean(gold)  # an empty answer never matches, not even an empty gold
        # The exact tier (_same) asks the symbolic tier (_symbolic_same) about leaves that differ.
        return bool(a and b) and (_squash(a) == _squash(b) or _same(_parse(a), _parse(b)))
    except Exception:  # never crash training; fall back to an exact comparison
        same = isinstance(pred, str) and isinstance(gold, str) and pred.strip() == gold.strip()
        return same and bool(pred.strip())

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k), n samples, c correct (Chen et al., 2021).

    >>> pass_at_k(4, 1, 2)  # 1 - C(3,2)/C(4,2): half of the pairs hold the correct sample
    0.5
    """
    try:
        n, c, k = (operator.index(x) for x in (n, c, k))
    except TypeError:
        raise ValueError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}") from None
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    # 1 - C(n-c, k) / C(n, k) = 1 - prod over i = n-c+1 .. n of (1 - k / i), which cannot overflow
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))

def load_problems(spec, split="train", n=None, seed=0, *,
                  question_field="question", answer_field="answer") -> list[dict]:
    """Problems as [{"question": str, "answer": str}].

    spec "arith" (or "arith:MIN-MAX") is the built-in task, "arith-steps" (or "arith-steps:MIN-MAX")
    the same in ARITH_STEPS_TEMPLATE's words. A fixed hash sends each operand pair to train or test,
    so the splits are disjoint for every seed, which only shuffles. n=None returns the whole split;
    a larger n repeats the train split and is capped for test. Any other spec is a JSONL file of
    {"question": ..., "answer": ...} objects, one per line (the field names are arguments); GSM8K's
    "... #### 1,234" becomes "1234", and n takes the first n.

    >>> load_problems("arith", n=1)
    [{'question': 'What is 9 + 20? Answer with just the number.', 'answer': '29'}]
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be None or a non-negative integer, got {n!r}")
    spec = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    if not isinstance(spec, str):
        raise ValueError(f"problem spec must be a string, got {type(spec).__name__}")
    if m := re.fullmatch(r"arith(-steps)?(?::(\d+)-(\d+))?", spec.strip()):
        low, high = (int(m[2]), int(m[3])) if m[2] else (ARITH_MIN, ARITH_MAX)
        template = ARITH_STEPS_TEMPLATE if m[1] else ARITH_TEMPLATE
        return _arith_problems(low, high, split, n, seed, template)
    if spec.endswith(".jsonl") or os.path.isfile(spec):
        return _jsonl_problems(spec, n, question_field, answer_field)
    raise ValueError(f"unknown problem spec {spec!r}: expected 'arith', 'arith:MIN-MAX', "
                     "'arith-steps', 'arith-steps:MIN-MAX' or the path of a JSONL file")

_ARITH_FNS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

def _arith_problems(low, high, split, n, seed, template):
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if low > high:
        raise ValueError(f"arith operand range is empty: {low}-{high}")
    if unknown := [op for op in ARITH_OPS if op not in _ARITH_FNS]:
        raise ValueError(f"unsupported ARITH_OPS {unknown}; supported: {sorted(_ARITH_FNS)}")
    problems = []
    for op, a, b in itertools.product(ARITH_OPS, range(low, high + 1), range(low, high + 1)):
        # a+b and b+a share a key, so a test question is never a train question reordered
        key = (min(a, b), max(a, b)) if op in "+*" else (a, b)
        test = zlib.crc32(f"{key[0]},{op},{key[1]}".encode()) % 100 < ARITH_TEST_PERCENT
        if test == (split == "test"):
            problems.append({"question": template.format(a=a, op=op, b=b),
                             "answer": str(_ARITH_FNS[op](a, b))})
    if not problems:
        raise ValueError(f"arith {low}-{high} {split} split contains no problems; widen the range")
    rng = random.Random(seed)
    rng.shuffle(problems)
    if n is None or n <= len(problems) or split == "test":
        return problems[:n]
    out = list(problems)
    while len(out) < n:  # the train split repeats, reshuffled on each pass
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
            if missing := [k for k in (question_field, answer_field) if k not in row]:
                raise ValueError(f"{where}: missing field {missing[0]!r}")
            question, answer = row[question_field], row[answer_field]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: field {question_field!r} must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(f"{where}: field {answer_field!r} must be a string or number")
            if "####" in (answer := str(answer)):  # a GSM8K solution ends "#### 1,234"
                answer = answer.rsplit("####", 1)[1].replace(",", "")
            if not answer.strip():
                raise ValueError(f"{where}: field {answer_field!r} is empty")
            problems.append({"question": question, "answer": answer.strip()})
    if not problems:
        raise ValueError(f"{path} contains no problems")
    return problems if n is None else problems[:n]

# ----------------------------------------------------------------------------- extraction
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_RE = re.compile(r"\\[{}]|[{}]")  # escaped braces (set notation) are skipped
_SPACES_RE, _TOKEN_RE = re.compile(r"\s*"), re.compile(r"[^\s$]+")
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

def _after_thinking(text: str) -> str:
    """What follows the last </think>; "" inside a <think> block that is never closed."""
    _, closed, after = text.rpartition("</think>")
    return after if closed or "<think>" not in text else ""

def _boxed_content(text: str) -> str | None:
    """Content of the last complete \\boxed{...}/\\fbox{...}, or of "\\boxed 5"."""
    ends = [m.end() for m in _BOX_RE.finditer(text)]
    # One pass pairs every brace, without recursion, so falling back to an earlier box is cheap.
    closing, stack = {}, []
    for m in _BRACE_RE.finditer(text, ends[0] if ends else len(text)):
        if m[0] == "{":
            stack.append(m.start())
        elif m[0] == "}" and stack:
            closing[stack.pop()] = m.start()
    for end in reversed(ends):
        i = _SPACES_RE.match(text, end).end()
        if i in closing:
            return text[i + 1 : closing[i]].strip()
        token = _TOKEN_RE.match(text, i) if i > end and text[i : i + 1] != "{" else None
        if token and token[0].rstrip(".,;:"):  # "\boxed 5" boxes the one token after the space
            return token[0].rstrip(".,;:")
    return None

# -------------------------------------------------------------------------- normalisation
MAX_ANSWER_CHARS = 10_000  # longer answers are only compared as plain strings
MAX_DIGITS = 1_000  # longer numbers are compared as strings, never converted
MAX_DEPTH = 20  # deeper nesting (sets in tuples, brackets in an expression) stays a string
MAX_PAIRS = 10_000  # element comparisons allowed for unordered collections

_UNICODE = str.maketrans({"−": "-", "∞": "\\infty ", "°": "", "≤": "\\le ", "≥": "\\ge ",
                          "≠": "\\ne ", "·": "\\cdot ", "×": "\\times ", "π": "\\pi ",
                          "±": "\\pm ", "\u00a0": " "})
_SPACING_RE = re.compile(r"\\\\|\\!\s*|\\[,:; ]|\\q?quad(?![A-Za-z])|~|\{,\}")
# A unit with an exponent after a number ("5\text{ m}^2", "5 \mathrm{cm}^{3}") is dropped here,
# but not \mathrm{i}^2 or e^2, which are numbers; _strip_units drops a bare unit word later.
_UNIT_POWER_RE = re.compile(
    r"(?<=[\d}])\s*\\(?:text|textrm|mathrm|mbox)\s*\{\s*(?![ie]\s*\})[A-Za-z]{1,5}\s*\}"
    r"\s*\^\s*(?:\{\s*-?\d\s*\}|-?\d)[\s.]*$")
_TEXT_RE = re.compile(
    r"\\(?:text(?:bf|it|rm|normal|tt|sf|up)?|math(?:rm|bf|it|sf|tt|bb|cal)|mbox"
    r"|operatorname|boldsymbol)\s*\{([^{}]*)\}")
_CLEANUPS = [(re.compile(p), r) for p, r in [  # applied in order by _clean()
    (r"(?<!\\)\\\\(?=(?:[dtc]?frac|sqrt)(?![A-Za-z]))", r"\\"),  # "\\frac" typo
    (r"\\(?:left|right|[bB]ig[lr]?|displaystyle)(?![A-Za-z])\.?", ""),
    (r"\\\$", ""), (r"\$|\\[()\[\]]", " "),  # currency, then math delimiters
    (r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])", ""),
    (r"\\?%", ""),  # a percentage is stored as its number, so "28\%" is 28
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
    (r" ?,? ?\b(?:and|or)\b ?", ","),  # "6 and 8" and "(1,2) or (2,1)" are lists
    (r";", ","),
]]

def _clean(s: str) -> str:
    """The answer without formatting or a \\boxed{} around it; brackets and commas are kept."""
    inner = _boxed_content(s)
    if inner is not None:
        s = inner
    s = re.sub(r"\s+", " ", s.translate(_UNICODE))  # single spaces keep every \s* below linear
    spacing = {"\\\\": "\\\\", "{,}": ","}  # "\\" is a row break; "11,\! 111" is one number
    s = _SPACING_RE.sub(lambda m: "" if m[0][:2] == "\\!" else spacing.get(m[0], " "), s)
    s = _UNIT_POWER_RE.sub("", s)  # "5\text{ m}^2" before \text{} is unwrapped
    for _ in range(5):  # \text{...} may be nested a few levels
        s = _TEXT_RE.sub(r" \1 ", s)
    s = re.sub(r"\s+", " ", s)
    for pattern, repl in _CLEANUPS:
        s = pattern.sub(repl, s)
    return re.sub(r"\s+", " ", s).strip().rstrip(" .\\").strip()

def _squash(s: str) -> str:
    """Drop spaces, except before a digit after a digit or comma ("1 2" and "32, 349" are lists)."""
    return re.sub(r"(?<![\d,]) | (?!\d)", "", re.sub(r"\s+", " ", s.strip()))

# -------------------------------------------------------------------------------- numbers
_NUM_RE = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d*)(?:\.(\d*))?")
_RATIO_RES = [re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}"), re.compile(r"([\d.]+)/([+-]?[\d.]+)")]
_MIXED_RE = re.compile(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_POWER_RE = re.compile(r"(\d+)\^(?:\{(\d+)\}|(\d))")
_SCI_RE = re.compile(  # 3e5, 3E+05, 3\times10^{5}, 3\cdot10^5, 3.0x10^5, 10^{-3}
    r"(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,9})"
    r"|(?:(\d+(?:\.\d*)?|\.\d+)(?:\\times|\\cdot|\*|x))?10\^(?:\{([+-]?\d{1,9})\}|(\d))")
_UNIT_EXP_RE = re.compile(r"(?<=[A-Za-z]{2}) ?\^ ?(?:\{ ?-?\d ?\}|-?\d)$")
_NOT_UNITS = {"pi", "inf", "infty", "infinity", "sqrt", "sin", "cos", "tan", "cot", "sec", "csc",
              "log", "ln", "exp", "mod", "pmod", "and", "or", "times", "cdot", "is", "to", "i", "e"}

def _plain_number(t: str) -> Fraction | None:
    """Integer or decimal with optional sign and thousands separators."""
    if not (m := _NUM_RE.fullmatch(t)):
        return None
    whole, frac = re.sub("[ ,]", "", m[2]), m[3] or ""
    if not (whole or frac) or len(whole) + len(frac) > MAX_DIGITS:
        return None  # a huge number stays a string, as int() of it is slow or refused
    value = Fraction(int(whole or "0") * 10 ** len(frac) + int(frac or "0"), 10 ** len(frac))
    return -value if m[1] == "-" else value

def _strip_units(t: str, exponent: bool = True) -> str:
    """Drop trailing words of 2+ letters after a space ('5 apples' -> '5'). The last may carry an
    exponent ('5 cm^2' -> '5'), but a one-letter word is a variable ('5 x^2' stays)."""
    bare = _UNIT_EXP_RE.sub("", t) if exponent else t
    if bare != t:  # the exponent goes only with the unit word it follows
        stripped = _strip_units(bare, exponent=False)
        return stripped if stripped != bare else t
    i = len(t)
    while i and (t[i - 1] == " " or (t[i - 1].isascii() and t[i - 1].isalpha())):
        i -= 1
    words = t[i:].split()
    keep = (not words or not t[i:].startswith(" ") or t[i - 1 : i] == "\\" or len(words[0]) < 2
            or any(w.lower() in _NOT_UNITS for w in words))
    return t if keep else t[:i].rstrip()

def _number(s: str) -> Fraction | None:
    """Exact value of a numeric answer, or None when it is not a plain number."""
    t = _strip_units(s.strip())
    value = _plain_number(t)  # before squashing, so "1 000" stays one number
    t = _squash(t)
    if value is not None or " " in t:
        return value
    sign, t = (-1, t[1:]) if t.startswith("-") else (1, t.lstrip("+"))
    if (value := _plain_number(t)) is not None:  # "- 5" once squashed
        return sign * value
    for ratio in _RATIO_RES:  # \frac{a}{b} and a/b
        if m := ratio.fullmatch(t):
            num, den = _plain_number(m[1]), _plain_number(m[2])
            return sign * num / den if num is not None and den else None
    if m := _MIXED_RE.fullmatch(t):  # 918\frac{1}{2} is a mixed number
        whole, num, den = (_plain_number(g) for g in m.groups())
        ok = whole is not None and num is not None and den and num < den
        return sign * (whole + num / den) if ok else None
    if m := _SCI_RE.fullmatch(t):  # scientific notation is an exact number too (3e5 == 300000)
        mantissa, exp = _plain_number(m[1] or m[3] or "1"), int(m[2] or m[4] or m[5])
        if mantissa is not None and abs(exp) <= MAX_DIGITS:  # 1e1000000 stays a string
            return sign * mantissa * Fraction(10) ** exp
    if m := _POWER_RE.fullmatch(t):  # 2^3 == 8, but 10^{1000000} stays a string
        exp = int((m[2] or m[3])[:9])
        if len(m[1]) <= MAX_DIGITS and len(m[1]) * exp <= MAX_DIGITS:
            return sign * Fraction(int(m[1]) ** exp)
    return None

# ------------------------------------------------------------------------------ structure
@functools.lru_cache(maxsize=64)  # _parse asks up to four times about one string
def _outside(s: str) -> tuple[list[int], bool]:
    """Indices of the characters outside brackets (a closing one is outside); balanced or not."""
    top, depth, balanced = [], 0, True
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if depth < 0:
            balanced = False
        elif not depth:
            top.append(i)
    return top, balanced and not depth

def _split_top(s: str, sep: str) -> list[str]:
    """Split at `sep` outside brackets; an unbalanced string is not split."""
    (top, balanced), parts, start = _outside(s), [], 0
    for i in top if balanced else ():
        word = sep[-1].isalpha() and s[i + len(sep) : i + len(sep) + 1].isalpha()  # "\cupola"
        if i >= start and s.startswith(sep, i) and not word:
            parts.append(s[start:i])
            start = i + len(sep)
    return parts + [s[start:]]

def _enclosed(s: str):
    """(open, body, close) when one bracket pair wraps the whole string."""
    opening = "\\{" if s.startswith("\\{") and s.endswith("\\}") else s[:1]
    closing = "\\}" if opening == "\\{" else s[-1:]
    top, balanced = _outside(s)
    ok = (balanced and opening in ("(", "[", "{", "\\{") and closing[-1] in ")]}"
          and (opening[-1] == "{") == (closing[-1] == "}")
          and top == [*range(len(opening) - 1), len(s) - 1])  # one pair, not "(1,2) \cup (3,4)"
    return (opening, s[len(opening) : -len(closing)], closing) if ok else None

def _is_name(lhs: str) -> bool:
    """A variable-like left-hand side: x, f(x), (p,q), a_{3}, |AB|, A:B."""
    t = re.sub(r"_\{[^{}]*\}|_\w", "", lhs).replace(" ", "")
    return bool(re.fullmatch(r"[A-Za-z\\{}()|:,']+", t)) and bool(re.search("[A-Za-z]", t))

def _relation(s: str):
    """(lhs, rel, rhs) for a single '=', '\\in' or '\\approx' outside brackets."""
    found = []
    for i in _outside(s)[0]:
        if s[i] in "<>":
            return None  # an inequality stays whole
        if s[i] == "=" and s[i - 1 : i] not in ("!", "=") and s[i + 1 : i + 2] != "=":
            found.append((i, "="))
        found += [(i, rel) for rel in ("\\in", "\\approx")
                  if s.startswith(rel, i) and not s[i + len(rel) : i + len(rel) + 1].isalpha()]
    if len(found) != 1:
        return None
    i, rel = found[0]
    lhs, rhs = s[:i].strip(), s[i + len(rel) :].strip()
    return (lhs, rel, rhs) if lhs and rhs else None

def _parse(s: str, depth: int = 0):
    """A cleaned answer as a small tree of tagged tuples, whose leaves are ("num", value, text),
    ("str", canonical text, text) and ("eq", name, parsed right-hand side, text)."""
    s = s.strip().rstrip(" .").strip()
    if not s:
        return None
    if depth > MAX_DEPTH:
        return ("str", _squash(s), None)
    parse = functools.partial(_parse, depth=depth + 1)
    if (value := _number(s)) is not None:
        return ("num", value, s)
    if rel := _relation(s):
        lhs, op, rhs = rel
        if op == "\\approx":  # "x \approx 11" -> 11; "\frac{1}{3} \approx 0.33" -> 1/3
            return parse(rhs if _is_name(lhs) else lhs)
        if _is_name(lhs):  # "x = 5" and "5" are the same answer
            return ("eq", _squash(lhs), parse(rhs), s)
    for tag, sep in (("union", "\\cup"), ("list", ",")):
        if len(parts := _split_top(s, sep)) > 1:
            return (tag, [parse(p) for p in parts])
    if s.startswith("\\pm") and not s[3:4].isalpha() and (value := _number(s[3:])) is not None:
        return ("list", [("num", -value, None), ("num", value, None)])  # {-2, 2}, never just 2
    if wrapped := _enclosed(s):
        opening, body, closing = wrapped
        items = _split_top(body, ",")
        if opening == "\\{" or (opening == "{" and len(items) > 1):
            return ("list", [parse(p) for p in items])  # a set
        if len(items) > 1:  # a tuple or an interval, where order and brackets matter
            return ("seq", opening + closing, [parse(p) for p in items])
        if opening + closing in ("()", "{}"):  # a redundant grouping, so "(C)" is "C"
            return parse(body)
    t = _squash(s)
    m = t.count("<") == 2 and re.fullmatch(r"([^<]+)<(=?)([^<=][^<]*)<(=?)([^<=][^<]*)", t)
    if m and ">" not in t and "!" not in t and _is_name(m[3]):  # a < x < b is an interval
        return ("seq", "(["[bool(m[2])] + ")]"[bool(m[4])], [parse(m[1]), parse(m[5])])
    if m := re.fullmatch(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", t):
        return ("matrix", [[parse(c) for c in r.split("&")] for r in m[1].split("\\\\") if r])
    t = (t[1:] if t.startswith("+") else t).replace(", ", ",")
    rels = re.findall(r"<=|>=|!=|<|>", t)
    if len(rels) == 1 and rels[0][0] == ">":  # a > b is b < a
        lhs, rhs = t.split(rels[0], 1)
        t = rhs + "<" + rels[0][1:] + lhs
    return ("str", t, s)

def _same(a, b) -> bool:  # two trees of _parse, compared node by node
    if a is None or b is None:
        return False
    if "eq" in (a[0], b[0]):  # "x = 5" is 5, and two names must agree
        if a[0] == b[0]:
            same = a[1] == b[1] and _same(a[2], b[2])
        else:  # x = 5 against 5 compares the right-hand side
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
    # In a "list" (a set, a bare list, \pm) or a "union", order and repeats do not matter.
    xs, ys = a[1], b[1]
    return len(xs) * len(ys) <= MAX_PAIRS and all(any(_same(x, y) for y in ys) for x in xs) and all(
        any(_same(x, y) for x in xs) for y in ys)

# -------------------------------------------------------------------------- symbolic tier
# An answer is read into an exact rational function (numerator, denominator). A polynomial is
# {(monomial, radicand): coefficient}, summing coefficient * sqrt(radicand) * monomial, with a
# Fraction coefficient, a square-free radicand, and a monomial that is a sorted tuple of (atom,
# exponent). An atom is a free symbol: a word (xy is one symbol, x y two), a Greek letter, f(x),
# \sin(x) or a nested root. Square roots of distinct square-free integers are linearly independent
# over the rationals, so the form is canonical: \sqrt{8}, 2\sqrt{2} and \frac{4}{\sqrt{2}} are all
# {((), 2): 2}. An identity between free symbols holds whatever they stand for, so the tier can
# miss one (i^2 == -1, \sin(2x)) but never invent one; _mul adds sin^2 + cos^2 = 1. What it cannot
# read, or what a guard below refuses, raises ValueError, and the answers are not shown equal.

MAX_SYMBOLIC_CHARS = 300  # longer answers are not read symbolically
MAX_TERMS = 100  # terms in one polynomial (so (a+b+c)^32 is refused)
MAX_POWER = 32  # largest integer exponent that is expanded
MAX_RADICAND = 10**12  # \sqrt{n} is simplified by trial division up to n^(1/3)
MAX_BITS = 4_000  # size of a coefficient's numerator or denominator
MAX_WORK = 100_000  # term products per answer, and per comparison
APPROX_DIGITS = 12  # a decimal this precise may stand for 1/12 or sqrt(2), not for 1/8

_GREEK = {"\\" + w for w in "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta "
          "iota kappa lambda mu nu xi pi rho sigma tau upsilon phi varphi chi psi omega Gamma "
          "Delta Theta Lambda Xi Pi Sigma Phi Psi Omega".split()}
_FUNCTIONS = {"\\" + w for w in "sin cos tan sec csc cot arcsin arccos arctan sinh cosh tanh log "
              "ln lg exp".split()}
_SYM_TOKEN_RE = re.compile(
    r"\s*(?:(\d+(?:\.\d*)?|\.\d+"  # number
    r"|\\(?:sum|prod)(?![A-Za-z])(?: ?[_^] ?(?:\{(?:[^{}]|\{[^{}]*\})*\}|\w))*"  # \sum_{k=1}^n
    r"|\\[A-Za-z]+"  # command
    r"|[A-Za-z]+(?:_(?:\{[^{}]*\}|[A-Za-z0-9]))?"  # a word, with a subscript as in F_{n-1}
    r"|<=|>=|[-+*/^(){}\[\]=<>_])|(\S))")  # operator; else a character outside the tier
_NUMERAL = re.compile(r"\.?\d")
_FACTOR_START = re.compile(r"[A-Za-z0-9.({]|\\(?!cdot$|times$)")  # a token that starts a factor
_DECIMAL_RE = re.compile(r"[+-]?\d*\.\d+")
_ONE = {((), 1): Fraction(1)}  # the polynomial 1 (never modified in place)

def _poly(terms) -> dict:
    """The polynomial summing (key, coefficient) pairs; refused once it grows too large."""
    out = {}
    for key, c in terms:
        out[key] = out[key] + c if key in out else c
    out = {key: c for key, c in out.items() if c}
    if len(out) > MAX_TERMS or any(abs(c.numerator) >> MAX_BITS or c.denominator >> MAX_BITS
                                   or rad >> 256 for (_, rad), c in out.items()):
        raise ValueError("too large")
    return out

def _add(p: dict, q: dict, c=1) -> dict:  # p + c*q
    return _poly([*p.items(), *((key, c * v) for key, v in q.items())])

def _monomial(m1, m2) -> tuple:  # the product m1 * m2, exponents added
    powers = dict(m1)
    for atom, e in m2:
        powers[atom] = powers.get(atom, 0) + e
    return tuple(sorted((atom, e) for atom, e in powers.items() if e))

def _mul(p: dict, q: dict, work: list) -> dict:  # p * q
    work[0] += len(p) * len(q)  # term products, counted against MAX_WORK
    if work[0] > MAX_WORK:
        raise ValueError("too much work")
    todo, out = [], []
    for (m1, r1), c1 in p.items():
        for (m2, r2), c2 in q.items():
            g = math.gcd(r1, r2)  # sqrt(r1)*sqrt(r2) = g*sqrt(r1*r2/g^2), square-free again
            todo.append(((_monomial(m1, m2), (r1 // g) * (r2 // g)), c1 * c2 * g))
    # By Pythagoras, sin(u)^2 becomes 1 - cos(u)^2 until every sine has exponent 0 or 1. That form
    # is unique modulo sin^2 + cos^2 = 1, so sec^2 and tan^2 + 1 agree.
    while todo:
        (mono, rad), c = todo.pop()
        sine = next((a for a, e in mono if e > 1 and a.startswith("\\sin(")), None)
        if sine is None:
            out.append(((mono, rad), c))
            continue
        if len(out) + len(todo) > MAX_WORK:  # (sin a sin b ...)^2 has 2^k terms
            raise ValueError("too many terms")
        rest = _monomial(mono, ((sine, -2),))
        todo += [((rest, rad), c), ((_monomial(rest, (("\\cos(" + sine[5:], 2),)), rad), -c)]
    return _poly(out)

@functools.lru_cache(maxsize=1024)
def _square_free(n: int) -> tuple[int, int]:
    """(a, b) with n == a*a*b and b square-free; n <= MAX_RADICAND."""
    if n > MAX_RADICAND:
        raise ValueError("radicand too large")
    outside, inside, p = 1, 1, 2
    while p * p * p <= n:  # every prime up to the cube root ...
        while n % (p * p) == 0:
            n, outside = n // (p * p), outside * p
        if n % p == 0:
            n, inside = n // p, inside * p
        p += 1 if p == 2 else 2
    # ... leaves 1, q, q*r or q*q, with q and r primes above it
    root = math.isqrt(n)
    return (outside * root, inside) if root * root == n else (outside, inside * n)

def _rat(v) -> Fraction | None:
    """The value v = (numerator, denominator) as a Fraction when it is a rational constant."""
    key = next(iter(v[1]))
    c = v[0].get(key, 0) / v[1][key]
    return c if v[0] == _add({}, v[1], c) else None

def _key(v) -> str:
    """A fixed spelling of a value, to name atoms such as \\sqrt{x+1} or f(2x)."""
    num, den = v
    if (q := _rat((den, _ONE))) is not None:  # a rational denominator is folded in
        num, den = _add({}, num, 1 / q), _ONE
    return repr((sorted(num.items()), sorted(den.items())))

class _Reader:
    """Recursive descent over a cleaned answer; values are (numerator, denominator) polynomials."""

    def __init__(self, text: str):
        pairs, self.i, self.work = _SYM_TOKEN_RE.findall(text.strip()), 0, [0]
        self.toks = [tok for tok, _ in pairs]
        depth = max(itertools.accumulate((t in "({") - (t in ")}") for t in self.toks), default=0)
        if depth > MAX_DEPTH or any(outside for _, outside in pairs):
            raise ValueError("too deep, or a character outside the tier")

    def peek(self) -> str:
        return self.toks[self.i] if self.i < len(self.toks) else ""

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if not tok or expected not in (None, tok):
            raise ValueError(f"expected {expected}, got {tok!r}")
        self.i += 1
        return tok

    def accept(self, tok: str) -> bool:
        found = self.peek() == tok
        self.i += found
        return found

    def add(self, a, b, sign=1):
        if a[1] == b[1]:
            return _add(a[0], b[0], sign), a[1]
        return (_add(_mul(a[0], b[1], self.work), _mul(b[0], a[1], self.work), sign),
                _mul(a[1], b[1], self.work))

    def mul(self, a, b):
        return _mul(a[0], b[0], self.work), _mul(a[1], b[1], self.work)

    def div(self, a, b):
        if not b[0]:
            raise ValueError("division by zero")
        return self.mul(a, (b[1], b[0]))

    def power(self, v, k: int):
        if k < 0:
            v, k = self.div((_ONE, _ONE), v), -k
        if k > MAX_POWER or not (k or v[0]):  # 0^0 is undefined
            raise ValueError("exponent")
        out = v if k else (_ONE, _ONE)
        for bit in bin(k)[3:]:  # square, and multiply where a bit is set (from the second highest)
            out = self.mul(self.mul(out, out), v) if bit == "1" else self.mul(out, out)
        return out

    def sum(self):  # sum = product (("+" | "-") product)*
        value = self.product()
        while self.peek() in ("+", "-"):
            sign = 1 if self.take() == "+" else -1
            value = self.add(value, self.product(), sign)
        return value

    def product(self):  # product = factor (("*" | "/" | nothing) factor)*
        value = self.factor()
        while True:
            tok, explicit = self.peek(), self.peek() in ("*", "\\cdot", "\\times")
            if self.accept("/"):
                value = self.div(value, self.factor())
                if _FACTOR_START.match(self.peek()):
                    raise ValueError("1/2x is ambiguous")
            elif not (explicit or _FACTOR_START.match(tok)):
                return value
            elif _NUMERAL.match(tok) or tok == "\\frac" and _NUMERAL.match(self.toks[self.i - 1]):
                raise ValueError("x2 and 2 3 are no products, 3\\frac{1}{2} is a mixed number")
            else:
                self.i += explicit
                value = self.mul(value, self.factor())

    def factor(self):  # factor = "-" factor | ["+"] primary ["^" exponent]
        if self.accept("-"):
            num, den = self.factor()
            return _add({}, num, -1), den
        self.accept("+")
        value = self.primary()
        return self.power(value, self.exponent()) if self.accept("^") else value

    def exponent(self) -> int:
        """k in x^k. x^{-1} and x^{2} are values, but x^23 is refused: LaTeX reads x^2 * 3."""
        if self.peek() != "{" and not (len(self.peek()) == 1 and self.peek().isdigit()):
            raise ValueError("x^23 is ambiguous")
        k = _rat(self.primary())
        if k is None or k.denominator != 1:
            raise ValueError("only integer exponents")
        return int(k)

    def group(self, opening: str = "{"):
        self.take(opening)
        value = self.sum()
        self.take(")" if opening == "(" else "}")
        return value

    def atom(self, name: str):
        return {(((name, 1),), 1): Fraction(1)}, _ONE

    def primary(self):  # (sum), {sum}, a number, a word, a Greek letter or a command
        tok = self.peek()
        if tok in ("(", "{"):
            return self.group(tok)
        self.i += 1
        if _NUMERAL.match(tok):  # at most MAX_SYMBOLIC_CHARS digits
            return _add({}, _ONE, Fraction(tok)), _ONE
        if tok[:1].isalpha():  # a word, and f(x) a function, never f*x
            return self.atom(f"{tok}({_key(self.group('('))})" if self.peek() == "(" else tok)
        if tok in _GREEK:
            return self.atom(tok)
        if tok == "\\frac":
            return self.div(self.group(), self.group())
        if tok == "\\sqrt":  # also \sqrt[2]{x}; other roots stay outside the tier
            if self.accept("[") and (self.take() != "2" or self.take() != "]"):
                raise ValueError("only square roots")
            radicand = self.group()
            q = _rat(radicand)
            if q is None:  # \sqrt{x+1} is an atom named by its content
                return self.atom(f"\\sqrt{{{_key(radicand)}}}")
            if q < 0:
                raise ValueError("square root of a negative number")
            outside, inside = _square_free(q.numerator * q.denominator)  # sqrt(a/b) = sqrt(ab)/b
            return _add({}, {((), inside): Fraction(outside, q.denominator)}), _ONE
        if tok.startswith(("\\sum", "\\prod")):  # an atom named by its bounds and its body
            return self.atom(f"{tok.replace(' ', '')}({_key(self.product())})")
        if tok in _FUNCTIONS:
            k = self.exponent() if self.accept("^") else 1  # \sin^2(x)
            if self.peek() not in ("(", "{") or k < 1:
                raise ValueError("a function needs a bracketed argument")
            arg = _key(self.group(self.peek()))
            sin, cos = (self.atom(f"\\{f}({arg})")[0] for f in ("sin", "cos"))
            value = {"\\sec": (_ONE, cos), "\\csc": (_ONE, sin), "\\tan": (sin, cos),
                     "\\cot": (cos, sin)}.get(tok) or self.atom(f"{tok}({arg})")
            return self.power(value, k)
        raise ValueError(f"unknown {tok!r}")

@functools.lru_cache(maxsize=4096)
def _symbolic(text: str):
    """("expr", value), or ("rel", op, D) for D < 0, D <= 0 or D = 0, or None outside the tier."""
    if not text or len(text) > MAX_SYMBOLIC_CHARS:
        return None
    try:
        reader = _Reader(text)
        lhs = reader.sum()
        op = reader.take() if reader.peek() in ("=", "<", ">", "<=", ">=") else None
        rhs = reader.sum() if op else None
        if reader.peek():
            return None  # something after the expression
        if op is None:
            return ("expr", lhs)
        if op in (">", ">="):  # a > b is b < a
            op, lhs, rhs = "<" + op[1:], rhs, lhs
        num, den = reader.add(lhs, rhs, -1)
        if (q := _rat((den, _ONE))) is None:  # x/y = 1 is not y-x = 0 where y = 0
            return None
        return ("rel", op, _add({}, num, 1 / q))
    except (ValueError, ZeroDivisionError, RecursionError):
        return None

def _approx_same(a, b) -> bool:
    """A long decimal leaf a matches an exact leaf b (1/12) to within a unit in a's last place."""
    text = _squash(a[2]) if a[0] == "num" and a[2] else ""
    if (b[0] not in ("num", "str") or not b[2] or not _DECIMAL_RE.fullmatch(text)
            or _DECIMAL_RE.fullmatch(_squash(b[2]))
            or len(re.sub(r"\D", "", text).lstrip("0")) < APPROX_DIGITS):
        return False
    unit = Fraction(1, 10 ** len(text.split(".")[1]))
    if b[0] == "num":
        value = b[1]
    else:
        sym = _symbolic(b[2])
        if not sym or sym[0] != "expr" or any(m for p in sym[1] for m, _ in p):
            return False  # outside the tier, a relation, or not a constant
        value = _rat(sym[1])
    if value is None:  # an irrational value, to 60 decimals, far below the unit
        num, den = (sum(c * Fraction(math.isqrt(r * 10**120), 10**60) for (_, r), c in p.items())
                    for p in sym[1])
        return abs(den) > Fraction(1, 10**20) and abs(a[1] - num / den) <= unit
    d = value.denominator  # a finite decimal (1/8) has pow(10, bits, d) == 0: it must be exact
    return abs(a[1] - value) <= unit and pow(10, d.bit_length(), d) != 0

def _symbolic_same(a, b) -> bool:
    """Whether leaves a and b (num, str or eq), which the exact rules found different, are equal."""
    if (not SYMBOLIC or {a[0], b[0]} - {"num", "str", "eq"}
            or a[0] == b[0] == "eq" and a[1] == b[1]):  # x = 5 and x = \sqrt{25}: compared already
        return False
    try:
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
            # Refusal 1: a rational value written as arithmetic (2+3, \sqrt{4}, 2\cdot 3) is not
            # the number 5, 2 or 6, since "What is 2+3?" must not be answered "2+3".
            return same and _rat(x[1]) is None
        # Relations match when D1 = c*D2 with c > 0, or any c != 0 for an equation (sides may swap).
        (op1, p1), (op2, p2) = x[1:], y[1:]
        c = _rat((p1, p2)) if p1 and p2 else None
        atoms = {atom for mono, _ in p1 for atom, _ in mono}
        if op1 != op2 or not c or not atoms:
            return False
        # Refusal 2: in one unknown, 2x = 10 is the question and x = 5 its answer, so only a
        # rewriting that keeps the scale counts (5 = x, -x > -1 for x < 1).
        return (c == 1 or op1 == "=" and c == -1) if len(atoms) == 1 else (c > 0 or op1 == "=")
    except ValueError:  # a guard tripped while comparing, so they are not shown equal
        return False
