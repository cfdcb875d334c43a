"""`fish-sm bench`: load-test an endpoint, a server, or one started here."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import (aws_options, friendly_errors, main, make_aws, one_target, output_format_option,
                                over_error_rate, publish_report, serving_locally)
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
@click.option("--adapters", "n_adapters", type=click.IntRange(min=1),
              help="Spread the requests over N LoRA adapters, round-robin: the first N of --adapter-names, else of "
                   "the --local package's adapters, else of the endpoint's (`fish-sm adapters list`).")
@click.option("--adapter-names", metavar="A,B,...",
              help="The adapters --adapters uses (all of them without --adapters).")
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
@click.option("--clear-after", type=click.FloatRange(min=0), default=None,
              help="--bidi: barge in (clear, keeping the session) this many seconds after the first audio, then say "
                   "one more sentence; reports the time to the server's 'cleared' and that sentence's first audio.")
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
def bench(name, url, local, concurrency, n_requests, texts, voice, n_adapters, adapter_names, fmt, stream, bidi,
          piece_chars, clear_after, piece_interval, component, max_new_tokens, seed,
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

    one_target(("NAME", name), ("--url", url), ("--local", local))
    if clear_after is not None and not bidi:
        raise click.UsageError("--clear-after is for --bidi sessions")
    if bidi:
        if name or stream or n_adapters or adapter_names:
            raise click.UsageError("--bidi benchmarks a server (--url or --local) over its WebSocket, without --stream "
                                   "or --adapters")
        return _bench_bidi(url, local, concurrency, n_requests, texts, voice, max_new_tokens, seed, piece_chars,
                           piece_interval, max_error_rate, out_dir, timeout, startup_timeout, output_format,
                           clear_after)
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
    # Before a --local server starts: too few adapters is known without it.
    adapters = bench_adapters(n_adapters, adapter_names, local=local, endpoint=name, component=component, aws=aws)
    if adapters:
        say(f"spreading the requests over {len(adapters)} adapter(s), round-robin: {', '.join(adapters)}")
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
                             instance_type=instance_type, notes=notes, adapters=adapters, log=say)
    if local:
        report["target"] = f"local {local} (served at {report['target']})"
    adapter_line = [f"requests spread over {len(adapters)} adapter(s): {', '.join(adapters)}"] if adapters else []
    publish_report(report, out_dir, [format_table(report), *adapter_line, *verdict_lines(report)], output_format, say)
    failed = [lv for lv in report["levels"] if not lv["passed"]]
    if failed:
        raise over_error_rate(failed, len(report["levels"]), max_error_rate,
                              lambda lv: f"concurrency {lv['concurrency']} "
                                         f"{lv['requests'] - lv['ok']}/{lv['requests']} failed")


def bench_adapters(count: int | None, names: str | None, *, local: Path | None, endpoint: str | None,
                   component: str | None, aws) -> list[str]:
    """The adapter names `bench --adapters N` spreads its requests over: the first N of --adapter-names,
    else of the --local package's manifest, else of the endpoint's adapters; too few is an error."""
    from fish_sm.contract import check_adapter_name
    from fish_sm.errors import InputError

    if count is None and not names:
        return []
    if names:
        available = [n.strip() for n in names.split(",") if n.strip()]
        for n in available:
            check_adapter_name(n, lambda message: InputError(f"--adapter-names: {message}"))
        where = "--adapter-names"
        if len(set(available)) != len(available):
            raise InputError(f"--adapter-names names an adapter twice: {names}")
    elif local is not None:
        available, where = local_adapter_names(local), f"the package {local}"
    elif endpoint:
        from fish_sm.aws.adapters import endpoint_model, list_adapters

        available = list(dict.fromkeys(a.name for a in list_adapters(aws, endpoint_model(aws, endpoint, component))))
        where = f"endpoint {endpoint}"
    else:
        raise InputError("--adapters with --url needs the names: --adapter-names A,B,...")
    count = len(available) if count is None else count
    if len(available) < count:
        shown = ", ".join(available[:8]) + (", ..." if len(available) > 8 else "")
        raise InputError(f"--adapters {count}: {where} has only {len(available)} adapter(s)"
                         + (f" ({shown})" if available else ""))
    return available[:count]


def local_adapter_names(model: Path) -> list[str]:
    """The adapters a --local MODEL holds: its manifest.json's (a package directory, or model.tar.gz's
    first entry); a plain checkpoint has none."""
    import json
    import tarfile

    from fish_sm.errors import InputError

    model = Path(model)
    try:
        if model.is_dir():
            manifest_path = model / "manifest.json"
            manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else {}
        else:
            with tarfile.open(model, mode="r|gz") as tar:
                first = next(iter(tar), None)
                reader = tar.extractfile(first) if first is not None and first.name == "manifest.json" else None
                manifest = json.loads(reader.read()) if reader is not None else {}
    except (OSError, ValueError, tarfile.TarError) as exc:
        raise InputError(f"--local {model}: cannot read its manifest.json ({exc})") from None
    adapters = manifest.get("adapters") if isinstance(manifest, dict) else None
    return sorted(adapters) if isinstance(adapters, dict) else []


def _bench_bidi(url, local, concurrency, n_requests, texts, voice, max_new_tokens, seed, piece_chars, piece_interval,
                max_error_rate, out_dir, timeout, startup_timeout, output_format, clear_after=None):
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
                piece_chars=piece_chars, piece_interval_s=piece_interval, sessions=max(level, n_requests),
                clear_after_s=clear_after)))
    report = {"kind": "bidi", "target": url, "piece_chars": piece_chars, "piece_interval_s": piece_interval,
              "text_chars": len(text), "clear_after_s": clear_after, "levels": results}
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
