"""Turning text into audio on one device.

`Engine`, `Reference` and `Synthesis` load torch when first used (PEP 562), so the modules of
this package that need none (`audio`, `text`) import without it: the batching server's HTTP
front end resamples with `engine.audio` and never loads torch.
"""

from fish_sm.contract import SamplingParams

__all__ = ["Engine", "Reference", "Synthesis", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from fish_sm.engine.engine import Engine

        return Engine
    if name in ("Reference", "Synthesis"):
        from fish_sm.engine import synthesis

        return getattr(synthesis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
