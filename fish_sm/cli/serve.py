"""`fish-sm serve`: the SageMaker container contract on this machine."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import click

from fish_sm.cli.common import friendly_errors, main


@main.command()
@click.argument("model", metavar="MODEL", type=click.Path(exists=True, path_type=Path))
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="0.0.0.0 inside a container.")
@click.option("--workers", type=click.IntRange(1), help="Model workers (default: one per GPU, or one on the CPU).")
@click.option("--timeout", "response_timeout", type=click.IntRange(1), default=900, show_default=True,
              help="Seconds one request may take (mms).")
@click.option("--server", type=click.Choice(["batching", "mms"]),
              help="batching: continuous batching and streaming on aiohttp, one engine per GPU. "
                   "mms: sagemaker-inference's multi-model server, one request at a time per GPU. "
                   "[default: FISH_SM_SERVER, else batching]")
@friendly_errors
def serve(model: Path, port: int, host: str, workers: int | None, response_timeout: int, server: str | None):
    """Serve MODEL with GET /ping and POST /invocations.

    MODEL is a package directory, a plain checkpoint directory, or the model.tar.gz that
    `fish-sm package` writes (unpacked into a private temporary directory, verified against
    its manifest before anything in it is read, and removed when the server stops).
    Settings come from FISH_SM_* environment variables (see docs/settings.md).
    """
    from fish_sm.settings import Settings

    settings = Settings.from_env()  # a bad FISH_SM_* variable stops here, before any work
    server = server or settings.server
    if server != "mms" and workers is not None:
        raise click.UsageError("--workers is for --server mms; the batching server runs one engine per GPU")
    with _stopped_by_sigterm(), _model_dir(model, settings.manifest_sha256) as model_dir:
        from fish_sm.serving.config import ServerConfig

        cfg = ServerConfig(model_dir, port=port, host=host, workers=workers, response_timeout=response_timeout)
        if server == "mms":
            from fish_sm.serving.mms.launcher import serve as run_mms

            raise SystemExit(run_mms(cfg))
        from fish_sm.serving.batching_server import serve as run_batching

        raise SystemExit(run_batching(cfg))


@contextlib.contextmanager
def _model_dir(model: Path, manifest_sha256: str):
    """A directory as it is; a tarball unpacked and verified, for as long as the server runs."""
    if model.is_dir():
        yield model
        return
    import time

    from fish_sm.package.extract import extracted_package

    t0 = time.perf_counter()
    with extracted_package(model, manifest_sha256) as model_dir:
        click.echo(f"unpacked and verified {model} in {model_dir} ({time.perf_counter() - t0:.1f} s)", err=True)
        yield model_dir


@contextlib.contextmanager
def _stopped_by_sigterm():
    """SIGTERM (what `docker stop` and SageMaker send) ends a start that is still unpacking as
    Ctrl-C would, so the unpacked copy is removed; the servers handle it themselves once running."""

    def stop(signum, frame):
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
