#!/usr/bin/env bash
# Mutation testing of pocketllm's core modules with mutmut (not part of the default test run).
#
#   pip install mutmut                       # 3.x, once (kept out of the dev extra: it is heavy)
#   tools/mutation.sh pocketllm.cache        # one module's mutants, against its selected tests
#   tools/mutation.sh 'pocketllm.kernels.rope.x_apply_rope_ref*'   # a mutant-name pattern
#   tools/mutation.sh all                    # every module below, one after the other
#
# Each run works on its own copy of the repository ($MUTATION_WORKDIR/<module>, default under
# /tmp/pocketllm-mutation), so the checkout never sees mutmut's `mutants/` tree. The shared
# settings are the [tool.mutmut] section of pyproject.toml; the copy's test selection is replaced
# by the module's own (TESTS below; MUTATION_TESTS overrides it), which keeps a module to minutes:
# mutmut then runs, for each mutant, only the selected tests that reach the mutated function.
# MUTATION_JOBS sets the mutants run in parallel (default 1). Prints a score per module and the
# mutants not killed; docs/mutation.md records the last measured ones.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${MUTATION_WORKDIR:-/tmp/pocketllm-mutation}
python=${PYTHON:-python}

# The scheduler's parts are reached through its API: one selection serves them.
scheduler_tests="tests/scheduler/test_lifecycle.py tests/scheduler/test_cancel_poll.py tests/scheduler/test_callbacks_errors.py tests/scheduler/test_stats.py tests/scheduler/test_slot_state.py tests/scheduler/test_background_driver.py tests/scheduler/test_step_accounting.py tests/scheduler/test_poll_timeout.py tests/scheduler/test_scheduler_api_edges.py tests/scheduler/test_stop_thread.py --deselect=tests/scheduler/test_stop_thread.py::test_close_from_a_callback_does_not_deadlock"
declare -A TESTS=(
  [pocketllm.sampling]="tests/engine/test_generate_api.py -k sampling_params tests/engine/test_sampling_params.py"
  [pocketllm.cache]="tests/engine/test_slot_cache.py tests/scheduler/test_slot_state.py"
  [pocketllm.models.batch]="tests/models/test_batch.py tests/scheduler/test_slot_state.py"
  [pocketllm.scheduler.request]="tests/scheduler/test_request.py tests/scheduler/test_slot_state.py tests/scheduler/test_lifecycle.py"
  [pocketllm.scheduler.batch_scheduler]="$scheduler_tests"
  [pocketllm.scheduler.planner]="$scheduler_tests"
  [pocketllm.scheduler.delivery]="$scheduler_tests"
  [pocketllm.scheduler.slots]="tests/engine/test_slot_cache.py tests/scheduler/test_slot_state.py tests/scheduler/test_lifecycle.py"
  [pocketllm.kernels.sample]="tests/kernels/test_sample.py tests/kernels/test_sample_boundaries.py"
  [pocketllm.kernels.rms_norm]="tests/kernels/test_rms_norm.py tests/kernels/test_rms_norm_gated.py"
  [pocketllm.kernels.rms_norm_gated]="tests/kernels/test_rms_norm.py tests/kernels/test_rms_norm_gated.py"
  [pocketllm.kernels.rope]="tests/kernels/test_rope.py tests/kernels/test_rope_write_kv.py"
  [pocketllm.kernels._attention]="tests/kernels/test_prefill_attention.py tests/kernels/test_decode_attention.py"
  [pocketllm.kernels.prefill_attention]="tests/kernels/test_prefill_attention.py tests/kernels/test_decode_attention.py"
  [pocketllm.kernels.decode_attention]="tests/kernels/test_decode_attention.py"
)
# In the kernel modules only the torch references are mutated (the Triton kernels are decorated
# functions, which mutmut leaves alone; their launchers are tested under the interpreter elsewhere).
declare -A PATTERNS=(
  [pocketllm.kernels.sample]="pocketllm.kernels.sample.x_mix32* pocketllm.kernels.sample.x__mul32* pocketllm.kernels.sample.x_row_keys* pocketllm.kernels.sample.x_uniform_noise* pocketllm.kernels.sample.x_allowed_mask* pocketllm.kernels.sample.x_sample_ref*"
  [pocketllm.kernels.rms_norm]="pocketllm.kernels.rms_norm.x_*_ref*"
  [pocketllm.kernels.rms_norm_gated]="pocketllm.kernels.rms_norm_gated.x_*_ref*"
  [pocketllm.kernels.rope]="pocketllm.kernels.rope.x_rope_table* pocketllm.kernels.rope.x_apply_rope_ref*"
  [pocketllm.kernels._attention]="pocketllm.kernels._attention.x__attend_one*"
  [pocketllm.kernels.prefill_attention]="pocketllm.kernels.prefill_attention.x_prefill_attention_ref*"
  [pocketllm.kernels.decode_attention]="pocketllm.kernels.decode_attention.x_decode_attention_ref*"
)

run_one() {
  local target=$1 module=${1%%.x_*}
  local work="$root/${module//./_}"
  local selection=${MUTATION_TESTS:-${TESTS[$module]:-}}
  [[ -n "$selection" ]] || { echo "no test selection for $module" >&2; return 1; }
  mkdir -p "$work"
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf -) | (cd "$work" && tar xf -)
  "$python" - "$work/pyproject.toml" $selection <<'PY'
import re, sys
path, args = sys.argv[1], sys.argv[2:]
text = open(path).read()
listed = ", ".join(f'"{a}"' for a in args)
text = re.sub(r"pytest_add_cli_args_test_selection = \[[^\]]*\]", f"pytest_add_cli_args_test_selection = [{listed}]", text)
open(path, "w").write(text)
PY
  local patterns=()
  if [[ "$target" == *"*"* ]]; then patterns=("$target")
  elif [[ -n "${PATTERNS[$module]:-}" ]]; then read -ra patterns <<< "${PATTERNS[$module]}"
  else patterns=("$module.*"); fi
  (cd "$work" && OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} \
    "$python" -m mutmut run --max-children "${MUTATION_JOBS:-1}" "${patterns[@]}" || true)
  (cd "$work" && "$python" "$repo/tools/mutation_score.py" "${patterns[@]}")
}

targets=("$@")
[[ ${#targets[@]} -gt 0 && "${targets[0]}" != all ]] || targets=("${!TESTS[@]}")
for target in "${targets[@]}"; do run_one "$target"; done
