"""Splitting long text into chunks the model can speak one after another."""

from __future__ import annotations

import re

# A sentence ends at . ! ? ; … (ASCII or full-width) followed by space or end, or at a newline.
_SENTENCE_END = re.compile(r"(?<=[.!?;…])\s+|(?<=[。！？；])|\n+")
_CLAUSE_END = re.compile(r"(?<=[,:，、：])\s*")
_WIDE = re.compile(r"[\u3000-\u30ff\u3400-\u9fff\uff00-\uffef]")


def _join(a: str, b: str) -> str:
    """Join two pieces with a space, except where CJK text meets (it has no spaces)."""
    if not a:
        return b
    return a + b if _WIDE.match(a[-1]) or _WIDE.match(b[0]) else f"{a} {b}"


def split_text(text: str, chunk_length: int) -> list[str]:
    """Whole sentences packed greedily into chunks of at most `chunk_length` characters.

    A sentence longer than that is cut at clause punctuation, then at spaces, and only
    as a last resort mid-word; no character of the input is lost except whitespace at
    the cuts.
    """
    text = text.strip()
    if len(text) <= chunk_length:
        return [text] if text else []
    pieces = []
    for sentence in filter(None, (s.strip() for s in _SENTENCE_END.split(text))):
        pieces += _split_long(sentence, chunk_length)
    return _pack(pieces, chunk_length)


def _pack(pieces: list[str], limit: int) -> list[str]:
    """Greedily join consecutive pieces while the result stays within `limit`."""
    chunks, current = [], ""
    for piece in pieces:
        joined = _join(current, piece)
        if len(joined) <= limit:
            current = joined
        else:
            chunks.append(current)
            current = piece
    return chunks + [current] if current else chunks


def _split_long(sentence: str, limit: int) -> list[str]:
    if len(sentence) <= limit:
        return [sentence]
    for pattern in (_CLAUSE_END, re.compile(r"\s+")):
        parts = [p for p in pattern.split(sentence) if p]
        if len(parts) > 1:
            return _pack([q for p in parts for q in _split_long(p, limit)], limit)
    return [sentence[i : i + limit] for i in range(0, len(sentence), limit)]
