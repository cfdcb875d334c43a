"""AWS commands: package, deploy, invoke, bench, transform, status, delete.

Thin: options are parsed here and the work is done in fish_sm.aws (AWS resources) and
fish_sm.clients (requests to a server or endpoint), with progress bars from cli.progress.
boto3 is imported only when a command runs; botocore's errors become one-line messages like
our own.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from fish_sm.cli.common import friendly_errors, main
from fish_sm.contract import AUDIO_TYPES


def aws_options(fn):
    """--region, --profile, --endpoint-url: every AWS command takes them."""
    fn = click.option("--endpoint-url", metavar="URL",
                      help="Send every AWS call to this URL (a moto or LocalStack server, a proxy).")(fn)
    fn = click.option("--profile", help="AWS profile from ~/.aws/config.")(fn)
    fn = click.option("--region", help="AWS region (default: the profile's or AWS_REGION).")(fn)
    return fn


def _aws(region, profile, endpoint_url, **kwargs):
    from fish_sm.aws.session import AWS

    return AWS(region=region, profile=profile, endpoint_url=endpoint_url, **kwargs)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


# --- package ------------------------------------------------------------------------------

@main.command()
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("model.tar.gz"),
              show_default=True, help="The tarball to write.")
@click.option("--voice", "voices", multiple=True, metavar="ID=AUDIO[:TRANSCRIPT]",
              help="A voice to ship with the model: TRANSCRIPT is the text or @FILE; without it AUDIO's "
                   ".txt/.lab sidecar is read. Repeatable.")
@click.option("--compile-cache", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A torch.compile cache built on the target GPU, shipped to skip compiling at start-up.")
@click.option("--upload", metavar="s3://BUCKET/PREFIX/", help="Upload the tarball here (a prefix gets its file name).")
@click.option("--part-size", type=click.IntRange(5, 5 * 1024), default=64, show_default=True,
              help="MiB per part of the multipart upload (S3 allows 5 MiB to 5 GiB).")
@click.option("--compress-level", type=click.IntRange(0, 9), default=1, show_default=True,
              help="gzip level; weights barely compress, so 1 saves minutes.")
@aws_options
@friendly_errors
def package(checkpoint_dir, output, voices, compile_cache, upload, part_size, compress_level,
            region, profile, endpoint_url):
    """Build model.tar.gz from CHECKPOINT_DIR (or archive an already built package directory).

    The archive is reproducible: the same inputs give the same bytes and sha256.
    """
    import tempfile

    from fish_sm.aws.package import upload as upload_tarball
    from fish_sm.aws.s3 import MIB, check_bucket, parse_s3_uri
    from fish_sm.cli.package_inputs import is_package_dir, parse_voice_specs
    from fish_sm.cli.progress import ByteProgress, FileProgress
    from fish_sm.package.tarball import make_tarball

    def archive(src: Path):
        with ByteProgress(f"archiving {output.name}") as bar:
            return make_tarball(src, output, compresslevel=compress_level, progress=bar)

    dest = parse_s3_uri(upload, what="--upload") if upload else None
    if dest is not None:  # fail before the long work, not after it
        aws = _aws(region, profile, endpoint_url)
        check_bucket(aws, dest)
    parsed = parse_voice_specs(voices)
    if is_package_dir(checkpoint_dir):
        if parsed or compile_cache:
            raise click.UsageError(f"{checkpoint_dir} is a built package: --voice and --compile-cache apply "
                                   "only when packaging a checkpoint")
        from fish_sm.package.verify import verify_package

        verify_package(checkpoint_dir)  # a package changed since it was built is refused, not shipped
        tarball = archive(checkpoint_dir)
    else:
        from fish_sm.package.build import build_package_dir

        output.parent.mkdir(parents=True, exist_ok=True)
        # Next to the output rather than in /tmp: the package is as big as the checkpoint.
        with tempfile.TemporaryDirectory(prefix=".fish-sm-package-", dir=output.parent) as tmp:
            package_dir = Path(tmp) / "model"
            with FileProgress() as progress:
                build_package_dir(checkpoint_dir, package_dir, parsed, compile_cache, progress=progress)
            tarball = archive(package_dir)
    click.echo(f"wrote {tarball.path}: {_human(tarball.size)}, {tarball.files} files, sha256 {tarball.sha256}"
               + (f", voices: {', '.join(parsed)}" if parsed else ""))
    if dest is not None:
        with ByteProgress(f"uploading {tarball.path.name}") as bar:
            uri = upload_tarball(aws, tarball.path, dest, part_size=part_size * MIB, progress=bar)
        click.echo(str(uri))


# --- deploy -------------------------------------------------------------------------------

@main.command()
@click.argument("name")
@click.option("--model-data", required=True, metavar="s3://...", help="The model.tar.gz made by `fish-sm package`.")
@click.option("--role", required=True, metavar="ARN", help="IAM role SageMaker runs the model with.")
@click.option("--image", metavar="URI", help="Container image: fish-sm's own (see deploy/), or any.")
@click.option("--stock-container", is_flag=True,
              help="Run on AWS's PyTorch inference image with code/inference.py (image from the sagemaker SDK "
                   "unless --image).")
@click.option("--instance-type", default="ml.g5.xlarge", show_default=True)
@click.option("--instances", type=int, default=1, show_default=True, help="Instances to start with.")
@click.option("--min", "min_instances", type=int, help="Autoscaling minimum (default: --instances).")
@click.option("--max", "max_instances", type=int, help="Autoscaling maximum; turns autoscaling on.")
@click.option("--target", type=float,
              help="Target value of the scaling metric per instance. Default for concurrency: on fish-sm's image "
                   "(the batching server) half of its batch slots, FISH_SM_MAX_BATCH (64 unless --env) x the "
                   "instance's GPUs, e.g. 128 on ml.g5.12xlarge; with --stock-container or --env FISH_SM_SERVER=mms, "
                   "2. Invocations: 60 a minute for every server (it depends on text length: measure req/s with "
                   "`fish-sm bench` and pass --target). Async backlog: 2.")
@click.option("--metric", type=click.Choice(["concurrency", "invocations"]), default="concurrency", show_default=True,
              help="Real-time scaling metric: concurrent requests (high resolution; follows the server's slots) or "
                   "invocations a minute.")
@click.option("--async", "is_async", is_flag=True, help="Asynchronous inference: requests and results in S3.")
@click.option("--output", "async_output", metavar="s3://...", help="Async: where results go.")
@click.option("--failure", "async_failure", metavar="s3://...", help="Async: where errors go (default: OUTPUT-failures/).")
@click.option("--sns-success", metavar="ARN", help="Async: SNS topic told of each result.")
@click.option("--sns-error", metavar="ARN", help="Async: SNS topic told of each failure.")
@click.option("--max-concurrent", type=int, help="Async: requests one instance works on at once.")
@click.option("--scale-to-zero", is_flag=True, help="Async: scale to 0 instances when idle, back up on a backlog.")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE",
              help="Container environment, e.g. FISH_SM_COMPILE=1. Repeatable.")
@click.option("--startup-timeout", type=int, default=1800, show_default=True,
              help="Seconds the container may take to pass its first /ping (warm-up).")
@click.option("--download-timeout", type=int, default=1800, show_default=True,
              help="Seconds for downloading model.tar.gz.")
@click.option("--bake", type=int, default=300, show_default=True,
              help="Updates: seconds the new fleet serves before the old one goes (rollback window).")
@click.option("--rollback-errors", type=int, default=1, show_default=True,
              help="Updates: 5XX errors in a minute that trigger the rollback.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until InService (needed for autoscaling).")
@click.option("--poll", type=float, default=15.0, show_default=True, help="Seconds between status checks.")
@aws_options
@friendly_errors
def deploy(name, model_data, role, image, stock_container, instance_type, instances, min_instances, max_instances,
           target, metric, is_async, async_output, async_failure, sns_success, sns_error, max_concurrent,
           scale_to_zero, env_pairs, startup_timeout, download_timeout, bake, rollback_errors, wait, poll,
           region, profile, endpoint_url):
    """Create endpoint NAME, or update it blue/green with automatic rollback.

    Autoscaling options give the wanted state: a deploy without --max (or --scale-to-zero)
    removes autoscaling the endpoint had.
    """
    from fish_sm.aws.autoscaling import make_autoscaling
    from fish_sm.aws.container import parse_env
    from fish_sm.aws.deploy import deploy as deploy_endpoint
    from fish_sm.aws.deploy_request import DeployRequest, make_async
    from fish_sm.aws.s3 import parse_s3_uri

    async_only = {"--output": async_output, "--failure": async_failure, "--sns-success": sns_success,
                  "--sns-error": sns_error, "--max-concurrent": max_concurrent, "--scale-to-zero": scale_to_zero or None}
    if not is_async:
        given = [flag for flag, v in async_only.items() if v is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} only apply with --async")
        async_options = None
    else:
        if not async_output:
            raise click.UsageError("--async needs --output s3://bucket/prefix/")
        async_options = make_async(parse_s3_uri(async_output, what="--output", prefix=True),
                                   parse_s3_uri(async_failure, what="--failure", prefix=True) if async_failure else None,
                                   sns_success, sns_error, max_concurrent)
    env = parse_env(env_pairs)
    request = DeployRequest(
        name=name, model_data=parse_s3_uri(model_data, what="--model-data", prefix=False), role=role,
        instance_type=instance_type, image=image, stock_container=stock_container, instances=instances, env=env,
        autoscaling=make_autoscaling(instances=instances, min_instances=min_instances, max_instances=max_instances,
                                     target=target, metric=metric, is_async=is_async, scale_to_zero=scale_to_zero,
                                     instance_type=instance_type, env=env, stock_container=stock_container),
        async_options=async_options, startup_timeout=startup_timeout, download_timeout=download_timeout,
        bake_seconds=bake, rollback_errors=rollback_errors)
    result = deploy_endpoint(_aws(region, profile, endpoint_url), request, wait=wait, poll_s=poll, log=click.echo)
    if result.endpoint is not None:
        click.echo(f"endpoint {name} {result.action} and InService on {result.config_name}")
    else:
        click.echo(f"endpoint {name} is being {result.action}; follow it with `fish-sm status {name}`")


# --- invoke -------------------------------------------------------------------------------

def _sampling_options(fn):
    for opt in reversed([
        click.option("--seed", type=int), click.option("--temperature", type=float), click.option("--top-p", type=float),
        click.option("--repetition-penalty", type=float), click.option("--max-new-tokens", type=int),
        click.option("--chunk-length", type=int), click.option("--sample-rate", type=int),
    ]):
        fn = opt(fn)
    return fn


def _one_target(*choices: tuple[str, object]) -> None:
    """Exactly one of the (label, value) pairs must be given."""
    if sum(1 for _, v in choices if v) != 1:
        raise click.UsageError(f"give exactly one of {', '.join(label for label, _ in choices)}")


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

    _one_target(("NAME", name), ("--url", url))
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
        response = invoke_async(_aws(region, profile, endpoint_url), name, request, accept, input_location=loc,
                                timeout_s=timeout, poll_s=poll, log=click.echo)
    else:
        response = EndpointTarget(_aws(region, profile, endpoint_url), name).send(request, accept)
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
               + f"{_human(len(response.body))} {response.content_type}, {timing}")


# --- bench --------------------------------------------------------------------------------

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

    _one_target(("NAME", name), ("--url", url), ("--local", local))
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
            target = EndpointTarget(_aws(region, profile, endpoint_url, max_pool_connections=max(levels) + 2), name)
        report = b.run_bench(target, concurrencies=levels, requests_per_level=n_requests, texts=text_list, base=base,
                             accept=AUDIO_TYPES[fmt], warmup=warmup, stream=stream, log=click.echo)
    json_path = write_json(report, out_dir / "bench.json")
    click.echo(format_table(report))
    click.echo(f"wrote {json_path}")
    html_path = write_html(report, out_dir / "bench.html")
    click.echo(f"wrote {html_path}")


# --- transform, status, delete ------------------------------------------------------------

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
    """Run a Batch Transform job with the model of endpoint (or model) NAME over JSON Lines."""
    from fish_sm.aws.s3 import S3Uri, download_file, parse_s3_uri
    from fish_sm.aws.transform import run_transform
    from fish_sm.cli.progress import ByteProgress

    if download and not wait:
        raise click.UsageError("--download needs the job to finish: leave out --no-wait")
    src = parse_s3_uri(source, what="--input")
    out = parse_s3_uri(dest, what="--output", prefix=True)
    aws = _aws(region, profile, endpoint_url)
    result = run_transform(aws, name, src, out, instances=instances, instance_type=instance_type, wait=wait,
                           poll_s=poll, log=click.echo)
    if not wait:
        click.echo(f"transform job {result.job_name} started; results will be under {out}")
        return
    click.echo(f"transform job {result.job_name} {result.status}: {len(result.outputs)} result file(s) "
               f"for {len(result.inputs)} input(s) under {out}")
    for o in result.outputs:
        uri = S3Uri(out.bucket, o["Key"])
        line = f"  {uri}  {_human(o.get('Size', 0))}"
        if download:
            with ByteProgress(f"downloading {Path(uri.key).name}") as bar:
                line += f" -> {download_file(aws, uri, download / o['Key'][len(out.key):], progress=bar)}"
        click.echo(line)


@main.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@aws_options
@friendly_errors
def status(name, as_json, region, profile, endpoint_url):
    """Show endpoint NAME: state, instances, async config, autoscaling, alarms."""
    from fish_sm.aws.status import status as endpoint_status

    s = endpoint_status(_aws(region, profile, endpoint_url), name)
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

    aws = _aws(region, profile, endpoint_url)
    removed = delete_endpoint(aws, name)
    for line in removed:
        click.echo(line)
    if not removed:
        click.echo(f"nothing to delete: no endpoint {name}, nor configs, models, scaling or alarms of it, "
                   f"in {aws.region_name}")
