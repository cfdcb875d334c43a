"""`fish-sm invoke`: one request to an endpoint or a server, its audio checked and written to a file."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fish_sm.cli.common import (aws_options, friendly_errors, human_size, main, make_aws, one_target,
                                output_format_option)
from fish_sm.contract import AUDIO_TYPES


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
@click.option("--async", "is_async", is_flag=True, help="Use the endpoint's asynchronous inference.")
@click.option("--input-location", metavar="s3://...", help="Async: where to upload the request "
              "(default: fish-sm/async-inputs/ in the endpoint's output bucket, which needs DescribeEndpoint).")
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds to wait for the audio.")
@click.option("--poll", type=float, default=5.0, show_default=True, help="Async: seconds between checks for the result.")
@output_format_option
@aws_options
@friendly_errors
def invoke(name, text_arg, url, text, voice, reference, reference_text, out_path, fmt, seed, temperature, top_p,
           repetition_penalty, max_new_tokens, chunk_length, sample_rate, stream, is_async, input_location, timeout,
           poll, output_format, region, profile, endpoint_url):
    """Synthesize TEXT on endpoint NAME (or --url URL) and write the audio.

    The answer must be audio of the format asked for (its content type, and bytes that decode to
    at least one sample); anything else is an error naming what came back, and nothing is written.
    """
    from fish_sm.aws.s3 import parse_s3_uri
    from fish_sm.clients.endpoint import EndpointTarget, endpoint_problem, invoke_async
    from fish_sm.clients.request import build_request, check_stream, format_for
    from fish_sm.clients.response import ServiceError, check_audio
    from fish_sm.clients.url import UrlTarget
    from fish_sm.errors import FishSMError

    name, text = _target_and_text(name, text_arg, url, text)
    if is_async and url:
        raise click.UsageError("--async is for SageMaker endpoints, not --url")
    fmt = format_for(out_path, fmt)
    output = out_path or Path(f"out.{fmt}")
    if stream:
        check_stream(fmt, is_async=is_async, sample_rate=sample_rate)
    request = build_request(text, voice=voice, reference=reference, reference_text=reference_text, fmt=fmt,
                            stream=stream, seed=seed, temperature=temperature, top_p=top_p,
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
            response = EndpointTarget(aws, name).send(request, accept)
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
