"""The tenants file: read, checked, written, and the tenants it puts in force.

Theory of operation
-------------------
:func:`parse` checks every table of a tenants file (``tenants.py`` has its format) and
names what is wrong ("tenants.acme.quota: unknown key 'session'"); a file that fails is
refused whole, as is one that group or others may write. A :class:`Roster` holds the
tenants in force and swaps them whole when the file is read again (SIGHUP): a refused
file leaves the previous tenants in force.

``trio-supervisor tenants add`` and ``revoke`` change the file by its lines
(:func:`table_text`, :func:`without_table`) and replace it whole (:func:`replace`, under
:func:`locked`), so that the operator's comments and layout stay and no reader ever sees
it half written.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import tempfile
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from ..model import Limits
from .tenants import Ceilings, Fairness, Quota, Tenant, Tenants, TenantsError

__all__ = [
    "Roster",
    "ceilings_of",
    "locked",
    "parse",
    "read",
    "read_text",
    "replace",
    "table_text",
    "without_table",
]

logger = logging.getLogger(__name__)


# -- reading a file --------------------------------------------------------------------


def _table(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TenantsError(f"{where} must be a table, not {type(value).__name__}")
    return value


def _only(table: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in known:
            raise TenantsError(f"{where}: unknown key {key!r} (the keys are {', '.join(known)})")


def _build(kind: type[Any], table: Mapping[str, Any], where: str) -> Any:
    _only(table, tuple(field.name for field in attrs.fields(kind)), where)
    try:
        return kind(**table)
    except (TypeError, ValueError) as error:
        raise TenantsError(f"{where}: {error}") from None


def ceilings_of(value: object, where: str) -> Ceilings:
    """A ``limits`` table (``default`` and ``max``, each with :class:`Limits`' fields)."""
    table = _table(value, where)
    _only(table, ("default", "max"), where)
    return Ceilings(
        **{
            part: _build(Limits, _table(table[part], f"{where}.{part}"), f"{where}.{part}")
            for part in ("default", "max")
            if part in table
        }
    )


def _tenant(name: str, value: object, where: str) -> Tenant:
    table = _table(value, where)
    _only(table, ("token_sha256", "identities", "quota", "limits", "fairness"), where)
    for required in ("token_sha256", "identities"):
        if required not in table:
            raise TenantsError(f"{where}: {required} is missing")
    identities = table["identities"]
    if not isinstance(identities, list):
        raise TenantsError(f"{where}.identities must be an array of fnmatch patterns")
    try:
        return Tenant(
            name=name,
            token_sha256=table["token_sha256"],
            identities=tuple(identities),
            quota=_build(Quota, _table(table.get("quota", {}), f"{where}.quota"), f"{where}.quota"),
            limits=ceilings_of(table.get("limits", {}), f"{where}.limits"),
            fairness=_build(
                Fairness,
                _table(table.get("fairness", {}), f"{where}.fairness"),
                f"{where}.fairness",
            ),
        )
    except (TypeError, ValueError) as error:
        if isinstance(error, TenantsError):
            raise
        raise TenantsError(f"{where}: {error}") from None


def parse(data: Mapping[str, Any], source: str = "the tenants file") -> Tenants:
    """The tenants of a tenants file's TOML ``data``.

    Raises:
        TenantsError: A table is malformed; the message names ``source`` and the table.
    """
    try:
        _only(data, ("tenants",), source)
        tables = _table(data.get("tenants", {}), f"{source}: tenants")
        tenants = {
            name: _tenant(name, value, f"{source}: tenants.{name}")
            for name, value in tables.items()
        }
        if not tenants:
            raise TenantsError(f"{source} names no tenant: no host could call the runner")
        return Tenants(tenants)
    except TenantsError as error:
        if str(error).startswith(source):
            raise
        raise TenantsError(f"{source}: {error}") from None


def read_text(path: Path) -> str:
    """The text of the tenants file at ``path``, unparsed.

    The file must be writable by its owner alone: whoever may write it may add a tenant.

    Raises:
        TenantsError: The file cannot be read, or is writable by others.
    """
    try:
        mode = os.stat(path).st_mode
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise TenantsError(f"cannot read the tenants file {path}: {error}") from None
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TenantsError(
            f"the tenants file {path} is writable by others (mode {stat.S_IMODE(mode):04o}): "
            "whoever may write it may add a tenant; chmod go-w it"
        )
    return text


def read(path: Path) -> Tenants:
    """The tenants of the file at ``path``.

    The file must be writable by its owner alone: whoever may write it may add a tenant.

    Raises:
        TenantsError: The file cannot be read, is writable by others, or is malformed.
    """
    text = read_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TenantsError(f"the tenants file {path} is not TOML: {error}") from None
    return parse(data, str(path))


# -- writing a tenant's table (``trio-supervisor tenants add`` and ``revoke``) -----------
#
# The file is the operator's, comments and layout included: a tenant is added by
# appending its table to the text and revoked by removing its table's lines, never by
# rewriting the whole file from what was parsed. The command checks that the result
# parses to exactly the tenants intended before it writes anything.

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


# What a TOML basic string may not hold as it is: '"', '\\', the control characters but
# tab, and lone surrogates (an undecodable byte of a command line), whose escape TOML
# refuses, so that such a name is refused rather than written.
_ESCAPED: Final = re.compile(r'["\\\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]')


def _toml_string(value: str) -> str:
    """``value`` as a TOML basic string."""

    def escape(found: re.Match[str]) -> str:
        char = found[0]
        return "\\" + char if char in '"\\' else f"\\u{ord(char):04x}"

    return '"' + _ESCAPED.sub(escape, value) + '"'


def _toml_key(name: str) -> str:
    # A tenant's name may hold '.': unquoted, ``tenants.a.b`` would be table b in table a.
    return name if _BARE_KEY.fullmatch(name) else _toml_string(name)


def _inline(values: Mapping[str, int | float | None]) -> str | None:
    """The values that are set, as a TOML inline table (None if none is)."""
    items = [f"{key} = {value!r}" for key, value in values.items() if value is not None]
    return "{ " + ", ".join(items) + " }" if items else None


def table_text(tenant: Tenant, comment: str | None = None) -> str:
    """``tenant``'s table in a tenants file: :func:`parse` reads it back as ``tenant``.

    Args:
        tenant: The tenant.
        comment: A line to put under the table's header, as a TOML comment.
    """
    lines = [f"[tenants.{_toml_key(tenant.name)}]"]
    if comment is not None:
        lines.append(f"# {comment}")
    lines.append(f"token_sha256 = {_toml_string(tenant.token_sha256)}")
    lines.append(f"identities = [{', '.join(map(_toml_string, tenant.identities))}]")
    parts = {
        "quota": attrs.asdict(tenant.quota),
        "limits.default": attrs.asdict(tenant.limits.default),
        "limits.max": attrs.asdict(tenant.limits.max),
        "fairness": attrs.asdict(tenant.fairness),
    }
    for key, values in parts.items():
        inline = _inline(values)
        if inline is not None:
            lines.append(f"{key} = {inline}")
    return "\n".join(lines) + "\n"


def _header(line: str) -> tuple[str, ...] | None:
    """The key path of a table header line (``[tenants."a.b".quota]``), else None."""
    stripped = line.strip()
    if not stripped.startswith("["):
        return None
    try:  # tomllib reads the header's quoting and dots as TOML does
        node: object = tomllib.loads(stripped)
    except tomllib.TOMLDecodeError:
        return None  # a line of a multi-line array, say
    path = []
    while isinstance(node, dict) and len(node) == 1:
        key, node = next(iter(node.items()))
        path.append(key)
    return tuple(path)


def _comments_above(lines: list[str], index: int) -> int:
    """Where the comment lines right above line ``index`` (no blank line between) start."""
    while index > 0 and lines[index - 1].lstrip().startswith("#"):
        index -= 1
    return index


def without_table(text: str, name: str) -> str:
    """``text`` without tenant ``name``'s table, line by line.

    Removed: the ``[tenants.NAME]`` header and those of its sub-tables
    (``[tenants.NAME.quota]``), and each one's lines up to the next other header, but for
    the comments right above that header (they are its own). The comments above
    ``[tenants.NAME]`` stay: they may be the file's.

    Raises:
        TenantsError: No header of ``name``'s table is in ``text`` (its table is written
            inline, or with dotted keys under ``[tenants]``).
    """
    lines = text.splitlines(keepends=True)
    headers = [(index, path) for index, line in enumerate(lines) if (path := _header(line))]

    def is_its(path: tuple[str, ...]) -> bool:
        return path[:2] == ("tenants", name)

    removed: set[int] = set()
    for at, (index, path) in enumerate(headers):
        if not is_its(path):
            continue
        end = len(lines)
        if at + 1 < len(headers):
            following, following_path = headers[at + 1]
            end = following if is_its(following_path) else _comments_above(lines, following)
        removed.update(range(index, end))
    if not removed:
        raise TenantsError(
            f"no [tenants.{_toml_key(name)}] header: its table is not written as one"
        )
    kept = "".join(line for index, line in enumerate(lines) if index not in removed)
    return kept.rstrip() + "\n" if kept.strip() else ""


class Roster:
    """The tenants in force, swapped whole when their file is read again.

    Attributes:
        tenants: The tenants in force now.
        path: Their file, or None for the hosts' single token.
    """

    def __init__(self, tenants: Tenants, path: Path | None = None) -> None:
        self.tenants = tenants
        self.path = path
        self._reserved: set[str] = set()

    def reserve(self, sha256: str) -> None:
        """Refuse, now and at every reload, a tenant whose token has this hash (the
        operators' token may be no tenant's).

        Raises:
            TenantsError: A tenant in force has it.
        """
        self._reserved.add(sha256)
        self._check(self.tenants)

    def _check(self, tenants: Tenants) -> None:
        for tenant in tenants:
            if tenant.token_sha256 in self._reserved:
                raise TenantsError(
                    f"tenant {tenant.name!r} has the operators' token: give it a token of its own"
                )

    @classmethod
    def from_file(cls, path: Path) -> Roster:
        """The tenants of ``path``.

        Raises:
            TenantsError: The file cannot work.
        """
        roster = cls(read(path), path)
        roster._log("tenants from")
        return roster

    def reload(self) -> bool:
        """Read the file again; whether its tenants are now in force. A file that cannot
        work is refused with one logged line, and the previous tenants stay in force."""
        if self.path is None:
            return False
        try:
            tenants = read(self.path)
            self._check(tenants)
        except TenantsError as error:
            logger.error("tenants file refused, the previous tenants stay in force: %s", error)
            return False
        self.tenants = tenants
        self._log("tenants reread from")
        return True

    def _log(self, what: str) -> None:
        logger.info(
            "%s %s: %s",
            what,
            self.path,
            "; ".join(
                f"{tenant.name} ({', '.join(tenant.identities)}; quota {tenant.quota.described()})"
                for tenant in self.tenants
            ),
        )


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s lock while a tenants file in it is read, changed and replaced:
    two commands at once would otherwise each write over the other's change."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # and the lock with it


def replace(path: Path, text: str) -> None:
    """Write a file beside ``path`` (mode 0600, or the file's mode and owner), check it as
    the runner will read it, and rename it over ``path``.

    Raises:
        OSError: It could not be written.
        TenantsError: The text does not work as a tenants file; nothing was replaced.
    """
    target = Path(os.path.realpath(path))  # through a link: the link stays one
    try:
        existing: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        existing = None
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            if existing is not None:
                # Whoever could read the file still can (a runner of its group, say).
                os.fchmod(file.fileno(), stat.S_IMODE(existing.st_mode))
                if (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
                    os.fchown(file.fileno(), existing.st_uid, existing.st_gid)
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        read(Path(temporary))
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
