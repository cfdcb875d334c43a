"""Stand-in for descript-audiotools (needs torchaudio): only names imported at module level."""
from . import core, ml


class AudioSignal:
    pass


class STFTParams:
    def __init__(self, *args, **kwargs):
        pass
