"""model.pth in every layout upstream accepts, and clear errors for damaged ones."""

import shutil

import pytest
import torch

from fish_sm.errors import CheckpointError
from fish_sm.model.config import ModelConfig
from fish_sm.model.dual_ar import load_dual_ar
from fish_sm.model.tokenizer import Tokenizer
from fish_sm.model.weights import write_safetensors


@pytest.fixture(scope="module")
def parts(tiny_checkpoint):
    config = ModelConfig.from_file(tiny_checkpoint)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    weights = torch.load(tiny_checkpoint / "model.pth", weights_only=True)
    return config, tok, weights


def load(path, parts):
    config, tok, _ = parts
    return load_dual_ar(path, config, tok.semantic_begin_id, tok.im_end_id)


def prefill(model):
    model.setup_caches(1, 64)
    tokens = torch.zeros(1, 11, 12, dtype=torch.long)
    tokens[0, 0] = torch.arange(100, 112)
    with torch.no_grad():
        return model.forward_slow(tokens, torch.arange(12), 12)[0]


@pytest.fixture(scope="module")
def reference_logits(tiny_checkpoint, parts):
    return prefill(load(tiny_checkpoint / "model.pth", parts))


def test_official_layout_is_bf16_with_upstream_names(parts):
    _, _, weights = parts
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "layers.0.attention.wqkv.weight" in weights and "output.weight" in weights
    assert "layers.0.attention.q_norm.weight" in weights and "fast_layers.0.attention.q_norm.weight" not in weights


@pytest.mark.parametrize("layout", ["model_prefix", "lightning", "split_qkv", "audio_keys", "safetensors"])
def test_accepted_layouts_load_identically(tmp_path, parts, reference_logits, layout):
    _, _, weights = parts
    w = dict(weights)
    if layout == "model_prefix":
        w = {"model." + k: v for k, v in w.items()}
    if layout == "lightning":
        w = {"state_dict": {"model." + k: v for k, v in w.items()}}
    if layout == "split_qkv":
        for k in [k for k in w if k.endswith("wqkv.weight")]:
            fast = k.startswith("fast_")
            nh, nkv, hd = (4, 2, 16) if fast else (4, 2, 32)
            wq, wk, wv = w.pop(k).split([nh * hd, nkv * hd, nkv * hd])
            p = k[: -len("wqkv.weight")]
            w[p + "wq.weight"], w[p + "wk.weight"], w[p + "wv.weight"] = wq, wk, wv
    if layout == "audio_keys":
        w["audio_projector.weight"] = torch.zeros(3, 3)
    path = tmp_path / ("model.safetensors" if layout == "safetensors" else "model.pth")
    if layout == "safetensors":
        write_safetensors(w, path)
    else:
        torch.save(w, path)
    torch.testing.assert_close(prefill(load(path, parts)), reference_logits, rtol=0, atol=0)


def test_missing_tensor_is_named(tmp_path, parts):
    w = dict(parts[2])
    del w["layers.1.feed_forward.w3.weight"]
    torch.save(w, tmp_path / "model.pth")
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.1\.feed_forward\.w3\.weight"):
        load(tmp_path / "model.pth", parts)


def test_wrong_shape_is_named(tmp_path, parts):
    w = dict(parts[2])
    w["fast_output.weight"] = torch.zeros(10, 64)
    torch.save(w, tmp_path / "model.pth")
    with pytest.raises(CheckpointError, match=r"fast_output\.weight has shape \(10, 64\), expected \(4096, 64\)"):
        load(tmp_path / "model.pth", parts)


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_truncated_file(tmp_path, tiny_checkpoint, parts, keep):
    data = (tiny_checkpoint / "model.pth").read_bytes()
    (tmp_path / "model.pth").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="cannot read the file"):
        load(tmp_path / "model.pth", parts)


def test_truncated_safetensors(tmp_path, parts):
    write_safetensors(parts[2], tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load(tmp_path / "model.safetensors", parts)


def test_head_is_restricted_to_semantic_tokens_and_im_end(tiny_checkpoint, parts):
    config, tok, weights = parts
    model = load(tiny_checkpoint / "model.pth", parts)
    rows = model.head_rows()
    assert len(rows) == config.codebook_size + 1
    assert rows[0] == tok.semantic_begin_id and rows[-2] == tok.semantic_end_id and rows[-1] == tok.im_end_id
    torch.testing.assert_close(model.head.weight, weights["output.weight"].float()[rows])


def test_checkpoint_directory_has_the_five_files(tiny_checkpoint, tmp_path):
    from fish_sm.model.checkpoint import FILES

    assert sorted(p.name for p in tiny_checkpoint.iterdir()) == sorted(FILES)
    shutil.copytree(tiny_checkpoint, tmp_path / "c")
    (tmp_path / "c" / "model.pth").unlink()
    from fish_sm.engine import Engine

    with pytest.raises(CheckpointError, match="missing model.pth"):
        Engine.from_pretrained(tmp_path / "c")


def test_cache_rows_copy_one_row_prefix_in_every_cache():
    """`cache_rows` views, as a kept prefix is copied into a slot: one `_foreach_copy_`."""
    from fish_sm.model.dual_ar import KVCache, cache_rows

    caches = [KVCache(3, 8, 2, 4, torch.float32) for _ in range(3)]
    for cache in caches:
        cache.k.normal_(), cache.v.normal_()
    before = [(c.k.clone(), c.v.clone()) for c in caches]
    torch._foreach_copy_(cache_rows(caches, 0, 5), cache_rows(caches, 2, 5))
    for cache, (k, v) in zip(caches, before):
        for now, was in ((cache.k, k), (cache.v, v)):
            assert torch.equal(now[0, :, :5], was[2, :, :5])  # the copied prefix
            assert torch.equal(now[0, :, 5:], was[0, :, 5:]) and torch.equal(now[1:], was[1:])  # nothing else
