"""The `fish-sm` group and what every command shares.

Heavy imports (torch, boto3) happen inside the commands that need them, so `fish-sm
--help` stays fast. Errors the user can fix print one line and exit non-zero.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import click


def friendly_errors(fn):
    """Turn our errors, missing files and AWS errors into one-line messages instead of tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            message = _one_line(exc)
            if message is None:
                raise
            raise click.ClickException(message) from None

    return wrapper


def _one_line(exc: BaseException) -> str | None:
    from fish_sm.errors import FishSMError

    message = _boto_message(exc)
    if message is not None:
        message = " ".join(message.split())
        return message[:600] + " ..." if len(message) > 600 else message
    if isinstance(exc, FishSMError):
        return str(exc)
    if isinstance(exc, (OSError, ValueError)):
        return f"{type(exc).__name__}: {exc}"
    return None


def _boto_message(exc: BaseException) -> str | None:
    """A one-line message for errors raised by boto3/botocore/s3transfer; None for anything else."""
    module = type(exc).__module__ or ""
    if not module.startswith(("botocore", "boto3", "s3transfer")):
        return None
    from botocore import exceptions as bx

    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        return f"{exc.operation_name}: {err.get('Code', 'error')}: {err.get('Message') or exc}"
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return ("no usable AWS credentials: run `aws configure`, pass --profile, or set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(exc, bx.NoRegionError):
        return "no AWS region: pass --region or set AWS_REGION"
    if isinstance(exc, bx.EndpointConnectionError):
        return f"cannot reach AWS at {exc.kwargs.get('endpoint_url')}: check --region, --endpoint-url and the network"
    return f"{type(exc).__name__}: {exc}"



def aws_options(fn):
    """--region, --profile, --endpoint-url: every AWS command takes them."""
    fn = click.option("--endpoint-url", metavar="URL",
                      help="Send every AWS call to this URL (a moto or LocalStack server, a proxy).")(fn)
    fn = click.option("--profile", help="AWS profile from ~/.aws/config.")(fn)
    fn = click.option("--region", help="AWS region (default: the profile's or AWS_REGION).")(fn)
    return fn


def make_aws(region, profile, endpoint_url, **kwargs):
    from fish_sm.aws.session import AWS

    return AWS(region=region, profile=profile, endpoint_url=endpoint_url, **kwargs)


def output_format_option(fn):
    """--output text|json: what a command prints on stdout; json is one object for scripts."""
    return click.option("--output", "output_format", type=click.Choice(["text", "json"]), default="text",
                        show_default=True, help="text for people, json (one object on stdout) for scripts.")(fn)


def one_target(*choices: tuple[str, object]) -> None:
    """Exactly one of the (label, value) pairs must be given."""
    if sum(1 for _, v in choices if v) != 1:
        raise click.UsageError(f"give exactly one of {', '.join(label for label, _ in choices)}")


@contextlib.contextmanager
def serving_locally(model, out_dir, startup_timeout: float, say):
    """`fish-sm serve MODEL` on a free port for a --local benchmark, its log in out_dir; yields its URL."""
    from fish_sm.clients.local_server import local_server

    say(f"starting fish-sm serve {model} ...")
    with local_server(model, log_path=out_dir / "serve.log", startup_timeout_s=startup_timeout) as url:
        say(f"serving at {url} (log: {out_dir / 'serve.log'})")
        yield url


def publish_report(report: dict, out_dir, lines, output_format: str, say) -> None:
    """bench.json and bench.html under out_dir, the summary lines through `say`, and with
    --output json the report (without its samples) and both paths as one object on stdout."""
    import json

    from fish_sm.clients.report import write_html, write_json

    json_path = write_json(report, out_dir / "bench.json")
    for line in lines:
        say(line)
    say(f"wrote {json_path}")
    html_path = write_html(report, out_dir / "bench.html")
    say(f"wrote {html_path}")
    if output_format == "json":
        click.echo(json.dumps({**{k: v for k, v in report.items() if k != "samples"},
                               "json": str(json_path), "html": str(html_path)}))


def over_error_rate(failed: list[dict], levels: int, max_error_rate: float, describe):
    """The FishSMError of a run whose `failed` levels (of `levels`) brought no audio more often than
    --max-error-rate: each level as describe(level) says ("concurrency 4 3/32 failed"), and an
    example error from the worst."""
    from fish_sm.errors import FishSMError

    worst = max(failed, key=lambda lv: lv["error_rate"])
    example = " ".join(str(next(iter(worst["error_examples"].values()), "")).split())[:300]
    return FishSMError(f"{len(failed)} of {levels} level(s) over --max-error-rate {max_error_rate:g}: "
                       + ", ".join(describe(lv) for lv in failed) + (f"; e.g. {example}" if example else ""))


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


# Defaults for options come from a TOML file, then environment variables, then flags (each
# overriding the one before). The variables are FISHSM_<COMMAND>_<OPTION> (FISHSM_DEPLOY_ROLE,
# FISHSM_DEPLOY_INSTANCE_TYPE): not FISH_SM_, which the server reserves for its settings and
# refuses when unknown.
CONFIG_ENV = "FISHSM_CONFIG"
ENV_PREFIX = "FISHSM"
DEFAULT_SECTION = "default"


def config_path() -> tuple[Path, bool]:
    """The config file, and whether it was named (FISHSM_CONFIG) rather than the default place."""
    import os

    named = os.environ.get(CONFIG_ENV)
    if named:
        return Path(named).expanduser(), True
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "fish-sm" / "config.toml", False


def _option_keys(command: click.Command) -> dict[str, click.Option]:
    """A command's options by the names a user writes: the long flag ('instance-type') and its
    underscore spelling ('instance_type')."""
    keys = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name:
            for flag in param.opts:
                if flag.startswith("--"):
                    keys[flag[2:]] = keys[flag[2:].replace("-", "_")] = param
    return keys


def _name_envvars(command_name: str, command: click.Command) -> None:
    """FISHSM_<COMMAND>_<OPTION> for each option without a variable of its own, from its first long flag
    (a group's subcommands share the group's: FISHSM_ADAPTERS_REGION)."""
    for sub in getattr(command, "commands", {}).values():
        _name_envvars(command_name, sub)
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar is None:
            flag = next((f[2:] for f in param.opts if f.startswith("--")), None)
            if flag:
                param.envvar = f"{ENV_PREFIX}_{command_name}_{flag}".upper().replace("-", "_")


def _leaf_commands(group: click.Group, ctx: click.Context) -> dict[tuple[str, ...], click.Command]:
    """Every command by its path: ("deploy",), and a group's subcommands as ("adapters", "list")."""
    out = {}
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            out.update({(name, sub): command.get_command(ctx, sub) for sub in command.list_commands(ctx)})
        else:
            out[(name,)] = command
    return out


def load_config(group: click.Group, ctx: click.Context) -> dict:
    """click's default_map from the config file: {command: {parameter: value}} (a group's commands:
    {group: {command: {...}}}), [default] keys going to every command that has that option and a
    group's section to each of its commands. A file named but missing, bad TOML, an unknown section
    or key: a ClickException (one line)."""
    path, named = config_path()
    if not path.is_file():
        if named:
            raise click.ClickException(f"config file {path} (from {CONFIG_ENV}) does not exist")
        return {}
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.ClickException(f"config file {path}: {' '.join(str(exc).split())}") from None
    options = {where: _option_keys(command) for where, command in _leaf_commands(group, ctx).items()}
    sections = {where[0] for where in options}
    default_map: dict = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise click.ClickException(f"config file {path}: {section!r} must be a [section] of option = value")
        if section != DEFAULT_SECTION and section not in sections:
            raise click.ClickException(f"config file {path}: [{section}] is no fish-sm command; sections are "
                                       f"[{DEFAULT_SECTION}] and command names")
        for key, value in values.items():
            takers = [where for where, known in options.items()
                      if key in known and (section == DEFAULT_SECTION or where[0] == section)]
            if not takers:
                raise click.ClickException(f"config file {path}: [{section}] {key}: no such option"
                                           + ("" if section == DEFAULT_SECTION else f" of `fish-sm {section}`"))
            for where in takers:
                values_of = default_map
                for part in where:
                    values_of = values_of.setdefault(part, {})
                param = options[where][key].name
                if section == DEFAULT_SECTION:  # a command's own section wins, wherever it is in the file
                    values_of.setdefault(param, value)
                else:
                    values_of[param] = value
    return default_map


ENGINE_MODULES = frozenset({"torch", "torchao", "triton"})


class Commands(click.Group):
    """The command group: a command that needs the engine, run where it is not installed,
    says in one line what to install (the base package is the control plane, without torch)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in ENGINE_MODULES:
                raise
            command = ctx.invoked_subcommand or "this command"
            raise click.ClickException(f"`fish-sm {command}` needs the engine ({exc.name} is not installed): "
                                       "pip install 'fish-sm[engine]'") from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fish-sm")
@click.pass_context
def main(ctx):
    """Serve the OpenAudio S1-mini text-to-speech model on SageMaker.

    Option defaults may come from a TOML file, ~/.config/fish-sm/config.toml or the file
    FISHSM_CONFIG names: a [default] section (e.g. region = "us-east-1") for every command
    and a section per command ([deploy] role = "arn:...", instance-type = "ml.g5.xlarge").
    Environment variables FISHSM_<COMMAND>_<OPTION> (FISHSM_DEPLOY_INSTANCE_TYPE) override
    the file, and flags override both.
    """
    if ctx.resilient_parsing:  # shell completion: no file reading
        return
    if ctx.invoked_subcommand:
        _name_envvars(ctx.invoked_subcommand, ctx.command.get_command(ctx, ctx.invoked_subcommand))
    ctx.default_map = load_config(ctx.command, ctx)
