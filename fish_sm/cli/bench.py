"""`fish-sm bench`: load-test an endpoint, a server, or one started here."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import aws_options, friendly_errors, main, make_aws, one_target
from fish_sm.contract import AUDIO_TYPES


@main.command()
@click.argument("name", required=False)
@click.option("--url", help="Benchmark a running server over HTTP.")
@click.option("--local", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="MODEL_DIR",
              help="Start `fish-sm serve MODEL_DIR` on a free port, benchmark it, stop it.")
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
@click.option("--max-new-tokens", type=int, help="Cap the frames per text chunk (shorter runs).")
@click.option("--seed", type=int)
@click.option("--warmup", type=int, default=1, show_default=True, help="Unmeasured requests sent first.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"),
              show_default=True, help="Folder for bench.json and bench.html.")
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds per request.")
@click.option("--startup-timeout", type=float, default=900, show_default=True, help="--local: seconds to wait for /ping.")
@aws_options
@friendly_errors
def bench(name, url, local, concurrency, n_requests, texts, voice, fmt, stream, max_new_tokens, seed, warmup,
          out_dir, timeout, startup_timeout, region, profile, endpoint_url):
    """Load-test endpoint NAME, --url or --local: latency, throughput, real-time factor, errors,
    requests rejected by a full server, and with --stream the time to first audio."""
    import contextlib

    from fish_sm.clients import bench as b
    from fish_sm.clients.endpoint import EndpointTarget
    from fish_sm.clients.local_server import local_server
    from fish_sm.clients.report import format_table, write_html, write_json
    from fish_sm.clients.request import check_stream
    from fish_sm.clients.url import UrlTarget

    one_target(("NAME", name), ("--url", url), ("--local", local))
    if stream:
        check_stream(fmt)
    levels = b.parse_concurrency(concurrency)
    text_list = b.load_texts(texts) if texts else [{"text": t} for t in b.BUILTIN_TEXTS]
    base = {k: v for k, v in (("voice", voice), ("format", fmt), ("max_new_tokens", max_new_tokens),
                              ("seed", seed)) if v is not None}
    with contextlib.ExitStack() as stack:
        if local:
            click.echo(f"starting fish-sm serve {local} ...")
            url = stack.enter_context(local_server(local, log_path=out_dir / "serve.log",
                                                   startup_timeout_s=startup_timeout))
            click.echo(f"serving at {url} (log: {out_dir / 'serve.log'})")
        if url:
            target = UrlTarget(url, timeout_s=timeout)
        else:
            target = EndpointTarget(make_aws(region, profile, endpoint_url, max_pool_connections=max(levels) + 2), name)
        report = b.run_bench(target, concurrencies=levels, requests_per_level=n_requests, texts=text_list, base=base,
                             accept=AUDIO_TYPES[fmt], warmup=warmup, stream=stream, log=click.echo)
    json_path = write_json(report, out_dir / "bench.json")
    click.echo(format_table(report))
    click.echo(f"wrote {json_path}")
    html_path = write_html(report, out_dir / "bench.html")
    click.echo(f"wrote {html_path}")
