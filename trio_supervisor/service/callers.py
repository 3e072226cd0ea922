"""Who calls, and what a call passes before the supervisor sees it (docs/service.md
sections A and D).

Every ``/v1`` request carries ``Authorization: Bearer <token>``. The operators' token
(compared in constant time), or a dashboard's sign-in by code (``sign_in.py``), allows
every call; a tenant's (found by its SHA-256; without
a tenants file, the hosts' token is tenant ``default``) allows the session calls and the
listings on keys whose identity matches the tenant's patterns. :class:`Gate` holds what
decides that for a request: a key outside the tenant's patterns is a 403 before any
lookup, the same whether it exists or not; then the tenant's fairness (429).
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Callable, Iterator
from typing import Final

import attrs
from starlette.requests import Request

from ..errors import ForbiddenError
from ..model import Key
from .admission import Admission
from .calls import Call
from .sign_in import SignIns
from .tenants import Tenant
from .tenants_file import Roster

__all__ = [
    "OPERATORS",
    "UNAUTHORIZED",
    "Caller",
    "Gate",
    "Operators",
    "bearer_caller",
    "tenant_label",
]

UNAUTHORIZED: Final = (
    "a valid bearer token is required (Authorization: Bearer TOKEN): a host's is its "
    "tenant's, or the runner's --token-file (STATE/token by default); an operator's is "
    "the runner's --operator-token-file (STATE/operator-token)"
)


class Operators:
    """The caller holding the operators' token: every right, no quota, no fairness."""

    name: Final = "operators"

    @staticmethod
    def may_use(identity: str) -> bool:
        return True


OPERATORS: Final = Operators()
Caller = Tenant | Operators


def bearer_caller(
    request: Request, operators_secret: bytes, roster: Roster, sign_ins: SignIns | None = None
) -> Caller | None:
    """Who the request's bearer token says called: the operators (their token, compared
    in constant time, or a dashboard's sign-in by code, found by its digest), a tenant
    (found by its SHA-256), or None for no valid token."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return None
    token = given.strip()
    if hmac.compare_digest(token.encode(), operators_secret):
        return OPERATORS
    if sign_ins is not None and sign_ins.signed_in(token):
        return OPERATORS
    return roster.tenants.find(token)


def tenant_label(caller: Caller | None) -> str:
    """Who called, as the metrics and the log name it ("" before a token was accepted)."""
    return "" if caller is None else caller.name


@attrs.frozen(kw_only=True)
class Gate:
    """What a request passes before the supervisor: its token, its key's identity, its
    tenant's fairness.

    Attributes:
        roster: The tenants in force (read again on SIGHUP by the runner).
        admission: Whose fairness admits a tenant's calls.
        operators_secret: The operators' token, as bytes.
        sign_ins: The dashboard's sign-ins by code, which count as the operators'.
    """

    roster: Roster
    admission: Admission
    operators_secret: bytes
    sign_ins: SignIns | None = None

    def caller(self, request: Request) -> Caller | None:
        """Who the request's bearer token says called (None: no valid token)."""
        return bearer_caller(request, self.operators_secret, self.roster, self.sign_ins)

    @contextlib.contextmanager
    def admitted(self, request: Request, call: Call, key: Key | None) -> Iterator[Tenant | None]:
        """A call on ``key`` (None: on no key) by the request's caller: a key outside a
        tenant's identities is refused (403) before anything is looked up, then the
        tenant's fairness admits the call (429) for as long as the block runs. Yields
        the tenant, or None for the operators."""
        caller: Caller = request.state.caller
        if caller is OPERATORS:
            yield None
            return
        assert isinstance(caller, Tenant)
        if key is not None and not caller.may_use(key.identity):
            raise ForbiddenError(f"tenant {caller.name!r} may not use identity {key.identity!r}")
        with self.admission.calling(
            caller, bounded=call.fairness != "exempt", rated=call.fairness == "rated"
        ):
            yield caller

    def sees(self, request: Request) -> Callable[[str], bool]:
        """Whether the request's caller may see a key of an identity: the operators every
        one, a tenant its own, as long as it stays in force (a revoked tenant sees none)."""
        caller: Caller = request.state.caller
        if caller is OPERATORS:
            return Operators.may_use
        assert isinstance(caller, Tenant)
        tenant = caller
        roster = self.roster

        def visible(identity: str) -> bool:
            return roster.tenants.by_name.get(tenant.name) == tenant and tenant.may_use(identity)

        return visible
