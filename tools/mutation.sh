#!/usr/bin/env bash
# Mutation testing of pocketllm's core modules with mutmut (not part of the default test run).
#
#   pip install mutmut                    # 3.x; once
#   tools/mutation.sh                     # every module in [tool.mutmut] only_mutate
#   tools/mutation.sh pocketllm.sampling pocketllm.cache    # only these modules' mutants
#   tools/mutation.sh 'pocketllm.kernels.rope.x_apply_rope_ref*'   # a mutant-name pattern (has a *)
#
# Works on a copy of the repository (MUTATION_WORKDIR, default /tmp/pocketllm-mutation), so the
# checkout never sees mutmut's `mutants/` tree. Configuration, including the test selection, is
# the [tool.mutmut] section of pyproject.toml. MUTATION_JOBS sets the parallel mutants (default 1).
# Prints mutmut's per-mutant results and a score per module (docs/mutation.md has the last ones).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${MUTATION_WORKDIR:-/tmp/pocketllm-mutation}
python=${PYTHON:-python}
mkdir -p "$work"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf - ) | (cd "$work" && tar xf -)
cd "$work"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
patterns=()
for module in "$@"; do
  case "$module" in *"*"*) patterns+=("$module") ;; *) patterns+=("$module.*") ;; esac
done
"$python" -m mutmut run --max-children "${MUTATION_JOBS:-1}" "${patterns[@]}" || true
"$python" "$repo/tools/mutation_score.py" "${@%%.x_*}"
