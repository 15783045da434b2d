"""Every Python block of the README and of docs/*.md runs as written.

- A block whose first line is `# test_<name>.py` is a pytest file: it is written under that name and
  run by pytest, with the plugin loaded from the install, on the `dev` profile.
- Every other ```python block is a script: a page's scripts run in order in one fresh interpreter
  (a subprocess in an empty working directory), in one namespace, so a block may use what an
  earlier block of its page defined. A traceback names the page and the line in it.
- A block that cannot run says why in an HTML comment on the line right above it, such as
  `<!-- not run: needs a running server -->`; it is still compiled.

`PAGES` holds how many blocks of each kind each page has, so a block that stops running (its
marker added, its fence changed, its page renamed) fails here until the table says so.
The relative links of every page, anchors included, are checked too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pocketllm.kernels.cpu.extension import DIR_ENV, build_dir

pytest_plugins = ["pytester"]
# pytester points HOME elsewhere, and the scripts run in fresh interpreters: every run here uses the
# C++ kernels already built for this one.
EXTENSIONS = str(build_dir().parent)


@pytest.fixture(autouse=True)
def _built_kernels(monkeypatch):
    monkeypatch.setenv(DIR_ENV, EXTENSIONS)


REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Counts:
    scripts: int = 0       # ```python blocks run as scripts
    pytest_files: int = 0  # ```python blocks that start with `# test_<name>.py`
    not_run: int = 0       # ```python blocks marked `<!-- not run: reason -->`


PAGES = {
    "README.md": Counts(scripts=6, pytest_files=1, not_run=1),
    "docs/api.md": Counts(scripts=4),
    "docs/architecture.md": Counts(),
    "docs/command_line.md": Counts(),
    "docs/errors.md": Counts(),
    "docs/invariance.md": Counts(),
    "docs/kernel_lab.md": Counts(),
    "docs/measurements.md": Counts(),
    "docs/models.md": Counts(),
    "docs/mutation.md": Counts(),
    "docs/scheduler.md": Counts(scripts=4),
    "docs/serving.md": Counts(scripts=1, not_run=2),
    "docs/tensor_parallel.md": Counts(scripts=1),
    "docs/testing.md": Counts(pytest_files=3),
}
FENCE = re.compile(r"^```\s*(\S*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*?) -->$")
PYTEST_FILE = re.compile(r"# (test_\w+\.py)\n")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the block's first line of code, from 1
    code: str
    not_run: str | None  # the reason given above it, or None

    @property
    def pytest_file(self) -> str | None:
        match = PYTEST_FILE.match(self.code)
        return match.group(1) if match else None


def _pages() -> list[str]:
    return ["README.md"] + sorted(f"docs/{path.name}" for path in (REPO / "docs").glob("*.md"))


def _blocks(page: str) -> list[Block]:
    """The ```python blocks of `page`; a fence other than python that starts with "py" is an error,
    and so is a not-run marker that is not right above a python block."""
    lines = (REPO / page).read_text().split("\n")
    blocks, start, info = [], None, ""
    for i, line in enumerate(lines):
        fence = FENCE.match(line)
        if start is None and fence:
            start, info = i, fence.group(1)
            assert info == "python" or not info.lower().startswith("py"), \
                f"{page}:{i + 1}: write ```python, not ```{info}, so the block runs"
        elif start is not None and fence and not fence.group(1):
            if info == "python":
                marker = NOT_RUN.match(lines[start - 1]) if start else None
                blocks.append(Block(page, start + 2, "\n".join(lines[start + 1:i]) + "\n",
                                    marker.group(1) if marker else None))
            start = None
        elif start is None and line.startswith("<!-- not run"):
            assert NOT_RUN.match(line), f"{page}:{i + 1}: write `<!-- not run: the reason -->`"
            assert i + 1 < len(lines) and lines[i + 1] == "```python", \
                f"{page}:{i + 1}: a not-run marker goes on the line right above a ```python block"
    assert start is None, f"{page}:{start + 1}: a code block that is never closed"
    return blocks


def _counts(blocks: list[Block]) -> Counts:
    return Counts(scripts=sum(b.not_run is None and b.pytest_file is None for b in blocks),
                  pytest_files=sum(b.not_run is None and b.pytest_file is not None for b in blocks),
                  not_run=sum(b.not_run is not None for b in blocks))


def test_every_page_has_the_blocks_it_expects():
    """Each page's blocks by kind, as PAGES says; every page is in PAGES and every entry is a page;
    a block that is not run still compiles."""
    pages = _pages()
    assert sorted(PAGES) == sorted(pages), "PAGES lists every Markdown page of README.md and docs/, no other"
    for page in pages:
        blocks = _blocks(page)
        assert _counts(blocks) == PAGES[page], f"{page}: {[(b.line, b.pytest_file, b.not_run) for b in blocks]}"
        for block in blocks:
            compile("\n" * (block.line - 1) + block.code, str(REPO / page), "exec")


# A page's scripts, in one interpreter: each block compiled under the page's path at its own line.
DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    exec(compile("\\n" * (block["line"] - 1) + block["code"], block["path"], "exec"), namespace)
"""


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page, counts in PAGES.items() if counts.scripts])
def test_the_scripts_of_a_page_run_as_written(page, tmp_path):
    blocks = [b for b in _blocks(page) if b.not_run is None and b.pytest_file is None]
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps([{"path": str(REPO / page), "line": b.line, "code": b.code} for b in blocks]))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, DIR_ENV: EXTENSIONS, "POCKETLLM_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", DRIVER, str(listing)], cwd=work, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{page}'s examples failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page, counts in PAGES.items() if counts.pytest_files])
def test_the_pytest_files_of_a_page_run_as_written(pytester, page):
    files = {b.pytest_file: b.code for b in _blocks(page) if b.not_run is None and b.pytest_file}
    for name, code in files.items():
        pytester.makepyfile(**{name.removesuffix(".py"): code})
    tests = sum(len(re.findall(r"^def test_", code, re.M)) for code in files.values())
    result = pytester.runpytest_subprocess("--pocketllm-profile", "dev", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=tests)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    text = CODE.sub("", path.read_text())
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", _pages())
def test_the_links_of_a_page_resolve(page):
    """Every relative link names a file that exists, and an anchor a heading of that file."""
    source = REPO / page
    broken = []
    for target in LINK.findall(CODE.sub("", source.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        path = (source.parent / name).resolve() if name else source
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{page}: links that do not resolve: {broken}"
