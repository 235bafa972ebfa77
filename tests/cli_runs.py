"""The generate CLI run as a user runs it, in this process (its ``main``: one weights load and
one set of compiled programs for every run of a test process), and its output read: the header
line in brackets, the generated text, a newline and a rule, then the timings report."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

from models.cli import generate

RULE = "-" * 72


@dataclass(frozen=True)
class CliRun:
    rc: int  # main's return, or the SystemExit code of a refused command line (argparse exits 2)
    out: str
    err: str

    @property
    def head(self) -> str:
        return self.out.split("]\n", 1)[0]

    @property
    def text(self) -> str:
        """The generated text exactly (without the newline the CLI writes before its rule)."""
        return self.out.split("]\n", 1)[1].split(f"\n{RULE}\n", 1)[0]

    @property
    def report(self) -> str:
        """The timings report after the rule ("" when the run printed none)."""
        rest = self.out.split(f"\n{RULE}\n", 1)
        return rest[1] if len(rest) == 2 else ""


def run_generate(argv: list[str]) -> CliRun:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = generate.main(argv)
        except SystemExit as e:
            rc = e.code
    return CliRun(int(rc or 0), out.getvalue(), err.getvalue())


def texts_with_and_without(args: list[str], flag: list[str]) -> tuple[list[str], list[str]]:
    """The generated texts and headers of ``args`` and of ``args + flag``; each run must exit 0."""
    texts, heads = [], []
    for extra in ([], flag):
        run = run_generate([*args, *extra])
        assert run.rc == 0, (extra, run.err[-2000:], run.out[-2000:])
        texts.append(run.text)
        heads.append(run.head)
    return texts, heads
