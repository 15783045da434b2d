#!/usr/bin/env bash
# The GPU check: GPU tests, the kernel benchmark, the AOT compile cross-check against the installed
# Triton on this device's architecture, and the end-to-end benchmark (one preset, to fit the time).
# Each step runs under a timeout: GPU tests 300 s, kernel bench 180 s, compile 60 s, e2e 120 s (its
# checkpoint write included), 11 minutes if every step hits its cap. A failed or timed-out step does
# not stop the others; the exit status is 1 when any failed. Results go to $OUT (or bench/results/): summary.json and summary.md gather device.txt,
# each step's exit status, gpu_tests.txt, kernels.json, compile.json and e2e.json (also written, with
# kernels.md and e2e.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
arch=$(python -c "import torch; print('sm_%d%d' % torch.cuda.get_device_capability())")
timeout 300 python -m pytest -q -m gpu tests 2>&1 | tail -40 | tee "$out/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
timeout 180 python bench/kernel_rooflines.py --out "$out" 2>&1 | tail -30
kernels_rc=${PIPESTATUS[0]}
timeout 60 python -m pocketllm.lab.compile --target "$arch" --json --quiet > "$out/compile.json"
compile_rc=$?
timeout 120 python bench/e2e.py --preset qwen3-0.6b --out "$out" 2>&1 | tail -20
e2e_rc=${PIPESTATUS[0]}
# Several GPUs: TP=1 against TP=2 on NCCL, with and without the fixed reduction tree (bits compared).
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -gt 1 ]; then
    timeout 180 python bench/tensor_parallel.py --device cuda --preset qwen3-0.6b --out "$out" 2>&1 | tail -12
fi
python bench/gpu_summary.py --out "$out" --rc "tests=$tests_rc" --rc "kernels=$kernels_rc" \
    --rc "compile=$compile_rc" --rc "e2e=$e2e_rc"
summary_rc=$?
echo "rc: gpu tests $tests_rc, kernel bench $kernels_rc, compile ($arch) $compile_rc, e2e $e2e_rc, summary $summary_rc"
exit $(( tests_rc != 0 || kernels_rc != 0 || compile_rc != 0 || e2e_rc != 0 || summary_rc != 0 ))
