import json
from pathlib import Path

import pytest

from fish_sm.errors import ConfigError
from fish_sm.model.checkpoint import S1_MINI
from fish_sm.model.config import ModelConfig

# The official config.json, kept in the shared reference folder beside the repository.
REAL_CONFIG = Path(__file__).resolve().parents[3] / "shared" / "reference" / "s1-mini" / "config.json"


def real_config() -> dict:
    if not REAL_CONFIG.is_file():
        pytest.skip(f"{REAL_CONFIG} is not here")
    return json.loads(REAL_CONFIG.read_text())


def test_reads_the_official_config():
    cfg = ModelConfig.from_dict(real_config())
    assert (cfg.n_layer, cfg.dim, cfg.n_head, cfg.n_local_heads, cfg.head_dim) == (28, 1024, 16, 8, 128)
    assert (cfg.vocab_size, cfg.codebook_size, cfg.num_codebooks) == (155776, 4096, 10)
    assert cfg.fast_head_dim == 64 and cfg.n_fast_layer == 4 and cfg.scale_codebook_embeddings


def test_s1_mini_preset_is_the_official_config():
    assert S1_MINI == ModelConfig.from_dict(real_config())


def test_round_trip(tmp_path):
    S1_MINI.save(tmp_path / "config.json")
    assert ModelConfig.from_file(tmp_path) == S1_MINI


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "naive"}, "unknown model_type 'naive'"),
        ({"n_layers": 3}, "unknown field(s) n_layers"),
        ({"dim": "1024"}, "'dim' must be int"),
        ({"attention_qk_norm": 1}, "'attention_qk_norm' must be bool"),
        ({"n_local_heads": 5}, "multiple of n_local_heads"),
    ],
)
def test_bad_fields_are_named(change, message):
    data = {**real_config(), **change}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict(data)


def test_missing_field_is_named():
    data = real_config()
    del data["fast_head_dim"]
    with pytest.raises(ConfigError, match="missing field.*fast_head_dim"):
        ModelConfig.from_dict(data)


def test_unreadable_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match="file not found"):
        ModelConfig.from_file(tmp_path / "nope")
