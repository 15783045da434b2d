"""Hypothesis budgets come from the active profile, so --pocketllm-profile reaches every property.

A property with a literal max_examples would keep its budget under every profile (the thorough
profile would silently not scale it); this scan keeps that from coming back.
"""

from __future__ import annotations

import re
from pathlib import Path

from helpers import budget
from hypothesis import settings

TESTS = Path(__file__).resolve().parent
LITERAL_BUDGET = re.compile(r"max_examples\s*=\s*\d+\s*[,)]")  # a bare number, not one scaled by the profile


def test_no_property_hard_codes_its_budget():
    offenders = [f"{path.relative_to(TESTS)}:{number}"
                 for path in sorted(TESTS.rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if LITERAL_BUDGET.search(line) and "register_profile" not in line]
    assert offenders == []


def test_budget_scales_with_the_active_profile():
    full = settings().max_examples
    assert budget() == full
    assert budget(0.5) == max(1, int(full * 0.5))
    assert budget(1e-9) == 1  # never zero examples
