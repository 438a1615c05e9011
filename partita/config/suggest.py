""""Did you mean ...?" for misspelled config keys.

Typos such as ``zero_optimisation`` or ``reduce_bucket_sise`` are the most common config
mistake; naming the closest valid key turns a lookup in the docs into a one-word fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_matches(word: str, candidates: Iterable[str], *, limit: int = 3) -> list[str]:
    """Valid keys that look like ``word``, best first (case-insensitive, difflib ratio >= 0.6)."""
    by_folded: dict[str, str] = {}
    for candidate in candidates:
        by_folded.setdefault(candidate.lower(), candidate)
    folded = difflib.get_close_matches(word.lower(), list(by_folded), n=limit, cutoff=0.6)
    return [by_folded[f] for f in folded]


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"did you mean 'x'?"`` (or two or three choices), or "" when nothing is close."""
    matches = close_matches(word, candidates)
    if not matches:
        return ""
    if len(matches) == 1:
        return f"did you mean '{matches[0]}'?"
    quoted = [f"'{m}'" for m in matches]
    return f"did you mean {', '.join(quoted[:-1])} or {quoted[-1]}?"
