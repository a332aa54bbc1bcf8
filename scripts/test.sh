#!/usr/bin/env bash
# Run the whole test suite (installs into .venv first if needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TMPDIR=${TMPDIR:-/tmp}
exec .venv/bin/python -m pytest "$@"
