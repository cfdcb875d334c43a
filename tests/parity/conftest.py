"""Make upstream fish-speech 0.1.0 importable for the parity tests.

Upstream is installed with --no-deps (see the Makefile); the stand-ins folder
supplies the handful of module-level names it imports but never uses here.
"""

import sys
from pathlib import Path


STANDINS = Path(__file__).parent / "standins"
if str(STANDINS) not in sys.path:
    sys.path.insert(0, str(STANDINS))
