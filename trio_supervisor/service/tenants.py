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

``tenants_file.py`` reads and writes that file, and holds the tenants in force. Without
a file, the hosts' token of section A is one tenant, ``default``, that may use every
identity and has no quota (:meth:`Tenants.single`).

Nothing here does I/O, and nothing knows about HTTP.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

import attrs

from .. import _fields as fields
from ..model import Limits, lowest

__all__ = [
    "DEFAULT_TENANT",
    "LIMIT_FIELDS",
    "Ceilings",
    "Fairness",
    "Quota",
    "Tenant",
    "Tenants",
    "TenantsError",
    "effective_limits",
    "token_hash",
]

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
        """These ceilings, with ``base``'s for every field these leave unset.

        Args:
            base: The ceilings beneath these (the runner's own, say).

        Returns:
            The merged ceilings.
        """
        return Ceilings(
            default=_merged(self.default, base.default), max=_merged(self.max, base.max)
        )

    def described(self) -> str:
        """The ceilings in a line of a log.

        Returns:
            ``memory_bytes 268,435,456 by default, at most unlimited; ...``, or
            ``none`` when no field is set.
        """
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
        ceiling = lowest(getattr(tenant.max, name), getattr(runner.max, name))
        values[name] = lowest(asked, ceiling)
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
