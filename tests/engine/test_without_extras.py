"""The engine needs four packages; the client and the service say which extra they need.

Each check that an optional package is absent runs in a fresh interpreter whose import
system refuses those packages (a finder first on ``sys.meta_path``), as an environment
that installed only ``pip install trio_supervisor`` would.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from packaging.requirements import Requirement

from trio_supervisor._extras import needs_extra

CLIENT = ("httpx",)
SERVICE = ("hypercorn", "starlette", "click", "rich", "prometheus_client")


def requirements() -> dict[str | None, set[str]]:
    """The package's requirements by the extra that asks for them (None: always)."""
    found: dict[str | None, set[str]] = {}
    for line in importlib.metadata.requires("trio_supervisor") or []:
        requirement = Requirement(line)
        extra = None
        if requirement.marker is not None:
            extras = [
                name
                for name in ("client", "service", "postgres", "test", "lint", "docs")
                if requirement.marker.evaluate({"extra": name})
            ]
            assert len(extras) == 1, line
            extra = extras[0]
        found.setdefault(extra, set()).add(requirement.name.lower().replace("_", "-"))
    return found


def test_only_four_packages_are_required_unconditionally() -> None:
    found = requirements()
    assert found[None] == {"trio", "attrs", "cattrs", "orjson"}
    assert found["client"] == {"httpx"}
    assert found["service"] == {
        "hypercorn",
        "starlette",
        "click",
        "rich",
        "prometheus-client",
        "httpx",
    }
    assert found["postgres"] == {"psycopg"}
    # The test and lint extras pull [service,client,postgres] (the build spells them out).
    assert found["client"] | found["service"] | found["postgres"] <= found["test"] <= found["lint"]
    assert {"pytest", "pytest-trio", "pytest-timeout", "hypothesis"} <= found["test"]
    # The site's build imports every part it documents (the testing kit's too).
    assert found["client"] | found["service"] | found["postgres"] <= found["docs"]
    assert {"sphinx", "myst-parser", "furo", "sphinxcontrib-trio", "sphinx-click"} <= found["docs"]


# Run in the fresh interpreter: block the modules named in argv[1], embed a supervisor,
# then try each optional part; print what happened as JSON.
PROBE = textwrap.dedent(
    """
    import contextlib, importlib, io, json, runpy, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())

    import trio
    import trio_supervisor
    from trio_supervisor import InProcessExecution, Key, Load, MemoryStore, open_supervisor

    async def plugin(context):
        await trio.sleep_forever()

    async def embedded():
        async with (
            InProcessExecution({"plugin": plugin}) as execution,
            open_supervisor(MemoryStore(), execution, lease=5.0, grace=1.0) as supervisor,
        ):
            record = await supervisor.open(Key(identity="no", instance="extras"), "r1")
            await supervisor.load(record.handle, Load(specifier="plugin"))
            return (await supervisor.dispose(record.handle)).describe()

    report = {"embedded": trio.run(embedded), "parts": {}}
    # The other adapters need nothing optional either.
    report["adapters"] = [
        trio_supervisor.SqliteStore.__name__, trio_supervisor.SubprocessExecution.__name__
    ]
    for part in ("trio_supervisor.client", "trio_supervisor.service", "the command"):
        try:
            if part == "the command":
                sys.argv = ["trio-supervisor", "--help"]
                said = io.StringIO()
                with contextlib.redirect_stderr(said):
                    try:
                        runpy.run_module("trio_supervisor", run_name="__main__")
                    except SystemExit as exit:
                        if exit.code:
                            raise SystemExit(f"{exit.code}: {said.getvalue()}") from None
                        raise
            else:
                importlib.import_module(part)
        except ImportError as error:
            report["parts"][part] = f"{type(error).__name__}: {error}"
        except SystemExit as exit:
            report["parts"][part] = f"exit {exit.code}"
        else:
            report["parts"][part] = "imported"
    report["loaded"] = sorted(
        name for name in sys.modules if name.partition(".")[0] in BLOCKED
    )
    print(json.dumps(report))
    """
)


def probe(*blocked: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(blocked)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


def test_with_no_extra_the_engine_runs_and_the_optional_parts_name_their_pip_command() -> None:
    report = probe(*CLIENT, *SERVICE)
    assert report["embedded"] == "exited (cancelled)"
    assert report["adapters"] == ["SqliteStore", "SubprocessExecution"]
    parts = report["parts"]
    assert parts["trio_supervisor.client"] == (
        "MissingExtraError: trio_supervisor.client needs httpx, which is not installed; "
        "it comes with the [client] extra: pip install 'trio_supervisor[client]'"
    )
    # Which module is missed first is the import order's business.
    service = "(hypercorn|starlette|prometheus_client)"
    command = "(click|rich|httpx|hypercorn|starlette|prometheus_client)"
    then = (
        r", which is not installed; it comes with the \[service\] extra: "
        r"pip install 'trio_supervisor\[service\]'"
    )
    assert re.fullmatch(
        rf"MissingExtraError: trio_supervisor\.service needs {service}{then}",
        parts["trio_supervisor.service"],
    )
    # One line, and exit status 1: no traceback.
    assert re.fullmatch(
        rf"exit 1: Error: the trio-supervisor command needs {command}{then}\n",
        parts["the command"],
    )
    assert report["loaded"] == []


def test_with_the_client_extra_only_the_client_imports_and_the_service_names_its_extra() -> None:
    report = probe(*SERVICE)
    assert report["embedded"] == "exited (cancelled)"
    parts = report["parts"]
    assert parts["trio_supervisor.client"] == "imported"
    assert parts["trio_supervisor.service"].endswith("pip install 'trio_supervisor[service]'")
    assert parts["the command"].endswith("pip install 'trio_supervisor[service]'\n")
    assert report["loaded"] == []


def test_with_every_extra_the_command_runs() -> None:
    report = probe("no_such_package_blocked")
    assert report["parts"] == {
        "trio_supervisor.client": "imported",
        "trio_supervisor.service": "imported",
        "the command": "exit 0",
    }


def test_only_a_missing_module_of_the_extra_is_reported_as_the_extra_s() -> None:
    # Installed, but without the name asked for (an old version, say): its own error.
    with (
        pytest.raises(ImportError, match="cannot import name 'no_such_name'") as caught,
        needs_extra("client", "this test", "json"),
    ):
        exec("from json import no_such_name")
    assert not isinstance(caught.value, ModuleNotFoundError)
    # A missing module the extra does not provide: unchanged too.
    with (
        pytest.raises(ModuleNotFoundError, match=r"^No module named 'no_such_module'$"),
        needs_extra("client", "this test", "httpx"),
    ):
        importlib.import_module("no_such_module")
    # A missing module it provides: named, with the command.
    with (
        pytest.raises(ModuleNotFoundError) as named,
        needs_extra("client", "this test", "no_such_module"),
    ):
        importlib.import_module("no_such_module.sub")
    assert str(named.value) == (
        "this test needs no_such_module, which is not installed; it comes with the "
        "[client] extra: pip install 'trio_supervisor[client]'"
    )
    assert named.value.name == "no_such_module"
