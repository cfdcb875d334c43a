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



@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fish-sm")
def main():
    """Serve the OpenAudio S1-mini text-to-speech model on SageMaker."""
