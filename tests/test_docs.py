"""Every code block of README.md and docs/*.md runs, and every quoted output is what tecc prints
today, so the pages cannot go stale. A page's blocks are read (markdown-it, CommonMark) in order:

- ```python blocks run in one namespace per page (`tc`, `np` and `math` imported), in a fresh
  folder that links the checkout's `examples/` and `docs/`. A block that starts with `>>> ` is a
  session: each statement runs and the lines after it are compared with its value's repr, or
  with `ErrorName: message` when it raises.
- A block whose first line starts with `$ ` holds commands: each runs in that folder (`tecc ...`
  is `python -m tecc ...`, `python` this interpreter; a fresh cache directory per page) and the
  lines up to the next `$ ` are compared with what it printed (stdout, then stderr).
- An HTML comment right before a block says what else it is:
  `<!-- docs-test: output -->`: what the python block above printed;
  `<!-- docs-test: output EXPR -->`: `str(EXPR)`, evaluated in the page's namespace;
  `<!-- docs-test: excerpt EXPR -->`: consecutive lines of `str(EXPR)`;
  `<!-- docs-test: skip: WHY -->`: not run (it needs a GPU, or installs things); keep these few.
- `<!-- docs-test: setup` ... `-->` holds Python the page's blocks assume (run where it stands,
  not shown on the page): the definitions a fragment leaves out.
- ```text blocks are illustrations (pseudocode, formulas, diagrams, layouts) and are not run.
  Any other block (untagged, indented, C/CUDA/JSON, shell) must be a command block or carry one
  of the markers above, so that nothing that looks like code or output escapes the test.

Comparisons are doctest's with ELLIPSIS and NORMALIZE_WHITESPACE: `...` stands for any text
(timings, addresses) and line wrapping does not matter.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(\w+)(?::)?\s*(.*?)\s*-->\s*$", re.S)
ILLUSTRATION = {"text"}
MAX_SKIPPED = 12  # blocks that cannot run here: few, each saying why
COMMAND_SECONDS = 900


@dataclass
class Block:
    page: Path
    line: int                  # 1-based line of the block's first line in the page
    info: str                  # the fence's language ("" for untagged and indented blocks)
    text: str
    marker: str = ""           # output | excerpt | skip | "" (see the module docstring)
    argument: str = ""

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Setup:
    page: Path
    line: int
    code: str


def read_page(page: Path) -> list[Block | Setup]:
    """The page's blocks and setup comments, in order."""
    found: list[Block | Setup] = []
    pending: tuple[str, str] | None = None
    for token in MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8")):
        line = token.map[0] + 1 if token.map else 0
        if token.type == "html_block":
            m = MARKER.match(token.content.strip())
            if m is None:
                continue
            kind, argument = m.group(1), m.group(2)
            if kind == "setup":
                found.append(Setup(page, line, argument))
            else:
                assert kind in ("output", "excerpt", "skip"), f"{page.name}:{line}: unknown marker docs-test: {kind}"
                pending = (kind, argument)
            continue
        if token.type in ("fence", "code_block"):
            block = Block(page, line + (1 if token.type == "fence" else 0), token.info.strip(), token.content)
            if pending is not None:
                block.marker, block.argument = pending
            found.append(block)
        pending = None
    return found


def same(want: str, got: str) -> bool:
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    return doctest.OutputChecker().check_output(want.strip() + "\n", got.strip() + "\n", flags)


def differs(block: Block, want: str, got: str) -> str:
    return f"{block.where()}: the page says\n{want.rstrip()}\n--- but tecc gives ---\n{got.rstrip()}\n"


class PageRun:
    """Runs one page's blocks in order and collects what does not hold."""

    def __init__(self, page: Path, folder: Path) -> None:
        self.page = page
        self.folder = folder
        self.namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
        exec("import math\nimport numpy as np\nimport tecc as tc", self.namespace)
        self.printed = ""
        self.failures: list[str] = []
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                        TECC_CACHE_DIR=str(folder / ".tecc-cache"), TECC_PROGRESS="0")
        self.env.pop("TECC_BUILD_CACHE", None)  # as a user runs the commands: both caches on, cold

    def run(self, item: Block | Setup) -> None:
        if isinstance(item, Setup):
            self.python(item.code, f"{item.page.relative_to(ROOT)}:{item.line} (setup)")
            return
        block = item
        if block.marker == "skip":
            return
        if block.marker in ("output", "excerpt"):
            self.compare(block)
        elif block.text.startswith("$ "):
            self.commands(block)
        elif block.info == "python" and block.text.startswith(">>> "):
            self.session(block)
        elif block.info == "python":
            self.python(block.text, block.where())

    def python(self, code: str, where: str) -> None:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, where, "exec"), self.namespace)
        except Exception:  # noqa: BLE001 - reported with the page and line
            self.failures.append(f"{where}: the block raised\n{traceback.format_exc(limit=-3)}")
        self.printed = out.getvalue()

    def compare(self, block: Block) -> None:
        if block.argument:
            try:
                got = str(eval(block.argument, self.namespace))
            except Exception:  # noqa: BLE001
                self.failures.append(f"{block.where()}: {block.argument} raised\n{traceback.format_exc(limit=-3)}")
                return
        else:
            got = self.printed
        want = block.text
        if block.marker == "excerpt":
            # the ellipses on both sides need text to stand for, also where the excerpt starts or
            # ends the output (whitespace normalization would drop an empty line there)
            want, got = f"...\n{block.text.strip()}\n...", f"[start]\n{got}\n[end]"
        if not same(want, got):
            self.failures.append(differs(block, block.text, got))

    def session(self, block: Block) -> None:
        for source, want in _statements(block.text):
            try:
                try:
                    code = compile(source, block.where(), "eval")
                except SyntaxError:
                    exec(compile(source, block.where(), "exec"), self.namespace)
                    got = ""
                else:
                    value = eval(code, self.namespace)
                    got = "" if value is None else repr(value)
            except Exception as exc:  # noqa: BLE001 - the session shows the error
                got = f"{type(exc).__name__}: {exc}"
            if not same(want or "", got):
                self.failures.append(differs(block, f">>> {source}\n{want}", got))

    def commands(self, block: Block) -> None:
        for command, want in _commands(block.text):
            argv = shlex.split(command)
            if argv[0] == "tecc":
                argv = [sys.executable, "-m", "tecc", *argv[1:]]
            elif argv[0] == "python":
                argv = [sys.executable, *argv[1:]]
            done = subprocess.run(argv, cwd=self.folder, env=self.env, capture_output=True, text=True,
                                  timeout=COMMAND_SECONDS)
            got = done.stdout + done.stderr
            if not same(want, got):
                self.failures.append(differs(block, f"$ {command}\n{want}", got))


def _statements(text: str) -> list[tuple[str, str]]:
    """(source, expected output) of each `>>> ` statement of a session block."""
    found: list[tuple[list[str], list[str]]] = []
    for line in text.splitlines():
        if line.startswith(">>> "):
            found.append(([line[4:]], []))
        elif line.startswith("... ") and found and not found[-1][1]:
            found[-1][0].append(line[4:])
        elif found:
            found[-1][1].append(line)
    return [("\n".join(src), "\n".join(out)) for src, out in found]


def _commands(text: str) -> list[tuple[str, str]]:
    """(command, expected output) of each `$ ` line of a command block."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            found.append((line[2:], []))
        else:
            found[-1][1].append(line)
    return [(command, "\n".join(out)) for command, out in found]


def _not_run(block: Block) -> str:
    """Why a block is neither run nor declared not to be code ("" when it is fine)."""
    if block.marker or block.text.startswith("$ ") or block.info in ILLUSTRATION | {"python"}:
        return ""
    what = f"a ```{block.info} block" if block.info else "an untagged block"
    return (f"{block.where()}: {what} that the test neither runs nor compares: make it a ```python block, a "
            "`$ command` block, give it a docs-test marker (output, excerpt, skip), or tag an illustration "
            "```text")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_block_of_the_page_runs_and_its_quoted_output_is_current(page: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("examples", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    items = read_page(page)
    problems = [why for item in items if isinstance(item, Block) for why in [_not_run(item)] if why]
    runner = PageRun(page, tmp_path)
    for item in items:
        runner.run(item)
    problems += runner.failures
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_the_blocks_that_do_not_run_are_few_and_say_why() -> None:
    skipped = [b for page in PAGES for b in read_page(page) if isinstance(b, Block) and b.marker == "skip"]
    vague = [b.where() for b in skipped if len(b.argument.split()) < 3]
    assert not vague, f"say why these blocks cannot run: {vague}"
    assert len(skipped) <= MAX_SKIPPED, "\n".join(f"{b.where()}: {b.argument}" for b in skipped)
