"""The CLI's adapter options: bad fine-tunes refused by `package --adapter` in one line with nothing
left behind (a pickle that would run code is never run), `bench --local` counting a package's
adapters, config-file defaults for `fish-sm adapters` (invoke --adapter and bench --adapters N:
tests/aws/test_bench.py)."""

import json
import os

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
