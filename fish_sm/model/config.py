"""`config.json` of a DualAR text-to-semantic checkpoint, read strictly.

Every field of the real S1-mini config is known here. A missing field, an unknown
one, a wrong type or an unknown `model_type` is a `ConfigError` that names it:
a silently ignored typo in a config would change the model without a word.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from fish_sm.errors import ConfigError

# The codec's residual codebooks have 1024 entries, so only the first 1024 of the
# fast head's `codebook_size` logits can be chosen for codebooks 1..9 (upstream
# hard-codes the same slice).
RESIDUAL_CODEBOOK_SIZE = 1024


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    n_layer: int
    n_head: int
    n_local_heads: int
    head_dim: int
    dim: int
    intermediate_size: int
    rope_base: float
    norm_eps: float
    max_seq_len: int
    dropout: float
    tie_word_embeddings: bool
    attention_qkv_bias: bool
    attention_o_bias: bool
    attention_qk_norm: bool
    codebook_size: int
    num_codebooks: int
    scale_codebook_embeddings: bool
    n_fast_layer: int
    fast_dim: int
    fast_n_head: int
    fast_n_local_heads: int
    fast_head_dim: int
    fast_intermediate_size: int
    fast_attention_qkv_bias: bool
    fast_attention_qk_norm: bool
    fast_attention_o_bias: bool
    # Training-only fields: accepted and kept so a config round-trips unchanged.
    use_gradient_checkpointing: bool = True
    initializer_range: float = 0.02
    is_reward_model: bool = False

    def __post_init__(self):
        if self.model_type != "dual_ar":
            raise ConfigError(f"config.json: unknown model_type {self.model_type!r} (fish-sm serves 'dual_ar' models)")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "bool": bool, "str": str}[f.type]
            if isinstance(value, bool) and f.type in ("int", "float") or not isinstance(value, want):
                raise ConfigError(f"config.json: field {f.name!r} must be {f.type}, got {value!r}")
        if self.is_reward_model:
            raise ConfigError("config.json: reward models (is_reward_model: true) cannot synthesize speech")
        if self.n_head % self.n_local_heads or self.fast_n_head % self.fast_n_local_heads:
            raise ConfigError("config.json: n_head must be a multiple of n_local_heads (and likewise for fast_)")
        if self.codebook_size < RESIDUAL_CODEBOOK_SIZE:
            raise ConfigError(f"config.json: codebook_size must be at least {RESIDUAL_CODEBOOK_SIZE}")
        for name in ("vocab_size", "n_layer", "n_head", "head_dim", "dim", "max_seq_len", "num_codebooks", "n_fast_layer"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: field {name!r} must be positive")

    @classmethod
    def from_dict(cls, data: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        if "model_type" in data and data["model_type"] != "dual_ar":
            raise ConfigError(f"{source}: unknown model_type {data['model_type']!r} (fish-sm serves 'dual_ar' models)")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}")
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=4, sort_keys=True) + "\n", encoding="utf-8")

    @property
    def semantic_vocab(self) -> int:
        """Number of semantic tokens the slow head can emit (codebook 0 entries)."""
        return self.codebook_size
