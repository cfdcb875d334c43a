"""The `fish-sm` group and what every command shares.

Heavy imports (torch, boto3) happen inside the commands that need them, so `fish-sm
--help` stays fast. Errors the user can fix print one line and exit non-zero.
"""

from __future__ import annotations

import functools

import click


def friendly_errors(fn):
    """Turn our errors (and missing files) into one-line messages instead of tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from fish_sm.errors import FishSMError

        try:
            return fn(*args, **kwargs)
        except FishSMError as exc:
            raise click.ClickException(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fish-sm")
def main():
    """Serve the OpenAudio S1-mini text-to-speech model on SageMaker."""
