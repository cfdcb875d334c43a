"""Commands on endpoints that exist: list, status, logs, scale, delete."""

from __future__ import annotations

import json

import click

from fish_sm.cli.common import aws_options, friendly_errors, main, make_aws, output_format_option


@main.command(name="list")
@output_format_option
@aws_options
@friendly_errors
def list_(output_format, region, profile, endpoint_url):
    """List the endpoints fish-sm deployed: name, status, instance type, instances."""
    from fish_sm.aws.fleet import list_endpoints

    aws = make_aws(region, profile, endpoint_url)
    endpoints = list_endpoints(aws)
    if output_format == "json":
        click.echo(json.dumps({"region": aws.region_name, "endpoints": endpoints}, indent=2))
        return
    if not endpoints:
        click.echo(f"no fish-sm endpoints in {aws.region_name}")
        return
    rows = [("NAME", "STATUS", "INSTANCE TYPE", "INSTANCES")] + [
        (e["name"], e["status"], e["instance_type"] or "-",
         f"{e['instances']['current']}/{e['instances']['desired']}") for e in endpoints]
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


@main.command()
@click.argument("name")
@output_format_option
@click.option("--json", "as_json", is_flag=True, hidden=True, help="Deprecated: use --output json.")
@aws_options
@friendly_errors
def status(name, output_format, as_json, region, profile, endpoint_url):
    """Show endpoint NAME: state, instances, async config, autoscaling, alarms; for an endpoint of
    inference components, each component's state, copies (current/desired) and autoscaling."""
    from fish_sm.aws.status import status as endpoint_status

    s = endpoint_status(make_aws(region, profile, endpoint_url), name)
    if as_json or output_format == "json":
        click.echo(json.dumps(s, indent=2))
        return
    click.echo(f"{s['name']}: {s['status']}" + (f" ({s['failure_reason']})" if s["failure_reason"] else ""))
    inst = s["instances"]
    click.echo(f"  config {s['endpoint_config']}" + (f", model {s['model']}" if s["model"] else ""))
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
    if s.get("components") is not None:
        pool = s["instance_pool"]
        click.echo(f"  instance pool: {pool['min']}-{pool['max']} instances as the components' copies need")
        for c in s["components"]:
            copies = c["copies"]
            per_copy = (f"{c['accelerators']:g} GPU, " if c["accelerators"] else "") + f"{c['memory_mb']} MB a copy"
            click.echo(f"  component {c['name']}: {c['status']}, {copies['current']}/{copies['desired']} copies "
                       f"(current/desired), model {c['model']}, {per_copy}"
                       + (f" ({c['failure_reason']})" if c["failure_reason"] else ""))
            if c["autoscaling"]:
                sc = c["autoscaling"]
                click.echo(f"    autoscaling {sc['min']}-{sc['max']} copies"
                           + "".join(f"; {p['name']} ({p['type']}" + (f", {p['metric']} target {p['target']:g}"
                                                                       if p["metric"] else "") + ")"
                                     for p in sc["policies"]))
        if not s["components"]:
            click.echo(f"  no components yet: add one with `fish-sm deploy {s['name']} --component NAME ...`")
    for a in s["alarms"]:
        click.echo(f"  alarm {a['name']}: {a['state']}")


@main.command()
@click.argument("name")
@click.option("--since", default="10m", show_default=True, help="How far back to start: 90s, 10m, 2h, 1d.")
@click.option("--tail", type=click.IntRange(min=0), help="Only the last N events of that span.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until interrupted (Ctrl-C).")
@aws_options
@friendly_errors
def logs(name, since, tail, follow, region, profile, endpoint_url):
    """Print endpoint NAME's container logs (CloudWatch Logs group /aws/sagemaker/Endpoints/NAME),
    every instance's stream interleaved by time."""
    import datetime

    from fish_sm.aws.logs import endpoint_logs, parse_since

    events = endpoint_logs(make_aws(region, profile, endpoint_url), name, since_s=parse_since(since), tail=tail,
                           follow=follow)
    try:
        for e in events:
            when = datetime.datetime.fromtimestamp(e["timestamp"] / 1000, datetime.timezone.utc)
            click.echo(f"{when:%Y-%m-%dT%H:%M:%S.%f}"[:-3] + f"Z {e.get('logStreamName', '')} "
                       f"{e['message'].rstrip()}")
    except KeyboardInterrupt:  # the way out of --follow
        pass


@main.command()
@click.argument("name")
@click.option("--instances", type=click.IntRange(min=0),
              help="Instances to run now (0 only for async endpoints). Autoscaling limits that exclude it are "
                   "widened to include it.")
@click.option("--component", metavar="COMPONENT", help="An inference component of NAME, whose --copies to set.")
@click.option("--copies", type=click.IntRange(min=0),
              help="With --component: copies to run now (UpdateInferenceComponentRuntimeConfig; 0 scales it to "
                   "zero). Autoscaling limits that exclude it are widened to include it.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until the endpoint is InService again.")
@click.option("--poll", type=float, default=15.0, show_default=True, help="Seconds between status checks.")
@aws_options
@friendly_errors
def scale(name, instances, component, copies, wait, poll, region, profile, endpoint_url):
    """Set endpoint NAME's instance count now (UpdateEndpointWeightsAndCapacities), or with
    --component C --copies N a component's copies."""
    if component is not None or copies is not None:
        if component is None or copies is None or instances is not None:
            raise click.UsageError("give --component C with --copies N (and no --instances: a component "
                                   "endpoint's instances follow its copies)")
        from fish_sm.aws.components import scale_copies

        s = scale_copies(make_aws(region, profile, endpoint_url), name, component, copies, wait=wait, poll_s=poll,
                         log=click.echo)
        c = s["copies"]
        click.echo(f"{name} component {component}: {s['status']}, {c['current']} running, {c['desired']} desired")
        return
    if instances is None:
        raise click.UsageError("give --instances N, or --component C --copies N")
    from fish_sm.aws.fleet import scale as scale_endpoint

    s = scale_endpoint(make_aws(region, profile, endpoint_url), name, instances, wait=wait, poll_s=poll,
                       log=click.echo)
    inst = s["instances"]
    click.echo(f"{name}: {s['status']}, {inst['current']} running, {inst['desired']} desired")


@main.command()
@click.argument("name")
@click.option("--wait/--no-wait", default=False, show_default=True,
              help="Return once SageMaker has finished deleting the endpoint.")
@click.option("--poll", type=float, default=15.0, show_default=True, help="With --wait: seconds between checks.")
@aws_options
@friendly_errors
def delete(name, wait, poll, region, profile, endpoint_url):
    """Delete endpoint NAME and its configs, models, autoscaling and alarms (safe to repeat); its
    inference components first, waiting until they are gone."""
    from fish_sm.aws.delete import delete as delete_endpoint

    aws = make_aws(region, profile, endpoint_url)
    removed = delete_endpoint(aws, name, wait=wait, poll_s=poll)
    for line in removed:
        click.echo(line)
    if not removed:
        click.echo(f"nothing to delete: no endpoint {name}, nor configs, models, scaling or alarms of it, "
                   f"in {aws.region_name}")
