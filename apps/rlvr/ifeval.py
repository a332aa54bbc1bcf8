"""Verifiable instructions of IFEval-style data (ROLL's ``GeneralRuleRewardWorker``), one check per ``func_name``.

A record's ``ground_truth`` is a JSON object (or a dict) naming the check and its arguments, as in the RLVR-IFEval
data ROLL trains on: ``{"func_name": "validate_word_constraint", "N": 50, "quantifier": "at least", ...}``. Only the
arguments a check takes are passed; the others (often ``null``) are ignored. Each check returns whether the response
follows the instruction. The names and arguments are the data's contract; what each check accepts follows the IFEval
definitions (Zhou et al. 2023), which these data were written from. Two places where ROLL's copy disagrees with its
own description are followed by the description: ``verify_keyword_frequency`` counts the word (ROLL's counts every
word) and ``validate_choice`` looks for an option in the response (ROLL's looks for the response in an option).
"""

from __future__ import annotations

import inspect
import json
import re
import warnings
from collections.abc import Callable
from typing import Any

CHECKS: dict[str, Callable[..., bool]] = {}


def check(function: Callable[..., bool]) -> Callable[..., bool]:
    """Register ``function`` under its own name (the data's ``func_name``)."""
    CHECKS[function.__name__] = function
    return function


def _compare(actual: int, n: int, quantifier: str, around: int) -> bool:
    """``at least`` / ``at most`` ``n``, or within ``around`` of it."""
    if quantifier == "at least":
        return actual >= n
    if quantifier == "at most":
        return actual <= n
    if quantifier == "around":
        return abs(actual - n) <= around
    raise ValueError(f"quantifier must be 'at least', 'at most' or 'around', got {quantifier!r}")


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text.lower())


# ---- keywords and letters ----------------------------------------------------------------------------------------
@check
def verify_keywords(text: str, keyword_list: list[str]) -> bool:
    """Every keyword appears (case-insensitive)."""
    lower = text.lower()
    return all(keyword.lower() in lower for keyword in keyword_list)


@check
def verify_keyword_frequency(text: str, word: str, N: int) -> bool:
    """The word appears exactly N times as a whole word (case-insensitive)."""
    return _words(text).count(word.lower()) == N


@check
def validate_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    """None of the words appears as a whole word (case-insensitive)."""
    return not any(re.search(rf"\b{re.escape(word)}\b", text, flags=re.I) for word in forbidden_words)


@check
def verify_letter_frequency(text: str, letter: str, N: int) -> bool:
    """The letter appears exactly N times (case-sensitive, as the data counts it)."""
    if len(letter) != 1:
        raise ValueError(f"letter must be one character, got {letter!r}")
    return text.count(letter) == N


@check
def validate_response_language(text: str, language: str) -> bool:
    """The response is in ``language`` (an ISO 639-1 code) by langdetect, seeded so that it is deterministic."""
    from langdetect import DetectorFactory, detect
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = 0
    try:
        return bool(detect(text) == language)
    except LangDetectException:  # no letters to judge
        return False


# ---- length ------------------------------------------------------------------------------------------------------
@check
def validate_word_constraint(text: str, N: int, quantifier: str) -> bool:
    """At least / at most / around N words (around: within 10 %, at least 1)."""
    return _compare(len(text.split()), N, quantifier, around=max(round(N * 0.1), 1))


SENTENCE_END = re.compile(r"(?<!\w\.\w.)(?<![A-Z][a-z]\.)(?<=\.|\?|!)\s+")


@check
def verify_sentence_constraint(text: str, N: int, quantifier: str) -> bool:
    """At least / at most / around (within 1) N sentences."""
    sentences = [s for s in SENTENCE_END.split(text.strip()) if s.strip()]
    return _compare(len(sentences), N, quantifier, around=1)


@check
def verify_paragraph_count(text: str, N: int) -> bool:
    """Exactly N non-empty paragraphs separated by the markdown divider ``* * *``."""
    cleaned = "\n".join(line.strip() for line in text.splitlines()).strip()
    paragraphs = cleaned.split("* * *")
    return all(p.strip() for p in paragraphs) and len(paragraphs) == N


@check
def validate_paragraphs(text: str, N: int, first_word: str, i: int) -> bool:
    """Exactly N paragraphs separated by blank lines, the i-th (1-based) starting with ``first_word``."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if len(paragraphs) != N or not 1 <= i <= N:
        return False
    first = re.match(r"\W*(\w+)", paragraphs[i - 1])
    return first is not None and first.group(1).lower() == first_word.lower()


# ---- format ------------------------------------------------------------------------------------------------------
@check
def verify_postscript(text: str, postscript_marker: str) -> bool:
    """A postscript: the marker followed by some text."""
    at = text.find(postscript_marker)
    return at >= 0 and len(text[at:].strip()) > len(postscript_marker)


@check
def validate_placeholders(text: str, N: int) -> bool:
    """At least N square-bracket placeholders such as ``[address]``."""
    return len(re.findall(r"\[[^\[\]\n]+\]", text)) >= N


@check
def verify_bullet_points(text: str, N: int) -> bool:
    """Exactly N markdown bullet points (lines starting ``* `` or ``- ``)."""
    bullets = re.findall(r"^\s*\*[^\*].*$", text, flags=re.M) + re.findall(r"^\s*-.*$", text, flags=re.M)
    return len(bullets) == N


@check
def validate_title(text: str) -> bool:
    """A title in double angular brackets, ``<<title>>``."""
    return any(title.strip() for title in re.findall(r"<<([^\n]+?)>>", text))


@check
def validate_choice(text: str, options: list[str] | str) -> bool:
    """The response gives one of the options."""
    choices = [options] if isinstance(options, str) else options
    return any(option.strip() and option.strip() in text for option in choices)


@check
def validate_highlighted_sections(text: str, N: int) -> bool:
    """At least N non-empty markdown highlights, ``*text*`` or ``**text**``."""
    single = re.findall(r"\*[^\n\*]*\*", text)
    double = re.findall(r"\*\*[^\n\*]*\*\*", text)
    found = [h for h in single if h.strip("*").strip()] + [h for h in double if h.removeprefix("**").strip()]
    return len(found) >= N


@check
def validate_sections(text: str, N: int, section_splitter: str) -> bool:
    """At least N sections, each starting with ``<section_splitter> <number>`` (e.g. ``SECTION 1``)."""
    sections = re.split(rf"\s?{re.escape(section_splitter)}\s?\d+\s?", text)
    return len(sections) - 1 >= N


@check
def validate_json_format(text: str) -> bool:
    """The whole response is JSON (a markdown code fence around it is allowed)."""
    body = text.strip()
    body = re.sub(r"^```(?:json|Json|JSON)?\s*", "", body)
    body = re.sub(r"\s*```$", "", body)
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


@check
def validate_repeat_prompt(text: str, original_prompt: str) -> bool:
    """The response starts by repeating the request word for word (case-insensitive)."""
    return text.strip().lower().startswith(original_prompt.strip().lower())


@check
def validate_two_responses(text: str) -> bool:
    """Two different non-empty responses separated by exactly one ``******``."""
    parts = text.split("******")
    return len(parts) == 2 and all(p.strip() for p in parts) and parts[0].strip() != parts[1].strip()


# ---- case and punctuation -----------------------------------------------------------------------------------------
@check
def validate_uppercase(text: str) -> bool:
    """All capital letters."""
    return text == text.upper()


@check
def validate_lowercase(text: str) -> bool:
    """No capital letters."""
    return text == text.lower()


@check
def validate_frequency_capital_words(text: str, N: int, quantifier: str) -> bool:
    """At least / at most / exactly ('around', as the data means it) N words in all capitals."""
    return _compare(len(re.findall(r"\b[A-Z]{2,}\b|\b[A-Z]\b", text)), N, quantifier, around=0)


@check
def validate_end(text: str, end_phrase: str) -> bool:
    """The response ends with the exact phrase, nothing after it."""
    return text.strip().endswith(end_phrase.strip())


@check
def validate_quotation(text: str) -> bool:
    """The whole response is wrapped in double quotes."""
    body = text.strip()
    return len(body) > 1 and body[0] == '"' and body[-1] == '"'


@check
def validate_no_commas(text: str) -> bool:
    """No comma anywhere."""
    return "," not in text


def follows(text: str, ground_truth: str | dict[str, Any]) -> bool:
    """Whether ``text`` follows the instruction ``ground_truth`` names.

    As ROLL: a ground truth that names no known check (or is no JSON object) is not followed, with a warning naming
    it (once per name); a check that fails on its arguments counts as not followed.
    """
    try:
        constraint = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    except (ValueError, TypeError):
        constraint = None
    name = constraint.pop("func_name", None) if isinstance(constraint, dict) else None
    if constraint is None or name not in CHECKS:
        shown = str(ground_truth)[:120]
        _warn_once(str(name), f"instruction-following ground_truth {shown!r} names no known func_name "
                              f"(known: {', '.join(sorted(CHECKS))}); scored 0")  # fmt: skip
        return False
    function = CHECKS[name]
    wanted = inspect.signature(function).parameters
    try:
        return bool(function(text, **{key: value for key, value in constraint.items() if key in wanted}))
    except (TypeError, ValueError, AttributeError):  # arguments missing or of the wrong type
        return False


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)
