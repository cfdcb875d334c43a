"""LoRA adapters in a package: `fish-sm make-adapter` writes fine-tunes as upstream does, `fish-sm
package --adapter` checks and packages them, and verification covers their files and manifest entries."""

import hashlib
import json
import shutil

import pytest
from click.testing import CliRunner

from fish_sm.cli import main
from fish_sm.errors import CheckpointError
from fish_sm.package.extract import extract
from fish_sm.package.verify import verify_package


def run(*args, ok=True):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    assert (result.exit_code == 0) == ok, result.output
    return result.output


@pytest.fixture(scope="module")
def fine_tunes(tiny_checkpoint, tmp_path_factory):
    """Two fine-tunes as upstream's LoRA training and its tools write them: a training checkpoint and a .pth."""
    root = tmp_path_factory.mktemp("fine-tunes")
    run("make-adapter", root / "yasuo.ckpt", "--checkpoint", tiny_checkpoint, "--seed", 1)
    run("make-adapter", root / "ahri.pth", "--checkpoint", tiny_checkpoint, "--seed", 2, "--rank", 4,
        "--format", "pth")
    return root


@pytest.fixture(scope="module")
def package(tiny_checkpoint, fine_tunes, tmp_path_factory, tone, encode_audio):
    """model.tar.gz with both adapters and a voice named like one of them, unpacked as SageMaker does."""
    root = tmp_path_factory.mktemp("adapter-package")
    voice = root / "yasuo.wav"
    voice.write_bytes(encode_audio(tone(1.0, 16000), 16000, "WAV"))
    printed = run("package", tiny_checkpoint, "-o", root / "model.tar.gz",
                  "--adapter", f"yasuo={fine_tunes / 'yasuo.ckpt'}", "--adapter", f"ahri={fine_tunes / 'ahri.pth'}",
                  "--lora-alpha", "ahri=8", "--voice", f"yasuo={voice}:The fine-tuned speaker.")
    assert "adapters: ahri (rank 4), yasuo (rank 8)" in printed.splitlines()[-1]
    (root / "model").mkdir()
    extract(root / "model.tar.gz", root / "model")
    return root / "model"


def test_make_adapter_writes_upstream_layouts(fine_tunes, tiny_checkpoint, tmp_path):
    import torch

    ckpt = torch.load(fine_tunes / "yasuo.ckpt", weights_only=True)
    state = ckpt["state_dict"]
    assert "random" in ckpt["note"]
    assert all(k.startswith("model.") and k.endswith((".lora_A", ".lora_B")) for k in state)
    assert state["model.layers.0.attention.wqkv.lora_A"].shape[0] == 8
    pth = torch.load(fine_tunes / "ahri.pth", weights_only=True)
    assert pth["layers.0.attention.wqkv.lora_A"].shape[0] == 4 and set(k.rpartition(".")[2] for k in pth) == \
        {"lora_A", "lora_B"}
    printed = run("make-adapter", tmp_path / "r.safetensors", "--checkpoint", tiny_checkpoint, "--format",
                  "safetensors")
    assert "random weights, not a fine-tune" in printed
    from fish_sm.model.lora import read_metadata

    assert read_metadata(tmp_path / "r.safetensors") == {"format": "fish-sm-lora", "rank": "8", "alpha": "16.0"}


def test_package_holds_checked_adapters_and_verifies(package, tiny_checkpoint):
    from fish_sm.model.config import ModelConfig
    from fish_sm.model.lora import read_packaged

    manifest = json.loads((package / "manifest.json").read_text())
    assert manifest["adapters"] == {
        "ahri": {"file": "adapters/ahri.safetensors", "rank": 4, "alpha": 8.0,
                 "bytes": (package / "adapters/ahri.safetensors").stat().st_size},
        "yasuo": {"file": "adapters/yasuo.safetensors", "rank": 8, "alpha": 16.0,
                  "bytes": (package / "adapters/yasuo.safetensors").stat().st_size}}
    assert manifest["voices"]["yasuo"]["adapter"] == "yasuo"  # the speaker's voice implies its adapter
    assert manifest["config"] == json.loads((tiny_checkpoint / "config.json").read_text())
    for name in ("ahri", "yasuo"):  # every adapter file is hashed like the rest
        data = (package / f"adapters/{name}.safetensors").read_bytes()
        assert manifest["files"][f"adapters/{name}.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert verify_package(package)
    config = ModelConfig.from_file(package / "config.json")
    served = read_packaged(package / "adapters/ahri.safetensors", "ahri", config)  # as the server reads it
    assert (served.rank, served.alpha) == (4, 8.0)


def test_tampered_adapters_fail_verification(package, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(package, changed)
    data = bytearray((changed / "adapters/yasuo.safetensors").read_bytes())
    data[-1] ^= 1
    (changed / "adapters/yasuo.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"adapters/yasuo.safetensors: sha256 .* differs"):
        verify_package(changed)

    def with_manifest(edit, name):
        copy = tmp_path / name
        shutil.copytree(package, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        return copy

    def elsewhere(m):  # an entry pointing the server at another file of the package
        m["adapters"]["yasuo"]["file"] = "model.pth"

    with pytest.raises(CheckpointError, match="adapter yasuo must be the file adapters/yasuo.safetensors"):
        verify_package(with_manifest(elsewhere, "elsewhere"))

    def unknown_voice_adapter(m):
        m["voices"]["yasuo"]["adapter"] = "nobody"

    with pytest.raises(CheckpointError, match="voice yasuo names adapter 'nobody'"):
        verify_package(with_manifest(unknown_voice_adapter, "voice"))

    def bad_name(m):
        m["adapters"]["../x"] = m["adapters"].pop("ahri")

    with pytest.raises(CheckpointError, match="adapter name"):
        verify_package(with_manifest(bad_name, "name"))
