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
              help="Seconds one request may take.")
@friendly_errors
def serve(model_dir: Path, port: int, host: str, workers: int | None, response_timeout: int):
    """Serve MODEL_DIR (a package or checkpoint directory) with GET /ping and POST /invocations.

    Settings come from FISH_SM_* environment variables (see the README).
    """
    from fish_sm.serving.server import ServerConfig, serve as run_server

    raise SystemExit(run_server(ServerConfig(model_dir, port=port, host=host, workers=workers,
                                             response_timeout=response_timeout)))
