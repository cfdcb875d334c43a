"""A package is trusted only as built: every file against manifest.json (pinned by
FISH_SM_MANIFEST_SHA256), no link or voice path leading out, and a compile cache (pickles)
only from a verified package. Each attack runs on a copy of the session's package."""

import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import subprocess

import pytest
import soundfile as sf
import torch

from server_helpers import free_port, serve_cmd

from fish_sm.errors import CheckpointError, InputError
from fish_sm.serving.mms import handler
from fish_sm.serving.compile_cache import META, build_info
from fish_sm.serving.config import check_model_dir
from fish_sm.serving.runtime import load_model
from fish_sm.package.build import build_package_dir
from fish_sm.settings import Settings
from fish_sm.package.verify import verify_package
from fish_sm.package.voices import load_voices

ENTRY = "fxgraph/ab/fabcdef0123/entry"
PLANTED = f"compile_cache/{ENTRY}"


class Planted:
    """A cache entry whose unpickling creates `marker`: what inductor would run when it loads the entry."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant_compile_cache(model_dir, marker):
    """A compile cache built for this machine (so it would be used), its entry a planted pickle."""
    cache = model_dir / "compile_cache"
    (cache / ENTRY).parent.mkdir(parents=True, exist_ok=True)
    (cache / ENTRY).write_bytes(pickle.dumps(Planted(marker)))
    (cache / META).write_text(json.dumps(build_info(torch.device("cpu"))))


@pytest.fixture(scope="module")
def cached_package(tiny_checkpoint, voice_audio, tmp_path_factory):
    """A package built with a compile cache for this machine, as `fish-sm package --compile-cache` makes it."""
    cache = tmp_path_factory.mktemp("compile-cache")
    (cache / ENTRY).parent.mkdir(parents=True)
    (cache / ENTRY).write_bytes(pickle.dumps({"kernel": "a harmless entry"}))
    (cache / META).write_text(json.dumps(build_info(torch.device("cpu"))))
    out = tmp_path_factory.mktemp("cached-package")
    build_package_dir(tiny_checkpoint, out, voices={"narrator": (voice_audio, "This is the narrator speaking.")},
                      compile_cache=cache)
    return out


def copy_of(src, tmp_path, name="model"):
    return shutil.copytree(src, tmp_path / name)


def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def manifest_sha256(model_dir) -> str:
    return hashlib.sha256((model_dir / "manifest.json").read_bytes()).hexdigest()


@pytest.fixture
def compile_settings(tmp_path, monkeypatch):
    """CPU settings that open the compile cache; inductor's cache variables are put back afterwards."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-before"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-before"))
    return Settings(compile="true", warmup=0, cache_dir=str(tmp_path / "writable"))


def test_the_planted_pickle_really_runs_when_unpickled(tmp_path):
    pickle.loads(pickle.dumps(Planted(tmp_path / "proof")))
    assert (tmp_path / "proof").exists()


def test_pickle_planted_in_compile_cache_is_refused_before_anything_loads(cached_package, tmp_path, compile_settings,
                                                                          monkeypatch):
    model = copy_of(cached_package, tmp_path)
    marker = tmp_path / "marker"
    plant_compile_cache(model, marker)
    with pytest.raises(CheckpointError, match=f"{PLANTED}: [0-9]+ bytes, manifest.json says [0-9]+") as refused:
        load_model(model, "cpu", compile_settings)
    assert "\n" not in str(refused.value)
    # model_fn (the stock container's and MMS's entry) goes through the same check.
    monkeypatch.setattr(handler, "_settings", handler._settings)
    monkeypatch.setenv("FISH_SM_COMPILE", "true")
    monkeypatch.setenv("FISH_SM_CACHE_DIR", compile_settings.cache_dir)
    with pytest.raises(CheckpointError, match=f"{PLANTED}: [0-9]+ bytes"):
        handler.model_fn(str(model))
    # Nothing was copied into the writable cache, so a restarted worker finds nothing either.
    assert not marker.exists() and not list((tmp_path / "writable").rglob("entry"))


def test_pickle_added_to_compile_cache_is_refused(cached_package, tmp_path, compile_settings):
    model = copy_of(cached_package, tmp_path)
    marker = tmp_path / "marker"
    added = model / "compile_cache" / "fxgraph" / "cd" / "f0123" / "entry"
    added.parent.mkdir(parents=True)
    added.write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointError, match="compile_cache/fxgraph/cd/f0123/entry: not in manifest.json"):
        load_model(model, "cpu", compile_settings)
    assert not marker.exists() and not list((tmp_path / "writable").rglob("entry"))


def test_a_rewritten_manifest_is_refused_by_the_pinned_sha256(cached_package, tmp_path, compile_settings):
    """An attacker who also rewrites manifest.json to match the pickle passes the file check; deploy's pin stops it."""
    model = copy_of(cached_package, tmp_path)
    pinned = manifest_sha256(model)
    marker = tmp_path / "marker"
    plant_compile_cache(model, marker)
    manifest = json.loads((model / "manifest.json").read_text())
    for rel in (PLANTED, f"compile_cache/{META}"):
        data = (model / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (model / "manifest.json").write_text(json.dumps(manifest))
    assert verify_package(model)  # self-consistent: without the pin it would be trusted
    settings = dataclasses.replace(compile_settings, manifest_sha256=pinned)
    with pytest.raises(CheckpointError, match="manifest.json: sha256 [0-9a-f]{64} is not FISH_SM_MANIFEST_SHA256"):
        load_model(model, "cpu", settings)
    assert not marker.exists() and not list((tmp_path / "writable").rglob("entry"))


def test_a_verified_package_seeds_the_writable_cache(cached_package, tmp_path, compile_settings):
    _, cache, _ = load_model(cached_package, "cpu", dataclasses.replace(
        compile_settings, manifest_sha256=manifest_sha256(cached_package)))
    assert cache.status.startswith("packaged cache loaded")
    assert pickle.loads((tmp_path / "writable" / "cpu" / ENTRY).read_bytes()) == {"kernel": "a harmless entry"}


def test_plain_checkpoint_dir_never_uses_its_compile_cache(tiny_checkpoint, package_dir, tmp_path, compile_settings,
                                                           caplog):
    model = copy_of(tiny_checkpoint, tmp_path)
    shutil.copytree(package_dir / "voices", model / "voices")  # voices are data: they still load
    marker = tmp_path / "marker"
    plant_compile_cache(model, marker)
    assert verify_package(model) is False
    with caplog.at_level(logging.WARNING, logger="fish_sm.serving"):
        served, cache, _ = load_model(model, "cpu", compile_settings)
    assert cache.status.startswith("packaged cache not used") and cache.status in caplog.text
    assert set(served.voices) == {"narrator"}
    assert not marker.exists() and not list((tmp_path / "writable").rglob("entry"))
    # A pinned manifest sha256 with no manifest to check is refused, not ignored.
    with pytest.raises(CheckpointError, match="no manifest.json, but FISH_SM_MANIFEST_SHA256 is set"):
        verify_package(model, "0" * 64)


@pytest.mark.parametrize("rel", ["voices/narrator/codes.npy", "voices/narrator/transcript.txt", "model.pth"])
def test_a_changed_byte_is_refused_naming_the_file(package_dir, tmp_path, rel):
    model = copy_of(package_dir, tmp_path)
    size = (model / rel).stat().st_size
    flip_byte(model / rel)
    assert (model / rel).stat().st_size == size
    with pytest.raises(CheckpointError, match=f"{rel}: sha256 [0-9a-f]{{64}} differs from manifest.json's"):
        verify_package(model)


def test_load_model_refuses_a_changed_model_pth(package_dir, tmp_path):
    model = copy_of(package_dir, tmp_path)
    flip_byte(model / "model.pth")
    with pytest.raises(CheckpointError, match="model.pth: sha256"):
        load_model(model, "cpu", Settings(warmup=0, cache_dir=str(tmp_path / "writable")))


def test_missing_extra_resized_and_misnamed_files_are_refused(package_dir, tmp_path):
    cases = {}
    missing = copy_of(package_dir, tmp_path, "missing")
    (missing / "voices" / "narrator" / "transcript.txt").unlink()
    cases[missing] = "voices/narrator/transcript.txt: listed in manifest.json but missing"
    extra = copy_of(package_dir, tmp_path, "extra")
    (extra / "code" / "fish_sm" / "sitecustomize.py").write_text("print('hi')\n")
    cases[extra] = "code/fish_sm/sitecustomize.py: not in manifest.json"
    stray_pyc = copy_of(package_dir, tmp_path, "stray-pyc")
    (stray_pyc / "voices" / "narrator" / "x.pyc").write_bytes(b"\0")  # bytecode is ignored only under code/
    cases[stray_pyc] = "voices/narrator/x.pyc: not in manifest.json"
    resized = copy_of(package_dir, tmp_path, "resized")
    with open(resized / "codec.pth", "ab") as f:
        f.write(b"\0")
    cases[resized] = "codec.pth: [0-9]+ bytes, manifest.json says [0-9]+"
    for name, message in (("../outside.txt", "'../outside.txt'"), ("/etc/hostname", "'/etc/hostname'")):
        escaping = copy_of(package_dir, tmp_path, f"escaping-{len(cases)}")
        manifest = json.loads((escaping / "manifest.json").read_text())
        manifest["files"][name] = {"size": 1, "sha256": "0" * 64}
        (escaping / "manifest.json").write_text(json.dumps(manifest))
        cases[escaping] = f"manifest.json lists {message}: not a relative path inside the package"
    for model, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as refused:
            verify_package(model)
        assert "\n" not in str(refused.value)


def test_links_leaving_the_package_are_refused(package_dir, tmp_path):
    model = copy_of(package_dir, tmp_path)
    outside = shutil.copy(model / "voices" / "narrator" / "codes.npy", tmp_path / "codes.npy")  # same bytes
    (model / "voices" / "narrator" / "codes.npy").unlink()
    (model / "voices" / "narrator" / "codes.npy").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"codes.npy: a symlink to .*/codes.npy, outside"):
        verify_package(model)


def test_bytecode_under_code_and_the_right_pin_are_accepted(package_dir, tmp_path):
    model = copy_of(package_dir, tmp_path)
    pycache = model / "code" / "fish_sm" / "__pycache__"
    pycache.mkdir(exist_ok=True)
    (pycache / "handler.cpython-311.pyc").write_bytes(b"\0")  # what the stock container's import writes
    assert verify_package(model, manifest_sha256(model)) is True
    with pytest.raises(CheckpointError, match="not FISH_SM_MANIFEST_SHA256 0{64}"):
        verify_package(model, "0" * 64)


def test_checked_once_per_process_and_again_after_a_change(package_dir, tmp_path, monkeypatch, caplog):
    """The batching server checks the directory, then loads each GPU from it: one hash, not one per step."""
    model = copy_of(package_dir, tmp_path)
    monkeypatch.setenv("FISH_SM_MANIFEST_SHA256", manifest_sha256(model))
    monkeypatch.setenv("FISH_SM_CACHE_DIR", str(tmp_path / "writable"))
    with caplog.at_level(logging.INFO, logger="fish_sm.serving"):
        check_model_dir(model)
        load_model(model, "cpu", Settings.from_env())
    assert sum("verified" in r.getMessage() for r in caplog.records) == 1
    flip_byte(model / "voices" / "narrator" / "codes.npy")  # the same size: found by its stat, then its hash
    with pytest.raises(CheckpointError, match="codes.npy: sha256"):
        check_model_dir(model)


def test_a_started_process_trusts_its_parent_s_token_only_for_the_files_it_verified(package_dir, tmp_path,
                                                                                     monkeypatch):
    """The front end verifies a package and hands its engine cores a token: a core (here, this
    process with its own verifications forgotten) skips the hashing while every file is as it
    was verified under the same pin, and hashes everything again otherwise."""
    from fish_sm.package import verify

    model = copy_of(package_dir, tmp_path)
    pin = manifest_sha256(model)
    assert verify.verified_token(model, pin) is None
    assert verify_package(model, pin)
    token = verify.verified_token(model, pin)
    assert token and verify.verified_token(model, "") is None  # a token is for the pin it was verified under

    hashed = []
    real_sha256 = verify.file_sha256
    monkeypatch.setattr(verify, "file_sha256", lambda path: hashed.append(path.name) or real_sha256(path))

    def as_a_new_process(pinned, given):
        monkeypatch.setattr(verify, "_verified", {})
        hashed.clear()
        return verify_package(model, pinned, token=given)

    assert as_a_new_process(pin, token) and hashed == []
    assert as_a_new_process("", token) and "model.pth" in hashed  # another pin: verified afresh
    assert as_a_new_process(pin, "0" * 64) and "model.pth" in hashed
    flip_byte(model / "voices" / "narrator" / "codes.npy")  # the same size, new times
    with pytest.raises(CheckpointError, match="codes.npy: sha256"):
        as_a_new_process(pin, token)


@pytest.mark.parametrize("field, value", [("transcript", "../../x"), ("transcript", "/etc/hostname"),
                                          ("codes", "../other/codes.npy"), ("codes", "sub/codes.npy")])
def test_voice_json_paths_stay_in_the_voice_directory(tiny_checkpoint, package_dir, tmp_path, field, value):
    """On a plain checkpoint directory, where no manifest protects voice.json."""
    model = copy_of(tiny_checkpoint, tmp_path)
    shutil.copytree(package_dir / "voices", model / "voices")
    voice_json = model / "voices" / "narrator" / "voice.json"
    meta = json.loads(voice_json.read_text())
    voice_json.write_text(json.dumps({**meta, field: value}))
    with pytest.raises(CheckpointError, match=f"voice narrator: {field} '{value}' is not a file name inside "
                                              "voices/narrator/"):
        load_voices(model / "voices", 10)


def test_voice_file_linked_outside_is_refused_and_a_package_refuses_any_voice_edit(tiny_checkpoint, package_dir,
                                                                                   tmp_path):
    model = copy_of(tiny_checkpoint, tmp_path)
    shutil.copytree(package_dir / "voices", model / "voices")
    (tmp_path / "secret.txt").write_text("not for the prompt")
    transcript = model / "voices" / "narrator" / "transcript.txt"
    transcript.unlink()
    transcript.symlink_to(tmp_path / "secret.txt")
    with pytest.raises(CheckpointError, match="voice narrator: transcript 'transcript.txt' is not a file name inside"):
        load_model(model, "cpu", Settings(warmup=0, cache_dir=str(tmp_path / "writable")))
    # In a package, voice.json itself is covered by the manifest.
    packaged = copy_of(package_dir, tmp_path, "package")
    voice_json = packaged / "voices" / "narrator" / "voice.json"
    voice_json.write_text(json.dumps({**json.loads(voice_json.read_text()), "transcript": "../../x"}))
    with pytest.raises(CheckpointError, match="voices/narrator/voice.json: [0-9]+ bytes, manifest.json says"):
        verify_package(packaged)


def test_build_package_dir_refuses_links_out_of_the_checkpoint_and_cache(tiny_checkpoint, tmp_path):
    ckpt = copy_of(tiny_checkpoint, tmp_path, "ckpt")
    shutil.move(ckpt / "model.pth", tmp_path / "blob")
    (ckpt / "model.pth").symlink_to(tmp_path / "blob")  # what a Hugging Face cache snapshot holds
    with pytest.raises(InputError, match=r"model.pth is a symlink to .*blob, outside .*huggingface-cli download "
                                         "--local-dir") as refused:
        build_package_dir(ckpt, tmp_path / "out")
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()

    ckpt = copy_of(tiny_checkpoint, tmp_path, "ckpt2")
    cache = tmp_path / "cache"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / META).write_text(json.dumps(build_info(torch.device("cpu"))))
    (tmp_path / "elsewhere").write_bytes(b"anything")
    (cache / "fxgraph" / "entry").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InputError, match=r"fxgraph/entry is a symlink to .*elsewhere, outside"):
        build_package_dir(ckpt, tmp_path / "out2", compile_cache=cache)
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("server", ["mms", "batching"])
def test_serve_refuses_a_tampered_package_in_one_line(cached_package, package_dir, tmp_path, server):
    model = copy_of(cached_package, tmp_path)
    plant_compile_cache(model, tmp_path / "marker")
    env = {**os.environ, "FISH_SM_CACHE_DIR": str(tmp_path / "writable")}
    out = subprocess.run(serve_cmd(model, free_port(), server), env=env, capture_output=True, text=True, timeout=120)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stdout + out.stderr
    assert lines[0].startswith("Error: ") and f"{PLANTED}: " in lines[0] and "manifest.json says" in lines[0]
    # The untampered package with a wrong pin is refused the same way.
    env["FISH_SM_MANIFEST_SHA256"] = "0" * 64
    out = subprocess.run(serve_cmd(package_dir, free_port(), server), env=env, capture_output=True, text=True,
                         timeout=120)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "is not FISH_SM_MANIFEST_SHA256" in lines[0], lines
    assert not (tmp_path / "marker").exists()


def test_the_untampered_package_still_serves(package_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(handler, "_settings", handler._settings)
    monkeypatch.setenv("FISH_SM_WARMUP", "0")
    monkeypatch.setenv("FISH_SM_CACHE_DIR", str(tmp_path / "writable"))
    monkeypatch.setenv("FISH_SM_MANIFEST_SHA256", manifest_sha256(package_dir))
    model = handler.model_fn(str(package_dir))
    assert model.timings["verify"] >= 0 and set(model.voices) == {"narrator"}
    batch = handler.input_fn(json.dumps({"text": "Still trusted.", "voice": "narrator", "max_new_tokens": 3,
                                         "seed": 1}), "application/json")
    body, content_type = handler.output_fn(handler.predict_fn(batch, model), "audio/wav")
    assert content_type == "audio/wav" and sf.info(io.BytesIO(body)).samplerate == 44100
