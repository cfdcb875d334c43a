"""`fish-sm invoke`: one request to an endpoint or a server, its audio written to a file."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import aws_options, friendly_errors, human_size, main, make_aws, one_target
from fish_sm.contract import AUDIO_TYPES


def _sampling_options(fn):
    for opt in reversed([
        click.option("--seed", type=int), click.option("--temperature", type=float), click.option("--top-p", type=float),
        click.option("--repetition-penalty", type=float), click.option("--max-new-tokens", type=int),
        click.option("--chunk-length", type=int), click.option("--sample-rate", type=int),
    ]):
        fn = opt(fn)
    return fn


@main.command()
@click.argument("name", required=False)
@click.option("--url", help="A `fish-sm serve` (or any SageMaker-contract server) to call over HTTP instead.")
@click.option("--text", required=True, help="What to say.")
@click.option("--voice", help="A voice packaged with the model.")
@click.option("--reference", metavar="AUDIO|s3://...", help="Reference audio of the voice to imitate.")
@click.option("--reference-text", help="Transcript of --reference.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("out.wav"),
              show_default=True, help="Where the audio goes; .pcm and .raw get bare 16-bit PCM.")
@click.option("--format", "fmt", type=click.Choice(list(AUDIO_TYPES)),
              help="Audio format (default: from the output's extension); pcm is bare 16-bit little-endian mono.")
@_sampling_options
@click.option("--stream", is_flag=True,
              help="Have the audio streamed as it is made (batching server; wav or pcm): prints the time to the "
                   "first audio byte. Endpoints are called with InvokeEndpointWithResponseStream.")
@click.option("--async", "is_async", is_flag=True, help="Use the endpoint's asynchronous inference.")
@click.option("--input-location", metavar="s3://...", help="Async: where to upload the request "
              "(default: fish-sm/async-inputs/ in the output bucket).")
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds to wait for the audio.")
@click.option("--poll", type=float, default=5.0, show_default=True, help="Async: seconds between checks for the result.")
@aws_options
@friendly_errors
def invoke(name, url, text, voice, reference, reference_text, output, fmt, seed, temperature, top_p,
           repetition_penalty, max_new_tokens, chunk_length, sample_rate, stream, is_async, input_location, timeout,
           poll, region, profile, endpoint_url):
    """Synthesize TEXT on endpoint NAME (or --url) and write the audio."""
    from fish_sm.aws.s3 import parse_s3_uri
    from fish_sm.clients.endpoint import EndpointTarget, invoke_async
    from fish_sm.clients.request import build_request, check_stream, format_for
    from fish_sm.clients.url import UrlTarget

    one_target(("NAME", name), ("--url", url))
    if is_async and url:
        raise click.UsageError("--async is for SageMaker endpoints, not --url")
    fmt = format_for(output, fmt)
    if stream:
        check_stream(fmt, is_async=is_async, sample_rate=sample_rate)
    request = build_request(text, voice=voice, reference=reference, reference_text=reference_text, fmt=fmt,
                            stream=stream, seed=seed, temperature=temperature, top_p=top_p,
                            repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
                            chunk_length=chunk_length, sample_rate=sample_rate)
    accept = AUDIO_TYPES[fmt]
    if url:
        response = UrlTarget(url, timeout_s=timeout).send(request, accept)
    elif is_async:
        loc = parse_s3_uri(input_location, what="--input-location", prefix=True) if input_location else None
        response = invoke_async(make_aws(region, profile, endpoint_url), name, request, accept, input_location=loc,
                                timeout_s=timeout, poll_s=poll, log=click.echo)
    else:
        response = EndpointTarget(make_aws(region, profile, endpoint_url), name).send(request, accept)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(response.body)
    seconds = response.audio_seconds
    if stream:
        first = response.first_audio_s
        timing = (f"first audio after {first:.3f} s" if first is not None else "no audio arrived") + \
            f", complete after {response.latency_s:.2f} s"
    else:
        timing = f"answered in {response.latency_s:.2f} s"
    click.echo(f"wrote {output}: " + (f"{seconds:.2f} s of audio, " if seconds is not None else "")
               + f"{human_size(len(response.body))} {response.content_type}, {timing}")
