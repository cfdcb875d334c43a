"""What the batching server's front end and its engine cores say to each other, and how.

Two zmq PUSH/PULL pipes per core over `ipc://` sockets in a private directory (0700, made by the
front end with `private_directory`, removed when it stops): each side binds the socket it reads
(`CoreAddresses`) and connects to the one it writes, so nothing listens on TCP and only this
user's processes can connect. Messages are msgspec Structs, msgpack-encoded, decoded against a
tagged union of the types each side accepts (`Command`, `Event`): anything else is refused as a
`BadMessage`, never unpickled or executed.

- Front end to core: one `Command` a zmq message.
- Core to front end: a batch of `Event`s in the first frame, then one raw frame of float32
  samples (native byte order, both sides are one machine) for each `Audio` event, in order, so
  audio is never encoded sample by sample.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

MAX_SOCKET_PATH = 100  # bytes; a unix socket's path must fit sockaddr_un (108 on Linux)


class BadMessage(ValueError):
    """Frames that are not a message of the expected types."""


# -- front end to core ------------------------------------------------------------------------

class JobSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What to synthesize: a validated request, its voice by name or as a recording to encode."""

    text: str
    chunk_length: int
    temperature: float
    top_p: float
    repetition_penalty: float
    max_new_tokens: int
    seed: int | None = None
    stream: bool = False
    adapter: str | None = None
    voice: str | None = None  # a packaged voice (None, without a reference: the default voice, if any)
    reference: bytes | None = None  # a zero-shot recording (WAV, FLAC, Ogg), its size and length checked
    reference_text: str | None = None


class Submit(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A request; `bounded=False` queues it beyond the queue's bound (a JSON Lines line)."""

    id: int
    job: JobSpec
    bounded: bool = True


class OpenSession(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A bidirectional-streaming session: sentences arrive by `Speak`, end with `Close`."""

    id: int
    job: JobSpec


class Speak(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    id: int
    text: str


class Close(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    id: int


class Clear(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Barge-in that keeps the session: the sentences queued so far are cut, it takes new text."""

    id: int


class Cancel(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The client went away (or barged in): free the request's slot; nothing more is sent for it."""

    id: int


class ForgetAdapter(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """An S3 adapter was found removed or replaced: read it afresh when next asked for."""

    name: str


class Shutdown(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Stop the engine and exit 0 (the front end has drained its requests)."""


class Verified(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The front end has checked the model directory: the core may read it now. A core starts
    (its interpreter, imports, CUDA) while the front end hashes the package, and waits for this
    before it reads a file. `token`: `verify.verified_token` for a package (the core then checks
    its files are those hashed instead of hashing them again); None for a plain checkpoint
    directory, which has nothing to verify."""

    token: str | None


Command = Submit | OpenSession | Speak | Close | Clear | Cancel | ForgetAdapter | Shutdown | Verified


# -- core to front end ------------------------------------------------------------------------

class Hello(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The core runs and has chosen its device; `devices` are all this machine has (the first
    core's tells the front end which others to start)."""

    pid: int
    device: str
    devices: list[str]


class Ready(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    slots: int
    max_queue: int
    sample_rate: int
    voices: list[str]
    timings: dict[str, float]


class StartFailed(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The one-line reason; `expected`: a bad file or setting, not a bug."""

    message: str
    expected: bool


class Stopped(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The engine failed: the core fails what it holds and exits non-zero."""

    message: str


class Load(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    active: int
    waiting: int


class Admitted(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The request left the queue for a slot. Timings: the ticket's so far (seconds from its
    submission to the engine), `accepted_s` the core's time before that (a reference encoded)."""

    id: int
    timings: dict[str, float] = {}
    accepted_s: float = 0.0


class Opened(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A session was queued (it may be admitted before or after this arrives)."""

    id: int


class Audio(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Samples, in the batch's next payload frame; a stream's first carries its timings."""

    id: int
    timings: dict[str, float] | None = None
    accepted_s: float = 0.0


class Spoken(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    id: int
    index: int


class Cleared(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A session's `Clear` took effect: every event before it belongs to what was cut."""

    id: int


class Done(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    id: int
    frames: int
    seconds: float
    rtf: float
    timings: dict[str, float]
    accepted_s: float = 0.0


class Failed(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The request failed with this HTTP status; `final=False`: a session's sentence was refused
    and the session goes on; `adapter`: its LoRA adapter could not be read or served."""

    id: int
    status: int
    message: str
    retry_after_s: int | None = None
    final: bool = True
    adapter: bool = False
    timings: dict[str, float] = {}
    accepted_s: float = 0.0


Event = Hello | Ready | StartFailed | Stopped | Load | Admitted | Opened | Audio | Spoken | Cleared | Done | Failed


# -- encoding ------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_events = msgspec.msgpack.Decoder(list[Event])


def encode_command(command: Command) -> bytes:
    return _encoder.encode(command)


def decode_command(frames: list) -> Command:
    if len(frames) != 1:
        raise BadMessage(f"a command is one frame, not {len(frames)}")
    try:
        return _commands.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadMessage(str(exc)) from None


def encode_events(events: list[tuple[Event, np.ndarray | None]]) -> list:
    """Frames for a batch of events: the events, then each `Audio` event's samples as float32."""
    frames: list = [_encoder.encode([event for event, _ in events])]
    for event, samples in events:
        if isinstance(event, Audio):
            frames.append(np.ascontiguousarray(samples, dtype=np.float32).data)
    return frames


def decode_events(frames: list) -> list[tuple[Event, np.ndarray | None]]:
    """(event, its samples or None) for each event of a batch; `BadMessage` for anything else."""
    if not frames:
        raise BadMessage("an empty message")
    try:
        events = _events.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadMessage(str(exc)) from None
    payloads = iter(frames[1:])
    out = []
    for event in events:
        samples = None
        if isinstance(event, Audio):
            data = next(payloads, None)
            if data is None or len(data) % 4:
                raise BadMessage("an Audio event without its frame of float32 samples")
            samples = np.frombuffer(data, dtype=np.float32)
        out.append((event, samples))
    if next(payloads, None) is not None:
        raise BadMessage("more audio frames than Audio events")
    return out


# -- where -----------------------------------------------------------------------------------

def private_directory() -> Path:
    """A directory only this user can enter (mkdtemp makes it 0700), short enough for socket paths."""
    directory = Path(tempfile.mkdtemp(prefix="fish-sm-ipc-"))
    if len(str(directory)) + 24 > MAX_SOCKET_PATH:  # TMPDIR too deep for a unix socket's path
        os.rmdir(directory)
        directory = Path(tempfile.mkdtemp(prefix="fish-sm-ipc-", dir="/tmp"))
    return directory


@dataclass(frozen=True)
class CoreAddresses:
    """Core `index`'s two sockets: it binds `commands` and reads it; the front end binds `events`."""

    commands: str
    events: str

    @classmethod
    def of(cls, directory: Path, index: int) -> "CoreAddresses":
        return cls(f"ipc://{directory}/core-{index}.commands", f"ipc://{directory}/core-{index}.events")
