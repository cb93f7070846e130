"""Final answers as strings ready to compare: from a model response, and from a verl ground truth.

:func:`extract_answer` finds the answer a response commits to, :func:`extract_ground_truth` reads a
dataset's ``reward_model.ground_truth``, and :func:`normalize_answer` is the clean-up both sides get before
:func:`verl_ext.verify.is_equivalent` compares them. Pure string work: regexes only, no sympy, and linear
in the length of the response.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

__all__ = ["Extraction", "extract_answer", "extract_ground_truth", "normalize_answer"]


class Extraction(NamedTuple):
    """The answer found in a response: ``answer`` is None when nothing was found; ``method`` names the
    rule that found it ("boxed", "####", "answer_is", "last_number" or "none")."""

    answer: str | None
    method: str


_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# A number at the start of a string, optionally with a currency sign and a percent sign.
_LEADING_NUMBER_RE = re.compile(r"^(?:\\?\$\s*)?(" + _NUMBER + r")(?:\s*\\?%)?")
# The text after a marker is read up to the end of its line, at most 1024 characters (keeps regexes linear).
_HASH_RE = re.compile(r"####[ \t]*([^\n]{0,1024})")
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer\s+is|answer\s+is|final\s+answer\s*:|answer\s*:)[ \t]*\**[ \t]*:?[ \t]*([^\n]{0,1024})",
    re.IGNORECASE,
)
_MATH_SPAN_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# End of the answer inside a sentence: a period before whitespace/end, a semicolon, or a comma before a word.
_SENTENCE_END_RE = re.compile(r"\.(?=\s|$)|;|,\s+(?=[A-Za-z]{2,})")
# After a leading number: a word ("18 dollars", "3 then 6") or punctuation before a word or the end ("72.",
# "5, which"). Not "2x", "3/4", "1, 2", "3 + 4" or "3 \\text{cm}": those stay whole.
_WORDS_AFTER_NUMBER_RE = re.compile(r"^(?:\s+[A-Za-z]|\s*[.,;:!?)]+\s*(?:[A-Za-z]|$))")
_HASH_START_RE = re.compile(r"^\s*(?:\\?\$|-|\u2212|\d|\\|\(|\[|\{)")
_PROSE_RE = re.compile(r"[A-Za-z][A-Za-z']+[ \t]+[A-Za-z][A-Za-z']+")
_GROUPED_INTEGER_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+$")
_PLAIN_NUMBER_RE = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+|\d{1,300})(?:\.\d{1,300})?$")


def _last_braced(text: str, commands: Sequence[str]) -> str | None:
    """Content of the last ``\\cmd{...}`` for any of ``commands`` whose braces close; None if none does.

    Linear time: when the box opened at ``start`` never closes, an earlier box can only be complete if it
    closes before ``start`` (its depth stays above zero after that), so each retry scans up to the last
    failed start."""
    pattern = re.compile("(?:" + "|".join(re.escape(cmd) for cmd in commands) + r")\{")
    starts = [match.end() for match in pattern.finditer(text)]
    limit = len(text)
    for start in reversed(starts):
        depth = 1
        for i in range(start, limit):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
        limit = start  # unclosed (e.g. a truncated response): try the previous one
    return None


def _cut_sentence(text: str) -> str:
    match = _SENTENCE_END_RE.search(text)
    return text[: match.start()] if match else text


def _tidy(raw: str, *, boxed: bool = False) -> str:
    """Turn the text inside a box, or after a marker, into an answer string."""
    text = raw.strip().replace("\u2212", "-")
    if not boxed:
        text = text.replace("**", "").strip()
    span = _MATH_SPAN_RE.search(text)
    lead = _LEADING_NUMBER_RE.match(text)
    if lead is not None:
        rest = text[lead.end() :]
        if not rest or _WORDS_AFTER_NUMBER_RE.match(rest):
            return lead.group(1)
    if span is not None and not boxed:
        text = next(group for group in span.groups() if group is not None)
    elif not boxed:
        text = _cut_sentence(text)
    return text.strip().rstrip(".").strip()


def _is_prose(text: str) -> bool:
    """Two plain words in a row outside LaTeX commands: a sentence, not an answer."""
    plain = re.sub(r"\\[A-Za-z]+(\{[^{}]*\})?", " ", text)
    return _PROSE_RE.search(plain) is not None


_MAX_MARKER_TRIES = 16  # markers looked at, from the last one backwards, before a rule gives up


def _last_hash_answer(text: str) -> str | None:
    # "#### 72" counts; "#### Step 2: ..." (a markdown heading) does not.
    candidates = [m.group(1) for m in _HASH_RE.finditer(text) if _HASH_START_RE.match(m.group(1))]
    for raw in reversed(candidates[-_MAX_MARKER_TRIES:]):
        answer = _tidy(raw)
        if answer:
            return answer
    return None


def _last_answer_is(text: str) -> str | None:
    candidates = [m.group(1) for m in _ANSWER_IS_RE.finditer(text) if m.group(1).strip()]
    for raw in reversed(candidates[-_MAX_MARKER_TRIES:]):
        answer = _tidy(raw)
        if answer and not _is_prose(answer):
            return answer
    return None


def extract_answer(response: str, *, allow_last_number: bool = True) -> Extraction:
    """Find the final answer in a model response.

    The first rule that finds something wins; within a rule the LAST occurrence in the response counts:

    1. ``\\boxed{...}`` (also ``\\fbox{...}``), with balanced braces.
    2. ``#### X`` (the GSM8K format): the rest of that line.
    3. ``The final answer is X`` / ``The answer is X`` / ``Answer: X`` (any case; ``**`` markdown allowed).
    4. The last number in the response (only with ``allow_last_number=True``).

    If the response contains ``</think>``, only the text after the last ``</think>`` is searched. The found
    text is tidied: after a marker the content of a math span (``$...$``, ``\\(...\\)``) is taken, a
    trailing period and ``**`` are dropped, and a leading number followed by plain words keeps the number
    (``18 dollars`` -> ``18``).
    """
    if not isinstance(response, str):
        response = "" if response is None else str(response)
    think_end = response.rfind("</think>")
    if think_end >= 0:
        response = response[think_end + len("</think>") :]

    boxed = _last_braced(response, ("\\boxed", "\\fbox"))
    if boxed is not None:
        answer = _tidy(boxed, boxed=True)
        if answer:
            return Extraction(answer, "boxed")
    answer = _last_hash_answer(response)
    if answer:
        return Extraction(answer, "####")
    answer = _last_answer_is(response)
    if answer:
        return Extraction(answer, "answer_is")
    if allow_last_number:
        last = None
        for last in _NUMBER_RE.finditer(response):
            pass
        if last is not None:
            return Extraction(last.group(0), "last_number")
    return Extraction(None, "none")


def normalize_answer(answer: str) -> str:
    """Final clean-up applied to both sides before comparing: unicode minus, currency and percent signs,
    thousands separators in plain numbers, surrounding ``$``, a trailing period."""
    text = answer.strip().replace("\u2212", "-")
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text.strip("$").strip()
    text = re.sub(r"^\\?\$\s*", "", text)
    text = re.sub(r"\s*\\?%$", "", text)
    text = text.rstrip(".").strip()
    if _GROUPED_INTEGER_RE.match(text) or _PLAIN_NUMBER_RE.match(text):
        text = text.replace(",", "")
    return text


def extract_ground_truth(ground_truth: Any) -> list[str]:
    """The acceptable answers in a verl ``reward_model.ground_truth`` value (str, number, or a list of them).

    ``"#### 72"`` (or a whole GSM8K solution) gives ``["72"]``; a ``\\boxed{}`` gives its content."""
    if ground_truth is None:
        return []
    if isinstance(ground_truth, bool):
        raise TypeError(f"ground_truth must be a string, a number or a list of them, got bool {ground_truth!r}")
    if isinstance(ground_truth, int):
        return [str(ground_truth)]
    if isinstance(ground_truth, float):
        return [repr(ground_truth) if not ground_truth.is_integer() else str(int(ground_truth))]
    if isinstance(ground_truth, bytes):
        ground_truth = ground_truth.decode()
    if not isinstance(ground_truth, str):
        if hasattr(ground_truth, "tolist"):  # numpy arrays / scalars from parquet
            ground_truth = ground_truth.tolist()
            if not isinstance(ground_truth, list):
                return extract_ground_truth(ground_truth)
        if isinstance(ground_truth, Iterable):
            out: list[str] = []
            for item in ground_truth:
                out.extend(extract_ground_truth(item))
            return out
        raise TypeError(f"ground_truth must be a string, a number or a list of them, got {type(ground_truth).__name__}")
    text = ground_truth.strip()
    if "####" in text:
        text = _tidy(text[text.rfind("####") + 4 :])
    else:
        boxed = _last_braced(text, ("\\boxed", "\\fbox"))
        if boxed is not None:
            text = boxed.strip()
    text = normalize_answer(text)
    return [text] if text else []
