"""How the PostgreSQL store reaches its server: connections, and the threads that watch
over them.

* :class:`Settings` makes every connection the same way: libpq TCP keepalives and
  ``tcp_user_timeout`` (a peer that vanished fails a call in seconds, not hours),
  ``statement_timeout`` and ``lock_timeout``, the store's schema first on the
  ``search_path``; and words every error, never with the DSN's password.
* :class:`Watchdog` drops a connection whose call gets no answer in time.
* :class:`Listener` is the thread that LISTENs for the fleet's notifications.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from .. import _defaults as defaults
from .._extras import needs_extra
from ..retention import Retention
from ._postgres_sql import listen, session_settings

with needs_extra("postgres", "trio_supervisor.stores.postgres", "psycopg"):
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

__all__ = ["Listener", "Settings", "Watchdog", "describe"]

logger = logging.getLogger("trio_supervisor.stores.postgres")


def describe(dsn: str) -> tuple[str, str | None]:
    """The DSN as errors name it (never with its password), and the password if any.

    A multi-host DSN (libpq's ``host=a,b port=1,2``, or ``postgresql://a:1,b:2/db``)
    is shown with each of its hosts.
    """
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "PostgreSQL (a DSN that does not parse)", None
    password = params.get("password")
    user = params.get("user")
    hosts = str(params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = str(params.get("port") or "").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)  # one port for every host, as libpq reads it
    where = ",".join(
        f"{host}{f':{port}' if port else ''}"
        for host, port in zip(hosts, ports + [""] * len(hosts), strict=False)
    )
    shown = f"postgresql://{f'{user}@' if user else ''}{where}"
    return f"{shown}/{params.get('dbname') or ''}", str(password) if password else None


class Settings:
    """How the store connects, and who it is in the fleet."""

    def __init__(
        self,
        dsn: str,
        *,
        schema: str,
        runner_id: str,
        advertise: str,
        runner_lease: float,
        retention: Retention,
        connect_timeout: float,
        statement_timeout: float,
        store_wait: float,
        commit_window: float = defaults.COMMIT_WINDOW,
    ) -> None:
        self.dsn = dsn
        self.store_wait = store_wait
        self.commit_window = commit_window
        self.shown, self.password = describe(dsn)
        self.schema = schema
        self.runner_id = runner_id
        self.advertise = advertise
        self.runner_lease = runner_lease
        self.retention = retention
        self.connect_timeout = connect_timeout
        self.statement_timeout = statement_timeout

    def connect(self, *, autocommit: bool = False) -> psycopg.Connection[Any]:
        """A new connection with the store's timeouts, keepalives and search path."""
        connection = psycopg.connect(
            self.dsn,
            autocommit=autocommit,
            # libpq takes whole seconds, and treats 1 as 2.
            connect_timeout=max(2, math.ceil(self.connect_timeout)),
            # TCP keepalive: an idle socket is probed, then probed again, and given up
            # after a few unanswered probes.
            keepalives=1,
            keepalives_idle=defaults.KEEPALIVE_IDLE,
            keepalives_interval=defaults.KEEPALIVE_INTERVAL,
            keepalives_count=defaults.KEEPALIVE_COUNT,
            # Unacknowledged data for this long fails the socket, keepalives or not.
            tcp_user_timeout=max(1000, round(self.statement_timeout * 1000)),
            application_name=f"trio_supervisor {self.runner_id}"[:63],
        )
        try:
            timeout = f"{max(1, round(self.statement_timeout * 1000))}ms"
            connection.execute(session_settings(timeout, self.schema))
            if not autocommit:
                connection.commit()
        except BaseException:
            connection.close()
            raise
        return connection

    def explain(self, action: str, error: BaseException) -> str:
        """The message of the StateStorageError a caller gets for ``error``."""
        if isinstance(error, psycopg.Error):
            text = str(error).strip() or type(error).__name__
        else:
            text = repr(error)
        if self.password:
            text = text.replace(self.password, "***")
        return f"{self.shown}: cannot {action}: {text}"


class Watchdog:
    """Drops the connection when a job gets no answer in time.

    The server's ``statement_timeout`` bounds what it does, TCP keepalives and
    ``tcp_user_timeout`` a peer that vanished; neither bounds a network that takes the
    bytes and never delivers them (a stalled middlebox, a paused proxy), and psycopg's
    sync calls wait without end. Past ``bound`` this thread shuts the socket down under
    the waiting worker, whose call then fails; the next job connects again.
    """

    def __init__(
        self, bound: float, connection: Callable[[], psycopg.Connection[Any] | None]
    ) -> None:
        self.bound = bound
        self.fired = False
        self._connection = connection
        self._deadline: float | None = None
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name="trio_supervisor watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def __enter__(self) -> None:
        with self._changed:
            self.fired = False
            self._deadline = time.monotonic() + self.bound
            self._changed.notify()

    def __exit__(self, *exc_info: object) -> None:
        with self._changed:
            self._deadline = None

    def _run(self) -> None:
        with self._changed:
            while not self._stopped:
                if self._deadline is None:
                    self._changed.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self._deadline = None
                self.fired = True
                connection = self._connection()
                if connection is not None:
                    with contextlib.suppress(OSError, psycopg.Error):
                        descriptor = os.dup(connection.pgconn.socket)
                        with socket.socket(fileno=descriptor) as sock:
                            sock.shutdown(socket.SHUT_RDWR)


class Listener:
    """The thread that LISTENs, and hands each notification's payload to ``hand``.

    Its connection is its own, in autocommit. It is only a wake-up: when the connection
    dies it connects again, and whatever it missed meanwhile the periodic checks of
    ``run_member`` find. ``hand`` is called from this thread; it must only pass the
    payload on to the run.
    """

    POLL: Final = defaults.LISTENER_POLL  # seconds between looks at the stop flag
    RETRY: Final = defaults.LISTENER_RETRY  # seconds between attempts to connect again

    def __init__(
        self, settings: Settings, hand: Callable[[str], None], listening: Callable[[], None]
    ) -> None:
        self.settings = settings
        self._hand = hand
        self._listening = listening
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=self.run, name=f"trio_supervisor listen {settings.shown}", daemon=True
        )

    def run(self) -> None:
        quiet = False
        while not self.stopping.is_set():
            try:
                with self.settings.connect(autocommit=True) as connection:
                    connection.execute(listen(self.settings.schema))
                    if quiet:
                        logger.info("%s: listening again", self.settings.shown)
                    quiet = False
                    self._listening()
                    while not self.stopping.is_set():
                        for note in connection.notifies(timeout=self.POLL):
                            self._hand(note.payload)
            except Exception as error:
                if self.stopping.is_set():
                    return
                # Only a wake-up: the periodic checks cover what is missed meanwhile.
                # Said once per outage, not at every attempt.
                if not quiet:
                    logger.warning("%s; listening again", self.settings.explain("listen", error))
                quiet = True
                self.stopping.wait(self.RETRY)
                continue
