"""Reading LoRA adapters: upstream's files at package time, our packaged form at serve time;
every bad file refused with one line that names what is wrong, nothing unpickled."""

import pickle

import pytest
import torch

from fish_sm.errors import AdapterError
from fish_sm.model.config import ModelConfig
from fish_sm.model.lora import (DEFAULT_ALPHA, random_adapter, read_fine_tune, read_packaged, targets,
                                write_packaged)
from fish_sm.model.weights import write_safetensors


@pytest.fixture(scope="module")
def config(tiny_checkpoint):
    return ModelConfig.from_file(tiny_checkpoint)


@pytest.fixture(scope="module")
def adapter(config):
    return random_adapter(config, "yasuo", rank=4, seed=2)


def upstream_state(adapter) -> dict:
    """As upstream's LoRA training saves it: a Lightning checkpoint of only the LoRA tensors."""
    tensors = {}
    for target, (a, b) in adapter.pairs.items():
        tensors[f"model.{target}.lora_A"], tensors[f"model.{target}.lora_B"] = a, b
    return {"state_dict": tensors}


def test_every_module_upstream_adapts_is_a_target(config):
    names = set(targets(config))
    assert {"embeddings", "codebook_embeddings", "fast_embeddings", "output", "fast_output"} <= names
    for stack, n in (("layers", config.n_layer), ("fast_layers", config.n_fast_layer)):
        for i in range(n):
            for linear in ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
                assert f"{stack}.{i}.{linear}" in names
    assert len(names) == 5 + 5 * (config.n_layer + config.n_fast_layer)


@pytest.mark.parametrize("suffix", [".ckpt", ".pth", ".safetensors"])
def test_upstreams_files_read_and_package_to_the_same_adapter(tmp_path, config, adapter, suffix):
    path = tmp_path / f"lora{suffix}"
    if suffix == ".safetensors":
        write_safetensors({k[len("model."):]: v for k, v in upstream_state(adapter)["state_dict"].items()}, path)
    else:
        torch.save(upstream_state(adapter) if suffix == ".ckpt" else upstream_state(adapter)["state_dict"], path)
    read = read_fine_tune(path, "yasuo", config, alpha=8.0)
    assert (read.rank, read.alpha) == (4, 8.0) and read.pairs.keys() == adapter.pairs.keys()
    assert all(torch.equal(read.pairs[t][0], adapter.pairs[t][0]) for t in adapter.pairs)
    packaged = tmp_path / "yasuo.safetensors"
    write_packaged(read, packaged, dtype=torch.float32)
    served = read_packaged(packaged, "yasuo", config)
    assert (served.rank, served.alpha) == (4, 8.0)
    assert all(torch.equal(served.pairs[t][1], adapter.pairs[t][1]) for t in adapter.pairs)
    assert read_fine_tune(packaged, "again", config).alpha == 8.0  # the packaged form keeps its alpha
    assert read_fine_tune(path, "default", config).alpha == DEFAULT_ALPHA


def bad_files(tmp_path, adapter, config):
    """(file, what the one-line error must say) for each way an adapter file can be wrong."""
    state = upstream_state(adapter)["state_dict"]
    cases = []

    def saved(name, tensors):
        torch.save({"state_dict": tensors}, tmp_path / name)
        return tmp_path / name

    wrong_shape = dict(state)
    wrong_shape["model.layers.0.attention.wo.lora_B"] = torch.zeros(7, 4)
    cases.append((saved("shape.ckpt", wrong_shape), "layers.0.attention.wo.lora_B has shape (7, 4)"))
    wrong_name = dict(state)
    wrong_name["model.layers.0.attention.wk.lora_A"] = torch.zeros(4, config.dim)
    cases.append((saved("name.ckpt", wrong_name), "layers.0.attention.wk.lora_A is not a LoRA tensor of this model"))
    unpaired = {k: v for k, v in state.items() if k != "model.layers.1.feed_forward.w2.lora_B"}
    cases.append((saved("unpaired.ckpt", unpaired), "has no layers.1.feed_forward.w2.lora_B"))
    mixed = {**state, "model.layers.0.attention.wo.weight": torch.zeros(config.dim, config.dim)}
    cases.append((saved("mixed.ckpt", mixed), "is not a LoRA tensor"))
    merged = saved("merged.ckpt", {"model.layers.0.attention.wo.weight": torch.zeros(config.dim, config.dim)})
    cases.append((merged, "merged fine-tune is a full model"))
    nan = dict(state)
    nan["model.output.lora_A"] = torch.full_like(state["model.output.lora_A"], float("nan"))
    cases.append((saved("nan.ckpt", nan), "output.lora_A holds NaN"))
    return cases


class Planted:
    """Unpickling this would run `touch` on a file: the weights-only loader must refuse it."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.target}",)


def test_bad_fine_tunes_are_refused_with_one_line_naming_the_problem(tmp_path, config, adapter):
    for path, says in bad_files(tmp_path, adapter, config):
        with pytest.raises(AdapterError) as info:
            read_fine_tune(path, "bad", config)
        assert says in str(info.value) and "\n" not in str(info.value), (path.name, str(info.value))
    ran = tmp_path / "ran"
    with open(tmp_path / "pickle.pth", "wb") as f:
        pickle.dump({"state_dict": {"x": Planted(ran)}}, f)
    with pytest.raises(AdapterError, match="cannot read the file") as info:  # a bare pickle: not torch's format
        read_fine_tune(tmp_path / "pickle.pth", "bad", config)
    assert "\n" not in str(info.value) and not ran.exists()
    torch.save({"state_dict": upstream_state(adapter)["state_dict"], "extra": Planted(ran)}, tmp_path / "ckpt.pth")
    with pytest.raises(AdapterError, match="holds Python objects .*system.*not read") as info:
        read_fine_tune(tmp_path / "ckpt.pth", "bad", config)
    assert "\n" not in str(info.value) and not ran.exists()
    with pytest.raises(AdapterError, match="adapter name"):
        read_fine_tune(tmp_path / "ckpt.pth", "../escape", config)


def test_serving_reads_only_our_safetensors(tmp_path, config, adapter):
    torch.save(upstream_state(adapter), tmp_path / "a.safetensors")  # a pickle wearing the suffix
    with pytest.raises(AdapterError, match="torch pickle"):
        read_packaged(tmp_path / "a.safetensors", "a", config)
    torch.save(upstream_state(adapter), tmp_path / "a.pth")
    with pytest.raises(AdapterError, match="safetensors file written by fish-sm package"):
        read_packaged(tmp_path / "a.pth", "a", config)
    write_safetensors({k[len("model."):]: v for k, v in upstream_state(adapter)["state_dict"].items()},
                      tmp_path / "plain.safetensors")
    with pytest.raises(AdapterError, match="not a fish-sm adapter"):
        read_packaged(tmp_path / "plain.safetensors", "plain", config)
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(AdapterError, match="truncated"):
        read_packaged(tmp_path / "short.safetensors", "short", config)
    other = ModelConfig.from_dict({**config.to_dict(), "dim": config.dim * 2, "n_head": config.n_head,
                                   "head_dim": config.head_dim * 2})
    write_packaged(adapter, tmp_path / "yasuo.safetensors")
    with pytest.raises(AdapterError, match="has shape"):
        read_packaged(tmp_path / "yasuo.safetensors", "yasuo", other)
