"""What `fish-sm package` is given: --voice ID=AUDIO[:TRANSCRIPT] options, and a directory
that is either a checkpoint or an already built package."""

from __future__ import annotations

import re
from pathlib import Path

from fish_sm.errors import InputError

_VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".opus", ".aiff", ".aif"}


def parse_voice_spec(spec: str) -> tuple[str, Path, str]:
    """`ID=AUDIO[:TRANSCRIPT]` -> (id, audio path, transcript).

    TRANSCRIPT is the text itself, or @FILE to read it from a file. Without it, a sidecar
    AUDIO.txt or AUDIO.lab (upstream fish-speech's convention) next to the audio is used.
    """
    voice_id, sep, rest = spec.partition("=")
    if not sep or not voice_id or not rest:
        raise InputError(f"--voice must be ID=AUDIO[:TRANSCRIPT], got {spec!r}")
    if not _VOICE_ID.match(voice_id):
        raise InputError(f"--voice {spec!r}: voice id {voice_id!r} must be letters, digits, '_', '-', '.' "
                         "(up to 64, starting with a letter or digit)")
    audio_str, colon, transcript = rest.partition(":")
    audio = Path(audio_str).expanduser()
    if not audio.is_file():
        raise InputError(f"--voice {voice_id}: audio file not found: {audio}")
    if colon:
        if transcript.startswith("@"):
            tfile = Path(transcript[1:]).expanduser()
            if not tfile.is_file():
                raise InputError(f"--voice {voice_id}: transcript file not found: {tfile}")
            transcript = tfile.read_text(encoding="utf-8")
    else:
        sidecars = [audio.with_suffix(s) for s in (".txt", ".lab")]
        found = next((s for s in sidecars if s.is_file()), None)
        if found is None:
            raise InputError(f"--voice {voice_id}: no transcript; use ID=AUDIO:TEXT, ID=AUDIO:@FILE, "
                             f"or put it in {sidecars[0].name}")
        transcript = found.read_text(encoding="utf-8")
    transcript = transcript.strip()
    if not transcript:
        raise InputError(f"--voice {voice_id}: the transcript is empty")
    if audio.suffix.lower() not in _AUDIO_SUFFIXES:
        raise InputError(f"--voice {voice_id}: {audio.name} is not an audio file "
                         f"({', '.join(sorted(_AUDIO_SUFFIXES))})")
    return voice_id, audio, transcript


def parse_voice_specs(specs) -> dict[str, tuple[Path, str]]:
    """Several --voice options -> {id: (audio, transcript)}, each id once."""
    voices: dict[str, tuple[Path, str]] = {}
    for spec in specs:
        voice_id, audio, transcript = parse_voice_spec(spec)
        if voice_id in voices:
            raise InputError(f"--voice {voice_id} is given twice")
        voices[voice_id] = (audio, transcript)
    return voices


def is_package_dir(path: Path) -> bool:
    """A directory that is already a built package (what build_package_dir writes)."""
    return (Path(path) / "manifest.json").is_file() and (Path(path) / "code").is_dir()


def parse_adapter_specs(specs, alphas=()) -> dict[str, tuple[Path, float | None]]:
    """--adapter NAME=PATH options (and --lora-alpha NAME=ALPHA) -> {name: (path, alpha or None)}.

    None leaves alpha to the file's metadata, else upstream's default (16)."""
    from fish_sm.contract import check_adapter_name

    adapters: dict[str, tuple[Path, float | None]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--adapter must be NAME=PATH, got {spec!r}")
        check_adapter_name(name, lambda message: InputError(f"--adapter {spec!r}: {message}"))
        if name in adapters:
            raise InputError(f"--adapter {name} is given twice")
        file = Path(path).expanduser()
        if not file.is_file():
            raise InputError(f"--adapter {name}: file not found: {file}")
        adapters[name] = (file, None)
    for spec in alphas:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise InputError(f"--lora-alpha must be NAME=ALPHA, got {spec!r}")
        if name not in adapters:
            raise InputError(f"--lora-alpha {name}: no --adapter {name}=PATH is given")
        try:
            alpha = float(value)
        except ValueError:
            alpha = float("nan")
        if not alpha > 0 or alpha == float("inf"):
            raise InputError(f"--lora-alpha {name}: alpha must be a positive number, got {value!r}")
        adapters[name] = (adapters[name][0], alpha)
    return adapters
