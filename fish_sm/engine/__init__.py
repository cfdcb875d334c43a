"""Turning text into audio on one device.

`Engine`, `Reference` and `Synthesis` load torch when first used (PEP 562), so the modules of
this package that need none (`audio`, `text`) import without it: the batching server's HTTP
front end resamples with `engine.audio` and never loads torch.
"""

from fish_sm.contract import SamplingParams

__all__ = ["Engine", "Reference", "Synthesis", "SamplingParams"]
_FROM_ENGINE = frozenset({"Engine", "Reference", "Synthesis"})


def __getattr__(name: str):
    if name in _FROM_ENGINE:
        from fish_sm.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
