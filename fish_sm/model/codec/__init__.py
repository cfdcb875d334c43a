"""The S1-mini audio codec (fish-speech's "modded DAC"): `config` its shape, `layers` its
causal layers, `model` the network and its loading from codec.pth."""

from fish_sm.model.codec.config import CodecConfig
from fish_sm.model.codec.model import Codec, codec_from_state_dict, fold_weight_norm, load_codec

__all__ = ["Codec", "CodecConfig", "codec_from_state_dict", "fold_weight_norm", "load_codec"]
