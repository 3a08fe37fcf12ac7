"""Error-message helpers: quote what a user sent without echoing a huge input whole."""

from __future__ import annotations

QUOTE_CHARS = 80


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with its full length said when cut."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def shown(value, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` clipped to ``limit`` characters (:func:`clip`)."""
    return clip(repr(value), limit)
