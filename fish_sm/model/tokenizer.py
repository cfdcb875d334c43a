"""The S1-mini tokenizer: tiktoken BPE ranks plus the special tokens.

Special-token ids follow upstream's rule: they are numbered from the number of BPE
ranks upward, in the order `special_tokens.json` lists them (the ids written in
that file are not read; in the official files they agree with this numbering).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import tiktoken

from fish_sm.errors import CheckpointError

# Upstream's split pattern, character for character (including its `\s+(\?!\S)`
# alternative, which matches a literal "?!" and must stay for identical ids).
SPLIT_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"\p{P}",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(\?!\S)",
        r"\s+",
    ]
)
_MAX_CHARS_PER_PIECE = 400_000  # tiktoken's recursion limit on very long inputs

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
INTERLEAVE = "<|interleave|>"
BASE_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    IM_START,
    IM_END,
    "<|phoneme_start|>",
    "<|phoneme_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|text|>",
    "<|voice|>",
    INTERLEAVE,
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio|>",
]
_SEMANTIC = re.compile(r"<\|semantic:(\d+)\|>")


def semantic_token(i: int) -> str:
    return f"<|semantic:{i}|>"


class Tokenizer:
    def __init__(self, ranks: dict[bytes, int], special_tokens: list[str]):
        base = len(ranks)
        self.special_ids = {tok: base + i for i, tok in enumerate(special_tokens)}
        semantic = {int(m.group(1)): tid for tok, tid in self.special_ids.items() if (m := _SEMANTIC.fullmatch(tok))}
        if not semantic:
            raise CheckpointError("special_tokens.json: no <|semantic:N|> tokens")
        n = max(semantic) + 1
        if sorted(semantic) != list(range(n)) or any(semantic[i] != semantic[0] + i for i in range(n)):
            raise CheckpointError("special_tokens.json: semantic tokens must be <|semantic:0|>.. in order, without gaps")
        for tok in (IM_END, INTERLEAVE):
            if tok not in self.special_ids:
                raise CheckpointError(f"special_tokens.json: missing {tok}")
        self.semantic_begin_id = semantic[0]
        self.semantic_end_id = semantic[n - 1]
        self.num_semantic = n
        self.im_end_id = self.special_ids[IM_END]
        self._enc = tiktoken.Encoding(
            name="fish-sm",
            pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        return cls(read_ranks(path / "tokenizer.tiktoken"), read_special_tokens(path / "special_tokens.json"))

    @property
    def vocab_size(self) -> int:
        """BPE ranks plus special tokens (the model's embedding may be padded beyond)."""
        return self._enc.n_vocab

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids for `text`. With `allow_special`, special-token strings in the text
        become their ids (as upstream does); without, they are tokenized as plain text."""
        if allow_special and text in self.special_ids:
            # The prompt's control tokens, one per prompt at least: tiktoken would take the set of
            # all ~4,100 special tokens across into Rust on each call, time the decode loop waits on.
            return [self.special_ids[text]]
        allowed = self._enc.special_tokens_set if allow_special else set()
        pieces = [text[i : i + _MAX_CHARS_PER_PIECE] for i in range(0, len(text), _MAX_CHARS_PER_PIECE)]
        # Not `encode_batch`: its thread pool costs a few ms a call on a busy server (GIL hand-offs).
        return [t for piece in pieces for t in self._enc.encode(piece, allowed_special=allowed, disallowed_special=())]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def read_ranks(path: Path) -> dict[bytes, int]:
    """`base64(token) rank` a line; a line whose token is `=` stands for the empty token and is skipped."""
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a tiktoken ranks file") from None
    ranks = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise CheckpointError(f"{path}:{lineno}: expected 'base64-token rank'")
        if parts[0] == "=":
            continue
        try:
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except ValueError:
            raise CheckpointError(f"{path}:{lineno}: bad base64 token") from None
    if not ranks:
        raise CheckpointError(f"{path}: no BPE ranks")
    return ranks


def read_special_tokens(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict):
        return list(data)
    if isinstance(data, list) and all(isinstance(t, str) for t in data):
        return data
    raise CheckpointError(f"{path}: expected a JSON object of token -> id")


def write_tokenizer(path: str | Path, ranks: dict[bytes, int], num_semantic: int) -> None:
    """Write `tokenizer.tiktoken` and `special_tokens.json` in the official layout."""
    path = Path(path)
    lines = [f"{base64.b64encode(tok).decode() or '='} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    (path / "tokenizer.tiktoken").write_text("\n".join(lines) + "\n", encoding="ascii")
    specials = BASE_SPECIAL_TOKENS + [semantic_token(i) for i in range(num_semantic)]
    ids = {tok: len(ranks) + i for i, tok in enumerate(specials)}
    (path / "special_tokens.json").write_text(json.dumps(ids, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
