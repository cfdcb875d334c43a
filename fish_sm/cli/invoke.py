"""`fish-sm invoke`: one request to an endpoint or a server, its audio checked and written to a file."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fish_sm.cli.common import (aws_options, friendly_errors, human_size, main, make_aws, one_target,
                                output_format_option)
from fish_sm.errors import FishSMError
from fish_sm.contract import AUDIO_TYPES


# How long invoke waits for a scaled-to-zero component's first copy: an instance starts and the
# model loads in about 5 minutes (AWS measures ~5; ours warms up with a few syntheses too).
CAPACITY_WAIT_S = 600


def _sampling_options(fn):
    for opt in reversed([
        click.option("--seed", type=int), click.option("--temperature", type=float), click.option("--top-p", type=float),
        click.option("--repetition-penalty", type=float), click.option("--max-new-tokens", type=int),
        click.option("--chunk-length", type=int), click.option("--sample-rate", type=int),
    ]):
        fn = opt(fn)
    return fn


def _target_and_text(name: str | None, text_arg: str | None, url: str | None,
                     text: str | None) -> tuple[str | None, str]:
    """NAME and TEXT from the positional arguments and --text. With --url the one positional is
    the text unless --text gives it; exactly one of TEXT and --text."""
    if url and name and text_arg is None and text is None:
        name, text_arg = None, name  # `invoke --url URL "Hello"`
    one_target(("NAME", name), ("--url", url))
    if (text_arg is None) == (text is None):
        raise click.UsageError('give the text to speak once: as an argument (fish-sm invoke NAME "Hello.") '
                               "or with --text")
    return name, text_arg if text is None else text


@main.command()
@click.argument("name", required=False)
@click.argument("text_arg", metavar="[TEXT]", required=False)
@click.option("--url", help="A `fish-sm serve` (or any SageMaker-contract server) to call over HTTP instead.")
@click.option("--text", help="What to say (the same as the TEXT argument).")
@click.option("--voice", help="A voice packaged with the model.")
@click.option("--adapter", metavar="NAME",
              help="A LoRA adapter (fine-tune) to speak with: packaged with the model or in the endpoint's adapter "
                   "source (`fish-sm adapters list`). A packaged voice of the same name implies it.")
@click.option("--reference", metavar="AUDIO|s3://...", help="Reference audio of the voice to imitate.")
@click.option("--reference-text", help="Transcript of --reference.")
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Where the audio goes (default: out.wav, or out.FORMAT); its extension picks the format "
                   "(.wav .flac .ogg .mp3, and .pcm or .raw for bare 16-bit PCM) unless --format does.")
@click.option("--format", "fmt", type=click.Choice(list(AUDIO_TYPES)),
              help="Audio format (default: from the output's extension); pcm is bare 16-bit little-endian mono.")
@_sampling_options
@click.option("--stream", is_flag=True,
              help="Have the audio streamed as it is made (batching server; wav or pcm): prints the time to the "
                   "first audio byte. Endpoints are called with InvokeEndpointWithResponseStream.")
@click.option("--component", metavar="COMPONENT",
              help="The endpoint's inference component to call (InferenceComponentName), for an endpoint deployed "
                   "with --components.")
@click.option("--wait/--no-wait", "wait_capacity", default=True, show_default=True,
              help="While a component scaled to zero has no copy, retry with backoff for up to 10 minutes "
                   "(saying so once); --no-wait fails at once.")
@click.option("--bidi", "bidi_source", metavar="FILE|-",
              help="A bidirectional session (voice agent): the text of FILE (or stdin) sent piece by piece as it is "
                   "read, audio written to -o as it arrives, a line per sentence with its first audio. --url: a "
                   "WebSocket; an endpoint: InvokeEndpointWithBidirectionalStream (needs aws-sdk-sagemaker-runtime-http2).")
@click.option("--piece-chars", type=click.IntRange(min=0), default=0,
              help="--bidi: send the text in pieces of N characters (an LLM's stand-in); default: as read, by line.")
@click.option("--piece-interval", type=click.FloatRange(min=0), default=0.0,
              help="--bidi: seconds between pieces.")
@click.option("--async", "is_async", is_flag=True, help="Use the endpoint's asynchronous inference.")
@click.option("--input-location", metavar="s3://...", help="Async: where to upload the request "
              "(default: fish-sm/async-inputs/ in the endpoint's output bucket, which needs DescribeEndpoint).")
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds to wait for the audio.")
@click.option("--poll", type=float, default=5.0, show_default=True, help="Async: seconds between checks for the result.")
@output_format_option
@aws_options
@friendly_errors
def invoke(name, text_arg, url, text, voice, adapter, reference, reference_text, out_path, fmt, seed, temperature,
           top_p, repetition_penalty, max_new_tokens, chunk_length, sample_rate, stream, component, wait_capacity,
           bidi_source, piece_chars, piece_interval, is_async, input_location, timeout, poll, output_format, region,
           profile, endpoint_url):
    """Synthesize TEXT on endpoint NAME (or --url URL) and write the audio.

    The answer must be audio of the format asked for (its content type, and bytes that decode to
    at least one sample); anything else is an error naming what came back, and nothing is written.
    """
    from fish_sm.aws.s3 import parse_s3_uri
    from fish_sm.clients.endpoint import EndpointTarget, endpoint_problem, invoke_async, send_when_capacity
    from fish_sm.clients.request import build_request, check_stream, format_for
    from fish_sm.clients.response import ServiceError, check_audio
    from fish_sm.clients.url import UrlTarget
    from fish_sm.errors import FishSMError

    if bidi_source is not None:
        if text_arg is not None or text is not None or (url and name):
            raise click.UsageError("--bidi reads the text from its FILE (or - for stdin): give no TEXT")
        if stream or is_async or component or sample_rate:
            raise click.UsageError("--bidi is a session of its own: not with --stream, --async, --component or "
                                   "--sample-rate")
        one_target(("NAME", name), ("--url", url))
        return _bidi(name, url, bidi_source, out_path, fmt, piece_chars, piece_interval, timeout, output_format,
                     region, profile, endpoint_url, voice=voice, reference=reference, reference_text=reference_text,
                     adapter=adapter, seed=seed, temperature=temperature, top_p=top_p,
                     repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens, chunk_length=chunk_length)
    name, text = _target_and_text(name, text_arg, url, text)
    if is_async and url:
        raise click.UsageError("--async is for SageMaker endpoints, not --url")
    if component and (url or is_async):
        raise click.UsageError("--component is for real-time endpoints of inference components, not --url or --async")
    fmt = format_for(out_path, fmt)
    output = out_path or Path(f"out.{fmt}")
    if stream:
        check_stream(fmt, is_async=is_async, sample_rate=sample_rate)
    request = build_request(text, voice=voice, reference=reference, reference_text=reference_text, fmt=fmt,
                            stream=stream, adapter=adapter, seed=seed, temperature=temperature, top_p=top_p,
                            repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
                            chunk_length=chunk_length, sample_rate=sample_rate)
    accept = AUDIO_TYPES[fmt]
    log = (lambda line: click.echo(line, err=True)) if output_format == "json" else click.echo
    loc = parse_s3_uri(input_location, what="--input-location", prefix=True) if input_location else None
    aws = None if url else make_aws(region, profile, endpoint_url)
    source = url or f"endpoint {name}"
    try:
        if url:
            target = UrlTarget(url, timeout_s=timeout)
            source = str(target)
            response = target.send(request, accept)
        elif is_async:
            response = invoke_async(aws, name, request, accept, input_location=loc, timeout_s=timeout,
                                    poll_s=poll, log=log)
        else:
            response = send_when_capacity(EndpointTarget(aws, name, component), request, accept,
                                          wait_s=CAPACITY_WAIT_S if wait_capacity else 0, log=log)
        # S3 may keep an async result without its content type: then its bytes alone must show it is audio.
        seconds = check_audio(response, fmt, source, type_stated=not is_async)
    except ServiceError as exc:
        problem = endpoint_problem(aws, name) if aws is not None else None  # a clearer reason, where allowed
        raise FishSMError(problem or str(exc)) from None
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(response.body)
    first = response.first_audio_s
    if output_format == "json":
        click.echo(json.dumps({
            "output": str(output), "target": source, "format": fmt, "content_type": response.content_type,
            "bytes": len(response.body), "audio_seconds": seconds, "latency_s": response.latency_s,
            "stream": stream, "first_audio_s": first}))
        return
    if stream:
        timing = (f"first audio after {first:.3f} s" if first is not None else "no audio arrived") + \
            f", complete after {response.latency_s:.2f} s"
    else:
        timing = f"answered in {response.latency_s:.2f} s"
    click.echo(f"wrote {output}: " + (f"{seconds:.2f} s of audio, " if seconds is not None else "")
               + f"{human_size(len(response.body))} {response.content_type}, {timing}")


def _bidi(name, url, source, out_path, fmt, piece_chars, piece_interval, timeout, output_format, region, profile,
          endpoint_url, *, voice, reference, reference_text, adapter=None, **sampling):
    """`invoke --bidi`: one session, its audio written as it arrives, a line per sentence on stderr."""
    import asyncio

    from fish_sm.clients import bidi
    from fish_sm.clients.request import build_request

    fmt = fmt or (out_path.suffix.lstrip(".").lower() if out_path else "wav")
    if fmt not in ("wav", "pcm", "raw"):
        raise click.UsageError("--bidi writes wav, or bare pcm (.pcm, .raw)")
    output = out_path or Path("out.wav" if fmt == "wav" else "out.pcm")
    if reference:  # the reference is read and encoded as for a request (base64 or its s3:// URI)
        ref = build_request("-", reference=reference, reference_text=reference_text)["reference"]
        reference, reference_text = ref["audio"], ref["text"]
    if adapter:
        from fish_sm.contract import check_adapter_name

        sampling["adapter"] = check_adapter_name(adapter)
    settings = bidi.session_settings(voice=voice, reference_audio=reference, reference_text=reference_text,
                                     fmt="pcm", **sampling)
    source_name = "stdin" if source == "-" else source
    if source != "-" and not Path(source).is_file():
        raise click.UsageError(f"--bidi: no such file: {source}")

    def channel():
        if url:
            return bidi.WebSocketChannel(url, timeout_s=timeout)
        return bidi.EndpointChannel(name, make_aws(region, profile, endpoint_url))

    writer = None

    def on_audio(pcm: bytes, rate: int):
        nonlocal writer
        if writer is None:
            output.parent.mkdir(parents=True, exist_ok=True)
            writer = bidi.WavWriter(output, rate) if fmt == "wav" else open(output, "wb")
            state["rate"] = rate
        writer.write(pcm)

    def on_sentence(s):
        first = f"{s.first_audio_s * 1e3:.0f} ms" if s.first_audio_s is not None else "-"
        click.echo(f"sentence {s.index + 1}: first audio {first} after its end was sent, "
                   f"{s.samples / max(state['rate'], 1):.2f} s of audio: {s.text[:60]}", err=True)

    state = {"rate": 0}

    async def run():
        async with channel() as ch:
            return await bidi.run_session(ch, settings, bidi.file_pieces(source, piece_chars),
                                          piece_interval_s=piece_interval, on_audio=on_audio,
                                          on_sentence=on_sentence)

    try:
        result = asyncio.run(run())
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise FishSMError(f"the session from {source_name} made no audio" +
                          (f": {result.errors[-1]}" if result.errors else ""))
    first = result.sentences[0].first_audio_s if result.sentences else None
    if output_format == "json":
        click.echo(json.dumps({"output": str(output), "target": url or f"endpoint {name}", "format": fmt,
                               "audio_seconds": result.audio_seconds, "sentences": len(result.sentences),
                               "first_audio_s": first, "errors": result.errors, "done": result.done}))
        return
    click.echo(f"wrote {output}: {result.audio_seconds:.2f} s of audio in {len(result.sentences)} sentence(s), "
               + (f"first audio {first * 1e3:.0f} ms after the first sentence's end" if first is not None else "")
               + (f"; {len(result.errors)} error message(s), the last: {result.errors[-1]}" if result.errors else ""))
