#!/usr/bin/env bash
# The README's first command: install everything, then run the main job: a tiny RLVR run (GRPO on single-digit
# addition) on the CPU that prints its reward rising. Extra arguments are config overrides (e.g. max_steps=20).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m apps.rlvr.demo "$@"
