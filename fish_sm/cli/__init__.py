"""The `fish-sm` command line. Thin: parse options, call the package, print results.

Each module registers its commands on the one group in `common`.
"""

from fish_sm.cli.common import main
from fish_sm.cli import adapters, bench, capacity, deploy, engine, fleet, invoke, metrics, package, serve, transform

# Imported for what importing does: each module registers its commands on `main`.
_COMMAND_MODULES = (engine, package, deploy, adapters, invoke, bench, capacity, transform, fleet, serve, metrics)

__all__ = ["main"]
