"""Error types shared by every layer, so callers can tell a bad file from a bug."""


class FishSMError(Exception):
    """Base class: a problem with what the user gave us, with a one-line message."""


class ConfigError(FishSMError, ValueError):
    """config.json (or another setting) is missing a field, has an unknown one, or a bad value."""


class CheckpointError(FishSMError, ValueError):
    """A checkpoint file is missing, unreadable, or holds a missing or mis-shaped tensor."""


class InputError(FishSMError, ValueError):
    """A request's text, reference audio or sampling parameters cannot be used."""


class AdapterError(CheckpointError):
    """A LoRA adapter that cannot be served: unknown to the engine, unreadable, or not shaped for
    the base model (a request naming it fails alone)."""
