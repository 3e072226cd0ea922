"""A TCP proxy of the tests' own, to pause and cut a runner's connections to PostgreSQL.

A runner reaches the database through :class:`TcpProxy` instead of directly; the test
then decides what the network does:

* :meth:`TcpProxy.pause` holds every byte in both directions, connections stay open: to
  the database the runner is frozen (its renewals and writes stop arriving), while the
  runner itself keeps running and finds its calls unanswered;
* :meth:`TcpProxy.resume` delivers what was held, in order: the runner's writes from
  before the pause then reach the database late, which is what a runner frozen past its
  takeover and then resumed does;
* :meth:`TcpProxy.cut` closes every connection and refuses new ones, as a dead network
  whose peer answers with resets; :meth:`TcpProxy.restore` accepts them again;
* :meth:`TcpProxy.hold_answers` lets the runner's bytes through but holds the
  server's: a statement runs and commits, and its answer never comes (cut it then, and
  the outcome of a commit is lost on the way back).

One thread runs every socket with a selector; the methods may be called from any
thread or Trio task (they return at once).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import urllib.parse
from types import TracebackType
from typing import Self

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["TcpProxy"]

# SO_LINGER on, with a zero timeout: close() sends a reset instead of a FIN.
_RESET = struct.pack("ii", 1, 0)


class _Pipe:
    """One proxied connection: the client's socket, the server's, and what each owes."""

    __slots__ = ("client", "pending", "server")

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        # Bytes read from one side and not yet written to the other, by the writing side.
        self.pending: dict[socket.socket, bytearray] = {client: bytearray(), server: bytearray()}

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.server if sock is self.client else self.client

    def close(self) -> None:
        for sock in (self.client, self.server):
            # A reset, not a polite FIN: a cut network does not say goodbye.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            sock.close()


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` until closed.

    Attributes:
        port: The proxy's own port on 127.0.0.1.
        connections: How many connections it accepted in all.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.connections = 0
        self._selector = selectors.DefaultSelector()
        self._pipes: dict[socket.socket, _Pipe] = {}
        self._paused = False
        self._answers_held = False
        self._hold_after: bytes | None = None  # hold answers once a client sends this
        self._refusing = False
        self._closed = False
        self._cut_pending = False
        self._cuts_done = threading.Condition()
        self._cuts = 0  # cuts asked for, and done by the thread
        self._cuts_made = 0
        self._lock = threading.Lock()
        # A socket pair wakes the thread when a method changed what it must do.
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="tcp proxy", daemon=True)
        self._thread.start()

    @classmethod
    def to(cls, dsn: str) -> TcpProxy:
        """A proxy to the server ``dsn`` names (a libpq URL or ``key=value`` string)."""
        params = conninfo_to_dict(dsn)
        return cls((str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)))

    def through(self, dsn: str) -> str:
        """``dsn`` (of the proxy's target) pointed at the proxy, in libpq's form."""
        return make_conninfo(dsn, host="127.0.0.1", port=str(self.port))

    def url(self, url: str) -> str:
        """``url`` (a ``postgresql://`` URL of the target) pointed at the proxy."""
        parts = urllib.parse.urlsplit(url)
        user = f"{parts.username}@" if parts.username else ""
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    # -- what the test does to the network --------------------------------------------

    def pause(self) -> None:
        """Hold every byte from now on; connections stay open."""
        self._change(paused=True)

    def hold_answers(self, *, after: bytes | None = None) -> None:
        """Forward what clients send; hold what the server answers, from now on, or
        from when a client sends bytes holding ``after`` (a statement's text: the
        server gets it, and its answer is held)."""
        if after is None:
            self._change(answers_held=True)
        else:
            with self._lock:
                self._hold_after = after

    def resume(self) -> None:
        """Deliver what was held, and forward again."""
        self._change(paused=False)

    def cut(self) -> None:
        """Reset every connection, and refuse new ones until :meth:`restore`; returns
        once the connections were reset."""
        with self._cuts_done:
            self._cuts += 1
            wanted = self._cuts
        self._change(refusing=True, cut=True)
        with self._cuts_done:
            self._cuts_done.wait_for(lambda: self._cuts_made >= wanted, timeout=5)

    def restore(self) -> None:
        """Accept and forward connections again, both ways."""
        self._change(refusing=False, paused=False, answers_held=False)

    def close(self) -> None:
        """Reset every connection and stop the thread."""
        self._change(refusing=True, cut=True, closed=True)
        self._thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _change(
        self,
        *,
        paused: bool | None = None,
        answers_held: bool | None = None,
        refusing: bool | None = None,
        cut: bool = False,
        closed: bool = False,
    ) -> None:
        with self._lock:
            if paused is not None:
                self._paused = paused
            if answers_held is not None:
                self._answers_held = answers_held
                self._hold_after = None
            if refusing is not None:
                self._refusing = refusing
            self._cut_pending = self._cut_pending or cut
            self._closed = self._closed or closed
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    closed, cut = self._closed, self._cut_pending
                    self._cut_pending = False
                    paused, answers_held = self._paused, self._answers_held
                if cut:
                    with self._cuts_done:
                        asked = self._cuts
                    for pipe in {id(pipe): pipe for pipe in self._pipes.values()}.values():
                        self._drop(pipe)
                    with self._cuts_done:
                        self._cuts_made = asked
                        self._cuts_done.notify_all()
                if closed:
                    return
                self._arm(paused, answers_held)
                for selected, events in self._selector.select(timeout=1.0):
                    sock = selected.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._wake_read:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_read.recv(4096)
                    elif sock is self._listener:
                        self._accept()
                    else:
                        found = self._pipes.get(sock)
                        if found is not None:
                            self._pump(found, sock, events)
        finally:
            for pipe in {id(pipe): pipe for pipe in self._pipes.values()}.values():
                self._drop(pipe)
            self._selector.close()
            self._listener.close()
            self._wake_read.close()
            self._wake_write.close()

    def _accept(self) -> None:
        with self._lock:  # now, not as the loop began: restore() may have come since
            refusing = self._refusing
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if refusing:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            client.close()
            return
        try:
            server = socket.create_connection(self._target, timeout=5)
        except OSError:
            client.close()
            return
        self.connections += 1
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe = _Pipe(client, server)
        self._pipes[client] = self._pipes[server] = pipe
        self._selector.register(client, selectors.EVENT_READ)
        self._selector.register(server, selectors.EVENT_READ)

    def _arm(self, paused: bool, answers_held: bool) -> None:
        """Ask the selector for reads, and for writes where bytes are owed and may go."""
        for sock, pipe in self._pipes.items():
            events = selectors.EVENT_READ
            held = paused or (answers_held and sock is pipe.client)
            if pipe.pending[sock] and not held:
                events |= selectors.EVENT_WRITE
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(sock, events)

    def _pump(self, pipe: _Pipe, sock: socket.socket, events: int) -> None:
        with self._lock:
            paused, answers_held = self._paused, self._answers_held
        if events & selectors.EVENT_READ:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._drop(pipe)
                return
            if data:
                pipe.pending[pipe.peer(sock)] += data
                with self._lock:
                    if sock is pipe.client and self._hold_after and self._hold_after in data:
                        self._answers_held = answers_held = True
                        self._hold_after = None
        if paused:
            return
        for target in (pipe.client, pipe.server):
            owed = pipe.pending[target]
            if not owed or (answers_held and target is pipe.client):
                continue
            try:
                sent = target.send(owed)
            except BlockingIOError:
                continue
            except OSError:
                self._drop(pipe)
                return
            del owed[:sent]

    def _drop(self, pipe: _Pipe) -> None:
        for sock in (pipe.client, pipe.server):
            self._pipes.pop(sock, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
        pipe.close()
