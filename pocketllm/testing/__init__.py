"""pocketllm.testing: the engine's invariance machinery as a toolkit for your own property tests.

- `strategies`: Hypothesis strategies (sampling parameters, prompts, request streams, schedules,
  checkpoints, per-op case grids);
- `Engines`: the engine factory a property drives (a serial reference and batched engines on one
  checkpoint), `Workload` and `Job` what it runs;
- assertions that say what broke and how to reproduce it: `assert_batch_invariant`,
  `assert_scoring_matches_generation`, `assert_matches_reference`, `assert_rows_invariant`,
  `assert_split_invariant`;
- `planted`: defects planted by construction, so a property can be seen to fail;
- a pytest plugin (`pytest_pocketllm`, beside the package; loaded by pytest once pocketllm is installed):
  fixtures for engines on cached random checkpoints, `--impl OP=SPEC`, `--pocketllm-profile`.

```python
from hypothesis import given
from pocketllm.testing import Engines, assert_batch_invariant, strategies

@given(workload=strategies.workloads(vocab=256, max_prompt=40))
def test_my_attention_keeps_the_contract(pocketllm_engines, workload):
    engines = pocketllm_engines("tiny", engine_args={"op_overrides": {"decode_attention": "mypkg.attn:decode"}})
    assert_batch_invariant(engines, workload)
```
"""

from __future__ import annotations

import math

from hypothesis import settings

from . import _checks as check
from . import planted, strategies
from .assertions import (
    ContractViolation,
    assert_batch_invariant,
    assert_matches_reference,
    assert_rows_invariant,
    assert_scoring_matches_generation,
    assert_split_invariant,
    op_case,
)
from .engines import Engines, Mismatch, find_mismatches, run_batched
from .explain import mismatches
from .strategies import Job, Schedule, Workload

__all__ = ["ContractViolation", "Engines", "Job", "Mismatch", "Schedule", "Workload", "assert_batch_invariant",
           "assert_matches_reference", "assert_rows_invariant", "assert_scoring_matches_generation",
           "assert_split_invariant", "budget", "find_mismatches", "mismatches", "op_case", "planted", "run_batched",
           "strategies"]


def budget(fraction: float = 1.0) -> int:
    """Examples for one property: `fraction` of the active Hypothesis profile's max_examples (at
    least 1), so a profile (`--pocketllm-profile thorough`) scales every property, the costly ones too."""
    rule = "a finite number > 0"
    check.real("budget", "fraction", fraction, rule)
    if not 0 < fraction < math.inf:  # NaN fails too
        raise check.refuse(ValueError, "budget", "fraction", rule, fraction)
    return max(1, int(settings().max_examples * fraction))
