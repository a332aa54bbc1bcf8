#!/usr/bin/env bash
# The README's first command: install everything, then run the main job.
# Until the RLVR app exists (issue 5) the main job is the rl-core benchmark: rollout importance sampling +
# PPO loss + aggregation on 128 x 4096 tokens, against a memory-copy roofline measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python benchmarks/bench_rl_core.py "$@"
