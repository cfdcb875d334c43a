"""`fish-sm bench`: load-test an endpoint, a server, or one started here."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import (aws_options, friendly_errors, main, make_aws, one_target, output_format_option,
                                publish_report, serving_locally)
from fish_sm.contract import AUDIO_TYPES


@main.command()
@click.argument("name", required=False)
@click.option("--url", help="Benchmark a running server over HTTP.")
@click.option("--local", type=click.Path(exists=True, path_type=Path), metavar="MODEL",
              help="Start `fish-sm serve MODEL` (a package or checkpoint directory, or model.tar.gz) on a free "
                   "port, benchmark it, stop it.")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Concurrency levels, comma-separated.")
@click.option("--requests", "n_requests", type=int, default=32, show_default=True, help="Requests per level.")
@click.option("--texts", type=click.Path(dir_okay=False, path_type=Path),
              help="One text (or JSON request) per line; default: a built-in set of varied length.")
@click.option("--voice", help="A packaged voice for every request.")
@click.option("--format", "fmt", type=click.Choice(list(AUDIO_TYPES)), default="wav",
              show_default=True)
@click.option("--stream", is_flag=True,
              help="Every request streams (batching server; wav or pcm; endpoints through "
                   "InvokeEndpointWithResponseStream) and reports its time to first audio.")
@click.option("--bidi", is_flag=True,
              help="Bidirectional sessions (voice agents; --url or --local, over a WebSocket): each sends a "
                   "multi-sentence text in pieces; reports first audio after the first complete sentence and the "
                   "gap between sentences.")
@click.option("--piece-chars", type=click.IntRange(min=1), default=8, show_default=True,
              help="--bidi: characters per text piece.")
@click.option("--piece-interval", type=click.FloatRange(min=0), default=0.02, show_default=True,
              help="--bidi: seconds between pieces (an LLM writing).")
@click.option("--component", metavar="COMPONENT",
              help="The endpoint's inference component to load (InferenceComponentName).")
@click.option("--max-new-tokens", type=int, help="Cap the frames per text chunk (shorter runs).")
@click.option("--seed", type=int)
@click.option("--warmup", type=int, default=1, show_default=True, help="Unmeasured requests sent first.")
@click.option("--max-error-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="The fraction of a level's requests that may bring no audio (errors, answers that are not "
                   "audio, rejections by a full server); a level over it fails the run (exit 1).")
@click.option("--instance-type", metavar="ml.TYPE",
              help="The SageMaker instance type a --url/--local run stands for, priced for $ per audio-hour "
                   "(an endpoint's own type is read from its config).")
@click.option("--price", type=click.FloatRange(min=0, min_open=True), metavar="USD_PER_HOUR",
              help="An instance's hourly price (default: on-demand, from the AWS Pricing API, for the endpoint's "
                   "or --instance-type's type).")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"),
              show_default=True, help="Folder for bench.json and bench.html.")
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds per request.")
@click.option("--startup-timeout", type=float, default=900, show_default=True, help="--local: seconds to wait for /ping.")
@output_format_option
@aws_options
@friendly_errors
def bench(name, url, local, concurrency, n_requests, texts, voice, fmt, stream, bidi, piece_chars, piece_interval,
          component, max_new_tokens, seed,
          warmup,
          max_error_rate, instance_type, price, out_dir, timeout, startup_timeout, output_format, region, profile,
          endpoint_url):
    """Load-test endpoint NAME, --url or --local: latency, throughput, real-time factor, errors,
    requests rejected by a full server, with --stream the time to first audio, and with an
    instance type or --price the dollars per audio-hour of each level.

    Every answer must be audio of the format asked for; a level whose requests fail more often
    than --max-error-rate fails the run, after the report is written."""
    import contextlib

    from fish_sm.cli.capacity import instance_price
    from fish_sm.clients import bench as b
    from fish_sm.clients.capacity import endpoint_hardware
    from fish_sm.clients.endpoint import EndpointTarget, endpoint_instances
    from fish_sm.clients.report import format_table, verdict_lines
    from fish_sm.clients.request import check_stream
    from fish_sm.clients.url import UrlTarget, server_info
    from fish_sm.errors import FishSMError

    one_target(("NAME", name), ("--url", url), ("--local", local))
    if bidi:
        if name or stream:
            raise click.UsageError("--bidi benchmarks a server (--url or --local) over its WebSocket, without --stream")
        return _bench_bidi(url, local, concurrency, n_requests, texts, voice, max_new_tokens, seed, piece_chars,
                           piece_interval, max_error_rate, out_dir, timeout, startup_timeout, output_format)
    if component and not name:
        raise click.UsageError("--component is for an endpoint NAME of inference components")
    if stream:
        check_stream(fmt)
    levels = b.parse_concurrency(concurrency)
    text_list = b.load_texts(texts) if texts else [{"text": t} for t in b.BUILTIN_TEXTS]
    base = {k: v for k, v in (("voice", voice), ("format", fmt), ("max_new_tokens", max_new_tokens),
                              ("seed", seed)) if v is not None}
    # With --output json, stdout carries one JSON object; progress and the table go to stderr.
    say = (lambda line: click.echo(line, err=True)) if output_format == "json" else click.echo
    server, instances, notes = None, 1, []
    # Lazy: nothing is asked of AWS unless an endpoint or an instance type is named.
    aws = make_aws(region, profile, endpoint_url, max_pool_connections=max(levels) + 2)
    with contextlib.ExitStack() as stack:
        if local:
            url = stack.enter_context(serving_locally(local, out_dir, startup_timeout, say))
        if url:
            target = UrlTarget(url, timeout_s=timeout)
            device, server = server_info(url)
        else:
            device = endpoint_instances(aws, name)  # also refuses an endpoint that is missing or not in service
            target = EndpointTarget(aws, name, component)
            instance_type, instances = endpoint_hardware(aws, name)
        price_doc = instance_price(aws, instance_type, price, notes)
        report = b.run_bench(target, concurrencies=levels, requests_per_level=n_requests, texts=text_list, base=base,
                             accept=AUDIO_TYPES[fmt], warmup=warmup, stream=stream, max_error_rate=max_error_rate,
                             device=device, server=server, price=price_doc, instances=instances,
                             instance_type=instance_type, notes=notes, log=say)
    if local:
        report["target"] = f"local {local} (served at {report['target']})"
    publish_report(report, out_dir, [format_table(report), *verdict_lines(report)], output_format, say)
    failed = [lv for lv in report["levels"] if not lv["passed"]]
    if failed:
        worst = max(failed, key=lambda lv: lv["error_rate"])
        example = " ".join(str(next(iter(worst["error_examples"].values()), "")).split())[:300]
        raise FishSMError(
            f"{len(failed)} of {len(report['levels'])} level(s) over --max-error-rate {max_error_rate:g}: "
            + ", ".join(f"concurrency {lv['concurrency']} {lv['requests'] - lv['ok']}/{lv['requests']} failed"
                        for lv in failed) + (f"; e.g. {example}" if example else ""))


def _bench_bidi(url, local, concurrency, n_requests, texts, voice, max_new_tokens, seed, piece_chars, piece_interval,
                max_error_rate, out_dir, timeout, startup_timeout, output_format):
    """`bench --bidi`: each level runs max(concurrency, --requests) sessions, `concurrency` at a time."""
    import asyncio
    import contextlib
    import json

    from fish_sm.clients import bidi
    from fish_sm.clients import bench as b
    from fish_sm.clients.report import write_json
    from fish_sm.errors import FishSMError

    levels = b.parse_concurrency(concurrency)
    text = " ".join(t["text"] for t in b.load_texts(texts)) if texts else bidi.BENCH_TEXT
    settings = bidi.session_settings(voice=voice, max_new_tokens=max_new_tokens, seed=seed)
    say = (lambda line: click.echo(line, err=True)) if output_format == "json" else click.echo
    results = []
    with contextlib.ExitStack() as stack:
        if local:
            url = stack.enter_context(serving_locally(local, out_dir, startup_timeout, say))
        for level in levels:
            say(f"concurrency {level}: {max(level, n_requests)} sessions ...")
            results.append(asyncio.run(bidi.bench_level(
                lambda: bidi.WebSocketChannel(url, timeout_s=timeout), settings, text, concurrency=level,
                piece_chars=piece_chars, piece_interval_s=piece_interval, sessions=max(level, n_requests))))
    report = {"kind": "bidi", "target": url, "piece_chars": piece_chars, "piece_interval_s": piece_interval,
              "text_chars": len(text), "levels": results}
    path = write_json(report, out_dir / "bench-bidi.json")
    if output_format == "json":
        click.echo(json.dumps(report))
    say(bidi.format_bench(results))
    say(f"wrote {path}")
    failed = [lv for lv in results if (lv["sessions"] - lv["ok"]) / lv["sessions"] > max_error_rate]
    if failed:
        example = next(iter(failed[0]["errors"]), "")
        raise FishSMError(f"{len(failed)} of {len(results)} level(s) over --max-error-rate {max_error_rate:g}: "
                          + ", ".join(f"concurrency {lv['concurrency']} {lv['sessions'] - lv['ok']}/{lv['sessions']} "
                                      "failed" for lv in failed) + (f"; e.g. {example}" if example else ""))
