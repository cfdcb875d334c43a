"""`Engine`: one checkpoint on one device, from text (and optional reference voices) to audio.

It holds the model, the codec and the tokenizer, encodes reference voices, and speaks through
the batching engine (`engine.batching`) built over it: a server's, or one of one slot. Long
text is spoken chunk by chunk; each chunk's prompt holds the references and the previous
chunk (its text and the codes just generated for it), so the voice carries over, and the
streaming codec turns all chunks' codes into one continuous waveform, whole (`synthesize`)
or piece by piece (`stream`).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from fish_sm import kernels
from fish_sm.contract import DEFAULT_CHUNK_LENGTH, SamplingParams, check_text
from fish_sm.engine.adapters import AdapterCache, AdapterSource
from fish_sm.engine.audio import AudioInput, load_reference_audio
from fish_sm.engine.generate import HostCopy, to_device
from fish_sm.engine.synthesis import Reference, Synthesis
from fish_sm.errors import FishSMError, InputError
from fish_sm.model.checkpoint import find_model_file
from fish_sm.model.codec import Codec, load_codec
from fish_sm.model.config import ModelConfig
from fish_sm.model.dual_ar import DualARTransformer, load_dual_ar
from fish_sm.model.tokenizer import Tokenizer

logger = logging.getLogger("fish_sm.engine")

SILENCE_PEAK = 1e-4


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The device to load on. A GPU named by its index also becomes this process's current
    device: Triton's launches, CUDA events and streams made without a device go to the current
    one, and on another GPU they would fail or order nothing."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                 "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(names)}")
        return names[dtype]
    return dtype


class Engine:
    def __init__(self, model: DualARTransformer, codec: Codec, tokenizer: Tokenizer, reference_cache_size: int = 64):
        kernels.install(model)  # the kernels that need no compiling; `compile` adds the rest
        self.model, self.codec, self.tokenizer = model, codec, tokenizer
        self.config: ModelConfig = model.config
        self.device = model.device
        self.sample_rate = codec.sample_rate
        self.frame_length = codec.frame_length
        self._references: OrderedDict[str, Tensor] = OrderedDict()
        self._reference_cache_size = reference_cache_size
        self._batcher = None  # the BatchEngine that serves this engine's requests (`batching`)
        self._batching_lock = threading.Lock()
        self.adapters: AdapterCache | None = None  # LoRA adapters, once enable_adapters() has run

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                        codec_dtype: str | torch.dtype | None = None, max_seq_len: int | None = None) -> "Engine":
        """Load a checkpoint directory (config.json, model.pth, codec.pth, tokenizer files).

        CUDA with bf16 when present, else CPU with float32. The codec runs in float32
        unless `codec_dtype` says otherwise: it costs little (about 30 ms for 10 s of audio
        on an H200 either way) and keeps streamed and whole decodes alike. `max_seq_len`
        caps the KV cache below the model's limit to save memory.
        """
        path = Path(path)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        config = ModelConfig.from_file(path / "config.json")
        tokenizer = Tokenizer.from_dir(path)
        model = load_dual_ar(find_model_file(path, "model"), config, tokenizer.semantic_begin_id,
                             tokenizer.im_end_id, device=device, dtype=dtype)
        model.setup_caches(1, min(max_seq_len or config.max_seq_len, config.max_seq_len))
        codec = load_codec(find_model_file(path, "codec"), device=device,
                           dtype=resolve_dtype(codec_dtype or torch.float32, device))
        return cls(model, codec, tokenizer)

    # -- speed ----------------------------------------------------------------------

    def quantize_int8(self) -> None:
        """INT8 weight-only quantization of the transformer (`kernels.quantize_int8`): half the
        weights' memory and of the bytes read per frame. The codec stays as it is."""
        if self.adapters is not None:
            raise FishSMError("quantize before enabling adapters: the adapters wrap the quantized layers")
        kernels.quantize_int8(self.model)

    @property
    def quantized(self) -> bool:
        return kernels.quantized(self.model)

    def enable_adapters(self, source: AdapterSource, memory_bytes: int, rank: int = 8) -> AdapterCache:
        """Serve LoRA adapters from `source` (`load(name) -> Adapter`), unmerged, any of them per
        request: as many adapter slots of rank up to `rank` as `memory_bytes` holds (at least
        one). After any INT8 quantization and before `compile` and the batching engine: the
        graphs read the adapter slots, and the kernels installed then add each row's adapter."""
        if self.adapters is not None:
            raise FishSMError("adapters are enabled already")
        if self._batcher is not None:
            raise FishSMError("enable adapters before compiling or synthesizing: the batching engine reads the "
                              "adapter slots when it is built")
        slots = max(1, memory_bytes // kernels.AdapterSlots.slot_bytes(self.model, rank))
        self.adapters = AdapterCache(kernels.AdapterSlots(self.model, slots, rank), source)
        logger.info("adapters: %d slots of rank %d, %.1f MiB each", slots, rank,
                    self.adapters.slots.bytes_per_slot / 2**20)
        return self.adapters

    def adapter_stats(self) -> dict:
        """Adapter slots, the adapters in them (least recently used first), bytes per adapter."""
        return {} if self.adapters is None else self.adapters.stats()

    def compile(self, **options) -> None:
        """Capture the decode step, admissions and codec as CUDA graphs now, not on a request
        (on a GPU; elsewhere nothing is compiled): a new one-slot batching engine over this one
        (`options`: `BatchEngine`'s keyword arguments), compiled, started and warmed up."""
        batcher = self._one_slot(options)
        batcher.compile(capture_all=True)  # (few graphs at one slot; nothing captured while serving)
        batcher.start()
        self.synthesize("Compiling the decoder.", seed=0, max_new_tokens=3)

    @property
    def compiled(self) -> bool:
        """The batching engine over this one has its graphs captured (a GPU's, after `compile`)."""
        return self._batcher is not None and self._batcher.runner.captured is not None

    def batching(self, **options):
        """The `BatchEngine` that runs this engine's requests: the last one built over it while it
        serves (a server's), else a new one of one slot (`options`: `BatchEngine`'s keyword
        arguments), started now. `synthesize` and `stream` go through it: one engine, one
        streaming codec, however many slots."""
        with self._batching_lock:  # callers on several threads make one
            if self._batcher is None or self._batcher.finished():
                self._one_slot(options).start()
            return self._batcher

    def _one_slot(self, options: dict):
        from fish_sm.engine.batching import BatchEngine

        return BatchEngine(self, **{"max_batch": 1, **options})

    def attach(self, batcher) -> None:
        """`batcher` takes over this engine's model (its KV cache): the one before it stops."""
        previous, self._batcher = self._batcher, batcher
        if previous is not None and previous is not batcher:
            previous.stop()

    # -- references ---------------------------------------------------------------

    def encode_reference(self, audio: AudioInput, text: str) -> Reference:
        """Codes for a reference recording (wav/flac/ogg bytes, a path, or (samples, rate)).

        Encoding is cached by the SHA-256 of the audio, so a voice sent with every
        request is encoded once.
        """
        if not isinstance(text, str):
            raise InputError("the reference transcript must be a string")
        key = _audio_key(audio)
        codes = self._references.get(key)
        if codes is not None:
            self._references.move_to_end(key)
            return Reference(text, codes)
        samples = load_reference_audio(audio, self.sample_rate)
        if np.abs(samples).max() < SILENCE_PEAK:
            raise InputError("the reference audio is silent")
        with torch.inference_mode():
            # Pinned copies both ways (`to_device`, `HostCopy`): the batching server encodes
            # on a thread beside its decode loop, which a pageable copy's wait would stall.
            x = to_device(torch.from_numpy(samples), self.device).to(self.codec_dtype)[None]
            codes = HostCopy(self.codec.encode(x)[0]).get().clone()
        self._references[key] = codes
        if len(self._references) > self._reference_cache_size:
            self._references.popitem(last=False)
        return Reference(text, codes)

    @property
    def codec_dtype(self) -> torch.dtype:
        return next(self.codec.parameters()).dtype

    # -- synthesis ----------------------------------------------------------------

    def synthesize(self, text: str, reference: Reference | Sequence[Reference] | None = None,
                   chunk_length: int = DEFAULT_CHUNK_LENGTH, adapter: str | None = None, **sampling) -> Synthesis:
        """Speak `text` (in the voice of `reference`, if given; with LoRA adapter `adapter`, if
        named). `sampling`: temperature, top_p, repetition_penalty, max_new_tokens (per chunk), seed."""
        return self._submit(text, reference, chunk_length, adapter, sampling, stream=False).result()

    def stream(self, text: str, reference: Reference | Sequence[Reference] | None = None,
               chunk_length: int = DEFAULT_CHUNK_LENGTH, adapter: str | None = None,
               **sampling) -> Iterator[np.ndarray]:
        """Yield float32 audio as it is decoded, in the batching engine's codec pieces (4 frames,
        then doubling to 64). The pieces concatenate to what `synthesize` returns for the same
        seed. Closing the iterator early cancels the request."""
        ticket = self._submit(text, reference, chunk_length, adapter, sampling, stream=True)
        try:
            for kind, payload in ticket.events():
                if kind == "error":
                    raise payload
                if kind == "audio":
                    yield payload
        finally:
            ticket.cancel()

    def _submit(self, text, reference, chunk_length: int, adapter: str | None, sampling: dict, stream: bool):
        from fish_sm.engine.batching import Job

        check_text(text, chunk_length)
        job = Job(text, references=tuple(as_references(reference)), chunk_length=chunk_length,
                  params=SamplingParams(**sampling), stream=stream, adapter=adapter)
        # Not bounded by the queue: a caller of this API waits its turn rather than being refused.
        return self.batching().submit(job, bounded=False)


def freeze_start_up_objects() -> None:
    """Move what start-up made (the compiled graphs' millions of Python objects, which live
    as long as the server) out of the garbage collector's sight, so that a full collection
    while serving does not walk them all with every thread stopped."""
    gc.collect()
    gc.freeze()


def as_references(reference) -> list[Reference]:
    if reference is None:
        return []
    if isinstance(reference, Reference):
        return [reference]
    refs = list(reference)
    if not all(isinstance(r, Reference) for r in refs):
        raise InputError("reference must be a Reference (from Engine.encode_reference) or a list of them")
    return refs


def _audio_key(audio: AudioInput) -> str:
    h = hashlib.sha256()
    if isinstance(audio, tuple):
        samples, rate = audio
        h.update(np.ascontiguousarray(samples, dtype=np.float32).tobytes())
        h.update(str(rate).encode())
    elif isinstance(audio, (bytes, bytearray, memoryview)):
        h.update(audio)
    else:
        try:
            h.update(Path(audio).read_bytes())
        except OSError as exc:
            raise InputError(f"cannot read reference audio {audio}: {exc.strerror}") from None
    return h.hexdigest()
