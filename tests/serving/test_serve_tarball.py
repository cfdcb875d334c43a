"""`fish-sm serve model.tar.gz` refuses a hostile or tampered tarball in one line, before any
server starts, and leaves nothing behind. (Serving a good one, on both servers, is in
test_server.py and test_batching_server.py.)"""

import hashlib
import io
import socket
import tarfile
import tempfile

import pytest
from click.testing import CliRunner

from fish_sm.cli import main
from fish_sm.package import extract
from fish_sm.package.tarball import make_tarball


@pytest.fixture(scope="module")
def good_tarball(package_dir, tmp_path_factory):
    return make_tarball(package_dir, tmp_path_factory.mktemp("good") / "model.tar.gz").path


@pytest.fixture
def private_temp(tmp_path, monkeypatch):
    """This process's temporary directory, to see what an unpacking leaves there."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


@pytest.fixture(scope="module")
def busy_port():
    """A port in use: should a tarball get through by mistake, the server stops there instead of serving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve_refuses(tarball, busy_port, env=None) -> str:
    """The one line `fish-sm serve TARBALL` answers with."""
    result = CliRunner().invoke(main, ["serve", str(tarball), "--port", str(busy_port)], env=env)
    lines = result.output.splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and "Traceback" not in result.output
    return lines[0]


def hostile(package_dir, path, add):
    """A package's first members (its manifest, a directory, its config), then one made by `add(tar)`."""
    with tarfile.open(path, "w:gz") as out:
        for name in ("manifest.json", "voices", "config.json"):
            out.add(package_dir / name, name, recursive=False)
        add(out)
    return path


def file_member(name: str, data: bytes = b"planted\n"):
    def add(tar):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return add


def special_member(name: str, kind: bytes, target: str = ""):
    def add(tar):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, target
        tar.addfile(info)
    return add


HOSTILE = {
    "parent": (file_member("../escaped.txt"), "member '../escaped.txt' is not a relative path inside the package"),
    "inner-parent": (file_member("voices/../../escaped.txt"), "'voices/../../escaped.txt' is not a relative path"),
    "absolute": (file_member("/tmp/escaped.txt"), "member '/tmp/escaped.txt' is not a relative path"),
    "symlink": (special_member("voices/x.txt", tarfile.SYMTYPE, "/etc/passwd"), "'voices/x.txt' is a symlink"),
    "inner-symlink": (special_member("voices/y.txt", tarfile.SYMTYPE, "../config.json"), "is a symlink"),
    "hardlink": (special_member("voices/z.txt", tarfile.LNKTYPE, "config.json"), "'voices/z.txt' is a hard link"),
    "fifo": (special_member("voices/fifo", tarfile.FIFOTYPE), "'voices/fifo' is a device or FIFO"),
    "device": (special_member("voices/null", tarfile.CHRTYPE), "'voices/null' is a device or FIFO"),
    "twice": (file_member("config.json", b"{}"), "member 'config.json' appears twice"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_members_are_refused_and_nothing_is_left(package_dir, tmp_path, private_temp, busy_port, case):
    add, message = HOSTILE[case]
    tarball = hostile(package_dir, tmp_path / "hostile.tar.gz", add)
    line = serve_refuses(tarball, busy_port)
    assert line.startswith(f"Error: {tarball}: ") and message in line
    assert not any(private_temp.iterdir())  # the private directory is gone again
    assert not list(tmp_path.rglob("escaped.txt"))


def test_a_tampered_file_or_a_wrong_pin_is_refused(package_dir, good_tarball, tmp_path, private_temp, busy_port):
    with tarfile.open(good_tarball) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    codes = tmp_path / "unpacked" / "voices" / "narrator" / "codes.npy"
    data = bytearray(codes.read_bytes())
    data[-1] ^= 0xFF
    codes.write_bytes(bytes(data))
    tampered = make_tarball(tmp_path / "unpacked", tmp_path / "tampered.tar.gz", compresslevel=0).path
    line = serve_refuses(tampered, busy_port)
    assert "voices/narrator/codes.npy: sha256 " in line and "differs from manifest.json's" in line
    line = serve_refuses(good_tarball, busy_port, env={"FISH_SM_MANIFEST_SHA256": "0" * 64})
    assert "manifest.json: sha256 " in line and "is not FISH_SM_MANIFEST_SHA256" in line
    assert not any(private_temp.iterdir())
    # The right pin lets it through to the server, which stops at the port in use.
    pin = hashlib.sha256((package_dir / "manifest.json").read_bytes()).hexdigest()
    result = CliRunner().invoke(main, ["serve", str(good_tarball), "--port", str(busy_port)],
                                env={"FISH_SM_MANIFEST_SHA256": pin})
    assert result.exit_code == 1 and "unpacked and verified" in result.output
    assert result.output.splitlines()[-1] == f"Error: cannot listen on 127.0.0.1:{busy_port}: address already in use"
    assert not any(private_temp.iterdir())


def test_what_is_not_a_package_tarball_is_refused(tiny_checkpoint, good_tarball, tmp_path, private_temp, busy_port):
    plain = make_tarball(tiny_checkpoint, tmp_path / "checkpoint.tar.gz").path
    assert "no manifest.json in it" in serve_refuses(plain, busy_port)
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good_tarball.read_bytes()[: good_tarball.stat().st_size // 2])
    assert "not a readable tar archive" in serve_refuses(cut, busy_port)
    text = tmp_path / "notes.tar.gz"
    text.write_text("not an archive\n")
    assert "not a readable tar archive" in serve_refuses(text, busy_port)
    assert not any(private_temp.iterdir())


def test_size_limits(good_tarball, tmp_path, private_temp, busy_port, monkeypatch):
    limit = extract.MAX_TOTAL_BYTES
    monkeypatch.setattr(extract, "MAX_TOTAL_BYTES", 1024**2)
    assert "over 0.000976562 GiB unpacked; not a model package" in serve_refuses(good_tarball, busy_port)
    monkeypatch.setattr(extract, "MAX_TOTAL_BYTES", limit)
    monkeypatch.setattr(extract, "FREE_SPACE_MARGIN", 1 << 60)  # as if the disk were full
    assert "does not fit in the" in serve_refuses(good_tarball, busy_port)
    monkeypatch.setattr(extract, "FREE_SPACE_MARGIN", 0)
    monkeypatch.setattr(extract, "MAX_MEMBERS", 3)
    assert "more than 3 members" in serve_refuses(good_tarball, busy_port)
    assert not any(private_temp.iterdir())
