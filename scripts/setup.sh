#!/usr/bin/env bash
# Create (or refresh) .venv with every workspace package installed editable plus the dev tools.
# Idempotent: re-running with unchanged requirements does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
# Every workspace package that has a pyproject.toml (placeholders without one are skipped).
PACKAGES=()
for f in packages/*/pyproject.toml; do PACKAGES+=("$(dirname "$f")"); done

stamp_now=$(cat requirements-dev.txt "${PACKAGES[@]/%//pyproject.toml}" | sha256sum | cut -d' ' -f1)
if [[ -f $VENV/.setup-stamp && $(cat $VENV/.setup-stamp) == "$stamp_now" ]]; then
  exit 0
fi
echo "[setup] creating $VENV and installing torch 2.13.0 (CPU), the packages and the dev tools ..."
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
# DS_BUILD_OPS=0: DeepSpeed builds no C++/CUDA ops at install (the CPU path needs none)
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
for pkg in "${PACKAGES[@]}"; do
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$pkg"
done
"$VENV/bin/python" -m pip check >/dev/null
echo "$stamp_now" > $VENV/.setup-stamp
echo "[setup] done"
