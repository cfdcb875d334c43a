"""The `fish-sm` group and what every command shares.

Heavy imports (torch, boto3) happen inside the commands that need them, so `fish-sm
--help` stays fast. Errors the user can fix print one line and exit non-zero.
"""

from __future__ import annotations

import functools

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


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fish-sm")
def main():
    """Serve the OpenAudio S1-mini text-to-speech model on SageMaker."""
