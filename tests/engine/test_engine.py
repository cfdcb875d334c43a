"""End to end on the tiny checkpoint: text -> codes -> waveform, through the engine's one-slot
batching engine (`Engine.synthesize` and `Engine.stream`)."""

import numpy as np
import pytest
import torch

from fish_sm.engine import Reference
from fish_sm.errors import InputError

SAMPLING = dict(seed=1234, max_new_tokens=24)


def test_synthesis_is_44k_audio_of_2048_samples_a_frame(engine):
    result = engine.synthesize("Hello from the tiny model.", **SAMPLING)
    assert result.sample_rate == 44100
    assert 0 < result.frames <= 24
    assert result.audio.dtype == np.float32 and result.audio.shape == (result.frames * 2048,)
    assert np.isfinite(result.audio).all() and np.abs(result.audio).max() > 0
    assert result.seconds == pytest.approx(result.frames * 2048 / 44100)
    assert result.rtf > 0 and {"queue", "first_frame", "generate", "decode", "total"} <= set(result.timings)
    assert result.codes.shape == (10, result.frames)
    assert result.codes[0].max() < 4096 and result.codes[1:].max() < 1024


def test_same_seed_same_audio_other_seed_other_audio(engine):
    a = engine.synthesize("Same seed, same audio.", **SAMPLING)
    b = engine.synthesize("Same seed, same audio.", **SAMPLING)
    c = engine.synthesize("Same seed, same audio.", **{**SAMPLING, "seed": 99})
    assert torch.equal(a.codes, b.codes) and np.array_equal(a.audio, b.audio)
    assert not torch.equal(a.codes, c.codes)


def test_stream_concatenates_to_the_non_streamed_audio(engine):
    whole = engine.synthesize("Streaming should match.", **SAMPLING)
    pieces = list(engine.stream("Streaming should match.", **SAMPLING))
    assert [len(p) for p in pieces[:2]] == [4 * 2048, 8 * 2048]  # the codec's pieces: 4 frames, then doubling
    joined = np.concatenate(pieces)
    assert joined.shape == whole.audio.shape
    np.testing.assert_allclose(joined, whole.audio, atol=1e-4)


@pytest.mark.parametrize("rate, channels, fmt", [(16000, 1, "WAV"), (48000, 2, "FLAC")])
def test_reference_voice_conditions_the_output(engine, tmp_path, rate, channels, fmt, tone, encode_audio):
    audio = encode_audio(tone(2.0, rate, channels), rate, fmt)
    ref = engine.encode_reference(audio, "This is the reference voice.")
    assert isinstance(ref, Reference) and ref.codes.shape == (10, int(np.ceil(2.0 * 44100 / 2048)))
    plain = engine.synthesize("Say it in that voice.", **SAMPLING)
    cloned = engine.synthesize("Say it in that voice.", reference=ref, **SAMPLING)
    assert cloned.audio.shape[0] > 0 and not torch.equal(plain.codes, cloned.codes)
    path = tmp_path / f"ref.{fmt.lower()}"
    path.write_bytes(audio)
    assert torch.equal(engine.encode_reference(path, "again").codes, ref.codes)


def test_reference_cache_is_keyed_by_the_audio(engine, tone, encode_audio):
    audio = encode_audio(tone(1.0, 22050, freq=180), 22050, "WAV")
    first = engine.encode_reference(audio, "one")
    assert engine._references  # cached
    size = len(engine._references)
    second = engine.encode_reference(audio, "two")
    assert len(engine._references) == size and second.text == "two" and torch.equal(first.codes, second.codes)


def test_silent_reference_is_rejected(engine, encode_audio):
    with pytest.raises(InputError, match="silent"):
        engine.encode_reference(encode_audio(np.zeros((22050, 1), np.float32), 22050, "WAV"), "nothing")


def test_long_text_is_chunked_into_one_waveform(engine, monkeypatch):
    import fish_sm.engine.batching.runner as runner_module

    prompts = []
    real_build = runner_module.chunk_prompt
    # chunk_prompt(tokenizer, num_codebooks, max_seq_len, references, previous, chunk)
    monkeypatch.setattr(runner_module, "chunk_prompt", lambda *a: prompts.append((a[0], a[1], a[3] + a[4], a[5])) or real_build(*a))
    text = "The first sentence is here. The second one follows it. A third closes the text."
    result = engine.synthesize(text, chunk_length=30, seed=7, max_new_tokens=6)
    assert [p[3] for p in prompts] == ["The first sentence is here.", "The second one follows it.",
                                       "A third closes the text."]
    # each chunk after the first is conditioned on the one before it
    assert prompts[1][2][0][0] == "The first sentence is here." and prompts[1][2][0][1].shape == (10, 6)
    assert result.frames == 18 and result.audio.shape == (18 * 2048,)
    streamed = np.concatenate(list(engine.stream(text, chunk_length=30, seed=7, max_new_tokens=6)))
    np.testing.assert_allclose(streamed, result.audio, atol=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(text=""), "non-empty"),
    (dict(text="hi", temperature=5.0), "temperature"),
    (dict(text="hi", chunk_length=0), "chunk_length"),
    (dict(text="hi", reference="not a reference"), "Reference"),
])
def test_bad_requests_raise_input_errors(engine, kwargs, message):
    with pytest.raises(InputError, match=message):
        engine.synthesize(**kwargs)


def test_prompt_longer_than_the_cache_is_rejected(engine):
    with pytest.raises(InputError, match="prompt is"):
        engine.synthesize("word " * 3000, chunk_length=100000, max_new_tokens=4)


def test_a_stream_closed_early_frees_the_engine_for_the_next_request(engine):
    """Leaving a stream after its first piece cancels the request: the one slot is free again."""
    stream = engine.stream("A long answer that the caller stops listening to.", seed=3, max_new_tokens=200)
    assert len(next(stream)) == 4 * 2048
    stream.close()
    assert engine.synthesize("The next one.", **SAMPLING).frames > 0
    assert engine.batching().load()["active"] == 0


def test_a_server_s_batching_engine_takes_over_and_synthesize_uses_it(tiny_checkpoint):
    """One engine: a batching engine built over an Engine (a server's) serves its `synthesize`
    too, and the one-slot engine it replaced stops."""
    from fish_sm.engine import Engine
    from fish_sm.engine.batching import BatchEngine

    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    alone = engine.synthesize("One engine.", **SAMPLING)
    first = engine.batching()
    with BatchEngine(engine, max_batch=4) as server:
        assert first.finished() and engine.batching() is server
        assert torch.equal(engine.synthesize("One engine.", **SAMPLING).codes, alone.codes)
    assert engine.batching() is not server and engine.batching().slots == 1  # a new one-slot engine after it
