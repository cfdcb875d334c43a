"""The CLI's adapter options: bad fine-tunes refused by `package --adapter` in one line with nothing
left behind (a pickle that would run code is never run), `invoke --adapter` and `bench --adapters N`
against a small server on loopback that records what it is sent."""

import io
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import soundfile as sf
import torch
from click.testing import CliRunner

from fish_sm.cli import main
from fish_sm.model.config import ModelConfig
from fish_sm.model.lora import random_adapter


def run(*args, ok=True):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    if ok:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines()[-1].startswith("Error: "), result.output
    return result.output


def lora_tensors(checkpoint, **edits):
    """Upstream-named LoRA tensors of a random rank-8 adapter for the checkpoint's model."""
    adapter = random_adapter(ModelConfig.from_file(checkpoint / "config.json"), "x", 8)
    tensors = {}
    for target, (a, b) in adapter.pairs.items():
        tensors[f"{target}.lora_A"], tensors[f"{target}.lora_B"] = a, b
    tensors.update(edits)
    return tensors


class Evil:
    """Unpickled, it would run a shell command: a pickle's GLOBAL of os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_bad_adapters_are_one_line_and_leave_nothing(tiny_checkpoint, tmp_path):
    good = tmp_path / "good.pth"
    torch.save(lora_tensors(tiny_checkpoint), good)
    wrong_shape = tmp_path / "wrong_shape.pth"
    torch.save(lora_tensors(tiny_checkpoint, **{"layers.0.attention.wqkv.lora_A": torch.zeros(8, 3)}), wrong_shape)
    wrong_name = tmp_path / "wrong_name.pth"
    torch.save(lora_tensors(tiny_checkpoint, **{"layers.0.attention.nope.lora_A": torch.zeros(8, 3)}), wrong_name)
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": lora_tensors(tiny_checkpoint), "callback": Evil(marker)}, evil)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cases = [
        (wrong_shape, "tensor layers.0.attention.wqkv.lora_A has shape (8, 3), expected"),
        (wrong_name, "tensor layers.0.attention.nope.lora_A is not a LoRA tensor of this model"),
        (evil, "system"),  # the GLOBAL refused is named
        (tiny_checkpoint / "model.pth", "holds no LoRA tensors but model weights"),  # a merged fine-tune
    ]
    for path, message in cases:
        printed = run("package", tiny_checkpoint, "-o", out_dir / "model.tar.gz", "--adapter", f"good={good}",
                      "--adapter", f"bad={path}", ok=False)
        last = printed.strip().splitlines()[-1]
        assert message in last and str(path) in last, last
        assert list(out_dir.iterdir()) == [], path  # no tarball, no .partial, no package directory
    assert not marker.exists()  # the pickle's command never ran

    for args, message in [
        (["--adapter", "../up=" + str(good)], 'adapter name "../up"'),
        (["--adapter", f"a={tmp_path / 'missing.pth'}"], "--adapter a: file not found"),
        (["--adapter", f"a={good}", "--adapter", f"a={good}"], "--adapter a is given twice"),
        (["--adapter", f"a={good}", "--lora-alpha", "b=8"], "--lora-alpha b: no --adapter b=PATH"),
        (["--adapter", f"a={good}", "--lora-alpha", "a=-1"], "--lora-alpha a: alpha must be a positive number"),
    ]:
        assert message in run("package", tiny_checkpoint, "-o", out_dir / "model.tar.gz", *args, ok=False)
    assert list(out_dir.iterdir()) == []


class Recorder(BaseHTTPRequestHandler):
    """The container contract in miniature: every body recorded, a short WAV back."""

    protocol_version = "HTTP/1.1"
    bodies: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/ping" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        Recorder.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        buf = io.BytesIO()
        sf.write(buf, np.zeros(1600, np.float32), 16000, format="WAV", subtype="PCM_16")
        self.send_response(200)
        self.send_header("Content-Type", "audio/wav")
        self.send_header("Content-Length", str(len(buf.getvalue())))
        self.end_headers()
        self.wfile.write(buf.getvalue())


@pytest.fixture(scope="module")
def recorder_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_invoke_sends_the_adapter(recorder_url, tmp_path):
    Recorder.bodies.clear()
    run("invoke", "--url", recorder_url, "Hello.", "--adapter", "yasuo", "-o", tmp_path / "a.wav")
    assert Recorder.bodies == [{"text": "Hello.", "adapter": "yasuo", "format": "wav"}]
    assert "adapter name" in run("invoke", "--url", recorder_url, "Hello.", "--adapter", "a/b", ok=False)
    assert len(Recorder.bodies) == 1  # a bad name is refused before anything is sent


def test_bench_spreads_requests_over_adapters(recorder_url, tmp_path):
    Recorder.bodies.clear()
    texts = tmp_path / "texts.txt"
    texts.write_text("One.\nTwo.\nThree.\n")
    printed = run("bench", "--url", recorder_url, "--adapters", 2, "--adapter-names", "a,b,c", "--texts", texts,
                  "--requests", 5, "--concurrency", 1, "--warmup", 0, "-o", tmp_path / "report")
    assert "requests spread over 2 adapter(s): a, b" in printed
    assert [b["adapter"] for b in Recorder.bodies] == ["a", "b", "a", "b", "a"]
    assert [b["text"] for b in Recorder.bodies] == ["One.", "Two.", "Three.", "One.", "Two."]
    report = json.loads((tmp_path / "report" / "bench.json").read_text())
    assert report["settings"]["adapters"] == 2 and report["settings"]["adapter_names"] == ["a", "b"]

    assert run("bench", "--url", recorder_url, "--adapters", 4, "--adapter-names", "a,b", ok=False).strip() \
        .endswith("--adapters 4: --adapter-names has only 2 adapter(s) (a, b)")
    assert "--adapters with --url needs the names" in run("bench", "--url", recorder_url, "--adapters", 2, ok=False)


def test_bench_local_counts_the_package_adapters_before_starting_it(tmp_path):
    """Too few adapters in a --local package is known from its manifest: no server is started."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "manifest.json").write_text(json.dumps({"files": {}, "adapters": {"a": {}, "b": {}}}))
    printed = run("bench", "--local", package, "--adapters", 3, "-o", tmp_path / "report", ok=False)
    assert printed.strip().splitlines()[-1] == f"Error: --adapters 3: the package {package} has only 2 adapter(s) (a, b)"
    assert "starting" not in printed


def test_config_file_defaults_reach_the_adapters_commands(tmp_path, monkeypatch):
    """[default] and [adapters] keys reach each `fish-sm adapters` command that has the option."""
    import click

    from fish_sm.cli.common import load_config

    config = tmp_path / "config.toml"
    config.write_text('[default]\nregion = "eu-west-1"\n[adapters]\ncomponent = "tts-a"\n[deploy]\nregion = "us-west-2"\n')
    monkeypatch.setenv("FISHSM_CONFIG", str(config))
    defaults = load_config(main, click.Context(main))
    assert defaults["adapters"]["list"] == {"region": "eu-west-1", "component": "tts-a"}
    assert defaults["adapters"]["add"]["component"] == "tts-a" and defaults["deploy"]["region"] == "us-west-2"
    config.write_text('[adapters]\nlora-alpha = 8\nconcurrency = "1"\n')
    printed = run("adapters", "list", "tts", ok=False)
    assert "[adapters] concurrency: no such option of `fish-sm adapters`" in printed
