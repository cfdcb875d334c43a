"""Turning text into audio on one device."""

from fish_sm.engine.engine import Engine, Reference, Synthesis
from fish_sm.contract import SamplingParams

__all__ = ["Engine", "Reference", "Synthesis", "SamplingParams"]
