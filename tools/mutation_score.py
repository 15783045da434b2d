"""Score per module from mutmut's results (run in the mutation work directory, after `mutmut run`).

Usage: python tools/mutation_score.py [MODULE ...]  (dotted names; default: every module tested)
Prints, per module, killed / (killed + survived + timeout + suspicious) and the survivors' names.
Mutants with no test reaching them ("no tests") count as survivors: the selection missed them.
"""

from __future__ import annotations

import collections
import subprocess
import sys


def main(modules: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all=True"], capture_output=True, text=True,
                         check=True).stdout
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    survivors: dict[str, list[str]] = collections.defaultdict(list)
    for line in out.splitlines():
        if ": " not in line:
            continue
        name, status = line.strip().rsplit(": ", 1)
        module = name.split(".x_")[0].split(".x\u01c1")[0]  # mutant names: module.x_function__mutmut_N
        if modules and not any(module == m or module.startswith(m + ".") for m in modules):
            continue
        by_module[module][status] += 1
        if status not in ("killed", "not checked", "skipped"):
            survivors[module].append(f"{name} ({status})")
    print(f"{'module':45} {'mutants':>7} {'killed':>6} {'score':>6}")
    for module, counts in sorted(by_module.items()):
        checked = sum(v for k, v in counts.items() if k not in ("not checked", "skipped"))
        killed = counts["killed"]
        score = 100.0 * killed / checked if checked else float("nan")
        print(f"{module:45} {checked:7} {killed:6} {score:5.1f}%  {dict(counts)}")
    for module, names in sorted(survivors.items()):
        print(f"\n{module}: {len(names)} not killed")
        for name in names:
            print(f"  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
