"""The documentation's snippets as tests: every ``python`` and ``console`` block of the
README and of docs/ (not docs/_build), run by Sybil as a reader would type them.

A page's blocks run in order, in a working directory of the page's own (with
``examples`` linked to the project's, so ``examples/plugins`` is where a clone has it):

* a ``python`` block runs in the page's one namespace; one that starts with ``>>>`` is a
  doctest (its output is checked); one whose first line is ``# content of NAME`` is a
  file the reader saves, written to the page's directory (so is a block of any language
  that starts so, a ``toml`` file say);
* a ``console`` block's ``$ `` lines run in bash, one shell per page (its variables and
  directory carry over); each must exit 0, and what the page shows below a command is
  compared with what it printed (stdout and stderr, as a terminal shows them), with
  ``...`` standing for anything and tokens, UUIDs, times and decimals normalised;
* ``trio-supervisor serve ...`` in a console block starts the page's runner in the
  background, listening on a free port: wherever the page writes the address it asked
  for (``127.0.0.1:8470`` unless it gave ``--listen``), its blocks reach that port, and
  what they print reads as the page's address again. An operator command given no
  ``--url`` (the runner's machine needs none) is given the runner's. A page that talks to
  ``127.0.0.1:8470`` before it starts a runner gets one as its reader is told to start
  it (``trio-supervisor serve --plugins examples/plugins``). Every runner is stopped
  (SIGTERM, exit status 0) when the page ends;
* a block right below the line ``<!-- illustration: WHY -->`` is skipped, saying so
  (``pytest -rs``): a fleet on several machines, a command that never returns.

A page is one test, ``PAGE::blocks``, whatever pytest-xdist's ``--dist``: its blocks
depend on each other. Each illustration is a test of its own that skips, named by its
line (``PAGE::line:N,column:1``). A failure names the page, the line and the command.
"""

from __future__ import annotations

import contextlib
import doctest
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.evaluators.doctest import DocTestEvaluator
from sybil.integration.pytest import SybilFile, SybilItem
from sybil.parsers.abstract.doctest import DocTestStringParser

from . import ROOT
from .processes import SHUTDOWN, Launched, NotReady, launched, without_others_on_the_machine

DOCS: Final = ROOT / "docs"


def pages() -> list[Path]:
    """The pages whose snippets run: the README and docs/**/*.md, the built site aside."""
    built = DOCS / "_build"
    found = [path for path in DOCS.rglob("*.md") if built not in path.parents]
    return [ROOT / "README.md", *sorted(found)]


FENCE: Final = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<language>[\w-]*)[^\n]*\n(?P<source>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
ILLUSTRATION: Final = re.compile(r"<!--\s*illustration:\s*(?P<why>.+?)\s*-->")
CONTENT_OF: Final = re.compile(r"#\s*content of\s+(?P<name>\S+)\s*\n")
DOCTEST_FLAGS: Final = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# What a reader's runner listens on (serve's default), and the operator commands that
# reach it there when given no --url.
DEFAULT_ADDRESS: Final = "127.0.0.1:8470"
CLIENT_COMMANDS: Final = (
    "sessions",
    "show",
    "logs",
    "dispose",
    "health",
    "runners",
    "usage",
    "dashboard",
    "drain",
)
DEFAULT_RUNNER: Final = ("trio-supervisor", "serve", "--plugins", "examples/plugins")
# A runner the page starts: serve and its flags, no more (``serve ...; echo $?`` is a
# command like any other, which the page expects to end).
SERVE: Final = re.compile(r"trio-supervisor serve\b[^;|&<>()$`]*")
COMMAND_BOUND: Final = 180.0  # seconds a console command may take


class Page:
    """One page's run: its directory, its shell's variables, the runners it started.

    Attributes:
        name: The page, relative to the project (``docs/how-to/fleet.md``).
        directory: Its working directory.
        environment: Its shell's variables, carried from one command to the next.
        addresses: For each address the page wrote, the one its runner really has.
    """

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory
        self.cwd = directory
        bin_directory = str(Path(sys.executable).parent)  # python3, trio-supervisor
        self.environment = {
            **os.environ,
            "PATH": f"{bin_directory}:{os.environ.get('PATH', '')}",
            "PYTHONDONTWRITEBYTECODE": "1",
            "COLUMNS": "200",  # rich lays tables out for a wide terminal
        }
        self.addresses: dict[str, str] = {}
        self.runners: list[Launched] = []
        self.serving: dict[str, Launched] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for runner in self.runners:
                status = runner.stop(bound=SHUTDOWN)
                assert status == 0, f"{self.name}: a runner exited {status}: {runner.stderr(20)}"
        finally:
            self._stack.close()

    # -- addresses ---------------------------------------------------------------------

    def adapt(self, text: str, *, start: bool = True) -> str:
        """``text`` as it runs here: the page's addresses are its runners' real ones (and
        with ``start``, a page that names the default address before it started a
        runner gets one)."""
        if start and DEFAULT_ADDRESS in text and not self.addresses:
            self.serve(shlex.join(DEFAULT_RUNNER))
        for written, real in self.addresses.items():
            text = text.replace(written, real)
        return text

    def as_written(self, text: str) -> str:
        """What a command printed, with the runners' real addresses as the page wrote them."""
        for written, real in self.addresses.items():
            text = text.replace(real, written)
        return text

    # -- runners -----------------------------------------------------------------------

    def serve(self, command: str) -> str:
        """Start ``trio-supervisor serve ...`` in the background; its first line."""
        argv = shlex.split(command)
        assert argv[:2] == ["trio-supervisor", "serve"], command
        written = DEFAULT_ADDRESS
        if "--listen" in argv:
            at = argv.index("--listen") + 1
            written = argv[at]
            argv[at] = "127.0.0.1:0"
        else:
            argv += ["--listen", "127.0.0.1:0"]
        before = self.serving.get(written)
        # A page may start a runner again where one ran, once that one has exited.
        assert before is None or before.process.poll() is not None, (
            f"{self.name}: two runners on {written}"
        )
        log = self.cwd / f"serve-{len(self.runners) + 1}.stderr"
        runner = self._stack.enter_context(
            launched(
                [sys.executable, "-m", "trio_supervisor", *argv[1:]],
                ready=lambda line: True,
                cwd=self.cwd,
                log=log,
            )
        )
        self.runners.append(runner)
        self.serving[written] = runner
        line = runner.lines[-1]
        if not line.startswith("listening on "):
            raise NotReady(f"{command} printed {line!r}: {runner.stderr()}")
        real = line.split("://", 1)[1].strip()
        self.addresses[written] = real
        return self.as_written(line)

    # -- the shell ---------------------------------------------------------------------

    def shell(self, command: str) -> tuple[int, str]:
        """Run ``command`` as a reader's bash would; its exit status and its output."""
        command = self.adapt(command)
        real = self.addresses.get(DEFAULT_ADDRESS)
        if real is not None:  # the operator commands' default is the page's runner
            client = "|".join(CLIENT_COMMANDS)
            command = re.sub(
                rf"(?m)^(\s*trio-supervisor\s+(?:{client}))\b(?!.*--url)",
                rf"\1 --url http://{real}",
                command,
            )
        state = self.directory / ".shell-environment"
        where = self.directory / ".shell-directory"
        script = (
            f"set -a\ncd {shlex.quote(str(self.cwd))}\n{command}\n__status=$?\n"
            f"env -0 > {shlex.quote(str(state))}\npwd > {shlex.quote(str(where))}\n"
            "exit $__status\n"
        )
        done = subprocess.run(
            ["bash", "-c", script],
            env=self.environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=COMMAND_BOUND,
            check=False,
        )
        self._reap_orphans()
        if state.exists():
            pairs = (entry.split("=", 1) for entry in state.read_text().split("\0") if entry)
            self.environment = dict(pair for pair in pairs if len(pair) == 2)
            self.cwd = Path(where.read_text().strip())
        return done.returncode, self.as_written(done.stdout.decode(errors="replace"))

    def _reap_orphans(self) -> None:
        """Reap what a command's processes left to this one, as a reader's init would: a
        program killed with its children running leaves them to the test process (a
        child subreaper, conftest.py). The page's runners are left alone."""
        mine = os.getpid()
        ours = {runner.process.pid for runner in self.runners}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()
            if fields[0] == "Z" and int(fields[1]) == mine:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(int(entry.name), os.WNOHANG)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """The page's directory as the process's, for a Python block."""
        before = Path.cwd()
        os.chdir(self.cwd)
        try:
            yield
        finally:
            os.chdir(before)


# -- what a command printed, against what the page shows ----------------------------------

ANSI: Final = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NORMAL: Final = (
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "UUID"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)?"), "TIME"),
    (re.compile(r"(?<![\w-])[A-Za-z0-9_-]{43}(?![\w-])"), "TOKEN"),
    (re.compile(r"\b\d+\.\d+"), "N.N"),
    (re.compile(r"([─━═│┃┏┓┗┛┡┩└┘┌┐╇╈┳┻┼╋├┤])\1+"), r"\1"),
    (re.compile(r"[ \t]+"), " "),
)


def normal(text: str) -> str:
    """``text`` with what differs from run to run made alike: tokens, UUIDs, times,
    decimals, the widths of a table's columns."""
    text = ANSI.sub("", text)
    for pattern, replacement in NORMAL:
        text = pattern.sub(replacement, text)
    return "\n".join(line.strip() for line in text.strip().splitlines())


def matches(shown: str, printed: str) -> bool:
    """Whether ``printed`` reads as the page shows it, ``...`` standing for anything
    (what a runner logs of other processes of the machine left out)."""
    parts = [re.escape(part) for part in normal(shown).split("...")]
    printed = without_others_on_the_machine(printed)
    return re.fullmatch(".*?".join(parts), normal(printed), flags=re.DOTALL) is not None


# -- the evaluators ------------------------------------------------------------------------


def page_of(example: Example) -> Page:
    page: Page = example.namespace["snippet_page"]
    return page


def run_python(example: Example) -> None:
    """A Python block: run in the page's namespace and directory."""
    __tracebackhide__ = True
    page = page_of(example)
    source = "\n" * example.line + page.adapt(str(example.parsed))
    code = compile(source, example.path, "exec", dont_inherit=True)
    with page.inside():
        exec(code, example.namespace)
    example.namespace.pop("__builtins__", None)


class InPage:
    """A doctest's evaluator, run in the page's directory."""

    def __init__(self) -> None:
        self.doctest = DocTestEvaluator(DOCTEST_FLAGS)

    def __call__(self, example: Example) -> str | None:
        with page_of(example).inside():
            return self.doctest(example)


def save(name: str) -> Any:
    """A file the page has its reader save: written to the page's directory."""

    def evaluate(example: Example) -> None:
        page = page_of(example)
        (page.cwd / name).write_text(page.adapt(str(example.parsed), start=False))

    return evaluate


class Illustration:
    """A block that only illustrates (or waits for its page's owner): skipped, naming it
    and why, as a test of its own (it needs nothing of its page's)."""

    def __init__(self, why: str) -> None:
        self.reason = why if why.startswith("pending: ") else f"illustration: {why}"

    def __call__(self, example: Example) -> None:
        # Reported at the block (the page and its line), not here.
        raise pytest.skip.Exception(self.reason, _use_item_location=True)


def commands(source: str) -> Iterator[tuple[str, str]]:
    """A console block's commands (a line ending in ``\\`` goes on below) and the output
    the page shows under each."""
    command: list[str] = []
    shown: list[str] = []
    lines = iter(source.splitlines())
    for line in lines:
        if line.startswith("$ "):
            if command:
                yield "\n".join(command), "\n".join(shown)
            command, shown = [line[2:]], []
            while command[-1].endswith("\\"):
                command.append(next(lines))
        elif command:
            shown.append(line)
        elif line.strip():
            raise AssertionError(f"output before any `$ ` command: {line!r}")
    if command:
        yield "\n".join(command), "\n".join(shown)


def run_console(example: Example) -> None:
    """A console block: each ``$ `` command must exit 0 and print what the page shows."""
    __tracebackhide__ = True
    page = page_of(example)
    found = list(commands(str(example.parsed)))
    assert found, f"{page.name}:{example.line}: a console block with no `$ ` command"
    for command, shown in found:
        if SERVE.fullmatch(command) and "--help" not in command:
            status, printed = 0, page.serve(command)
        else:
            status, printed = page.shell(command)
        where = f"{page.name}:{example.line}: $ {command}"
        assert status == 0, f"{where}\nexited {status}, printing:\n{printed}"
        if shown.strip():
            assert matches(shown, printed), (
                f"{where}\nthe page shows:\n{shown}\nit printed:\n{printed}"
            )


# -- the parser ---------------------------------------------------------------------------

RUN: Final = {"python", "console"}

# Blocks of pages their owners are still rewriting, each skipped by name until its page
# follows the conventions above; then its entry goes (test_docs.py fails on an entry
# that names no block). (page, text the block holds): why.
PENDING: Final[dict[tuple[str, str], str]] = {}


def pending(page: str, source: str) -> str | None:
    """Why a block of ``page`` waits for its owner, if it does."""
    for (name, holds), why in PENDING.items():
        if name == page and holds in source:
            return why
    return None


def snippets(document: Document) -> Iterable[Region]:
    """The blocks of a page that run, each a region with its evaluator."""
    text = document.text
    for block in FENCE.finditer(text):
        language, indent = block["language"], len(block["indent"])
        # A block in a list item is indented as the item's text is.
        source = "".join(line[indent:] for line in block["source"].splitlines(keepends=True))
        above = text[: block.start()].rstrip().rpartition("\n")[2]
        marked = ILLUSTRATION.fullmatch(above.strip())
        saved = CONTENT_OF.match(source)
        if language not in RUN and saved is None:
            continue
        waiting = pending(str(Path(document.path).relative_to(ROOT)), source)
        if marked is not None or waiting is not None:
            why = marked["why"] if marked is not None else waiting
            yield Region(block.start(), block.end(), source, Illustration(str(why)))
        elif saved is not None:
            yield Region(block.start(), block.end(), source, save(saved["name"]))
        elif language == "console":
            yield Region(block.start(), block.end(), source, run_console)
        elif source.startswith(">>>"):
            offset = block.start("source")
            for region in DocTestStringParser(InPage())(source, document.path):  # type: ignore[arg-type]
                region.start += offset
                region.end += offset
                yield region
        else:
            yield Region(block.start(), block.end(), source, run_python)


SYBIL: Final = Sybil(parsers=[snippets], fixtures=["snippet_page"])
SKIPPED: Final = Sybil(parsers=[snippets])  # an illustration's: no page is needed


class Snippet(SybilItem):
    """An illustration of a page: a test that skips, saying which block and why."""

    def _traceback_filter(self, excinfo: pytest.ExceptionInfo[BaseException]) -> Any:
        # Sybil cuts the traceback at its own frames, which a failure in the page's
        # fixture (a runner that did not start) never passed through.
        try:
            return super()._traceback_filter(excinfo)
        except IndexError:
            return excinfo.traceback


class PageRun(Snippet):
    """A page's blocks that run, in order, as one test: they share a namespace, a
    directory, a shell and the runners the page started, so no scheduling of pytest-xdist
    may part them. A failure names the block (its page and line)."""

    def __init__(self, parent: PageFile, sybil: Sybil, examples: list[Example]) -> None:
        pytest.Item.__init__(self, "blocks", parent)
        self.example = examples[0]  # whose namespace the fixtures go to: the page's
        self.examples = examples
        self.request_fixtures(sybil.fixtures)  # type: ignore[no-untyped-call]  # Sybil's own

    def runtest(self) -> None:
        for example in self.examples:
            example.evaluate()

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name}: its blocks, in order"


class PageFile(SybilFile):
    """A page: one test of its blocks that run, and one skip per illustration."""

    def collect(self) -> Iterator[Snippet]:
        document = SYBIL.parse(self.path)
        self.documents.append(document)
        examples = list(document.examples())
        run = [e for e in examples if not isinstance(e.region.evaluator, Illustration)]
        if run:
            yield PageRun.from_parent(self, sybil=SYBIL, examples=run)
        for example in examples:
            if isinstance(example.region.evaluator, Illustration):
                yield Snippet.from_parent(self, sybil=SKIPPED, example=example)


class Pages(pytest.Module):
    """test_docs.py's tests, then each page's: its blocks as one test, its illustrations
    as skips."""

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        found: list[pytest.Item | pytest.Collector] = list(super().collect())
        for path in pages():
            found.append(PageFile.from_parent(self, path=path, sybils=[SYBIL]))
        return found


def page_directory(name: str, directory: Path) -> Page:
    """A page's run in ``directory``, with ``examples`` as a clone has it."""
    (directory / "examples").symlink_to(ROOT / "examples")
    return Page(name, directory)
