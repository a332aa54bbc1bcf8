"""``python -m rl_ckpt`` runs the CLI."""

import sys

from rl_ckpt.cli import main

sys.exit(main())
