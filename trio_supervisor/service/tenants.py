"""Tenants: who may call the runner, on which keys, with which ceilings and quotas.

Theory of operation
-------------------
A runner is shared by hosts that do not trust each other (docs/service.md section D).
Each host is a *tenant*: a name, the SHA-256 of its bearer token (the token itself is
never stored), the ``fnmatch`` patterns of the key identities it may use, and what it may
take: a :class:`Quota` (its live sessions, children, and their summed memory and CPU),
its :class:`Ceilings` (the limits a child gets when the host asks for none, and the most
it may ask for), and its :class:`Fairness` (calls in flight, opens and loads per
second).

The tenants come from a TOML file (``serve --tenants FILE``)::

    [tenants.acme]
    token_sha256 = "9f86d0..."
    identities = ["acme", "acme-*"]
    quota = { sessions = 100, children = 20 }
    limits.default = { memory_bytes = 536870912 }
    limits.max = { memory_bytes = 2147483648, processes = 1024 }
    fairness = { inflight = 32, rate = 50, burst = 100 }

:func:`parse` checks every table and names what is wrong ("tenants.acme.quota: unknown
key 'session'"); a file that fails is refused whole. A :class:`Roster` holds the tenants
in force and swaps them whole when the file is read again (SIGHUP): a refused file
leaves the previous tenants in force. Without a file, the hosts' token of section A is
one tenant, ``default``, that may use every identity and has no quota
(:meth:`Tenants.single`).

Nothing here does I/O but reading the file, and nothing knows about HTTP.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import math
import os
import re
import stat
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from .. import _fields as fields
from ..model import Limits

__all__ = [
    "DEFAULT_TENANT",
    "Ceilings",
    "Fairness",
    "Quota",
    "Roster",
    "Tenant",
    "Tenants",
    "TenantsError",
    "parse",
    "read",
    "read_text",
    "table_text",
    "token_hash",
    "without_table",
]

logger = logging.getLogger(__name__)

DEFAULT_TENANT: Final = "default"  # the tenant of the hosts' token, without --tenants
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_HEX: Final = re.compile(r"[0-9a-f]{64}")
LIMIT_FIELDS: Final = tuple(field.name for field in attrs.fields(Limits))


class TenantsError(ValueError):
    """A tenants file (or table) that cannot work; the message names the file, the
    table and the problem."""


def token_hash(token: str) -> str:
    """The hex SHA-256 of ``token``: what a tenants file holds instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def _lowest(one: int | None, other: int | None) -> int | None:
    if one is None:
        return other
    if other is None:
        return one
    return min(one, other)


@attrs.frozen(kw_only=True)
class Ceilings:
    """Kubernetes' LimitRange for a child's :class:`~trio_supervisor.model.Limits`.

    Attributes:
        default: What a child gets, field by field, when its host asks for nothing.
        max: The most a host may ask for, field by field (None: no ceiling here).
    """

    default: Limits = attrs.field(factory=Limits, validator=attrs.validators.instance_of(Limits))
    max: Limits = attrs.field(factory=Limits, validator=attrs.validators.instance_of(Limits))

    def over(self, base: Ceilings) -> Ceilings:
        """These ceilings, with ``base``'s for every field these leave unset."""
        return Ceilings(
            default=_merged(self.default, base.default), max=_merged(self.max, base.max)
        )

    def described(self) -> str:
        """The ceilings in a line of a log."""
        parts = []
        for name in LIMIT_FIELDS:
            default, most = getattr(self.default, name), getattr(self.max, name)
            if default is None and most is None:
                continue
            parts.append(f"{name} {_amount(default)} by default, at most {_amount(most)}")
        return "; ".join(parts) or "none"


def _merged(over: Limits, base: Limits) -> Limits:
    return Limits(
        **{
            name: getattr(base, name) if getattr(over, name) is None else getattr(over, name)
            for name in LIMIT_FIELDS
        }
    )


def _amount(value: int | None) -> str:
    return "unlimited" if value is None else f"{value:,}"


def effective_limits(requested: Limits | None, tenant: Ceilings, runner: Ceilings) -> Limits:
    """A session's limits (docs/service.md section D, "Ceilings").

    Field by field: what the host asked for, or where it asked for nothing the tenant's
    default (else the runner's), lowered to the lower of the tenant's and the runner's
    ``max`` (None counts as infinite, as :func:`~trio_supervisor.model.negotiate` has
    it). Never refused, only lowered.
    """
    values: dict[str, int | None] = {}
    for name in LIMIT_FIELDS:
        asked = None if requested is None else getattr(requested, name)
        if asked is None:
            asked = _lowest_set(getattr(tenant.default, name), getattr(runner.default, name))
        ceiling = _lowest(getattr(tenant.max, name), getattr(runner.max, name))
        values[name] = _lowest(asked, ceiling)
    return Limits(**values)


def _lowest_set(first: int | None, then: int | None) -> int | None:
    """``first`` if set, else ``then``: the tenant's default before the runner's."""
    return then if first is None else first


@attrs.frozen(kw_only=True)
class Quota:
    """Kubernetes' ResourceQuota for one tenant: None means no quota on that count.

    Attributes:
        sessions: Live (not Stopped) sessions.
        children: Loaded (Loading or Loaded) children.
        memory_bytes: The children's summed memory ceilings.
        cpu_percent: The children's summed CPU ceilings (100 is one core).
    """

    sessions: int | None = attrs.field(default=None, validator=fields.optional(fields.count))
    children: int | None = attrs.field(default=None, validator=fields.optional(fields.count))
    memory_bytes: int | None = attrs.field(default=None, validator=fields.optional(fields.count))
    cpu_percent: int | None = attrs.field(default=None, validator=fields.optional(fields.count))

    def described(self) -> str:
        parts = [
            f"{field.name} {getattr(self, field.name):,}"
            for field in attrs.fields(Quota)
            if getattr(self, field.name) is not None
        ]
        return ", ".join(parts) or "none"


def _positive(name: str, value: object) -> None:
    fields.count.check(name, value)
    assert isinstance(value, int)
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def _rate(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not (0 < value < math.inf):
        raise ValueError(f"{name} must be a number above 0, got {value}")


@attrs.frozen(kw_only=True)
class Fairness:
    """How fast one tenant may call (Kubernetes' API Priority and Fairness, in small).

    Attributes:
        inflight: Calls of the tenant's at once, renew and dispose aside; None: no bound.
        rate: Opens and loads per second, on average; None: no bound.
        burst: Opens and loads at once above the rate (the bucket's size); by default
            the rate, rounded up.
    """

    inflight: int | None = attrs.field(
        default=None, validator=fields.optional(fields.Check(_positive, minimum=1))
    )
    rate: float | None = attrs.field(
        default=None,
        converter=fields.as_float,
        validator=fields.optional(fields.Check(_rate, exclusiveMinimum=0)),
    )
    burst: int | None = attrs.field(
        default=None, validator=fields.optional(fields.Check(_positive, minimum=1))
    )

    def described(self) -> str:
        parts = []
        for field in attrs.fields(Fairness):
            value = getattr(self, field.name)
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # a rate of 50, read as 50.0
            if value is not None:
                parts.append(f"{field.name} {value:,}")
        return ", ".join(parts) or "none"

    @property
    def bucket(self) -> int:
        """The token bucket's size (meaningful only with a rate)."""
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.rate or 1))


def _identities(name: str, value: object) -> None:
    if not isinstance(value, tuple) or not value:
        raise ValueError(f"{name} must be a non-empty array of fnmatch patterns")
    for pattern in value:
        fields.key_text.check(f"{name}[]", pattern)


def _patterns(value: Iterable[str]) -> tuple[str, ...]:
    # A lone pattern is a sequence of characters: never read it as one per character.
    return (value,) if isinstance(value, str) else tuple(value)


def _sha256(name: str, value: object) -> None:
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise ValueError(
            f"{name} must be the hex SHA-256 of the tenant's token (64 characters 0-9a-f; "
            "`trio-supervisor tenants add` writes it)"
        )


def _tenant_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            f"{name} must be 1-63 letters, digits, '_', '.' or '-', starting with a letter "
            f"or a digit, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class Tenant:
    """One host, or one group of hosts sharing a token.

    Attributes:
        name: How logs, metrics and operators name it.
        token_sha256: The hex SHA-256 of its bearer token.
        identities: ``fnmatch`` patterns (case-sensitive) of the key identities it may use.
        quota: What it may hold at once.
        limits: Its ceilings, applied within the runner's.
        fairness: How fast it may call.
    """

    name: str = attrs.field(validator=fields.Check(_tenant_name))
    token_sha256: str = attrs.field(validator=fields.Check(_sha256), repr=False)
    identities: tuple[str, ...] = attrs.field(
        converter=_patterns, validator=fields.Check(_identities)
    )
    quota: Quota = attrs.field(factory=Quota)
    limits: Ceilings = attrs.field(factory=Ceilings)
    fairness: Fairness = attrs.field(factory=Fairness)

    def may_use(self, identity: str) -> bool:
        """Whether a key of ``identity`` is this tenant's to use."""
        return any(fnmatch.fnmatchcase(identity, pattern) for pattern in self.identities)


@attrs.frozen
class Tenants:
    """The tenants in force, found by their tokens' hashes."""

    by_name: Mapping[str, Tenant]
    _by_hash: Mapping[str, Tenant] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        by_hash: dict[str, Tenant] = {}
        for tenant in self.by_name.values():
            other = by_hash.setdefault(tenant.token_sha256, tenant)
            if other is not tenant:
                raise TenantsError(
                    f"tenants {other.name!r} and {tenant.name!r} have the same token: each "
                    "tenant needs a token of its own"
                )
        object.__setattr__(self, "_by_hash", by_hash)

    @classmethod
    def single(cls, token: str) -> Tenants:
        """The runner without a tenants file: ``token`` is tenant ``default``, which may
        use every identity and has no quota."""
        return cls(
            {
                DEFAULT_TENANT: Tenant(
                    name=DEFAULT_TENANT, token_sha256=token_hash(token), identities=("*",)
                )
            }
        )

    def find(self, token: str) -> Tenant | None:
        """The tenant whose token ``token`` is, if any.

        Found by the token's hash: a dictionary lookup of a SHA-256 says nothing an
        attacker could use about other tokens, so no comparison of secrets happens here.
        """
        return self._by_hash.get(token_hash(token))

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)


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
