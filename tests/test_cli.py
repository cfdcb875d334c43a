"""The fish-sm command, run as a user runs it."""

import subprocess
import sys

import soundfile as sf
from click.testing import CliRunner

from fish_sm.cli import main


def test_help_is_fast_and_imports_no_torch():
    code = "import sys; from fish_sm.cli import main; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "make-checkpoint" in result.output and "synthesize" in result.output


def test_make_checkpoint_then_synthesize(tmp_path, tone, encode_audio):
    runner = CliRunner()
    result = runner.invoke(main, ["make-checkpoint", str(tmp_path / "ckpt"), "--preset", "tiny", "--seed", "3"])
    assert result.exit_code == 0, result.output
    ref = tmp_path / "voice.flac"
    ref.write_bytes(encode_audio(tone(1.0, 48000, 2), 48000, "FLAC"))
    out = tmp_path / "out" / "speech.flac"
    result = runner.invoke(main, ["synthesize", str(tmp_path / "ckpt"), "Hello there.", "-o", str(out),
                                  "--reference", str(ref), "--reference-text", "A voice.",
                                  "--max-new-tokens", "8", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "8 frames" in result.output and "real-time factor" in result.output
    audio, rate = sf.read(out)
    assert rate == 44100 and len(audio) == 8 * 2048
    result = runner.invoke(main, ["synthesize", str(tmp_path / "ckpt"), "Hello there.", "-o", str(tmp_path / "s.wav"),
                                  "--max-new-tokens", "8", "--seed", "1", "--stream"])
    assert result.exit_code == 0 and "time to first audio" in result.output


def test_bad_input_is_one_line_and_non_zero(tmp_path, tiny_checkpoint):
    runner = CliRunner()
    cases = [
        ["synthesize", str(tiny_checkpoint), "hi", "--temperature", "7", "-o", str(tmp_path / "a.wav")],
        ["synthesize", str(tmp_path), "hi"],  # a directory with no checkpoint in it
        ["synthesize", str(tiny_checkpoint), "hi", "--reference", str(tiny_checkpoint / "config.json"),
         "--reference-text", "x"],
        ["synthesize", str(tiny_checkpoint), "hi", "--reference", str(tiny_checkpoint / "config.json")],
        ["make-checkpoint", str(tmp_path / "x"), "--preset", "huge"],
    ]
    for args in cases:
        result = runner.invoke(main, args)
        assert result.exit_code != 0, args
        assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
        assert result.output.strip().splitlines()[-1].startswith("Error"), result.output


def test_stream_refuses_what_cannot_stream_in_one_line(tmp_path):
    """Checked before anything is sent (nothing listens on port 9): exit 1, one 'Error:' line."""
    url = ["--url", "http://127.0.0.1:9"]
    cases = [
        (["invoke", *url, "--text", "Hi.", "--stream", "-o", str(tmp_path / "a.flac")], "flac cannot be written"),
        (["invoke", *url, "--text", "Hi.", "--stream", "--format", "ogg"], "ogg cannot be written"),
        (["invoke", *url, "--text", "Hi.", "--stream", "--format", "mp3"], "--stream sends wav or pcm"),
        (["invoke", *url, "--text", "Hi.", "--stream", "--sample-rate", "16000"], "--sample-rate cannot be combined"),
        (["invoke", "some-endpoint", "--text", "Hi.", "--stream", "--async"], "cannot be combined with --async"),
        (["bench", *url, "--stream", "--format", "flac", "-o", str(tmp_path / "b")], "--stream sends wav or pcm"),
    ]
    for args, expected in cases:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and "Traceback" not in result.output, (args, result.output)
        line, = result.output.strip().splitlines()
        assert line.startswith("Error: ") and expected in line, (args, line)
    assert not (tmp_path / "a.flac").exists() and not (tmp_path / "b").exists()


def test_stream_and_pcm_are_offered():
    for command in ("invoke", "bench"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "--stream" in result.output and "pcm" in result.output
    result = CliRunner().invoke(main, ["deploy", "--help"])
    assert "half of its batch slots" in " ".join(result.output.split())


def test_synthesize_checks_its_output_and_device_before_any_work(tmp_path, tiny_checkpoint):
    """Each in one line, before the checkpoint is loaded: nothing is written."""
    import torch

    runner = CliRunner()
    base = ["synthesize", str(tiny_checkpoint), "Hello.", "--max-new-tokens", "2"]
    result = runner.invoke(main, [*base, "-o", str(tmp_path / "speech.xyz")])
    assert result.exit_code == 1 and result.output.splitlines() == [
        f"Error: --output {tmp_path / 'speech.xyz'}: the extension names the audio format; "
        "use one of .wav, .flac, .ogg, .mp3, .pcm"]
    version = torch.__version__.split("+")[0]
    if torch.version.cuda is None:
        device, message = "cuda", f"CUDA is not available on this machine (torch {version} CPU build)"
    elif not torch.cuda.is_available():
        device, message = "cuda:0", "CUDA is not available on this machine"
    else:
        device, message = "cuda:99", f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    result = runner.invoke(main, [*base, "-o", str(tmp_path / "a.wav"), "--device", device])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    line, = result.output.splitlines()
    assert line.startswith("Error: ") and message in line
    for option, value, choices in (("--device", "gpu0", "choose auto, cpu, cuda or cuda:N"),
                                   ("--dtype", "half", "'auto', 'bf16', 'fp16', 'fp32'")):
        result = runner.invoke(main, [*base, "-o", str(tmp_path / "a.wav"), option, value])
        assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output and choices in result.output
    assert not any(tmp_path.iterdir())
    help_text = runner.invoke(main, ["synthesize", "--help"]).output
    assert "[auto|bf16|fp16|fp32]" in help_text and "cuda:N" in help_text and ".mp3" in help_text


def test_synthesize_writes_raw_pcm_for_a_pcm_extension(tmp_path, tiny_checkpoint):
    """The formats a server answers with (wav and flac are written above)."""
    out = tmp_path / "speech.pcm"
    result = CliRunner().invoke(main, ["synthesize", str(tiny_checkpoint), "Hello.", "-o", str(out),
                                       "--max-new-tokens", "2", "--seed", "1", "--device", "cpu", "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size == 2 * 2048 * 2  # 2 frames of 16-bit samples
