"""Packaged voices: `voices/<id>/` with the reference recording, its transcript, its
precomputed codes and a `voice.json`, so a request that names a voice needs no encoding."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from fish_sm.engine import Reference
from fish_sm.errors import CheckpointError

VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def write_voice(directory: Path, voice_id: str, audio_path: Path, transcript: str, codes: torch.Tensor,
                sample_rate: int) -> dict:
    """Write one voice; returns its metadata (also saved as voice.json)."""
    if not VOICE_ID.match(voice_id):
        raise CheckpointError(f"voice id {voice_id!r}: use letters, digits, '.', '_' or '-' (up to 64, first a letter or digit)")
    d = directory / voice_id
    d.mkdir(parents=True, exist_ok=True)
    audio_name = "reference" + audio_path.suffix.lower()
    (d / audio_name).write_bytes(audio_path.read_bytes())
    (d / "transcript.txt").write_text(transcript, encoding="utf-8")
    np.save(d / "codes.npy", codes.to(torch.int16).numpy())
    meta = {"id": voice_id, "audio": audio_name, "transcript": "transcript.txt", "codes": "codes.npy",
            "frames": int(codes.shape[1]), "seconds": round(codes.shape[1] * 2048 / sample_rate, 3)}
    (d / "voice.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def load_voices(directory: Path, num_codebooks: int) -> dict[str, Reference]:
    """Every voice under `directory` (none if it does not exist), checked as it loads."""
    voices = {}
    if not directory.is_dir():
        return voices
    for d in sorted(p for p in directory.iterdir() if p.is_dir()):
        # A voice's files are confined to its own directory, so voice.json cannot point a read elsewhere.
        inside = directory.resolve() / d.name
        try:
            meta = json.loads(_voice_file(d, inside, "voice.json", "voice.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"voice {d.name}: cannot read voice.json ({exc})") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"voice {d.name}: voice.json is not a JSON object")
        transcript_path = _voice_file(d, inside, meta.get("transcript", "transcript.txt"), "transcript")
        codes_path = _voice_file(d, inside, meta.get("codes", "codes.npy"), "codes")
        try:
            transcript = transcript_path.read_text(encoding="utf-8")
            codes = torch.from_numpy(np.load(codes_path, allow_pickle=False).astype(np.int64))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"voice {d.name}: cannot read it ({exc})") from None
        if codes.ndim != 2 or codes.shape[0] != num_codebooks or codes.shape[1] == 0:
            raise CheckpointError(f"voice {d.name}: codes.npy has shape {tuple(codes.shape)}, expected ({num_codebooks}, frames)")
        voices[d.name] = Reference(transcript, codes)
    return voices


def _voice_file(voice_dir: Path, inside: Path, name, what: str) -> Path:
    """voice_dir/name, where name must be a plain file name whose real path (links followed) is in `inside`."""
    ok = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
    if not ok or not (voice_dir / name).resolve().is_relative_to(inside):
        raise CheckpointError(f"voice {voice_dir.name}: {what} {name!r} is not a file name inside "
                              f"voices/{voice_dir.name}/")
    return voice_dir / name
