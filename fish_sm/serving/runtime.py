"""What loads and runs the model on one device, for both servers: the one-slot batching engine
of the model server's handler, and each engine core of the batching server (`serving/core.py`).

- Start-up: `load_model` (verify the package, load, quantize, open the compile cache, load the
  packaged voices, each phase timed), and for the model server `start_model` (that, then a
  one-slot batching engine, compiled, warmed up, the cache saved). `check_model_dir`
  (`serving/config.py`) runs before any of it.
- Requests: `resolve_reference` (a packaged voice, a zero-shot recording from the body or S3,
  encoded, or the default), `resolve_adapters` (the LoRA adapter each uses, named or implied by
  its voice), `synthesize` and `predict` on the model server's engine, and `encode_prediction`
  (`serving/response.py`), the response body for an Accept header.
Every problem a client can act on is an `HTTPError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from fish_sm.contract import TTSRequest
from fish_sm.engine import Engine, Reference
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.errors import AdapterError, FishSMError, InputError
from fish_sm.package.voices import load_voices
from fish_sm.serving import adapters
from fish_sm.serving.adapters import AdapterRegistry
from fish_sm.serving.compile_cache import CompileCache
from fish_sm.serving.errors import HTTPError, NoAudio, engine_error, unknown_voice
from fish_sm.serving.references import reference_audio
from fish_sm.serving.response import Prediction
from fish_sm.settings import Settings

logger = logging.getLogger("fish_sm.serving")

WARMUP_TEXT = "Warming up the speech engine so that the first request is fast."


@dataclass
class ServingModel:
    """A loaded model: the engine and everything a request may refer to."""

    engine: Engine
    settings: Settings
    voices: dict[str, Reference]
    model_dir: Path
    timings: dict[str, float] = field(default_factory=dict)
    compiled: bool = False  # compile (and keep a compile cache) on this device
    adapters: AdapterRegistry | None = None  # LoRA adapters (packaged, S3 sources), when there are any


def load_model(model_dir: Path, device: str, settings: Settings, batching: bool = False, label: str = "model_fn",
               token: str | None = None, began: float | None = None, prepared: float | None = None):
    """The part of start-up both servers share: verify the package, load, quantize, open the
    compile cache, load the packaged voices. Returns the model, the cache (to save once compiled) and
    the timer that records each phase in `model.timings`. `token`: the token of the process
    that started this one and verified the package (`verify.verified_token`); `began`: when
    this process's start began (`time.perf_counter()`), its time until `prepared` (or this call)
    recorded as the phase "start" (the interpreter, imports); `prepared`: when it began to wait
    for that other process's verification, counted in the phase "verify"."""
    logging.getLogger("fish_sm").setLevel(settings.log_level)
    timings: dict[str, float] = {}
    now = time.perf_counter()
    if began is not None:
        timings["start"] = (prepared or now) - began
        logger.info("%s start: %.2f s", label, timings["start"])

    def phase(name, fn, since: float | None = None):
        t0 = time.perf_counter() if since is None else since
        out = fn()
        timings[name] = time.perf_counter() - t0
        logger.info("%s %s: %.2f s", label, name, timings[name])
        return out

    from fish_sm.package.verify import verify_package

    # Before anything in the directory is read: a tampered package stops here, naming the file.
    verified = phase("verify", lambda: verify_package(model_dir, settings.manifest_sha256, token=token), since=prepared)
    if not verified:
        logger.info("%s has no manifest.json: a plain checkpoint directory, served unverified", model_dir)
    cache = CompileCache(model_dir / "compile_cache", Path(settings.cache_dir) / device.replace(":", ""),
                         verified=verified)
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(settings.dtype, "auto")
    engine = phase("load", lambda: Engine.from_pretrained(model_dir, device=device, dtype=dtype,
                                                          max_seq_len=settings.max_seq_len or None))
    device_type = engine.device.type
    if settings.use_quantize(device_type, batching):
        phase("quantize", engine.quantize_int8)
    compiled = settings.use_compile(device_type)
    if compiled:
        phase("cache", lambda: cache.activate(engine.device))
    voices = phase("voices", lambda: load_voices(model_dir / "voices", engine.config.num_codebooks))
    if settings.default_voice and settings.default_voice not in voices:
        raise FishSMError(f"FISH_SM_DEFAULT_VOICE={settings.default_voice!r} is not a packaged voice "
                          f"(packaged: {', '.join(sorted(voices)) or 'none'})")
    registry = AdapterRegistry.from_package(model_dir, engine.config, settings)
    if registry.enabled:
        # After quantizing, before compiling and before a batching engine is built: both read the adapter slots.
        phase("adapters", lambda: engine.enable_adapters(registry, settings.adapter_memory,
                                                         registry.rank(settings.adapter_rank)))
        registry.on_change = engine.adapters.forget  # an S3 adapter replaced or removed is read afresh
        logger.info("%s adapters: %d packaged, sources %s; %s", label, len(registry.packaged),
                    ", ".join(s.uri() for s in registry.sources) or "none", engine.adapter_stats())
    return ServingModel(engine, settings, voices, model_dir, timings, compiled,
                        registry if registry.enabled else None), cache, phase


def engine_options(settings: Settings) -> dict:
    """The `BatchEngine` options both servers' engines take from the settings."""
    return {"prefix_cache": settings.prefix_cache, "codec_precision": settings.codec_precision,
            "forced_lengths": settings.benchmark_lengths}


def start_model(model_dir: Path, device: str, settings: Settings) -> ServingModel:
    """The model server's whole start: load, a one-slot batching engine (compiled on a GPU),
    warm up, save the compile cache."""
    model, cache, phase = load_model(model_dir, device, settings)
    options = engine_options(settings)
    if model.compiled:
        phase("compile", lambda: model.engine.compile(**options))
    else:
        model.engine.batching(**options)
    if settings.warmup:
        phase("warmup", lambda: _warm_up(model))
    if model.compiled:
        phase("cache_save", cache.save)
    logger.info("model_fn ready on %s in %.2f s (%s)", model.engine.device, sum(model.timings.values()),
                ", ".join(f"{k} {v:.2f} s" for k, v in model.timings.items()))
    freeze_start_up_objects()
    return model


def _warm_up(model: ServingModel) -> None:
    """Real syntheses along every path a request takes (prefill, decode, codec), each length bucket
    once; and with a packaged adapter, if any (it stays in memory for its first request)."""
    voice = model.voices.get(model.settings.default_voice) or next(iter(model.voices.values()), None)
    for i in range(model.settings.warmup):
        model.engine.synthesize(WARMUP_TEXT, reference=voice, seed=i, max_new_tokens=32 * (i + 1))
    if model.adapters is not None and model.adapters.packaged:
        name = next(iter(model.adapters.packaged))
        try:
            model.engine.synthesize(WARMUP_TEXT, reference=voice, seed=0, max_new_tokens=8, adapter=name)
        except AdapterError as exc:  # its requests will fail alone (422); the server serves the rest
            logger.warning("warm-up with adapter %s failed: %s", name, exc)


def resolve_adapters(model: ServingModel, requests: list[TTSRequest]) -> list[TTSRequest]:
    """The requests with the adapter each uses (`adapters.resolve_adapters`: unknown ones are a 400)."""
    return adapters.resolve_adapters(model.adapters, requests, model.settings.default_voice)


def predict(model: ServingModel, requests: list[TTSRequest], jsonlines: bool) -> Prediction:
    """Synthesize every request, each with its adapter (`resolve_adapters`: unknown ones fail the
    whole body first); in JSON Lines, a line without audio answers with its own error."""
    requests = resolve_adapters(model, requests)
    results = []
    for request in requests:
        try:
            results.append(synthesize(model, request))
        except NoAudio as exc:
            if not jsonlines:
                raise
            results.append(exc)
    return Prediction(results, requests, jsonlines)


def synthesize(model: ServingModel, request: TTSRequest):
    """One request on the model server's engine (its adapter resolved: see `resolve_adapters`): its
    Synthesis, or the HTTPError to answer with (an adapter that cannot be read: 422)."""
    import torch

    reference = resolve_reference(model, request)
    try:
        result = model.engine.synthesize(request.text, reference=reference, chunk_length=request.chunk_length,
                                         adapter=request.adapter,
                                         temperature=request.sampling.temperature, top_p=request.sampling.top_p,
                                         repetition_penalty=request.sampling.repetition_penalty,
                                         max_new_tokens=request.sampling.max_new_tokens, seed=request.sampling.seed)
    except (InputError, AdapterError, torch.cuda.OutOfMemoryError) as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()  # free what this request held, so the next one runs; fail only this one
        raise engine_error(exc) from None
    if not len(result.audio):
        raise NoAudio()
    return result


def resolve_reference(model: ServingModel, request: TTSRequest) -> Reference | None:
    """The request's voice: a packaged one, a zero-shot recording (encoded, cached), or the default."""
    if request.voice is not None:
        if request.voice not in model.voices:
            raise unknown_voice(request.voice, model.voices)
        return model.voices[request.voice]
    if request.reference is None:
        return model.voices.get(model.settings.default_voice)
    audio = reference_audio(request.reference, model.settings)
    try:
        return model.engine.encode_reference(audio, request.reference.text)
    except InputError as exc:
        raise HTTPError(422, f"reference audio: {exc}") from None
