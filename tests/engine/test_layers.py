"""The package's layers: the core imports no adapter, and the face loads adapters on use.

The layers of docs/design.md ("Where things are"), bottom up: values and protocols
(``abc``, ``model``, ``codec``, ``errors``, ...); then the core and the adapters; then the
conformance kit (``testing``), the client and the service; then the command. Each
module imports only what is below it (or beside it, in its own folder).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trio_supervisor

PACKAGE = Path(trio_supervisor.__file__).parent

# What each layer may import of the package (by first component after the package).
BOTTOM = {
    *("abc", "model", "codec", "errors", "retention", "realtime"),
    *("_fields", "_termination", "_defaults", "_routes", "_background", "_lazy", "_extras"),
}
ADAPTERS = {"stores", "executions"}
MAY_IMPORT = {
    "bottom": BOTTOM,
    "_core": BOTTOM | {"_core"},
    "stores": BOTTOM | {"stores"},
    "executions": BOTTOM | {"executions"},
    # Above the core and the adapters: the conformance kit, the client, the service,
    # and the command over both (the service reads the package's version too).
    "testing": BOTTOM | ADAPTERS | {"_core", "testing"},
    "client": BOTTOM | {"client"},
    "service": BOTTOM | ADAPTERS | {"_core", "service", "__version__"},
    "cli": BOTTOM | {"cli", "client", "service"},
    "_command": BOTTOM | {"cli"},
}


def layer_of(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[0] in MAY_IMPORT:
        return parts[0]
    if len(parts) == 1 and parts[0] in BOTTOM:
        return "bottom"
    return None


def imported_modules(path: Path) -> set[tuple[str, ...]]:
    """Every module of the package that ``path`` imports, as its parts after the package
    (for ``from . import name``, the name too)."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # folders below the package
    found: set[tuple[str, ...]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(path.relative_to(PACKAGE).parts[:depth])
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target] if node.module else [[*target, a.name] for a in node.names]
            elif node.module and node.module.startswith("trio_supervisor."):
                names = [node.module.split(".")[1:]]
            else:
                continue
            found.update(tuple(name) for name in names if name)
    return found


def package_imports(path: Path) -> set[str]:
    """The first component of every module of the package that ``path`` imports."""
    return {name[0] for name in imported_modules(path)}


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if layer_of(p) is not None),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_each_module_imports_only_what_is_below_it(path: Path) -> None:
    layer = layer_of(path)
    assert layer is not None
    wrong = package_imports(path) - MAY_IMPORT[layer]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({layer}) imports {sorted(wrong)}"


# -- the executions' rooms --------------------------------------------------------------
# Inside ``executions/`` (docs/design.md, "Where things are"), bottom up: ``child/`` (the
# child side: a script run by its path, so it imports nothing of the package, not even
# the bottom layer); ``trees/`` (process groups and trees, and how one is held);
# ``limits/`` (cgroups, isolation, claims: what a child may use and reach, and nothing
# that starts one); ``starting/`` (from options to a resolved child). The face, the
# modules beside the rooms (``subprocess.py``, ``inprocess.py``, ``_recovery.py``,
# ``_logs.py``), composes the rooms; no room imports the face.
EXECUTIONS = PACKAGE / "executions"
ROOMS: dict[str, set[str]] = {
    "child": set(),
    "trees": BOTTOM,
    "limits": BOTTOM | {"executions/child", "executions/trees"},
    "starting": BOTTOM | {"executions/child", "executions/trees", "executions/limits"},
}


def room_of(path: Path) -> str:
    """The room of a module of ``executions/``: its folder's name, or "face"."""
    parts = path.relative_to(EXECUTIONS).parts
    return parts[0] if len(parts) > 1 else "face"


def executions_imports(path: Path) -> set[str]:
    """What ``path`` imports of the package: each module of the bottom layer (or of
    another layer) by its first component, each of ``executions/`` by its room
    (``executions/limits``), or as ``executions/face`` for a module of the face."""
    found: set[str] = set()
    for name in imported_modules(path):
        if name[0] != "executions":
            found.add(name[0])
        elif len(name) > 1 and name[1] in ROOMS:
            found.add(f"executions/{name[1]}")
        else:
            found.add("executions/face")
    return found


@pytest.mark.parametrize(
    "path",
    sorted(p for p in EXECUTIONS.rglob("*.py") if room_of(p) != "face"),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_each_executions_room_imports_only_the_rooms_below_it(path: Path) -> None:
    room = room_of(path)
    wrong = executions_imports(path) - ROOMS[room] - {f"executions/{room}"}
    assert not wrong, f"{path.relative_to(PACKAGE)} (room {room}) imports {sorted(wrong)}"


def test_the_executions_face_composes_every_room() -> None:
    used = executions_imports(EXECUTIONS / "subprocess.py")
    assert {f"executions/{room}" for room in ROOMS} <= used
    assert sorted(
        path.name
        for path in EXECUTIONS.iterdir()
        if path.is_dir() and (path / "__init__.py").exists()
    ) == sorted(ROOMS)


def test_the_bootstrap_imports_only_the_standard_library_as_it_starts() -> None:
    """``child/_bootstrap.py`` runs as a script in every child: what it imports as it
    starts (its module level, but the type checker's block) is the standard library's
    alone, and nothing of the package anywhere (what a plugin needs, such as ``trio``
    for an async entry point, is imported in the function that needs it)."""
    tree = ast.parse((EXECUTIONS / "child" / "_bootstrap.py").read_text())
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.module is not None
            assert node.level == 0, f"a relative import at line {node.lineno}"
            imported.add(node.module.split(".")[0])
    assert imported, "no import found: the scan is broken"
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    typing_only = {
        id(inner)
        for block in tree.body
        if isinstance(block, ast.If)
        and isinstance(block.test, ast.Name)
        and block.test.id == "TYPE_CHECKING"
        for inner in ast.walk(block)
    }
    for found in ast.walk(tree):
        if isinstance(found, ast.ImportFrom) and (
            found.level or (found.module or "").startswith("trio_supervisor")
        ):
            assert id(found) in typing_only, f"the package imported at line {found.lineno}"


def test_importing_the_core_and_its_protocols_loads_no_adapter() -> None:
    code = (
        "import sys\n"
        "import trio_supervisor.abc\n"
        "from trio_supervisor import Supervisor, open_supervisor, Key, Store, Execution\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('trio_supervisor.stores',"
        " 'trio_supervisor.executions', 'trio_supervisor.service', 'trio_supervisor.client'))"
        " or m in ('sqlite3', 'httpx', 'hypercorn', 'starlette', 'click'))\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_face_loads_an_adapter_when_it_is_named() -> None:
    code = (
        "import sys, trio_supervisor\n"
        "assert 'trio_supervisor.stores.sqlite' not in sys.modules\n"
        "from trio_supervisor import SqliteStore\n"
        "from trio_supervisor import *\n"
        "print(SqliteStore.__module__, SubprocessExecution.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [
        "trio_supervisor.stores.sqlite",
        "trio_supervisor.executions.subprocess",
    ]
    assert "SqliteStore" in dir(trio_supervisor)
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        trio_supervisor.Nothing  # noqa: B018


def test_every_log_field_the_package_sets_is_one_the_json_log_prints() -> None:
    """Each ``extra={...}`` key of a log call is in ``model.LOG_FIELDS``, the list
    ``serve --log-format json`` prints; ``log_fields()``'s too."""
    from trio_supervisor.model import LOG_FIELDS, Key, log_fields

    used: set[str] = set(log_fields(Key(identity="i", instance="n"), 1))
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.keyword)
                and node.arg == "extra"
                and isinstance(node.value, ast.Dict)
            ):
                used |= {
                    key.value
                    for key in node.value.keys
                    if isinstance(key, ast.Constant) and isinstance(key.value, str)
                }
    assert used, "no extra= found: the scan is broken"
    assert used <= set(LOG_FIELDS), used - set(LOG_FIELDS)


def test_every_module_of_the_package_imports() -> None:
    """Each module imports on its own (with every extra installed): mypy does not see a
    wrong relative import under a package whose lazy ``__getattr__`` answers any name
    (``executions/``), so a fresh interpreter imports them all."""
    code = (
        "import importlib, pkgutil, trio_supervisor\n"
        "failed = []\n"
        "for module in pkgutil.walk_packages(trio_supervisor.__path__, 'trio_supervisor.'):\n"
        "    if module.name.endswith(('.__main__', '._bootstrap')):\n"
        "        continue  # the command's entry, and a script run by its path\n"
        "    try:\n"
        "        importlib.import_module(module.name)\n"
        "    except Exception as error:\n"
        "        failed.append(f'{module.name}: {error!r}')\n"
        "print('\\n'.join(failed))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
