#!/usr/bin/env bash
# The GPU checks of this project in one run, for a session lent a machine with a CUDA device: every test file marked
# `gpu` (they skip elsewhere), benchmarks/bench_rl_core.py on the device (issue 20) and benchmarks/bench_packing.py
# at a representative size with flash-attention's varlen kernel in bf16 (issue 15). Each step has its own time limit,
# so a slow step costs only its own result; the log goes to $OUT/gpu_checks.log ($OUT: the device tool's folder of
# files sent back; ./gpu-out elsewhere). It uses the machine's own python3 (PYTHON=... to choose) with this
# checkout's packages on PYTHONPATH and installs nothing but carried wheels: the tests and the benchmarks need torch,
# numpy, transformers, safetensors and pytest, not ray (bench_rl_core.py compares with verl 0.9.1 only where
# `import verl` works, and verl's import needs ray, whose wheel is larger than a device call carries).
#
# The image's transformers (5.17 when last read) is older than the one CI tests (requirements-dev.txt: 5.23.0); to
# test with the pinned one, put its wheel in .whl/ here (git ignores it) and carry it: every wheel found in .whl/
# is installed into /tmp/gpu-site first (no index, no dependencies; 5.23.0 accepts the image's huggingface-hub,
# tokenizers and safetensors), e.g.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.23.0        # then: run(command="bash scripts/gpu_checks.sh", carry=[".whl"])
#
#   bash scripts/gpu_checks.sh                    # on the GPU machine
#   DEVICE=cpu PACKING="--samples 8 --response-length 128 --hidden 128 --layers 2 --repeats 1" \
#     RL_CORE="--batch 16 --length 512 --repeats 2" bash scripts/gpu_checks.sh   # a dry run of the plumbing on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
root=$PWD
export PYTHONPATH="$root/packages/rl-core/src:$root/packages/rl-engines/src:$root/packages/rl-replay/src:$root/packages/rl-ckpt/src:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TMPDIR=${TMPDIR:-/tmp}
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (see the header) go before the machine's own packages
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .whl/*.whl ||
    exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu-site"
fi
device=${DEVICE:-cuda}
read -r -a rl_core_args <<<"${RL_CORE:-}"
read -r -a packing_args <<<"${PACKING:---samples 64 --response-length 4096 --hidden 1024 --layers 8 --dtype bf16 --attn fa2 --repeats 3}"
mapfile -t gpu_files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)

step() {  # step NAME SECONDS COMMAND...: one check under its own time limit, its exit status logged
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - start))s"
}

{
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi here"
  "$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
"from", transformers.__file__, "cuda", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
  step "GPU test files: ${gpu_files[*]}" 240 "$py" -m pytest -m gpu -q -rA -p no:cacheprovider "${gpu_files[@]}"
  step "bench_rl_core.py --device $device" 120 "$py" benchmarks/bench_rl_core.py --device "$device" "${rl_core_args[@]}"
  step "bench_packing.py ${packing_args[*]}" 240 "$py" benchmarks/bench_packing.py "${packing_args[@]}"
} 2>&1 | tee "$out/gpu_checks.log"
