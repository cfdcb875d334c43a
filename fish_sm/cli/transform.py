"""`fish-sm transform`: a Batch Transform job over JSON Lines requests."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import aws_options, friendly_errors, human_size, main, make_aws


@main.command()
@click.argument("name")
@click.option("--input", "source", required=True, metavar="s3://...", help="JSON Lines requests (a prefix or one object).")
@click.option("--output", "dest", required=True, metavar="s3://.../", help="Prefix for the JSON Lines results.")
@click.option("--instances", type=int, default=1, show_default=True)
@click.option("--instance-type", help="Default: the endpoint's.")
@click.option("--wait/--no-wait", default=True, show_default=True)
@click.option("--download", type=click.Path(file_okay=False, path_type=Path), help="Also fetch the results here.")
@click.option("--poll", type=float, default=30.0, show_default=True, help="Seconds between status checks.")
@aws_options
@friendly_errors
def transform(name, source, dest, instances, instance_type, wait, download, poll, region, profile, endpoint_url):
    """Run a Batch Transform job with the model of endpoint (or model) NAME over JSON Lines.

    Exits non-zero unless the job completed with a result file for every input (those that
    came are listed, and downloaded with --download, first)."""
    from fish_sm.aws import AWSError
    from fish_sm.aws.s3 import S3Uri, download_file, parse_s3_uri
    from fish_sm.aws.transform import run_transform
    from fish_sm.cli.progress import ByteProgress

    if download and not wait:
        raise click.UsageError("--download needs the job to finish: leave out --no-wait")
    src = parse_s3_uri(source, what="--input")
    out = parse_s3_uri(dest, what="--output", prefix=True)
    aws = make_aws(region, profile, endpoint_url)
    result = run_transform(aws, name, src, out, instances=instances, instance_type=instance_type, wait=wait,
                           poll_s=poll, log=click.echo)
    if not wait:
        click.echo(f"transform job {result.job_name} started; results will be under {out}")
        return
    click.echo(f"transform job {result.job_name} {result.status}: {len(result.outputs)} result file(s) "
               f"for {len(result.inputs)} input(s) under {out}")
    for o in result.outputs:
        uri = S3Uri(out.bucket, o["Key"])
        line = f"  {uri}  {human_size(o.get('Size', 0))}"
        if download:
            with ByteProgress(f"downloading {Path(uri.key).name}") as bar:
                line += f" -> {download_file(aws, uri, download / o['Key'][len(out.key):], progress=bar)}"
        click.echo(line)
    problem = result.problem()
    if problem:
        raise AWSError(problem)
