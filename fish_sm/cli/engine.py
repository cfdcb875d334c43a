"""Engine commands: write checkpoints, synthesize locally."""

from __future__ import annotations

import re
from pathlib import Path

import click

from fish_sm.cli.common import friendly_errors, main


# What --output's extension may be: the formats a server answers with (libsndfile writes MP3 from 1.1 on).
OUTPUT_FORMATS = ("wav", "flac", "ogg", "mp3", "pcm")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_ADAPTER_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # an output file name that can name the adapter


def _check_device(ctx, param, value: str) -> str:
    if not _DEVICE.fullmatch(value):
        raise click.BadParameter(f"{value!r}: choose auto, cpu, cuda or cuda:N")
    return value


def _check_cuda(device: str) -> None:
    """A CUDA device that this machine and this torch have, in one line if not."""
    if not device.startswith("cuda"):
        return
    import torch

    version = torch.__version__.split("+")[0]
    if torch.version.cuda is None:
        raise click.ClickException(f"CUDA is not available on this machine (torch {version} CPU build); "
                                   "use --device cpu")
    if not torch.cuda.is_available():
        raise click.ClickException(f"CUDA is not available on this machine (torch {version} for CUDA "
                                   f"{torch.version.cuda}, no usable GPU); use --device cpu")
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        raise click.ClickException(f"--device {device}: this machine has {count} CUDA device(s), "
                                   f"cuda:0 to cuda:{count - 1}")


def _output_format(output: Path) -> str:
    """The audio format --output's extension names, checked before any synthesis."""
    from fish_sm.serving.audio import writable_formats

    fmt = output.suffix.lower().lstrip(".")
    if fmt not in OUTPUT_FORMATS:
        raise click.ClickException(f"--output {output}: the extension names the audio format; use one of "
                                   f"{', '.join('.' + f for f in OUTPUT_FORMATS)}")
    if fmt not in writable_formats():
        raise click.ClickException(f"--output {output}: this libsndfile cannot write {fmt}; use one of "
                                   f"{', '.join('.' + f for f in writable_formats())}")
    return fmt


@main.command("make-checkpoint")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "s1-mini"]), default="tiny", show_default=True,
              help="tiny: runs on a CPU in seconds; s1-mini: the real shapes, for GPU benchmarks.")
@click.option("--seed", type=int, default=0, show_default=True)
@friendly_errors
def make_checkpoint(directory: Path, preset: str, seed: int):
    """Write a checkpoint with random weights in the official file formats."""
    from fish_sm.model.checkpoint import FILES, write_checkpoint

    write_checkpoint(directory, preset=preset, seed=seed)
    click.echo(f"wrote {preset} checkpoint to {directory}: {', '.join(FILES)}")


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("text")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("out.wav"),
              show_default=True, help="Audio file to write; the format follows the extension: "
                                      f"{', '.join('.' + f for f in OUTPUT_FORMATS)}.")
@click.option("--reference", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Reference recording of the voice to imitate.")
@click.option("--reference-text", help="Transcript of --reference.")
@click.option("--temperature", type=float, default=0.8, show_default=True)
@click.option("--top-p", type=float, default=0.8, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.1, show_default=True)
@click.option("--max-new-tokens", type=int, default=1024, show_default=True, help="Frames per text chunk at most.")
@click.option("--chunk-length", type=int, default=200, show_default=True, help="Characters per text chunk at most.")
@click.option("--seed", type=int, default=None)
@click.option("--device", default="auto", show_default=True, callback=_check_device,
              help="auto (CUDA if present, else the CPU), cpu, cuda, or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto", show_default=True,
              help="The transformer's precision; auto: bf16 on CUDA, fp32 on the CPU.")
@click.option("--stream", is_flag=True, help="Decode audio while generating (prints time to first audio).")
@friendly_errors
def synthesize(checkpoint, text, output, reference, reference_text, temperature, top_p, repetition_penalty,
               max_new_tokens, chunk_length, seed, device, dtype, stream):
    """Speak TEXT with the checkpoint in CHECKPOINT and write it to --output."""
    import time

    import numpy as np

    from fish_sm.engine import Engine
    from fish_sm.serving.audio import encode_audio

    if (reference is None) != (reference_text is None):
        raise click.UsageError("--reference and --reference-text go together")
    fmt = _output_format(output)
    _check_cuda(device)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(checkpoint, device=device, dtype=dtype)
    click.echo(f"loaded {checkpoint} on {engine.device} in {time.perf_counter() - t0:.2f} s")
    ref = engine.encode_reference(reference, reference_text) if reference else None
    sampling = dict(temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty,
                    max_new_tokens=max_new_tokens, seed=seed)
    if stream:
        t1 = time.perf_counter()
        first, pieces = None, []
        for piece in engine.stream(text, ref, chunk_length=chunk_length, **sampling):
            first = first or time.perf_counter() - t1
            pieces.append(piece)
        wall = time.perf_counter() - t1
        audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        frames, seconds = len(audio) // engine.frame_length, len(audio) / engine.sample_rate
        rtf = wall / seconds if seconds else float("inf")
        click.echo(f"time to first audio: {first or 0:.3f} s")
    else:
        result = engine.synthesize(text, ref, chunk_length=chunk_length, **sampling)
        audio, frames, seconds, rtf = result.audio, result.frames, result.seconds, result.rtf
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(encode_audio(audio, engine.sample_rate, fmt)[0])
    click.echo(f"wrote {output}: {seconds:.2f} s of audio, {frames} frames, real-time factor {rtf:.3f}")



@main.command("make-adapter")
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The base checkpoint whose config.json shapes the adapter.")
@click.option("--rank", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--alpha", type=click.FloatRange(min=0, min_open=True), default=16.0, show_default=True,
              help="lora_alpha (kept in the file's metadata only for --format safetensors; pass it to "
                   "`package --lora-alpha` otherwise, as for an upstream fine-tune).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["ckpt", "pth", "safetensors"]), default="ckpt", show_default=True,
              help="ckpt: as upstream's LoRA training saves it ({'state_dict': {'model.<module>.lora_A': ...}}); "
                   "pth: only the lora_A/lora_B tensors; safetensors: fish-sm's packaged form.")
@friendly_errors
def make_adapter(output: Path, checkpoint: Path, rank: int, alpha: float, seed: int, fmt: str):
    """Write a LoRA adapter of RANDOM weights for CHECKPOINT's model to OUTPUT (quick starts, tests,
    benchmarks): every module upstream's LoRA fine-tuning adapts, with nonzero lora_B, so it changes
    the output. It is no fine-tune: it makes the voice worse, not better."""
    import torch

    from fish_sm.model.config import ModelConfig
    from fish_sm.model.lora import random_adapter, write_packaged

    config = ModelConfig.from_file(checkpoint / "config.json")
    adapter = random_adapter(config, output.stem if _ADAPTER_STEM.fullmatch(output.stem) else "random", rank,
                             alpha, seed)
    output.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        write_packaged(adapter, output)
    else:
        tensors = {}
        for target, (a, b) in adapter.pairs.items():
            prefix = "model." if fmt == "ckpt" else ""
            tensors[f"{prefix}{target}.lora_A"], tensors[f"{prefix}{target}.lora_B"] = a, b
        # A Lightning checkpoint's shape; the note says what it is to anyone who opens it.
        data = {"state_dict": tensors, "epoch": 0, "global_step": 0,
                "note": "random LoRA weights from fish-sm make-adapter, not a fine-tune"} if fmt == "ckpt" else tensors
        torch.save(data, output)
    click.echo(f"wrote {output}: random LoRA adapter, rank {rank}, alpha {alpha:g}, {len(adapter.pairs)} modules, "
               f"{output.stat().st_size / 1e6:.1f} MB ({fmt}); random weights, not a fine-tune")
