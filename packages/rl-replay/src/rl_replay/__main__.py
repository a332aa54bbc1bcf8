"""`python -m rl_replay` runs the `rl-replay` CLI."""

import sys

from rl_replay.cli import main

sys.exit(main())
