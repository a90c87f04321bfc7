"""Final-answer extraction and exact numeric equivalence, shared by the verifiers.

Data flow: sampled completion text (host, detokenised, end token already stripped)
-> `extract_answer` (the string the model committed to) -> `answer_value` / `parse_number`
(an exact `fractions.Fraction`) -> `answers_match` against the reference answer from
`extract_reference_answer`. The registered rewards in `math_rewards.py` and `arith.py`
are thin wrappers around these functions.

The rules, in one place (each one is tested in tests/rewards/test_rewards.py):

Markers. A completion states its final answer with `#### <answer>` (GSM8K style) or
`\\boxed{<answer>}` (LaTeX style). When both kinds occur, the marker that *starts last*
in the text wins. For `####` the answer is the rest of that line (if the marker ends
its line, the next non-empty line). For `\\boxed` the answer is the content of the last
top-level box, braces matched with nesting; a box that only wraps another box is
unwrapped (`\\boxed{\\boxed{5}}` -> `5`); an unbalanced last box counts as no answer.
`\\fbox{...}` is treated like `\\boxed{...}`. When a marker is present its content is
the answer even if it is empty or unparsable: there is no fallback then (the model
committed to it).

Fallback (only when no marker is present), switchable: `fallback="last_number"` takes
the last number token in the text (integer, decimal, `a/b`, `\\frac{a}{b}`, with an
optional sign, `$` and thousands separators); `fallback=None` means no answer.

Numbers (`parse_number`, the whole string must be one number): integers, decimals
(`3.0`, `.5`), a sign (`-3`, `- 3`, `+3`, the Unicode minus), thousands separators in
valid groups only (`1,000` and `12,345.5`; `1,0000` and the decimal comma `12,5` are
not numbers), LaTeX thin spaces `1\\,000` and `1{,}000`, fractions `3/4`,
`\\frac{3}{4}`, `\\dfrac`, `\\tfrac`, `\\frac34`, `-\\frac{1}{2}`, `\\frac{-1}{2}`, a
leading currency `$`/`\\$`, surrounding math delimiters `$..$`, `\\(..\\)`, `\\[..\\]`,
wrapping braces, and scientific notation with an exponent of at most 3 digits
(`1.5e3`). Whitespace is ignored except between digits (`4 2` is not 42). Dropped as
units-free decorations: a trailing `.` (end of sentence, also after `$..$`), a
trailing `%`/`\\%` (so `50%` == `50`, *not* 0.5, because GSM8K references state
percentages as bare numbers) and a trailing degree sign (`^\\circ`, `^{\\circ}`, `°`).
Strings longer than `MAX_ANSWER_CHARS` are not parsed (bounds the work per item).
Every pass over a completion is linear or bounded (`MAX_BOX_UNWRAP` levels of a box
wrapping a box; non-numeric answers up to `MAX_TEXT_ANSWER_CHARS`): no text stalls a step.

Answer values (`answer_value`, what `math` compares): `parse_number` of the whole
answer; else of the part after the last `=` (`x = 5`); else a single leading number
followed by text that contains no digit (units: `42 apples`, `18 \\text{ dollars}`).
`5 or 6` and `3 + 4` are therefore not numbers.

Equivalence (`answers_match`): two numeric answers match iff their Fractions are equal
(exact: `0.50 == 1/2`, `3.0 == 3`, but `0.333 != 1/3`). Only with an explicit
`rel_tol > 0` (the documented float fallback, off by default and unused by the
registered rewards) are they compared as floats with that relative tolerance. A
numeric answer never matches a non-numeric one. Two non-numeric answers (e.g. MATH's
`x^2+1`) match iff their `normalize_answer_text` forms are equal and non-empty: a light
textual normalisation, not a computer-algebra check.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

# Longest answer string we try to parse as a number: bounds the cost of a
# pathological completion (huge digit strings make int() and Fraction slow).
MAX_ANSWER_CHARS = 200
# Every pass over a completion is linear or bounded, so no text can stall a step (a 40 KB
# response of 5,000 nested `\boxed{` used to take 13-58 s): a box wrapping a box is
# unwrapped at most MAX_BOX_UNWRAP times (deeper wrapping is no answer), and a non-numeric
# answer longer than MAX_TEXT_ANSWER_CHARS is not normalised or matched.
MAX_BOX_UNWRAP = 8
MAX_TEXT_ANSWER_CHARS = 1000

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
_BARE_TOKEN_RE = re.compile(r"[^\s$]+")
_HASH_MARKER = "####"

# One number written plainly: valid thousands groups or plain digits, optional
# decimals, optional short exponent (3 digits at most, so 1e999999999 cannot ask
# Fraction for a billion-digit integer).
_PLAIN = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?"
_SIGNED_RE = re.compile(r"([-+]?)(" + _PLAIN + r")")
_SLASH_RE = re.compile(r"([-+]?" + _PLAIN + r")/([-+]?" + _PLAIN + r")")
_FRAC_BRACED_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac(\d)(\d)")

# Number tokens inside free text (for the last-number fallback and the leading
# number of an answer). The look-behind stops a token from starting inside a word
# or another number ("x2", "1.5" read as ".5").
_TOKEN_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_TOKEN_RE = re.compile(
    r"(?<![\w.\\])"
    r"(?:[-−]\s?)?(?:\\?\$\s?)?"
    r"(?:"
    r"\\[dt]?frac\{[^{}]{1,40}\}\{[^{}]{1,40}\}"
    r"|" + _TOKEN_NUM + r"(?:\s?/\s?" + _TOKEN_NUM + r")?"
    r")"
)

# LaTeX that carries no value: sizing and spacing commands.
_NOISE_RE = re.compile(r"\\left|\\right|\\[!,;:]|\\quad|\\qquad|\\displaystyle|~")
_SPLIT_DIGITS_RE = re.compile(r"\d\s+\.?\d|\d\.\s+\d")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")
_DEGREE_RE = re.compile(r"(?:\^\{?\\circ\}?|°)$")


def _strip_outer(s: str) -> str:
    """Removes wrappers that do not change the value: `$..$`, `\\(..\\)`, `{..}`."""
    changed = True
    while changed and s:
        changed = False
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("{", "}")):
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                inner = s[len(left) : len(s) - len(right)]
                # "{1}{2}" must not become "1}{2": only strip braces that match.
                if left == "{" and not _balanced(inner):
                    continue
                s = inner
                changed = True
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def _plain_to_fraction(s: str) -> Fraction | None:
    """A signed plain number (no fractions) to a Fraction, or None."""
    m = _SIGNED_RE.fullmatch(s)
    if m is None:
        return None
    sign, body = m.groups()
    value = Fraction(body.replace(",", ""))
    return -value if sign == "-" else value


def _divide(num: Fraction | None, den: Fraction | None) -> Fraction | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _clean_number_text(text: str) -> str:
    s = text.replace("−", "-").replace("{,}", ",")
    s = _NOISE_RE.sub("", s)
    if _SPLIT_DIGITS_RE.search(s):
        return ""  # "4 2" is two numbers, not 42
    s = "".join(s.split())
    # A sentence's final "." may sit outside the math delimiters ("$\frac{1}{3}$.").
    s = _strip_outer(s.removesuffix(".")).removesuffix(".")
    # Currency may sit on either side of the sign: "$-5", "-$5".
    s = re.sub(r"^([-+]?)\\?\$", r"\1", s)
    s = s[:-2] if s.endswith("\\%") else s.removesuffix("%")
    s = _DEGREE_RE.sub("", s)
    return _strip_outer(s)


def parse_number(text: str) -> Fraction | None:
    """The exact value of a string that is one number, else None.

    Accepted forms and dropped decorations are listed in the module docstring
    (integers, decimals, signs, thousands groups, `a/b`, `\\frac{a}{b}`, `$`, one
    trailing `.`, trailing `%`, degrees). Never raises on any string.
    """
    if len(text) > MAX_ANSWER_CHARS:
        return None
    s = _clean_number_text(text)
    if not s:
        return None
    sign = 1
    if s[0] in "+-" and s[1:2] == "\\":  # -\frac{1}{2}
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    m = _FRAC_BRACED_RE.fullmatch(s) or _FRAC_SHORT_RE.fullmatch(s)
    if m is not None:
        num = _plain_to_fraction(_strip_outer(m.group(1)))
        den = _plain_to_fraction(_strip_outer(m.group(2)))
        value = _divide(num, den)
        return None if value is None else sign * value
    if sign != 1:
        return None
    m = _SLASH_RE.fullmatch(s)
    if m is not None:
        return _divide(_plain_to_fraction(m.group(1)), _plain_to_fraction(m.group(2)))
    return _plain_to_fraction(s)


def answer_value(answer: str) -> Fraction | None:
    """The numeric value of an extracted answer, with the salvage rules.

    parse_number(answer); else parse_number of the text after the last `=`; else a
    single leading number whose trailing text contains no digit (units).
    """
    if len(answer) > MAX_ANSWER_CHARS:
        return None
    value = parse_number(answer)
    if value is not None:
        return value
    if "=" in answer:
        value = parse_number(answer.rsplit("=", 1)[1])
        if value is not None:
            return value
    text = _TEXT_CMD_RE.sub(r" \1 ", answer).strip()
    m = _TOKEN_RE.match(text)
    if m is not None and not any(ch.isdigit() for ch in text[m.end() :]):
        return parse_number(m.group(0))
    return None


def _box_content(text: str, start: int) -> tuple[str | None, int]:
    """Content of the box whose command starts at `start`, and where it ends.

    Returns (None, end) for an unbalanced box. `\\boxed 5` (no brace) takes the
    next whitespace-delimited token.
    """
    i = _BOX_RE.match(text, start).end()
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i < n and text[i] == "{":
        depth = 0
        j = i
        while j < n:
            ch = text[j]
            if ch == "\\" and j + 1 < n:  # \{ and \} are literal braces
                j += 2
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j], j + 1
            j += 1
        return None, n
    m = _BARE_TOKEN_RE.match(text, i)
    if m is None:
        return None, i
    return m.group(0), m.end()


def top_level_boxes(text: str) -> list[tuple[int, str | None]]:
    """(start, content) of each top-level `\\boxed{}`/`\\fbox{}`, in order.

    Boxes nested inside an earlier box are skipped; an unbalanced box has content
    None and ends the scan.
    """
    boxes = []
    pos = 0
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return boxes
        content, end = _box_content(text, m.start())
        boxes.append((m.start(), content))
        if content is None:
            return boxes
        pos = end


def _unwrap_box(content: str) -> str:
    """`\\boxed{\\boxed{5}}` -> `5`: a box whose whole content is one box (at most
    MAX_BOX_UNWRAP levels: each is a linear scan)."""
    for _ in range(MAX_BOX_UNWRAP):
        stripped = content.strip()
        boxes = top_level_boxes(stripped)
        if len(boxes) != 1 or boxes[0][0] != 0 or boxes[0][1] is None:
            return content
        _, end = _box_content(stripped, 0)
        if end != len(stripped):
            return content
        content = boxes[0][1]
    return content


def _hash_segment(text: str, start: int) -> str:
    """The answer after a `####` at `start`: rest of the line, or the next non-empty line."""
    rest = text[start + len(_HASH_MARKER) :]
    rest = rest.lstrip()
    return rest.split("\n", 1)[0].strip()


def find_marker(text: str) -> tuple[str, str | None] | None:
    """The last final-answer marker: ("hash" | "boxed", answer or None), or None if absent."""
    hash_pos = text.rfind(_HASH_MARKER)
    boxes = top_level_boxes(text)
    box_pos = boxes[-1][0] if boxes else -1
    if hash_pos < 0 and box_pos < 0:
        return None
    if hash_pos > box_pos:
        return "hash", _hash_segment(text, hash_pos)
    content = boxes[-1][1]
    return "boxed", None if content is None else _unwrap_box(content).strip()


def last_number(text: str) -> str | None:
    """The last number token in free text (see the module docstring), or None."""
    last = None
    for m in _TOKEN_RE.finditer(text):
        last = m
    return None if last is None else last.group(0)


def extract_answer(completion: str, *, fallback: str | None = "last_number") -> str | None:
    """The final answer a completion states, as a string, or None.

    Marker rules and the fallback are in the module docstring. `fallback` is
    "last_number" or None.
    """
    if fallback not in ("last_number", None):
        raise ValueError(f"fallback must be 'last_number' or None, got {fallback!r}")
    marker = find_marker(completion)
    if marker is not None:
        answer = marker[1]
        return answer if answer else None
    if fallback == "last_number":
        return last_number(completion)
    return None


def extract_reference_answer(reference: str) -> str:
    """The answer part of a dataset reference: after the last `####` (a GSM8K
    solution), else the last `\\boxed{}` (a MATH solution), else the whole string.

    Raises ValueError (naming the reference) when that answer is empty: a
    malformed reference is a data bug, not a wrong completion.
    """
    if not isinstance(reference, str):
        raise TypeError(f"reference must be a str, got {type(reference).__name__}")
    marker = find_marker(reference)
    answer = reference.strip() if marker is None else (marker[1] or "")
    if not answer:
        raise ValueError(f"reference has no answer: {reference[-200:]!r}")
    return answer


def normalize_answer_text(answer: str) -> str:
    """Light textual normalisation for non-numeric answers (not a CAS).

    Removes whitespace, `\\left`/`\\right`, spacing commands, math delimiters,
    `\\text{}` wrappers and one trailing `.`; maps `\\dfrac`/`\\tfrac` to `\\frac`. An answer longer than
    MAX_TEXT_ANSWER_CHARS normalises to "" (no answer): stripping nested wrappers is
    quadratic in their depth.
    """
    if len(answer) > MAX_TEXT_ANSWER_CHARS:
        return ""
    s = _TEXT_CMD_RE.sub(r"\1", answer)
    s = _NOISE_RE.sub("", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = "".join(s.split())
    s = _strip_outer(s)
    return s.removesuffix(".")


def answers_match(predicted: str | None, reference: str, *, rel_tol: float = 0.0) -> bool:
    """Whether an extracted answer equals the reference answer.

    Exact rational equality of `answer_value`s when both are numeric; with
    `rel_tol > 0`, |p - r| <= rel_tol * max(|p|, |r|) in float64 instead (the
    documented float fallback). Non-numeric: equal `normalize_answer_text` forms.
    """
    if predicted is None:
        return False
    ref_value = answer_value(reference)
    pred_value = answer_value(predicted)
    if ref_value is not None or pred_value is not None:
        if ref_value is None or pred_value is None:
            return False
        if rel_tol > 0:
            return math.isclose(float(pred_value), float(ref_value), rel_tol=rel_tol)
        return pred_value == ref_value
    norm = normalize_answer_text(predicted)
    return bool(norm) and norm == normalize_answer_text(reference)
