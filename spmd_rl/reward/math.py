"""Math answer checking: pull the final answer out of a completion and compare it to a reference.

``math_score(completion, answer)`` is 1.0 when the extracted answer equals the reference, else 0.0.
Extraction order (first that applies): the last ``\\boxed{...}`` (nested braces), the last
``<answer>...</answer>``, ``#### x``, "answer is x" / "answer: x", else the last number.

Comparison: plain numbers (commas, ``$``, ``%``, trailing ``.``, ``a/b`` and ``\\frac{a}{b}`` allowed)
are compared exactly as fractions, with a relative tolerance of 1e-6 for decimals. A numeric
reference needs a numeric prediction (an expression such as ``12 + 7`` is not accepted for ``19``,
so the policy cannot restate the question). A non-numeric reference (``\\sqrt{2}``, ``x+1``) is
compared by the ``math-verify`` package when it is installed, else by normalised strings.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_NUM = r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|(?<![\w.])-?\.\d+"
_NUM_RE = re.compile(_NUM)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*(?:[:=]\s*)?", re.IGNORECASE)
_FRAC_RE = re.compile(r"^\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_LATEX_START_RE = re.compile(r"^\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|^\\sqrt\{[^{}]*\}")
REL_TOL = 1e-6
_UNITS_RE = re.compile(r"\\(?:text|mathrm|mbox)\{\s*[A-Za-z][^{}]*\}|\^\{?\\circ\}?")
_SENTENCE_END_RE = re.compile(r"\n|[.!?;](?=\s|$)")


def last_braced(text: str, command: str) -> str | None:
    """Content of the last ``command{...}`` in text, with nested braces; None if absent or unclosed."""
    start = text.rfind(command + "{")
    while start != -1:
        i = start + len(command) + 1
        depth = 1
        j = i
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        if depth == 0:
            return text[i : j - 1].strip()
        start = text.rfind(command + "{", 0, start)
    return None


def _normalise_text(text: str) -> str:
    return text.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "")


def _first_answer_token(rest: str) -> str | None:
    """The answer right after "answer is": a leading LaTeX fraction/root, else the first number
    before the end of that sentence or line."""
    rest = _SENTENCE_END_RE.split(rest, maxsplit=1)[0]
    rest = rest.strip().lstrip("$").strip()
    m = _LATEX_START_RE.match(rest)
    if m:
        return m.group(0)
    m = _NUM_RE.search(rest)
    return m.group(0) if m else None


def _from_plain(text: str) -> str | None:
    """"answer is x" / "answer: x", else the last number."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if matches:
        found = _first_answer_token(text[matches[-1].end():])
        if found is not None:
            return found
    nums = _NUM_RE.findall(text)
    return nums[-1] if nums else None


def extract_answer(text: str) -> str | None:
    """The final answer in a completion, as a string, or None when there is none."""
    text = _normalise_text(text)
    boxed = last_braced(text, "\\boxed")
    if boxed is None:
        boxed = last_braced(text, "\\fbox")
    if boxed:
        return boxed
    tags = _ANSWER_TAG_RE.findall(text)
    if tags:
        inner = tags[-1].strip()
        if "=" in inner:
            inner = inner.rsplit("=", 1)[1].strip()
        if _to_number(inner) is not None or not re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", "", inner)):
            return inner or None
        return _from_plain(inner)
    hashes = _HASH_RE.findall(text)
    if hashes:
        found = _first_answer_token(hashes[-1])
        if found is not None:
            return found
    return _from_plain(text)


def _to_number(text: str) -> Fraction | None:
    """Exact value of a plain number string (``1,234``, ``$5``, ``50%``, ``12.``, ``3/4``,
    ``\\frac{3}{4}``, ``-0.5``), else None."""
    s = _UNITS_RE.sub("", _normalise_text(text)).strip()
    for junk in ("\\$", "$", "\\%", "%", "\\text{", "\\mathrm{"):
        s = s.replace(junk, "")
    s = s.replace("}", "") if s.count("}") > s.count("{") else s
    s = s.strip().rstrip(".").strip()
    if s.startswith("+"):
        s = s[1:]
    m = _FRAC_RE.match(s)
    if m:
        num, den = _to_number(m.group(1)), _to_number(m.group(2))
        return num / den if num is not None and den else None
    if re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+", s):
        return Fraction(s.replace(",", ""))
    m = re.fullmatch(r"(-?\d+)\s*/\s*(\d+)", s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def _math_verify_equal(pred: str, ref: str) -> bool | None:
    """math-verify's verdict, or None when it is not installed or cannot parse either side."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"${ref}$", parsing_timeout=timeout)
        target = parse(f"${pred}$", parsing_timeout=timeout)
        if not gold or not target:
            return None
        return bool(verify(gold, target, timeout_seconds=timeout))
    except Exception:
        return None


def _plain_string(text: str) -> str:
    s = _normalise_text(text)
    for junk in (" ", "$", "\\left", "\\right", "\\text{", "\\mathrm{"):
        s = s.replace(junk, "")
    return s.rstrip(".").lower()


def numbers_equal(pred: str | float | int, ref: str | float | int, *, use_math_verify: bool = True) -> bool:
    """Whether a predicted answer equals the reference (see the module docstring for the rules)."""
    p, r = str(pred), str(ref)
    pn, rn = _to_number(p), _to_number(r)
    if pn is not None and rn is not None:
        if pn == rn:
            return True
        # Exact rationals: float() would overflow on an answer like 10**400 or 1/10**400.
        return abs(pn - rn) <= max(Fraction(REL_TOL) * max(abs(pn), abs(rn)), Fraction(1, 10**12))
    if rn is not None:
        # A numeric reference needs a numeric answer: "12 + 7" must not earn the reward for 19.
        return False
    if use_math_verify:
        verdict = _math_verify_equal(p, r)
        if verdict is not None:
            return verdict
    return _plain_string(p) == _plain_string(r) and bool(_plain_string(p))


def math_score(completion: str, answer: str | float | int, *, use_math_verify: bool = True) -> float:
    """1.0 when the completion's final answer equals ``answer``, else 0.0."""
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if numbers_equal(pred, answer, use_math_verify=use_math_verify) else 0.0


def math_reward(prompts: list[str], completions: list[str], *, answer: list[str], **_: object) -> list[float]:
    """Batch scorer ``reward.fn=math`` (the scorer signature, ``answer`` column)."""
    return [math_score(c, a) for c, a in zip(completions, answer)]


__all__ = ["extract_answer", "last_braced", "math_reward", "math_score", "numbers_equal"]
