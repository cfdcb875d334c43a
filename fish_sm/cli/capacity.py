"""`fish-sm capacity`: how many real-time listeners an endpoint, a server or one started here keeps fed."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import (aws_options, friendly_errors, main, make_aws, one_target, output_format_option,
                                over_error_rate, publish_report, serving_locally)

DEFAULT_STREAMS = "8,16,32,64,128,256,512,1024"


@main.command()
@click.argument("name", required=False)
@click.option("--url", help="Measure a running server over HTTP.")
@click.option("--local", type=click.Path(exists=True, path_type=Path), metavar="MODEL",
              help="Start `fish-sm serve MODEL` on a free port with this environment (set "
                   "FISH_SM_BENCHMARK_LENGTHS=true for random weights), measure it, stop it.")
@click.option("--streams", metavar="N,...",
              help="Open loop: offered concurrent real-time streams, comma-separated; ramped in ascending order "
                   f"[default, without --listeners: {DEFAULT_STREAMS}].")
@click.option("--listeners", metavar="N,...",
              help="Closed loop instead: N listeners per level, each asking again as soon as its answer has "
                   "played; comma-separated, ramped in ascending order.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds of arrivals (closed loop: of asking) per level; its answers are then awaited.")
@click.option("--arrivals", type=click.Choice(["poisson", "fixed"]), default="poisson", show_default=True,
              help="Open-loop arrivals at streams / mean audio seconds a second: Poisson or evenly spaced.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the arrivals (or the listeners' first requests) and the mix.")
@click.option("--slo-first-audio-ms", type=float, default=500.0, show_default=True,
              help="A level passes when its streams' p99 time to first audio is at most this ...")
@click.option("--slo-underrun", type=click.FloatRange(0, 1), default=0.001, show_default=True,
              help="... and the time listeners wait after playback began is at most this fraction of playback.")
@click.option("--max-error-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="The fraction of a level's requests that may bring no audio (errors and rejections by a full "
                   "server) for it to pass; errors other than rejections over it fail the run (exit 1).")
@click.option("--voice", help="A packaged voice for --voice-share of the requests.")
@click.option("--voice-share", type=click.FloatRange(0, 1), help="Default 0.25 with --voice, else 0.")
@click.option("--reference", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="AUDIO",
              help="A recording sent inline as a zero-shot reference by --reference-share of the requests.")
@click.option("--reference-text", help="Transcript of --reference.")
@click.option("--reference-share", type=click.FloatRange(0, 1), help="Default 0.1 with --reference, else 0.")
@click.option("--whole-share", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="Requests answered whole rather than streamed: load, not held to the streams' SLO.")
@click.option("--chars-per-second", type=click.FloatRange(min=0, min_open=True), default=15.0, show_default=True,
              help="Speaking rate of the intended lengths: max_new_tokens = characters / rate x 21.5 frames/s.")
@click.option("--forced-lengths", is_flag=True,
              help="State that the server forces request lengths (FISH_SM_BENCHMARK_LENGTHS=true) when it cannot "
                   "say so itself (an endpoint).")
@click.option("--gpus", type=click.IntRange(min=1),
              help="GPUs per instance (default: the endpoint's or --instance-type's, from EC2; a server's workers; 1).")
@click.option("--instance-type", metavar="ml.TYPE",
              help="The SageMaker instance type a --url/--local run stands for (its price and GPUs).")
@click.option("--price", type=click.FloatRange(min=0, min_open=True), metavar="USD_PER_HOUR",
              help="An instance's hourly price (default: on-demand, from the AWS Pricing API, for the endpoint's "
                   "or --instance-type's type).")
@click.option("--keep-going", is_flag=True, help="Run every level, not stopping after the first that fails the SLO.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Unmeasured requests sent first.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True, help="Folder for bench.json and bench.html.")
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds per request.")
@click.option("--startup-timeout", type=float, default=900, show_default=True, help="--local: seconds to wait for /ping.")
@output_format_option
@aws_options
@friendly_errors
def capacity(name, url, local, streams, listeners, duration, arrivals, seed, slo_first_audio_ms, slo_underrun,
             max_error_rate, voice, voice_share, reference, reference_text, reference_share, whole_share,
             chars_per_second, forced_lengths, gpus, instance_type, price, keep_going, warmup, out_dir, timeout,
             startup_timeout, output_format, region, profile, endpoint_url):
    """Concurrent real-time streams that endpoint NAME, --url or --local serves within an SLO.

    Requests arrive open-loop (--streams), a mix of texts, voices and whole answers, or come from
    a closed-loop population of --listeners, each asking again when its answer has played; each
    stream is played at real time, its first audio and underruns recorded. The levels ramp up;
    the largest level up to which every level meets the SLO is the capacity, reported per GPU,
    in audio-hours per instance-hour and in dollars per audio-hour. Writes bench.json and
    bench.html; exits 1 when no level meets the SLO or errors pass --max-error-rate."""
    import contextlib

    from fish_sm.clients import capacity as cap
    from fish_sm.clients.endpoint import EndpointTarget, endpoint_instances
    from fish_sm.clients.report import capacity_lines, format_capacity_table
    from fish_sm.clients.request import reference_audio
    from fish_sm.clients.url import UrlTarget, server_info
    from fish_sm.errors import FishSMError, InputError

    one_target(("NAME", name), ("--url", url), ("--local", local))
    if streams is not None and listeners is not None:
        raise InputError("give either --streams (an open loop of offered streams) or --listeners (a closed loop "
                         "of listeners), not both")
    if (reference is None) != (reference_text is None):
        raise click.UsageError("--reference and --reference-text go together")
    population = "closed loop" if listeners is not None else "open loop"
    unit = cap.unit_of(population)
    levels = (cap.parse_streams(listeners, "--listeners") if listeners is not None
              else cap.parse_streams(streams if streams is not None else DEFAULT_STREAMS))
    mix = cap.Mix(chars_per_second=chars_per_second, voice=voice,
                  voice_share=voice_share if voice_share is not None else cap.VOICE_SHARE if voice else 0.0,
                  reference=(reference_audio(str(reference)), reference_text) if reference else None,
                  reference_share=(reference_share if reference_share is not None
                                   else cap.REFERENCE_SHARE if reference else 0.0),
                  whole_share=whole_share)
    say = (lambda line: click.echo(line, err=True)) if output_format == "json" else click.echo
    notes: list[str] = []
    # Lazy: nothing is asked of AWS unless an endpoint or an instance type is named.
    aws = make_aws(region, profile, endpoint_url, max_pool_connections=2 * max(levels) + 8)
    instances, server = 1, None
    with contextlib.ExitStack() as stack:
        if local:
            url = stack.enter_context(serving_locally(local, out_dir, startup_timeout, say))
        if url:
            target = UrlTarget(url, timeout_s=timeout)
            device, server = server_info(url)
            if gpus is None and not instance_type and isinstance((server or {}).get("load"), list):
                gpus = max(1, len(server["load"]))  # the batching server runs one worker per GPU
        else:
            device = endpoint_instances(aws, name)  # also refuses an endpoint that is missing or not in service
            target = EndpointTarget(aws, name)
            instance_type, instances = cap.endpoint_hardware(aws, name)
        if gpus is None and instance_type:
            gpus = _instance_gpus(aws, instance_type, notes)
        price_doc = instance_price(aws, instance_type, price, notes)
        lengths = ("forced by the server's benchmark setting (FISH_SM_BENCHMARK_LENGTHS)"
                   if (server or {}).get("benchmark_lengths") else
                   "stated forced (--forced-lengths)" if forced_lengths else
                   "not forced: max_new_tokens caps each request; random weights stop at random frames, so the "
                   "load may be lighter than intended (see audio_vs_intended)")
        report = cap.run_capacity(
            target, levels=levels, duration_s=duration, mix=mix, population=population, arrivals=arrivals, seed=seed,
            slo_first_audio_ms=slo_first_audio_ms, slo_underrun=slo_underrun, max_error_rate=max_error_rate,
            warmup=warmup, keep_going=keep_going, gpus=gpus or 1, instances=instances, price=price_doc,
            lengths=lengths, device=device, server=server, notes=notes, log=say)
    if local:
        report["target"] = f"local {local} (served at {report['target']})"
    if instance_type:
        report["capacity"]["instance_type"] = instance_type
    publish_report(report, out_dir, [format_capacity_table(report), *capacity_lines(report)], output_format, say)
    broken = [lv for lv in report["levels"] if lv["broken"]]
    if broken:
        raise over_error_rate(broken, len(report["levels"]), max_error_rate,
                              lambda lv: f"{cap.level_of(lv)} {unit} "
                                         f"{sum(lv['errors'].values())}/{lv['requests']} failed")
    if not report["passed"]:
        first = report["levels"][0]
        raise FishSMError(f"no level meets the SLO: {cap.level_of(first)} {unit}: {'; '.join(first['slo_failures'])}")


def _instance_gpus(aws, instance_type: str, notes: list[str]) -> int | None:
    """GPUs of instance_type from EC2, or None with a note saying why not."""
    from fish_sm.aws.instances import instance_gpus

    try:
        return instance_gpus(aws, instance_type) or None
    except Exception as exc:  # no credentials, denied, unknown: the figures fall back to 1 GPU, said so
        notes.append(f"GPUs of {instance_type} unknown ({' '.join(str(exc).split())[:200]}); counted as 1, "
                     "or pass --gpus N")
        return None


def instance_price(aws, instance_type: str | None, price: float | None, notes: list[str]) -> dict | None:
    """{"usd_per_hour", "source"}: --price, else the on-demand price of instance_type from the
    Pricing API; None with a note when neither is to be had."""
    if price is not None:
        return {"usd_per_hour": price, "source": "--price"}
    if not instance_type:
        notes.append("no price: pass --price USD_PER_HOUR, or --instance-type to look it up, for $ per audio-hour")
        return None
    from fish_sm.aws.pricing import on_demand_price

    try:
        found = on_demand_price(aws, instance_type, aws.region_name)
    except Exception as exc:  # offline, no credentials, denied, not listed: the run goes on without $
        notes.append(f"no price for {instance_type}: {' '.join(str(exc).split())[:300]}")
        return None
    return {"usd_per_hour": found.usd_per_hour,
            "source": f"AWS Pricing API, on-demand {found.instance_type} in {found.region}: {found.description}"}
