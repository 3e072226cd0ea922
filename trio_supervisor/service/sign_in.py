"""Signing in to the dashboard with a link: one-time codes, and the sign-ins they make.

An operator asks for a code (``POST /v1/dashboard/codes``, ``trio-supervisor
dashboard``) and hands out the link ``URL/?code=CODE``: no token travels in a URL, where
histories, proxies and logs would keep it. The page trades the code, once and within
``DASHBOARD_CODE_FOR`` seconds, for a sign-in token of its own (``POST
/v1/dashboard/sign-in``), which it keeps in the tab as it keeps a pasted token, and which
the runner takes as the operators' for ``DASHBOARD_SESSION_FOR`` seconds at most. A
code that is wrong, spent or expired is refused in the same words: the answer tells a
guesser nothing.

The runner keeps only digests, in memory: a restart of the runner's process ends every
sign-in and every code (an incarnation's restart does not: the runner's
:class:`SignIns` outlives its incarnations).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from typing import Final

import trio

from .. import _defaults as defaults

__all__ = ["REFUSED", "SignIns"]

MAX_CODES: Final = defaults.DASHBOARD_MOST_CODES
REFUSED: Final = (
    "this sign-in link does not work: its code is wrong, was used already (each works "
    "once) or expired; ask an operator for a new link (trio-supervisor dashboard), or "
    "paste the operators' token"
)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class SignIns:
    """The dashboard's codes waiting to be used, and the sign-ins they made.

    Args:
        code_for: Seconds a code may be used, once.
        session_for: Seconds a sign-in lasts.
        clock: The time in seconds (Trio's clock by default; a test's own).
    """

    def __init__(
        self,
        *,
        code_for: float = defaults.DASHBOARD_CODE_FOR,
        session_for: float = defaults.DASHBOARD_SESSION_FOR,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.code_for = code_for
        self.session_for = session_for
        self._clock = clock
        # Digests, each with when it expires; in the order they were made.
        self._codes: dict[bytes, float] = {}
        self._sessions: dict[bytes, float] = {}

    def mint(self) -> str:
        """A new code, good once for :attr:`code_for` seconds."""
        now = self._clock()
        _forget_expired(self._codes, now)
        while len(self._codes) >= MAX_CODES:
            del self._codes[next(iter(self._codes))]
        code = secrets.token_urlsafe(24)
        self._codes[_digest(code)] = now + self.code_for
        return code

    def spend(self, code: str) -> str | None:
        """The sign-in token ``code`` is traded for, once; None if the code is wrong,
        spent or expired (the same None for each)."""
        now = self._clock()
        expires = self._codes.pop(_digest(code), None)
        if expires is None or now >= expires:
            return None
        _forget_expired(self._sessions, now)
        token = secrets.token_urlsafe(32)
        self._sessions[_digest(token)] = now + self.session_for
        return token

    def signed_in(self, token: str) -> bool:
        """Whether ``token`` is a sign-in that has not expired."""
        expires = self._sessions.get(_digest(token))
        return expires is not None and self._clock() < expires


def _forget_expired(expiring: dict[bytes, float], now: float) -> None:
    for digest in [digest for digest, expires in expiring.items() if now >= expires]:
        del expiring[digest]
