"""`fish-sm deploy --components` / `--component C`: the options of an inference-component deploy,
checked into ComponentOptions, and what the command prints after it."""

from __future__ import annotations

import json

import click

def component_options(fn):
    """The deploy options that make (or change) an endpoint of inference components."""
    for opt in reversed([
        click.option("--components", is_flag=True,
                     help="Deploy as inference components: the endpoint is a pool of instances (managed instance "
                          "scaling between --min and --max, 0 allowed) and the model one component of it, with its "
                          "own copies, GPUs and memory. Invoke it with --component."),
        click.option("--component", metavar="COMPONENT",
                     help="The component's name (default: NAME). On an endpoint of components that exists: adds "
                          "this component, or with --update replaces its model. Implies --components."),
        click.option("--copies", type=click.IntRange(min=0), default=1, show_default=True,
                     help="Components: copies of the model to start with."),
        click.option("--min-copies", type=click.IntRange(min=0),
                     help="Components: autoscaling minimum of copies (default --copies); 0 scales the component to "
                          "zero when idle and wakes it on the first call (an alarm on NoCapacityInvocationFailures), "
                          "as --scale-to-zero does."),
        click.option("--max-copies", type=click.IntRange(min=1),
                     help="Components: autoscaling maximum of copies; turns autoscaling of copies on (target "
                          "tracking on --metric per copy, --target)."),
        click.option("--accelerators", type=click.IntRange(min=1),
                     help="Components: GPUs each copy reserves (default 1 on GPU types, none on CPU types)."),
        click.option("--memory", type=click.IntRange(min=128), default=8192, show_default=True,
                     help="Components: host memory (MB) each copy reserves."),
        click.option("--update", is_flag=True,
                     help="With --component: replace that component's model by a rolling update, --batch-copies at "
                          "a time, each batch baking --bake seconds; rolls back when its 5XX alarm fires."),
        click.option("--batch-copies", type=click.IntRange(min=1), default=1, show_default=True,
                     help="With --update: copies replaced at a time."),
    ]):
        fn = opt(fn)
    return fn


def component_request(opts: dict, *, is_async: bool, scale_to_zero: bool, min_instances, max_instances, target,
                      metric):
    """ComponentOptions when --components or --component was given, else None (and then no other
    component option may be)."""
    from fish_sm.aws.components import ComponentOptions

    if not (opts["components"] or opts["component"]):
        given = [f"--{k.replace('_', '-')}" for k in ("min_copies", "max_copies", "accelerators", "update")
                 if opts[k]] + [f"--{k.replace('_', '-')}" for k, default in
                                (("copies", 1), ("memory", 8192), ("batch_copies", 1)) if opts[k] != default]
        if given:
            raise click.UsageError(f"{', '.join(given)} only apply with --components or --component")
        return None
    if is_async:
        raise click.UsageError("--components: asynchronous endpoints cannot hold inference components")
    if opts["update"] and not opts["component"]:
        raise click.UsageError("--update needs --component NAME (the component to update)")
    min_copies = opts["min_copies"]
    if scale_to_zero:
        if min_copies not in (None, 0):
            raise click.UsageError("--scale-to-zero sets --min-copies 0; leave out --min-copies")
        min_copies = 0
    return ComponentOptions(name=opts["component"], copies=opts["copies"], min_copies=min_copies,
                            max_copies=opts["max_copies"], accelerators=opts["accelerators"],
                            memory_mb=opts["memory"], target=target, metric=metric, min_instances=min_instances,
                            max_instances=max_instances, update=opts["update"], batch_copies=opts["batch_copies"])


def run_component_deploy(aws, request, options, *, wait: bool, poll_s: float, output_format: str, log,
                         monitoring=None) -> None:
    from fish_sm.aws.component_deploy import deploy_component
    from fish_sm.aws.components import copies

    result = deploy_component(aws, request, options, wait=wait, poll_s=poll_s, log=log, monitoring=monitoring)
    desc = result.component_desc
    if output_format == "json":
        click.echo(json.dumps({
            "name": request.name, "component": result.component, "action": result.action,
            "status": desc.get("InferenceComponentStatus") if desc else "Creating" if result.action != "updated"
            else "Updating",
            "copies": copies(desc) if desc else None, "model": result.model_name,
            "endpoint_config": result.config_name, "image": result.image, "instance_type": request.instance_type,
            "gpus": result.gpus, "accelerators_per_copy": result.accelerators,
            "manifest_sha256": result.manifest_sha256}, indent=2))
    elif desc is not None:
        c = copies(desc)
        click.echo(f"component {result.component} of endpoint {request.name} {result.action} and InService on "
                   f"{result.model_name}, {c['current']}/{c['desired']} copies; invoke it with "
                   f"`fish-sm invoke {request.name} --component {result.component} ...`")
    else:
        click.echo(f"component {result.component} of endpoint {request.name} is being {result.action}; follow it "
                   f"with `fish-sm status {request.name}`")
