"""The package's imports against the layers docs/architecture.md writes down: every import runs to
the importer's floor or below, and no modules import each other in a circle. Also the sizes a
newcomer can read: no module over 400 lines, no function over 60 outside the kernels.

Read with `ast`, nothing imported: every `import` and `from ... import` of every module, those
inside functions too (a lazy import is still an arrow). An import under `if TYPE_CHECKING:`
counts for the direction and not for circles: it never runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _layers(text: str) -> list[tuple[int, str, list[str]]]:
    """(floor, name, paths) of each line of the ```layers block."""
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    layers = []
    for line in block.group(1).splitlines():
        match = re.fullmatch(r"(\d+)\. ([^:]+): (.+)", line.strip())
        assert match, f"a layers line reads 'N. name: paths', got {line!r}"
        layers.append((int(match[1]), match[2], match[3].split()))
    return layers


def modules_under(root: Path) -> dict[str, Path]:
    """module name -> file, for every module of the package `root`/pocketllm."""
    modules = {}
    for path in sorted((root / "pocketllm").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = modules_under(REPO)


def source(module: str, path: Path) -> str:
    """The module's file, relative to the directory above the package ("pocketllm/llm.py")."""
    return "/".join(module.split(".")) + ("/__init__.py" if path.name == "__init__.py" else ".py")


def floor_of(modules: dict[str, Path], layers: list[tuple[int, str, list[str]]]) -> dict[str, int]:
    """Each module's floor: the layer whose path (a file, or a folder ending in /) names it, the
    longest path winning (a file listed apart from its folder)."""
    floors = {}
    for module, path in modules.items():
        rel = source(module, path).removeprefix("pocketllm/")
        claims = [(len(p), floor) for floor, _, paths in layers for p in paths
                  if rel == p or (p.endswith("/") and rel.startswith(p))]
        assert claims, f"pocketllm/{rel} is on no floor of docs/architecture.md's layers"
        floors[module] = max(claims)[1]
    return floors


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, runs) for every import of pocketllm in `path`; `runs` is False under
    `if TYPE_CHECKING:`."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, runs: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((target, child.lineno, runs) for target in _targets(module, path, child, modules))
            visit(child, runs and not _is_type_checking(child))

    visit(ast.parse(path.read_text()), True)
    return found


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The modules an import statement loads: a name that is a submodule counts as that submodule."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[:len(package) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else []))
        names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target for alias in node.names]
    targets = []
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name != module:
            targets.append(name)
    return targets


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in arrows[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = [stack.pop()]
            while group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in arrows:
        if v not in index:
            visit(v)
    return found


def violations(modules: dict[str, Path], layers: list[tuple[int, str, list[str]]]) -> tuple[list[str], list[list[str]]]:
    """(imports that run up, circles) of `modules` against `layers`."""
    floors = floor_of(modules, layers)
    names = {floor: name for floor, name, _ in layers}
    up, arrows = [], {module: set() for module in modules}
    for module, path in modules.items():
        for target, line, runs in imports_of(module, path, modules):
            if floors[target] > floors[module]:
                up.append(f"{source(module, path)}:{line} imports {target} ({names[floors[target]]}, floor "
                          f"{floors[target]}) from floor {floors[module]} ({names[floors[module]]})")
            if runs:
                arrows[module].add(target)
    return up, circles(arrows)


def test_every_import_runs_down_the_written_layers_and_none_in_a_circle():
    up, found = violations(MODULES, _layers((REPO / "docs" / "architecture.md").read_text()))
    assert up == [], "\n".join(up)
    assert found == [], "\n".join(" <-> ".join(group) for group in found)


def test_an_import_up_and_a_circle_are_caught(tmp_path):
    """Negative control: a copy of two modules where the lower imports the upper, and two that
    import each other."""
    package = tmp_path / "pocketllm"
    (package / "kernels").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "kernels" / "__init__.py").write_text("from ..llm import LLM\n")
    (package / "llm.py").write_text("from . import runner\n")
    (package / "runner.py").write_text("def f():\n    from .llm import LLM\n")
    layers = [(3, "top", ["__init__.py"]), (2, "engine", ["llm.py", "runner.py"]), (1, "kernels", ["kernels/"])]
    up, found = violations(modules_under(tmp_path), layers)
    assert len(up) == 1 and "pocketllm/kernels/__init__.py:1 imports pocketllm.llm (engine, floor 2)" in up[0]
    assert found == [["pocketllm.llm", "pocketllm.runner"]]


@pytest.mark.parametrize("module", ["pocketllm.kernels.linear", "pocketllm.config"])
def test_the_ground_floors_import_nothing_above_them(module):
    floors = floor_of(MODULES, _layers((REPO / "docs" / "architecture.md").read_text()))
    assert all(floors[t] <= floors[module] for t, _, _ in imports_of(module, MODULES[module], MODULES))


MAX_FILE_LINES = 400  # a module a newcomer reads in one sitting
MAX_FUNCTION_LINES = 60  # outside kernels/, whose launchers and kernels are allowed their length


def test_no_module_over_400_lines_and_no_function_over_60_outside_the_kernels():
    long_files, long_functions = [], []
    for module, path in MODULES.items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{source(module, path)}: {len(text.splitlines())} lines")
        if ".kernels" in module:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{source(module, path)}:{node.lineno} {node.name}: {length} lines")
    assert long_files == [] and long_functions == [], "\n".join(long_files + long_functions)
