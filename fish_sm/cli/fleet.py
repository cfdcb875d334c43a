"""Commands on endpoints that exist: status, delete."""

from __future__ import annotations

import json

import click

from fish_sm.cli.common import aws_options, friendly_errors, main, make_aws


@main.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@aws_options
@friendly_errors
def status(name, as_json, region, profile, endpoint_url):
    """Show endpoint NAME: state, instances, async config, autoscaling, alarms."""
    from fish_sm.aws.status import status as endpoint_status

    s = endpoint_status(make_aws(region, profile, endpoint_url), name)
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    click.echo(f"{s['name']}: {s['status']}" + (f" ({s['failure_reason']})" if s["failure_reason"] else ""))
    inst = s["instances"]
    click.echo(f"  config {s['endpoint_config']}, model {s['model']}")
    click.echo(f"  {s['instance_type']}: {inst['current']} running, {inst['desired']} desired")
    if s["async"]:
        a = s["async"]
        click.echo(f"  async: results {a['output']}, failures {a['failure']}"
                   + (f", {a['max_concurrent']} at once per instance" if a["max_concurrent"] else ""))
    if s["autoscaling"]:
        sc = s["autoscaling"]
        click.echo(f"  autoscaling {sc['min']}-{sc['max']} instances")
        for p in sc["policies"]:
            click.echo(f"    {p['name']} ({p['type']}" + (f", {p['metric']} target {p['target']:g}" if p["metric"] else "")
                       + ")")
    for a in s["alarms"]:
        click.echo(f"  alarm {a['name']}: {a['state']}")


@main.command()
@click.argument("name")
@aws_options
@friendly_errors
def delete(name, region, profile, endpoint_url):
    """Delete endpoint NAME and its configs, models, autoscaling and alarms (safe to repeat)."""
    from fish_sm.aws.delete import delete as delete_endpoint

    aws = make_aws(region, profile, endpoint_url)
    removed = delete_endpoint(aws, name)
    for line in removed:
        click.echo(line)
    if not removed:
        click.echo(f"nothing to delete: no endpoint {name}, nor configs, models, scaling or alarms of it, "
                   f"in {aws.region_name}")
