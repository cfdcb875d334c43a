"""`fish-sm metrics`: an endpoint's recent metrics from CloudWatch, in the terminal."""

from __future__ import annotations

import json

import click

from fish_sm.cli.common import aws_options, friendly_errors, main, make_aws, output_format_option


@main.command()
@click.argument("name")
@click.option("--minutes", type=click.IntRange(1, 1440), default=15, show_default=True,
              help="The window: each figure over the last this many minutes.")
@output_format_option
@aws_options
@friendly_errors
def metrics(name, minutes, output_format, region, profile, endpoint_url):
    """Recent metrics of endpoint NAME: its servers' (requests, rejections, errors, first audio,
    real-time factor, queue wait, batch occupancy, from their EMF lines) and SageMaker's
    (invocations, 5XX, model latency). Exits 1 when the endpoint has no data or does not exist."""
    from fish_sm.aws.metrics import recent_metrics

    figures = recent_metrics(make_aws(region, profile, endpoint_url), name, minutes)
    if output_format == "json":
        click.echo(json.dumps({"name": name, "minutes": minutes, "metrics": [
            {"label": f.label, "namespace": f.namespace, "metric": f.metric, "statistic": f.statistic,
             "unit": f.unit, "server": f.server, "value": f.value} for f in figures]}, indent=2))
        return
    rows = [["figure", "value", "metric"]]
    for f in figures:
        value = "-" if f.value is None else f"{f.value:,.{0 if f.statistic == 'Sum' else 2}f}" + (
            f" {f.unit}" if f.unit else "")
        where = f"{f.namespace} {f.metric} {f.statistic}" + (f" ({f.server})" if f.server else "")
        rows.append([f.label, value, where])
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    click.echo(f"endpoint {name}, last {minutes} minute(s):")
    for i, r in enumerate(rows):
        click.echo(f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2]}")
        if i == 0:
            click.echo(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * len(r[2])}")
