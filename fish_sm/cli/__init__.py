"""The `fish-sm` command line. Thin: parse options, call the package, print results.

Each module registers its commands on the one group in `common`.
"""

from fish_sm.cli.common import main
from fish_sm.cli import engine  # noqa: F401  (registers make-checkpoint, synthesize)
from fish_sm.cli import aws  # noqa: F401
from fish_sm.cli import serve  # noqa: F401  (registers serve)

__all__ = ["main"]
