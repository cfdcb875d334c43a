"""`fish-sm deploy`: create an endpoint, or update it blue/green with rollback."""

from __future__ import annotations

import json

import click

from fish_sm.cli.common import aws_options, friendly_errors, main, make_aws, output_format_option
from fish_sm.cli.deploy_components import component_options, component_request, run_component_deploy


@main.command()
@click.argument("name")
@click.option("--model-data", required=True, metavar="s3://...", help="The model.tar.gz made by `fish-sm package`.")
@click.option("--role", required=True, metavar="ARN", help="IAM role SageMaker runs the model with.")
@click.option("--image", metavar="URI", help="Container image: fish-sm's own (see deploy/), or any.")
@click.option("--stock-container", is_flag=True,
              help="Run on AWS's PyTorch inference image with code/inference.py (image from the sagemaker SDK "
                   "unless --image).")
@click.option("--instance-type", default="ml.g5.xlarge", show_default=True,
              help="Checked with EC2's DescribeInstanceTypes (ml.g5.12xlarge is EC2's g5.12xlarge), which also "
                   "gives its GPUs.")
@click.option("--gpus", type=click.IntRange(0, 64),
              help="GPUs on the instance type, instead of asking EC2 (for credentials without "
                   "ec2:DescribeInstanceTypes).")
@click.option("--ami-version", default="auto", show_default=True, metavar="VERSION|auto|none",
              help="The variant's InferenceAmiVersion (host image and NVIDIA driver). auto: "
                   "al2023-ami-sagemaker-inference-gpu-4-1 (driver 580, CUDA 13.0, which fish-sm's image needs) on "
                   "GPU types, unset on CPU types; none: leave it to SageMaker (driver 535 or 550).")
@click.option("--instances", type=int, default=1, show_default=True, help="Instances to start with.")
@click.option("--min", "min_instances", type=int,
              help="Autoscaling minimum (default: --instances). With --components: the instance pool's minimum "
                   "(default: 0 with --scale-to-zero, else --instances).")
@click.option("--max", "max_instances", type=int,
              help="Autoscaling maximum; turns autoscaling on. With --components: the instance pool's maximum "
                   "(default: --instances), the room the components' copies (and rolling updates) have.")
@click.option("--target", type=float,
              help="Target value of the scaling metric per instance. Default for concurrency: on fish-sm's image "
                   "(the batching server) 70% of the requests the instance's GPUs hold in flight at their measured "
                   "capacity (a GPU model's real-time streams under the SLO, at most FISH_SM_MAX_BATCH each), e.g. "
                   "358.4 on ml.p5.48xlarge (8 H100); for a GPU model not measured, half of its batch slots, "
                   "FISH_SM_MAX_BATCH (64 unless --env) x GPUs, e.g. 128 on ml.g5.12xlarge; with --stock-container "
                   "or --env FISH_SM_SERVER=mms, 2. Invocations: 60 a minute for every server (it depends on text length: measure req/s with "
                   "`fish-sm bench` and pass --target). Async backlog: 2.")
@click.option("--metric", type=click.Choice(["concurrency", "invocations"]), default="concurrency", show_default=True,
              help="Real-time scaling metric: concurrent requests (high resolution; follows the server's slots) or "
                   "invocations a minute.")
@click.option("--async", "is_async", is_flag=True, help="Asynchronous inference: requests and results in S3.")
@click.option("--async-output", "async_output", metavar="s3://...", help="Async: where results go.")
@click.option("--failure", "async_failure", metavar="s3://...",
              help="Async: where errors go (default: ASYNC-OUTPUT-failures/).")
@click.option("--sns-success", metavar="ARN", help="Async: SNS topic told of each result.")
@click.option("--sns-error", metavar="ARN", help="Async: SNS topic told of each failure.")
@click.option("--max-concurrent", type=int, help="Async: requests one instance works on at once.")
@click.option("--scale-to-zero", is_flag=True,
              help="Async: scale to 0 instances when idle, back up on a backlog. With --components: 0 copies (and "
                   "instances) when idle, back up on the first call (--min-copies 0).")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE",
              help="Container environment, e.g. FISH_SM_COMPILE=false; FISH_SM_* settings are checked as the "
                   "server checks them. Repeatable.")
@click.option("--adapter-source", default="auto", show_default=True, metavar="s3://BUCKET/PREFIX/|default|auto|none",
              help="Where the servers look up LoRA adapters not in the package (FISH_SM_ADAPTER_SOURCES), and where "
                   "`fish-sm adapters add NAME` puts them. default: adapters/NAME/ beside --model-data; auto: there "
                   "when the package holds adapters, else none (an endpoint without adapters carries no adapter "
                   "slots); none: packaged adapters only. Off with --network-isolation; with --components, none "
                   "unless an s3:// prefix is given. The role needs s3:GetObject on it and s3:ListBucket on its bucket.")
@click.option("--tags", "tag_pairs", multiple=True, metavar="KEY=VALUE",
              help="A tag on every resource the deploy makes (model, config, endpoint, alarms, scaling). Repeatable.")
@click.option("--subnets", multiple=True, metavar="ID[,ID]",
              help="Run the model in these VPC subnets (with --security-groups). Repeatable or comma-separated.")
@click.option("--security-groups", multiple=True, metavar="ID[,ID]",
              help="The model's VPC security groups (with --subnets). Repeatable or comma-separated.")
@click.option("--kms-key", metavar="KEY", help="KMS key (id, ARN or alias) for the instances' storage volumes.")
@click.option("--network-isolation", is_flag=True,
              help="No network access from the container (S3 reference audio then cannot be fetched).")
@click.option("--data-capture", metavar="s3://...", help="Capture requests and responses to this S3 prefix.")
@click.option("--data-capture-percent", type=int,
              help="With --data-capture: the share of requests captured, 1-100 (default 100).")
@click.option("--startup-timeout", type=int,
              help="Seconds the container may take to pass its first /ping (60-3600; default: twice the start "
                   "measured on the instance's GPU model plus 2 minutes, 1800 where none is measured).")
@click.option("--download-timeout", type=int,
              help="Seconds for downloading model.tar.gz (60-3600; default: from its size).")
@click.option("--bake", type=int, default=300, show_default=True,
              help="Updates: seconds the new fleet serves before the old one goes (rollback window).")
@click.option("--rollback-errors", type=int, default=1, show_default=True,
              help="Updates: 5XX errors in a minute that trigger the rollback.")
@click.option("--dashboard/--no-dashboard", default=True, show_default=True,
              help="A CloudWatch dashboard fish-sm-NAME: the servers' metrics (first audio, occupancy, queue, "
                   "rejections) and SageMaker's (invocations, model latency, 5XX).")
@click.option("--alarms/--no-alarms", default=True, show_default=True,
              help="CloudWatch alarms fish-sm/NAME/...: p99 first audio, 5XX rate and rejection rate over their "
                   "thresholds in 3 of 5 minutes; with LoRA adapters, adapter errors.")
@click.option("--alarm-first-audio-ms", type=float, default=500.0, show_default=True,
              help="The p99 first audio (ms, streamed requests) that sets off its alarm (the capacity SLO's).")
@click.option("--alarm-5xx-rate", "alarm_error_rate", type=float, default=1.0, show_default=True,
              help="The share of invocations answered 5XX (%) that sets off its alarm.")
@click.option("--alarm-rejection-rate", type=float, default=1.0, show_default=True,
              help="The share of requests turned away by a full server (%) that sets off its alarm.")
@click.option("--alarm-adapter-errors", type=float, default=1.0, show_default=True,
              help="With LoRA adapters: requests failed in 5 minutes because their adapter could not be read or "
                   "served (a bad upload, a missing permission) that set off its alarm.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until InService (needed for autoscaling).")
@click.option("--poll", type=float, default=15.0, show_default=True, help="Seconds between status checks.")
@component_options
@output_format_option
@aws_options
@friendly_errors
def deploy(name, model_data, role, image, stock_container, instance_type, gpus, ami_version, instances, min_instances,
           max_instances, target, metric, is_async, async_output, async_failure, sns_success, sns_error,
           max_concurrent, scale_to_zero, env_pairs, adapter_source, tag_pairs, subnets, security_groups, kms_key,
           network_isolation, data_capture, data_capture_percent, startup_timeout, download_timeout, bake,
           rollback_errors, dashboard, alarms, alarm_first_audio_ms, alarm_error_rate, alarm_rejection_rate,
           alarm_adapter_errors, wait, poll, output_format, region, profile, endpoint_url, **component_opts):
    """Create endpoint NAME, or update it blue/green with automatic rollback.

    With --components (or --component C) NAME is a pool of instances holding inference
    components: the first deploy creates it with component C (default NAME), later ones add a
    component, or with --update replace one's model (rolling, with rollback); --min/--max then
    bound the pool, --min-copies/--max-copies/--target scale the component's copies, and
    --scale-to-zero (--min-copies 0) lets it idle at no instance.

    Autoscaling options give the wanted state: a deploy without --max (or --scale-to-zero)
    removes autoscaling the endpoint had. Before anything is made, deploy checks the FISH_SM_*
    settings in --env as the server would, the instance type (EC2), the image (when in ECR) and
    that --model-data is a package made by `fish-sm package`.
    """
    from fish_sm.aws.autoscaling import make_autoscaling
    from fish_sm.aws.container import parse_env
    from fish_sm.aws.deploy import deploy as deploy_endpoint
    from fish_sm.aws.deploy_request import DataCapture, DeployRequest, make_async, parse_tags, split_ids
    from fish_sm.aws.s3 import parse_s3_uri

    components = component_request(component_opts, is_async=is_async, scale_to_zero=scale_to_zero,
                                    min_instances=min_instances, max_instances=max_instances, target=target,
                                    metric=metric)
    async_only = {"--async-output": async_output, "--failure": async_failure, "--sns-success": sns_success,
                  "--sns-error": sns_error, "--max-concurrent": max_concurrent,
                  "--scale-to-zero": (scale_to_zero and components is None) or None}
    if not is_async:
        given = [flag for flag, v in async_only.items() if v is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} only apply with --async")
        async_options = None
    else:
        if not async_output:
            raise click.UsageError("--async needs --async-output s3://bucket/prefix/")
        async_options = make_async(parse_s3_uri(async_output, what="--async-output", prefix=True),
                                   parse_s3_uri(async_failure, what="--failure", prefix=True) if async_failure else None,
                                   sns_success, sns_error, max_concurrent)
    env = parse_env(env_pairs)
    if components is not None and adapter_source not in ("auto", "default", "none"):
        from fish_sm.aws.adapters import SOURCES_ENV

        # A component's model gets its source through its environment; no default, since the
        # components of one endpoint may serve different base models.
        if SOURCES_ENV in env:
            raise click.UsageError(f"give the adapter source once: --adapter-source or --env {SOURCES_ENV}")
        env[SOURCES_ENV] = str(parse_s3_uri(adapter_source, what="--adapter-source", prefix=True))
    capture = None
    if data_capture:
        capture = DataCapture(parse_s3_uri(data_capture, what="--data-capture", prefix=True),
                              100 if data_capture_percent is None else data_capture_percent)
    elif data_capture_percent is not None:
        raise click.UsageError("--data-capture-percent only applies with --data-capture s3://...")
    request = DeployRequest(
        name=name, model_data=parse_s3_uri(model_data, what="--model-data", prefix=False), role=role,
        instance_type=instance_type, image=image, stock_container=stock_container, instances=instances, env=env,
        autoscaling=None if components is not None else make_autoscaling(
            instances=instances, min_instances=min_instances, max_instances=max_instances, target=target,
            metric=metric, is_async=is_async, scale_to_zero=scale_to_zero),
        async_options=async_options, startup_timeout=startup_timeout, download_timeout=download_timeout,
        bake_seconds=bake, rollback_errors=rollback_errors, gpus=gpus, ami_version=ami_version,
        tags=parse_tags(tag_pairs), subnets=split_ids(subnets), security_groups=split_ids(security_groups),
        kms_key=kms_key, network_isolation=network_isolation, data_capture=capture, adapter_source=adapter_source)
    as_json = output_format == "json"

    def progress(line: str) -> None:  # with --output json, stdout holds only the result
        click.echo(line, err=as_json)

    from fish_sm.aws.alarms import AlarmThresholds
    from fish_sm.aws.monitoring import Monitoring

    thresholds = AlarmThresholds(alarm_first_audio_ms, alarm_error_rate, alarm_rejection_rate, alarm_adapter_errors)
    thresholds.check()
    monitoring = Monitoring(dashboard=dashboard, alarms=thresholds if alarms else None)
    if components is not None:
        return run_component_deploy(make_aws(region, profile, endpoint_url), request, components, wait=wait,
                                    poll_s=poll, output_format=output_format, log=progress, monitoring=monitoring)
    result = deploy_endpoint(make_aws(region, profile, endpoint_url), request, wait=wait, poll_s=poll, log=progress,
                             monitoring=monitoring)
    if as_json:
        status = result.endpoint["EndpointStatus"] if result.endpoint else "Creating" if result.action == "created" \
            else "Updating"
        click.echo(json.dumps({"name": name, "action": result.action, "status": status, "model": result.model_name,
                               "endpoint_config": result.config_name, "image": result.image,
                               "instance_type": instance_type, "gpus": result.gpus,
                               "inference_ami_version": result.inference_ami,
                               "manifest_sha256": result.manifest_sha256,
                               "adapter_sources": result.adapter_sources}, indent=2))
    elif result.endpoint is not None:
        click.echo(f"endpoint {name} {result.action} and InService on {result.config_name}")
    else:
        click.echo(f"endpoint {name} is being {result.action}; follow it with `fish-sm status {name}`")
