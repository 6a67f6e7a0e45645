#!/usr/bin/env bash
# The GPU checks of the fused Triton kernels (issue 13), in one go, without Ray:
#   1. tests/unit/test_cuda.py: compiled kernels vs the CPU oracle (3 optimizers x 3 dtypes x 2 kinds,
#      offsets past 2**32), the start-up guard and its fallback, a CUDA trainer's records
#      replayed on the CPU (fused numba kernel, eager oracle) and on the GPU, equal state hashes;
#   2. `bench trainer` on CUDA: the ZOCheck step vs a plain MeZO step on an OPT-125m-shaped model
#      (125 M parameters, built from config) in bf16 and fp32, with kernel launches per step.
#
#   PYTHON=/path/to/python scripts/cuda_check.sh            # figures in $OUT or /tmp/zocheck-cuda-check
#
# Needs a Python with a CUDA build of torch (Triton comes with it), numba, transformers,
# pydantic, safetensors, fsspec and pytest (the package's dependencies; Ray is not used).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp/zocheck-cuda-check}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$py" - <<'PY' 2>&1 | tee "$out/environment.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton missing:", e)
PY
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || { echo "no CUDA device: nothing to check"; exit 3; }

echo "== tests/unit/test_cuda.py"
"$py" -m pytest -q -p no:cacheprovider -rs tests/unit/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
tests=${PIPESTATUS[0]}

echo "== bench trainer (cuda, opt-125m, bf16 and fp32)"
"$py" -m benchmarks.trainer --model opt-125m --dtype bf16 fp32 --device cuda --batch-size 8 --seq-len 256 \
  --steps 5 --rounds 5 --json "$out/bench_trainer_cuda.json" 2>&1 | tee "$out/bench_trainer_cuda.log"
bench=${PIPESTATUS[0]}

echo "== summary: test_cuda exit $tests, bench trainer exit $bench; logs and JSON in $out"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
