"""`fish-sm serve`: the SageMaker container contract on this machine."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import friendly_errors, main


@main.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
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
def serve(model_dir: Path, port: int, host: str, workers: int | None, response_timeout: int, server: str | None):
    """Serve MODEL_DIR (a package or checkpoint directory) with GET /ping and POST /invocations.

    Settings come from FISH_SM_* environment variables (see the README).
    """
    from fish_sm.serving.runtime import ServerConfig
    from fish_sm.settings import Settings

    cfg = ServerConfig(model_dir, port=port, host=host, workers=workers, response_timeout=response_timeout)
    if (server or Settings.from_env().server) == "mms":
        from fish_sm.serving.mms.launcher import serve as run_mms

        raise SystemExit(run_mms(cfg))
    if workers is not None:
        raise click.UsageError("--workers is for --server mms; the batching server runs one engine per GPU")
    from fish_sm.serving.batching_server import serve as run_batching

    raise SystemExit(run_batching(cfg))
