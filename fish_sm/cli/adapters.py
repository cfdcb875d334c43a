"""`fish-sm adapters list|add|remove ENDPOINT`: an endpoint's LoRA adapters, packaged and in its S3 sources."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fish_sm.cli.common import aws_options, friendly_errors, human_size, main, make_aws, output_format_option


def _endpoint_options(fn):
    fn = click.option("--component", metavar="COMPONENT",
                      help="For an endpoint of inference components: the component whose model to use "
                           "(default: its only one).")(fn)
    return fn


def _json_flag(fn):
    return click.option("--json", "as_json", is_flag=True, help="The same as --output json.")(fn)


@main.group()
def adapters():
    """An endpoint's LoRA adapters: those packaged with its model and those in its adapter source
    (FISH_SM_ADAPTER_SOURCES, an S3 prefix that `fish-sm deploy` sets). Adapters added to the source
    are served at once; a packaged adapter changes only with a new package and a redeploy."""


@adapters.command("list")
@click.argument("endpoint")
@_endpoint_options
@output_format_option
@_json_flag
@aws_options
@friendly_errors
def list_command(endpoint, component, output_format, as_json, region, profile, endpoint_url):
    """The adapters ENDPOINT serves: name, rank, alpha, size and where it is (the package, or its S3 object)."""
    from fish_sm.aws.adapters import as_json as to_json, endpoint_model, list_adapters

    json_out = as_json or output_format == "json"
    aws = make_aws(region, profile, endpoint_url)
    model = endpoint_model(aws, endpoint, component)
    found = list_adapters(aws, model, log=lambda line: click.echo(line, err=True))
    if json_out:
        click.echo(json.dumps(to_json(model, found), indent=2))
        return
    sources = ", ".join(map(str, model.sources)) or "none (FISH_SM_ADAPTER_SOURCES is not set)"
    click.echo(f"endpoint {endpoint}: {len(found)} adapter(s); adapter source: {sources}")
    if found:
        rows = [("NAME", "RANK", "ALPHA", "SIZE", "WHERE")] + [
            (a.name, _or_dash(a.rank), _or_dash(a.alpha), human_size(a.bytes) if a.bytes is not None else "-",
             a.where) for a in found]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for row in rows:
            click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])


@adapters.command("add")
@click.argument("endpoint")
@click.argument("spec", metavar="NAME=PATH")
@click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True),
              help="The fine-tune's lora_alpha (default: the file's metadata, else 16, upstream's r_8_alpha_16).")
@click.option("--source", metavar="s3://BUCKET/PREFIX/",
              help="Which of the endpoint's adapter sources to put it in (default: the first).")
@_endpoint_options
@output_format_option
@aws_options
@friendly_errors
def add_command(endpoint, spec, lora_alpha, source, component, output_format, region, profile, endpoint_url):
    """Check the fine-tune at PATH against ENDPOINT's base model and put it in the endpoint's adapter
    source as NAME: upstream's training checkpoint (.ckpt), a .pth of its LoRA tensors, or a
    .safetensors. Served from the next request that names it; no redeploy."""
    import tempfile

    from fish_sm.aws.adapters import add_adapter, base_config, endpoint_model, packaged_adapters, \
        read_package_manifest
    from fish_sm.aws.s3 import parse_s3_uri
    from fish_sm.cli.package_inputs import parse_adapter_specs

    (name, (path, _)), = parse_adapter_specs([spec]).items()
    say = (lambda line: click.echo(line, err=True)) if output_format == "json" else click.echo
    aws = make_aws(region, profile, endpoint_url)
    model = endpoint_model(aws, endpoint, component)
    manifest = read_package_manifest(aws, model)
    packaged = {a.name for a in packaged_adapters(manifest)}
    if name in packaged:  # before the fine-tune is read: the answer does not depend on it
        raise click.ClickException(f"adapter {name} is packaged with endpoint {endpoint}'s model; choose another name")
    config = base_config(aws, model, manifest, log=lambda line: click.echo(line, err=True))
    with tempfile.TemporaryDirectory(prefix="fish-sm-adapter-") as tmp:
        packaged_file = Path(tmp) / f"{name}.safetensors"
        rank, alpha = _packaged_form(path, name, config, lora_alpha, packaged_file)
        size = packaged_file.stat().st_size
        uri = add_adapter(aws, model, name, packaged_file, rank=rank, alpha=alpha, packaged=packaged,
                          source=parse_s3_uri(source, what="--source", prefix=True) if source else None)
    if output_format == "json":
        click.echo(json.dumps({"endpoint": endpoint, "name": name, "rank": rank, "alpha": alpha, "bytes": size,
                               "uri": str(uri)}))
        return
    say(f"added adapter {name} (rank {rank}, alpha {alpha:g}, {human_size(size)}) to {uri}; endpoint {endpoint} "
        f"serves it from its next request naming it (\"adapter\": \"{name}\")")


@adapters.command("remove")
@click.argument("endpoint")
@click.argument("name")
@_endpoint_options
@aws_options
@friendly_errors
def remove_command(endpoint, name, component, region, profile, endpoint_url):
    """Delete adapter NAME from ENDPOINT's adapter source. Its servers stop serving it within a minute
    (FISH_SM_ADAPTER_REFRESH_S); a packaged adapter goes only with a new package and a redeploy."""
    from fish_sm.aws import AWSError
    from fish_sm.aws.adapters import endpoint_model, packaged_adapters, read_package_manifest, remove_adapter
    from fish_sm.contract import check_adapter_name
    from fish_sm.errors import InputError

    check_adapter_name(name, InputError)  # before anything is asked of AWS
    aws = make_aws(region, profile, endpoint_url)
    model = endpoint_model(aws, endpoint, component)
    try:
        packaged = {a.name for a in packaged_adapters(read_package_manifest(aws, model))}
    except AWSError:  # a package these credentials cannot read: the sources alone decide
        packaged = set()
    removed = remove_adapter(aws, model, name, packaged)
    click.echo(f"removed {', '.join(map(str, removed))}; endpoint {endpoint}'s servers stop serving {name} "
               "within a minute" + (" (it is packaged too: the packaged one is served from then on)"
                                    if name in packaged else ""))


def _packaged_form(path: Path, name: str, config: dict, alpha: float | None, out: Path) -> tuple[int, float]:
    """The fine-tune read and checked against the base's config (torch, so imported here), written in
    fish-sm's packaged form to `out`; (rank, alpha)."""
    from fish_sm.model.config import ModelConfig
    from fish_sm.model.lora import read_fine_tune, write_packaged

    adapter = read_fine_tune(path, name, ModelConfig.from_dict(config, "the endpoint's config.json"), alpha)
    write_packaged(adapter, out)
    return adapter.rank, adapter.alpha


def _or_dash(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
