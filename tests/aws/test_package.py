"""model.tar.gz: reproducible bytes, the layout inside, --voice parsing, and the package command's wiring."""

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from fish_sm.cli import main
from fish_sm.cli.package_inputs import is_package_dir, parse_voice_spec, parse_voice_specs
from fish_sm.errors import InputError
from fish_sm.package.tarball import make_tarball


def make_package_dir(root: Path, weights: bytes = b"\x01" * 1000) -> Path:
    """A hand-made directory in the package layout the handler reads."""
    files = {
        "config.json": b'{"preset": "tiny"}',
        "model.pth": weights,
        "codec.pth": b"\x02" * 500,
        "tokenizer.tiktoken": b"aGVsbG8= 0\n",
        "special_tokens.json": b"{}",
        "code/inference.py": b"def model_fn(model_dir):\n    return model_dir\n",
        "code/requirements.txt": b"soundfile\n",
        "voices/alice/transcript.txt": b"Hello there.",
        "voices/alice/voice.json": b'{"id": "alice"}',
        "voices/alice/reference.wav": b"RIFF....WAVE",
        "compile_cache/blob.bin": b"\x00" * 64,
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    listed = {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in files.items()}
    (root / "manifest.json").write_text(json.dumps({"files": listed}))
    return root


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tarball_is_reproducible_and_normalised(tmp_path):
    a = make_package_dir(tmp_path / "a")
    b = make_package_dir(tmp_path / "b")
    # Different mtimes, permissions and creation order must not change a byte.
    for i, p in enumerate(sorted(b.rglob("*"))):
        os.utime(p, (1_000_000 + i, 2_000_000 + i))
    (b / "code" / "inference.py").chmod(0o600)
    (b / "config.json").chmod(0o664)

    ta = make_tarball(a, tmp_path / "out1" / "model.tar.gz", progress=False)
    tb = make_tarball(b, tmp_path / "out2" / "other-name.tar.gz", progress=False)
    assert ta.sha256 == tb.sha256 == sha(ta.path) == sha(tb.path)
    assert ta.size == ta.path.stat().st_size and ta.files == 12

    raw = ta.path.read_bytes()
    assert raw[:2] == b"\x1f\x8b" and raw[4:8] == b"\x00\x00\x00\x00"  # gzip mtime 0
    assert raw[3] & 0x08 == 0  # FNAME flag unset: the output's name is not in the header
    with tarfile.open(ta.path) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names[0] == "manifest.json" and names[1:] == sorted(names[1:], key=str.encode)
        assert "config.json" in names and "code/inference.py" in names and "voices/alice/voice.json" in names
        assert not any(n.startswith(("./", "/")) for n in names)
        assert {m.mtime for m in members} == {0}
        assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}
        assert {m.mode for m in members if m.isfile()} == {0o644}
        assert {m.mode for m in members if m.isdir()} == {0o755}
        assert tar.extractfile("model.pth").read() == b"\x01" * 1000

    # Changing one byte of content changes the hash.
    (a / "model.pth").write_bytes(b"\x01" * 999 + b"\x02")
    assert make_tarball(a, tmp_path / "out3.tar.gz", progress=False).sha256 != ta.sha256


def test_tarball_follows_links_skips_its_own_output_and_keeps_exec_bits(tmp_path):
    src = make_package_dir(tmp_path / "pkg")
    (src / "code" / "run.sh").write_text("#!/bin/sh\n")
    (src / "code" / "run.sh").chmod(0o755)
    (tmp_path / "outside.bin").write_bytes(b"outside content")
    (src / "voices" / "linked.bin").symlink_to(tmp_path / "outside.bin")
    with pytest.raises(InputError, match="linked.bin: a symlink to .*outside.bin, outside"):
        make_tarball(src, tmp_path / "refused.tar.gz", progress=False)  # a link never ships what lies outside
    (src / "voices" / "linked.bin").unlink()
    (src / "linked content.bin").write_bytes(b"linked content")
    (src / "voices" / "linked.bin").symlink_to(src / "linked content.bin")
    out = make_tarball(src, src / "model.tar.gz", progress=False)  # written inside the directory it archives
    with tarfile.open(out.path) as tar:
        names = tar.getnames()
        assert "model.tar.gz" not in names and "model.tar.gz.partial" not in names
        assert tar.getmember("code/run.sh").mode == 0o755
        link = tar.getmember("voices/linked.bin")
        assert link.isfile() and tar.extractfile(link).read() == b"linked content"


def test_tarball_rejects_bad_input(tmp_path):
    with pytest.raises(InputError, match="not a directory"):
        make_tarball(tmp_path / "missing", tmp_path / "x.tar.gz", progress=False)
    src = make_package_dir(tmp_path / "pkg")
    (src / "voices" / "loop").symlink_to(src)
    with pytest.raises(InputError, match="archived already"):
        make_tarball(src, tmp_path / "x.tar.gz", progress=False)


def test_voice_specs(tmp_path):
    audio = tmp_path / "alice.wav"
    audio.write_bytes(b"RIFF")
    assert parse_voice_spec(f"alice={audio}:Hello: it's me.") == ("alice", audio, "Hello: it's me.")
    (tmp_path / "t.txt").write_text("  From a file.\n")
    assert parse_voice_spec(f"a-1={audio}:@{tmp_path / 't.txt'}")[2] == "From a file."
    (tmp_path / "alice.lab").write_text("Sidecar transcript.")
    assert parse_voice_spec(f"alice={audio}")[2] == "Sidecar transcript."
    voices = parse_voice_specs([f"alice={audio}:One.", f"bob={audio}:Two."])
    assert voices == {"alice": (audio, "One."), "bob": (audio, "Two.")}

    bad = {
        "alice": "ID=AUDIO",
        f"={audio}:x": "ID=AUDIO",
        f"bad id={audio}:x": "voice id",
        f"alice={tmp_path / 'nope.wav'}:x": "audio file not found",
        f"alice={audio}:@{tmp_path / 'nope.txt'}": "transcript file not found",
        f"alice={audio}:   ": "empty",
        f"alice={tmp_path / 't.txt'}:x": "not an audio file",
    }
    for spec, message in bad.items():
        with pytest.raises(InputError, match=message):
            parse_voice_spec(spec)
    (tmp_path / "alice.lab").unlink()
    with pytest.raises(InputError, match="no transcript"):
        parse_voice_spec(f"alice={audio}")
    with pytest.raises(InputError, match="twice"):
        parse_voice_specs([f"alice={audio}:One.", f"alice={audio}:Two."])


def test_package_command_archives_a_built_package_dir(tmp_path):
    src = make_package_dir(tmp_path / "pkg")
    assert is_package_dir(src) and not is_package_dir(tmp_path)
    out = tmp_path / "dist" / "model.tar.gz"
    result = CliRunner().invoke(main, ["package", str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"sha256 {sha(out)}" in result.output and "12 files" in result.output
    audio = tmp_path / "y.wav"
    audio.write_bytes(b"RIFF")
    result = CliRunner().invoke(main, ["package", str(src), "-o", str(out), "--voice", f"x={audio}:z"])
    assert result.exit_code != 0 and "only when packaging a checkpoint" in result.output


def test_package_command_builds_through_build_package_dir(tmp_path, monkeypatch):
    """The command's wiring to the serving side: parsed voices and the cache go to build_package_dir."""
    calls = []

    def build_package_dir(checkpoint_dir, out_dir, voices, compile_cache=None, progress=None, vendor_wheels=None):
        calls.append((checkpoint_dir, out_dir, voices, compile_cache, vendor_wheels))
        progress("hashing model.pth", 10, 10)  # below the size that earns a bar: silent
        make_package_dir(out_dir)
        return {"files": {}}

    fake = types.ModuleType("fish_sm.package.build")
    fake.build_package_dir = build_package_dir
    monkeypatch.setitem(sys.modules, "fish_sm.package.build", fake)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    audio = tmp_path / "alice.flac"
    audio.write_bytes(b"fLaC")
    cache = tmp_path / "cache"
    cache.mkdir()
    out = tmp_path / "dist" / "model.tar.gz"
    result = CliRunner().invoke(main, ["package", str(ckpt), "-o", str(out), "--voice", f"alice={audio}:Hi there.",
                                       "--compile-cache", str(cache)])
    assert result.exit_code == 0, result.output
    (got_ckpt, got_out, got_voices, got_cache, got_wheels), = calls
    assert got_ckpt == ckpt and got_voices == {"alice": (audio, "Hi there.")} and got_cache == cache
    assert got_wheels is None  # no --stock-container: the package keeps code/requirements.txt
    assert got_out.parent.parent == out.parent  # built next to the output, then removed
    assert not got_out.exists() and sorted(p.name for p in out.parent.iterdir()) == ["model.tar.gz"]
    assert "voices: alice" in result.output
    with tarfile.open(out) as tar:
        assert "manifest.json" in tar.getnames()


def test_package_command_bad_voice_is_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for spec, message in [("alice", "ID=AUDIO"), (f"alice={tmp_path / 'missing.wav'}:Hi", "audio file not found")]:
        result = CliRunner().invoke(main, ["package", str(ckpt), "-o", str(tmp_path / "m.tar.gz"), "--voice", spec])
        assert result.exit_code == 1 and "Traceback" not in result.output
        last = result.output.strip().splitlines()
        assert len(last) == 1 and last[0].startswith("Error:") and message in last[0], result.output


def test_gzip_stream_decompresses_to_a_valid_tar(tmp_path):
    src = make_package_dir(tmp_path / "pkg")
    t = make_tarball(src, tmp_path / "m.tar.gz", compresslevel=9, progress=False)
    data = gzip.decompress(t.path.read_bytes())
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert len([m for m in tar.getmembers() if m.isfile()]) == 12


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """The tiny random checkpoint in the official formats, written by the CLI."""
    path = tmp_path_factory.mktemp("tiny-package") / "ckpt"
    result = CliRunner().invoke(main, ["make-checkpoint", str(path), "--preset", "tiny", "--seed", "0"])
    assert result.exit_code == 0, result.output
    return path


def test_package_a_real_checkpoint_is_reproducible_and_complete(tiny_ckpt, tmp_path):
    import json

    import numpy as np
    import soundfile as sf

    audio = tmp_path / "alice.flac"
    t = np.arange(24000) / 24000
    sf.write(audio, (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 24000)
    (tmp_path / "alice.txt").write_text("A short reference sentence.")
    outs = []
    for run in ("a", "b"):
        out = tmp_path / run / "model.tar.gz"
        result = CliRunner().invoke(main, ["package", str(tiny_ckpt), "-o", str(out), "--voice", f"alice={audio}"])
        assert result.exit_code == 0, result.output
        outs.append(out)
        assert sorted(p.name for p in out.parent.iterdir()) == ["model.tar.gz"]  # the build dir is gone
    assert sha(outs[0]) == sha(outs[1])
    with tarfile.open(outs[0]) as tar:
        names = set(tar.getnames())
        for name in ("config.json", "model.pth", "codec.pth", "tokenizer.tiktoken", "special_tokens.json",
                     "code/inference.py", "code/requirements.txt", "voices/alice/transcript.txt", "manifest.json"):
            assert name in names, name
        manifest = json.loads(tar.extractfile("manifest.json").read())
        assert "alice" in manifest["voices"]
        for rel, entry in manifest["files"].items():  # every file, as the manifest hashed it
            assert hashlib.sha256(tar.extractfile(rel).read()).hexdigest() == entry["sha256"], rel
        assert tar.extractfile("voices/alice/transcript.txt").read().decode().strip() == "A short reference sentence."


def test_package_bad_checkpoints_are_one_line(tiny_ckpt, tmp_path):
    import shutil

    import torch

    cases = {}
    missing = shutil.copytree(tiny_ckpt, tmp_path / "missing")
    (missing / "codec.pth").unlink()
    cases[missing] = "missing codec.pth"
    truncated = shutil.copytree(tiny_ckpt, tmp_path / "truncated")
    data = (truncated / "model.pth").read_bytes()
    (truncated / "model.pth").write_bytes(data[: len(data) // 2])
    cases[truncated] = "model.pth: cannot read the file"
    reshaped = shutil.copytree(tiny_ckpt, tmp_path / "reshaped")
    state = torch.load(reshaped / "model.pth")
    name = next(iter(state))
    state[name] = torch.zeros(3, 3)
    torch.save(state, reshaped / "model.pth")
    cases[reshaped] = f"tensor {name} has shape (3, 3)"
    for ckpt, message in cases.items():
        out = tmp_path / "out" / f"{ckpt.name}.tar.gz"
        result = CliRunner().invoke(main, ["package", str(ckpt), "-o", str(out)])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        line, = result.output.strip().splitlines()
        assert line.startswith("Error:") and message in line, line
        assert not out.exists() and list(out.parent.iterdir()) == []  # no tarball, no leftover build dir


def test_file_progress_shows_a_bar_only_for_large_files(capsys):
    from fish_sm.cli.progress import FileProgress

    with FileProgress(min_bytes=100) as progress:
        progress("hashing code/inference.py", 10, 10)  # small: no bar
        for done in (40, 80, 120):
            progress("hashing model.pth", done, 120)
        progress("hashing codec.pth", 50, 200)  # left open: closed by the with block
    err = capsys.readouterr().err
    assert "hashing model.pth" in err and "hashing codec.pth" in err and "inference.py" not in err


def test_stock_wheels_pins_satisfy_the_stock_requirements():
    """The vendored pins and code/requirements.txt (the unvendored path) describe one dependency set."""
    from packaging.requirements import Requirement

    from fish_sm.package.build import STOCK_REQUIREMENTS
    from fish_sm.package.vendor import STOCK_WHEELS

    ranges = {r.name: r.specifier for r in map(Requirement, _requirement_lines(STOCK_REQUIREMENTS.read_text()))}
    pins = {r.name: next(iter(r.specifier)).version for r in map(Requirement, STOCK_WHEELS)}
    assert all(str(next(iter(Requirement(p).specifier))).startswith("==") for p in STOCK_WHEELS)
    for name, version in pins.items():
        assert name not in ranges or ranges[name].contains(version), (name, version, ranges[name])
    # numpy is the image's own; click only the CLI imports (the stock container test hides it).
    assert set(ranges) - set(pins) == {"numpy", "click"}


def _requirement_lines(text: str) -> list[str]:
    return [ln.split("#")[0].strip() for ln in text.splitlines() if ln.split("#")[0].strip()]


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_unpack_wheels_installs_libraries_and_refuses_escapes(tmp_path):
    from fish_sm.package.vendor import unpack_wheels

    wheel = _wheel(tmp_path / "demo-1.0-py3-none-any.whl", {
        "demo/__init__.py": b"VALUE = 1\n",
        "demo/__pycache__/__init__.cpython-311.pyc": b"\x00",
        "demo-1.0.dist-info/METADATA": b"Name: demo\nVersion: 1.0\n",
        "demo-1.0.data/platlib/_demo_native.py": b"NATIVE = 2\n",
        "demo-1.0.data/scripts/demo-cli": b"#!/bin/sh\n",
    })
    lib = tmp_path / "lib"
    assert unpack_wheels([wheel], lib) == [wheel.name]
    assert sorted(str(p.relative_to(lib)) for p in lib.rglob("*") if p.is_file()) == [
        "_demo_native.py", "demo-1.0.dist-info/METADATA", "demo/__init__.py"]
    evil = _wheel(tmp_path / "evil-1.0-py3-none-any.whl", {"../outside.py": b"x = 1\n"})
    with pytest.raises(InputError, match="outside code/lib"):
        unpack_wheels([evil], tmp_path / "lib2")
    assert not (tmp_path / "outside.py").exists()


def test_package_stock_container_option_errors_are_one_line(tmp_path):
    src = make_package_dir(tmp_path / "pkg")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cases = [
        (["package", str(ckpt), "--wheels", str(wheels)], 2, "--wheels applies only with --stock-container"),
        (["package", str(src), "--stock-container"], 2, "--stock-container apply only when packaging a checkpoint"),
        (["package", str(ckpt), "--stock-container", "--wheels", str(wheels)], 1, "no wheel for soundfile=="),
    ]
    for args, code, message in cases:
        result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "out" / "m.tar.gz")])
        assert result.exit_code == code and "Traceback" not in result.output, result.output
        assert message in result.output, result.output
        if code == 1:
            line, = result.output.strip().splitlines()
            assert line.startswith("Error:"), line
    assert not (tmp_path / "out" / "m.tar.gz").exists()


@pytest.fixture(scope="module")
def local_wheels(tmp_path_factory):
    """The pinned wheels for this machine's Python and platform, from pip's configured index."""
    from fish_sm.package.vendor import download_wheels

    path = tmp_path_factory.mktemp("wheels")
    download_wheels(path, python_version="{}.{}".format(*sys.version_info[:2]), platform=None)
    return path


@pytest.mark.integration
def test_package_stock_container_vendors_the_wheels(tiny_ckpt, local_wheels, tmp_path):
    out = tmp_path / "model.tar.gz"
    result = CliRunner().invoke(main, ["package", str(tiny_ckpt), "-o", str(out), "--stock-container",
                                       "--wheels", str(local_wheels)])
    assert result.exit_code == 0, result.output
    assert "vendored for the stock container: 4 wheels" in result.output
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        manifest = json.loads(tar.extractfile("manifest.json").read())
        assert "code/requirements.txt" not in names and "code/inference.py" in names
        lib = {n for n in names if n.startswith("code/lib/") and tar.getmember(n).isfile()}
        assert {"code/lib/soundfile.py", "code/lib/tiktoken/core.py", "code/lib/regex/__init__.py",
                "code/lib/torchao/__init__.py"} <= lib
        assert lib <= set(manifest["files"])
        for rel in sorted(lib)[:50]:
            assert hashlib.sha256(tar.extractfile(rel).read()).hexdigest() == manifest["files"][rel]["sha256"], rel
    assert len(manifest["vendored"]) == 4


@pytest.mark.integration
def test_package_stock_container_without_an_index_is_one_line(tiny_ckpt, tmp_path):
    """Downloading needs an index; without one the command says so, and how to give wheels instead."""
    out = tmp_path / "model.tar.gz"
    env = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
    result = CliRunner().invoke(main, ["package", str(tiny_ckpt), "-o", str(out), "--stock-container"], env=env)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: pip download of the stock container's wheels failed") and "--wheels DIR" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []
