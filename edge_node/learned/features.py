"""Features of a prompt for the stage-0 router: hashed word n-grams plus domain-agnostic scalars.

Hashing uses crc32, so features are the same in every process (Python's ``hash`` is salted).
Only the first ``MAX_CHARS`` characters are read, which bounds the cost of a decision whatever
the prompt's size; the length features still see the full length.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np

MAX_CHARS = 16_384
HASH_BITS = 18
_MASK = (1 << HASH_BITS) - 1

_TOKEN = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
_OPTION = re.compile(r"^\s*([A-J])[.)]\s*(.*)$", re.MULTILINE)
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[a-z]+")
_CONDITIONS = frozenset(("because", "unless", "if", "since", "only"))
_MULTI_STEP = (
    "each",
    "per",
    "total",
    "remaining",
    "left",
    "then",
    "after",
    "twice",
    "half",
    "times",
    "every",
    "altogether",
)
_MULTI_STEP_PHRASES = ("how many", "how much", "more than", "less than")
_JUDGEMENT = ("most likely", "most appropriate", "most important", "would most", "is likely")
_STATEMENT_COMBOS = ("I only", "II only", "I and II", "II and III", "I and III", "I, II")
_UPPER = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"

SCALAR_NAMES = (
    "length",
    "word count",
    "line count",
    "digit share",
    "numbers",
    "operators",
    "multiple choice",
    "question stem length",
    "option length",
    "option length spread",
    "numeric options",
    "negation (NOT/EXCEPT/LEAST)",
    "statement combinations (I and II)",
    "paired statements",
    "all/none of the above",
    "reading passage",
    "multi-step wording",
    "question marks",
    "word length",
    "long words",
    "capitalised words",
    "code",
    "years",
    "money or percent",
    "math symbols",
    "conversation turns",
    "first/second person",
    "judgement wording",
    "numbers in the question",
    "true/false options",
    "similar options",
    "parallel options (same first word)",
    "conditional options (because/if/unless)",
)
# Words too common to explain a decision on their own.
_STOPWORD_TEXT = """a an the of to in on at by for with from as into is are was were be been it
its this that these those which what who how why when where and or but not no if then than so do
does did can could will would should may might must i ii iii iv you your we our they their he she
his her following"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())


@dataclass(frozen=True)
class Features:
    buckets: np.ndarray
    """Sorted unique hashed n-gram buckets present in the prompt."""
    scalars: np.ndarray
    """Raw (unscaled) scalar features, in ``SCALAR_NAMES`` order."""
    tokens: tuple[str, ...]
    """Lower-cased tokens, kept so reasons can name the n-grams behind a bucket."""


def _crc(token: str) -> int:
    return zlib.crc32(("0" if token[0].isdigit() else token).encode("utf-8", "surrogatepass"))


def ngram_buckets(tokens: list[str], n: int = 2) -> list[np.ndarray]:
    """Bucket ids of the word 1..n-grams, one array per order (digits all hash alike)."""
    if not tokens:
        return []
    base = np.fromiter((_crc(t) for t in tokens), dtype=np.int64, count=len(tokens))
    out = []
    h = base.copy()
    for k in range(1, n + 1):
        if k > 1:
            h = (h[:-1] * 1_000_003 + base[k - 1 :]) & 0xFFFFFFFFFFFF
        out.append(((h * 31 + 7919 + k) ^ (h >> 17)) & _MASK)
    return out


def extract(text: str, turns: int = 1) -> Features:
    """Features of one prompt (all of a conversation's text, and its number of user turns)."""
    full_length = len(text)
    text = text[:MAX_CHARS]
    low = text.lower()
    tokens = _TOKEN.findall(low)
    grams = ngram_buckets(tokens)
    buckets = np.unique(np.concatenate(grams)) if grams else np.zeros(0, np.int64)
    return Features(buckets, _scalars(text, low, tokens, turns, full_length), tuple(tokens))


def _scalars(text: str, low: str, tokens: list[str], turns: int, full_length: int) -> np.ndarray:
    counts = Counter(tokens)
    words = letters = long_words = numbers = digits = years = 0
    for token, n in counts.items():
        if token[0].isalpha():
            words += n
            letters += len(token) * n
            long_words += n if len(token) >= 10 else 0
        elif token[0].isdigit():
            numbers += n
            digits += len(token) * n
            years += n if len(token) == 4 and token[:2] in ("19", "20") else 0
    per_word = max(1, words)
    options = _OPTION.findall(text)
    multiple_choice = len(options) >= 2
    first_option = _OPTION.search(text) if multiple_choice else None
    stem = text[: first_option.start()] if first_option else text
    option_lengths = [len(o[1]) for o in options] if multiple_choice else [0]
    mean_option = sum(option_lengths) / len(option_lengths)
    spread = math.sqrt(sum((x - mean_option) ** 2 for x in option_lengths) / len(option_lengths))
    numeric_options = sum(
        1 for o in options if _NUMBER.fullmatch(o[1].strip().rstrip("%").lstrip("$"))
    )
    option_numbers = len(_NUMBER.findall(" ".join(o[1] for o in options)))
    true_false = sum(1 for o in options if o[1].strip().split(",")[0] in ("True", "False"))
    raw = text.encode("utf-8", "ignore")
    capitals = len(raw) - len(raw.translate(None, _UPPER))
    n_options = max(1, len(options))
    values = (
        math.log1p(full_length),
        math.log1p(words),
        math.log1p(text.count("\n")),
        digits / max(1, len(text)),
        math.log1p(numbers),
        math.log1p(sum(text.count(c) for c in "+*/=^<>")),
        float(multiple_choice),
        math.log1p(len(stem)),
        math.log1p(mean_option),
        spread / (mean_option + 1.0),
        numeric_options / n_options if multiple_choice else 0.0,
        float(counts["not"] + counts["except"] + counts["least"] > 0),
        float(any(c in text for c in _STATEMENT_COMBOS)),
        float("Statement 1" in text),
        float(any(k in low for k in ("of the above", "both of these", "all of these"))),
        float(len(stem) > 700 or "refers to the following" in low),
        math.log1p(
            sum(counts[w] for w in _MULTI_STEP) + sum(low.count(p) for p in _MULTI_STEP_PHRASES)
        ),
        math.log1p(stem.count("?")),
        letters / per_word,
        long_words / per_word,
        capitals / per_word,
        math.log1p(text.count("```") + text.count("def ") + text.count(";") + text.count("{")),
        math.log1p(years),
        math.log1p(text.count("$") + text.count("%")),
        math.log1p(sum(text.count(c) for c in "\\√π∫∑") + low.count("sqrt")),
        math.log1p(max(1, turns) - 1),
        float(counts["i"] + counts["my"] + counts["you"] + counts["your"] > 0),
        float(counts["best"] + sum(low.count(p) for p in _JUDGEMENT) > 0),
        math.log1p(max(0, numbers - option_numbers)),
        true_false / n_options if multiple_choice else 0.0,
        *(_option_likeness([o[1] for o in options]) if multiple_choice else (0.0, 0.0, 0.0)),
    )
    return np.array(values, dtype=float)


def _option_likeness(options: list[str]) -> tuple[float, float, float]:
    """How finely the options must be told apart: mean word overlap (Jaccard) of option pairs,
    share of options whose first word another option shares ("Yes, because" / "No, because"
    counts once the reasons differ), and share of options that argue a condition."""
    words = [_WORD.findall(o.lower()) for o in options]
    sets = [set(w) for w in words]
    overlaps = [
        len(a & b) / len(a | b) if a | b else 0.0 for i, a in enumerate(sets) for b in sets[i + 1 :]
    ]
    firsts = [w[0] if w else "" for w in words]
    parallel = sum(1 for f in firsts if f and firsts.count(f) > 1)
    conditional = sum(1 for w in sets if w & _CONDITIONS)
    n = len(options)
    return sum(overlaps) / len(overlaps), parallel / n, conditional / n


def ngram_text(tokens: tuple[str, ...], bucket: int) -> str | None:
    """The first word 1- or 2-gram of ``tokens`` that hashes to ``bucket`` (for explanations)."""
    grams = ngram_buckets(list(tokens))
    for order, ids in enumerate(grams, start=1):
        hits = np.flatnonzero(ids == bucket)
        if len(hits):
            start = int(hits[0])
            return " ".join(tokens[start : start + order])
    return None
