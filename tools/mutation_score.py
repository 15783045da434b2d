"""Score per module from mutmut's results (run in a mutation work directory, after `mutmut run`).

Usage: python tools/mutation_score.py [MODULE_OR_PATTERN ...]
A dotted module name selects its mutants; an argument with a `*` is a mutant-name pattern.
Prints, per module, killed / checked (checked: every mutant run, whatever its outcome) and the
names of the mutants not killed. A mutant whose tests time out counts as killed (it made them
hang: detected, as mutmut counts it); one that no selected test reaches ("no tests") counts as not
killed: the selection missed it.
"""

from __future__ import annotations

import collections
import fnmatch
import subprocess
import sys


def _selected(name: str, module: str, wanted: list[str]) -> bool:
    if not wanted:
        return True
    return any(fnmatch.fnmatch(name, w) if "*" in w else module == w for w in wanted)


def main(wanted: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all=True"], capture_output=True, text=True,
                         check=True).stdout
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    not_killed: dict[str, list[str]] = collections.defaultdict(list)
    for line in out.splitlines():
        if ": " not in line:
            continue
        name, status = line.strip().rsplit(": ", 1)
        module = name.split(".x_")[0].split(".x\u01c1")[0]  # mutant names: module.x_function__mutmut_N
        if status in ("not checked", "skipped") or not _selected(name, module, wanted):
            continue
        counts[module][status] += 1
        if status not in ("killed", "timeout"):
            not_killed[module].append(f"{name} ({status})")
    print(f"{'module':40} {'mutants':>7} {'killed':>6} {'score':>7}")
    for module, c in sorted(counts.items()):
        checked = sum(c.values())
        killed = c["killed"] + c["timeout"]
        print(f"{module:40} {checked:7} {killed:6} {100.0 * killed / checked:6.1f}%  {dict(c)}")
    for module, names in sorted(not_killed.items()):
        print(f"\n{module}: {len(names)} not killed")
        for name in names:
            print(f"  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
