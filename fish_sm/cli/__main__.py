import sys

from fish_sm.cli import main

sys.exit(main())
