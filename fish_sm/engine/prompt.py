"""The prompt as upstream's interleaved content sequence lays it out.

    <|interleave|>
    <|speaker:0|> reference text  <semantic tokens of its audio>  <|im_end|>   (per reference)
    <|speaker:0|> text to speak

Each piece is tokenized on its own, as upstream does. Row 0 of the result holds the
token ids; rows 1..num_codebooks hold the codebook ids on semantic positions and 0
elsewhere. User text is tokenized with special-token strings treated as plain text,
so a request cannot inject control tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fish_sm.model.tokenizer import IM_END, INTERLEAVE, Tokenizer

SPEAKER = "<|speaker:0|>"


def _text(tokenizer: Tokenizer, text: str, num_codebooks: int, special: bool = False) -> Tensor:
    ids = torch.tensor(tokenizer.encode(text, allow_special=special), dtype=torch.long)
    out = torch.zeros(num_codebooks + 1, len(ids), dtype=torch.long)
    out[0] = ids
    return out


def _codes(tokenizer: Tokenizer, codes: Tensor) -> Tensor:
    codes = codes.to(torch.long).cpu()
    return torch.cat([codes[:1] + tokenizer.semantic_begin_id, codes])


def prompt_prefix(tokenizer: Tokenizer, num_codebooks: int, turns: list[tuple[str, Tensor]]) -> Tensor:
    """The part of the prompt before the text to speak: every prompt for the same turns
    starts with these tokens, so their KV cache can be computed once (the batching engine)."""
    parts = [_text(tokenizer, INTERLEAVE, num_codebooks, special=True)]
    for transcript, codes in turns:
        if codes.shape[0] != num_codebooks:
            raise ValueError(f"reference codes have {codes.shape[0]} codebooks, the model needs {num_codebooks}")
        parts += [
            _text(tokenizer, SPEAKER, num_codebooks),
            _text(tokenizer, transcript, num_codebooks),
            _codes(tokenizer, codes),
            _text(tokenizer, IM_END, num_codebooks, special=True),
        ]
    return torch.cat(parts, dim=1)


def build_prompt(tokenizer: Tokenizer, num_codebooks: int, turns: list[tuple[str, Tensor]], text: str) -> Tensor:
    """turns: (transcript, codes [num_codebooks, frames]) pairs spoken before `text`."""
    parts = [prompt_prefix(tokenizer, num_codebooks, turns), _text(tokenizer, SPEAKER, num_codebooks),
             _text(tokenizer, text, num_codebooks)]
    return torch.cat(parts, dim=1)


def chunk_prompt(tokenizer: Tokenizer, num_codebooks: int, max_seq_len: int, references: list[tuple[str, Tensor]],
                 previous: list[tuple[str, Tensor]], chunk: str) -> Tensor:
    """The prompt for one chunk of a long text: the references, then the chunk before it
    (its text and codes, so the voice carries over) when that still fits, then the chunk."""
    prompt = build_prompt(tokenizer, num_codebooks, references + previous, chunk)
    if previous and prompt.shape[1] + 1 >= max_seq_len:
        prompt = build_prompt(tokenizer, num_codebooks, references, chunk)
    return prompt
