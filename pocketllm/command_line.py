"""What every `pocketllm` command shares: a usage error in one line, and no traceback for a user
error. Below the commands (`cli.py`, `bench`, `lab`, `serve`), so each can use it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line on stderr (naming the subcommand and pointing to --help), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_command(command: str, body: Callable[[], int]) -> int:
    """`body`'s exit status, keeping the command line's promise of no traceback for a user error:
    a bad value (CheckpointError is a ValueError), a path that cannot be read or written or a
    missing optional package is one line on stderr and status 2; Ctrl-C is one line and 130."""
    try:
        return body()
    except (ValueError, TypeError, OSError, ImportError) as exc:
        print(f"pocketllm {command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pocketllm {command}: interrupted", file=sys.stderr)
        return 130


def one_line(text: str) -> str:
    """`text` with every run of whitespace (newlines too) as one space."""
    return " ".join(text.split())
