#!/usr/bin/env bash
# The GPU check: GPU tests, then the kernel benchmark. Under 8 minutes on one H200.
# Results go to $OUT (or bench/results/): gpu_tests.txt, kernels.json, kernels.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
timeout 300 python -m pytest -q -m gpu tests 2>&1 | tail -40 | tee "$out/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
timeout 180 python bench/kernels.py --out "$out" 2>&1 | tail -30
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, kernel bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
