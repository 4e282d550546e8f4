"""The public side of a TLS port: kvtier accepts the connections itself so that a client
that speaks plaintext to it is audited with its address (gRPC's C core refuses it before
any Python sees the connection, logging no peer).

    front = TlsFront.bind("0.0.0.0:50051", on_plaintext=audit_plaintext)
    grpc_server.add_secure_port(front.private_target, credentials)
    front.start()  # once the gRPC server listens
    ...
    front.close()  # refuses new connections; close_connections() after the gRPC drain

Each accepted connection's first byte says what it speaks: a TLS record starts 0x16
(a handshake). Anything else is plaintext: ``on_plaintext(peer)`` is called and the
connection is answered with a TLS alert (protocol_version), as a TLS server answers,
then closed (clients name the mismatch as they did before). A TLS connection is relayed,
still encrypted, to the gRPC server's private listener: a unix socket in a directory of
this user's only, so gRPC terminates TLS (mTLS sees the client's certificate) and nothing
else on the host can reach it. The bytes move kernel-side (``os.splice`` through a pipe,
one thread per direction, blocking calls that release the GIL): no copy into Python and
no event-loop work. The relay's end of each private connection is bound to an abstract
unix name that carries the client's address, so ``auth.client_peer(context)`` gives the
address the client connected from (``ipv4:10.1.2.3:40000``), as ``context.peer()`` does
on a direct port: per-connection limits, shared-memory leases and the audit see it.

Bounds: ``MAX_CONNECTIONS`` relayed at once (a connection over it is closed at accept);
a connection that sends nothing for ``FIRST_BYTE_S`` is closed unclassified.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import secrets
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable

from services.serving.audit import AuditLog
from services.serving.auth import RELAYED_PEER_PREFIX

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # each holds two threads, two sockets and two pipes
FIRST_BYTE_S = 10.0  # gRPC's own handshake deadline is of this order
ALERT_READ_S = 1.0  # how long a refused plaintext client may take to hang up
PIPE_BYTES = 256 << 10  # per direction (default 64 KiB); 64 KiB to 1 MiB measured alike
SPLICE_BYTES = 1 << 20
TLS_HANDSHAKE_RECORD = 0x16
# A fatal TLS alert, protocol_version: what a TLS server answers bytes that are no TLS
# record. Record header (alert, TLS 1.0, 2 bytes), then level fatal (2), description 70.
PROTOCOL_VERSION_ALERT = bytes((0x15, 0x03, 0x01, 0x00, 0x02, 0x02, 0x46))


def grpc_peer(address: tuple) -> str:
    """A socket address as gRPC names a peer (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    host, port = address[0], address[1]
    ip = ipaddress.ip_address(host.partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"ipv4:{ip.ipv4_mapped}:{port}"
    return f"ipv6:[{host}]:{port}" if ip.version == 6 else f"ipv4:{host}:{port}"


class TlsFront:
    def __init__(self, listeners: list[socket.socket], on_plaintext: Callable[[str], None],
                 on_count: Callable[[int], None]) -> None:
        self._listeners = listeners
        self.port: int = listeners[0].getsockname()[1]
        self._on_plaintext = on_plaintext
        self._on_count = on_count  # the number of relayed connections, on each change
        self._directory = tempfile.mkdtemp(prefix="kvtier-front-")  # 0700: ours only
        self._socket_path = os.path.join(self._directory, "grpc.sock")
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()  # both ends of every relayed connection
        self._relays = 0
        self._full = False  # at MAX_CONNECTIONS since the last connection admitted
        self._acceptor: threading.Thread | None = None
        self._closing = False

    @classmethod
    def bind(cls, listen: str, on_plaintext: Callable[[str], None],
             on_count: Callable[[int], None] = lambda _: None) -> TlsFront:
        """Listen on ``listen`` (host:port, port 0: a free one) as gRPC would: every
        address the host resolves to, a wildcard IPv6 address taking IPv4 too. OSError
        when the port cannot be had."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        found = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        listeners: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in found:
                bound = socket.socket(family, kind, proto)
                listeners.append(bound)
                bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    bound.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, len(found) > 1)
                if len(listeners) > 1:  # the port the first one got (port 0)
                    address = (address[0], listeners[0].getsockname()[1], *address[2:])
                bound.bind(address)
                bound.listen(socket.SOMAXCONN)
        except OSError:
            for bound in listeners:
                bound.close()
            raise
        return cls(listeners, on_plaintext, on_count)

    @property
    def private_target(self) -> str:
        """Where the gRPC server listens for what the front relays."""
        return f"unix:{self._socket_path}"

    def start(self) -> None:
        os.chmod(self._socket_path, 0o600)  # the directory is 0700 already; belt and braces
        self._acceptor = threading.Thread(target=self._accept, name="tls-front", daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        """Refuse new connections; relayed ones go on until either end closes them."""
        self._closing = True
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor
        if self._acceptor is not None:
            self._acceptor.join()
        for listener in self._listeners:
            listener.close()

    def close_connections(self) -> None:
        """End every relayed connection (after the gRPC server's drain) and remove the
        private socket's directory."""
        with self._lock:
            for end in self._open:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)  # wakes the relay threads: they close
        shutil.rmtree(self._directory, ignore_errors=True)

    def _accept(self) -> None:
        with selectors.DefaultSelector() as selector:
            for listener in self._listeners:
                selector.register(listener, selectors.EVENT_READ)
            while not self._closing:
                for key, _ in selector.select():
                    try:
                        client, address = key.fileobj.accept()  # type: ignore[union-attr]
                    except OSError:  # shut down (close), or the client gave up already
                        continue
                    self._admit(client, address)

    def _admit(self, client: socket.socket, address: tuple) -> None:
        with self._lock:
            if self._relays >= MAX_CONNECTIONS:
                client.close()
                if not self._full:  # once per time at the bound, not once per connection
                    log.warning("TLS port: %d connections open, the bound; closing new ones "
                                "(one from %s)", self._relays, grpc_peer(address))
                self._full = True
                return
            self._full = False
            self._relays += 1
            self._on_count(self._relays)
        threading.Thread(target=self._serve, args=(client, grpc_peer(address)),
                         name="tls-front-relay", daemon=True).start()

    def _serve(self, client: socket.socket, peer_name: str) -> None:
        try:
            client.settimeout(FIRST_BYTE_S)
            try:
                first = client.recv(1, socket.MSG_PEEK)
            except OSError:  # silent past FIRST_BYTE_S, or reset
                first = b""
            if first and first[0] == TLS_HANDSHAKE_RECORD:
                client.settimeout(None)
                self._relay(client, peer_name)
            elif first:
                self._refuse_plaintext(client, peer_name)
        finally:
            client.close()
            with self._lock:
                self._relays -= 1
                self._on_count(self._relays)

    def _refuse_plaintext(self, client: socket.socket, peer_name: str) -> None:
        try:
            self._on_plaintext(peer_name)
        finally:
            with contextlib.suppress(OSError):
                client.sendall(PROTOCOL_VERSION_ALERT)
                client.shutdown(socket.SHUT_WR)
                # Closing with the client's bytes unread would reset the connection, and a
                # reset may discard the alert before the client reads it: read to its end.
                deadline = time.monotonic() + ALERT_READ_S
                while (left := deadline - time.monotonic()) > 0:
                    client.settimeout(left)
                    if not client.recv(4096):
                        break

    def _relay(self, client: socket.socket, peer_name: str) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # what gRPC reports as the peer (``auth.client_peer``); the token: unique
            server.bind(f"\0{RELAYED_PEER_PREFIX}{secrets.token_hex(8)}/{peer_name}")
            server.connect(self._socket_path)
        except OSError as exc:  # the gRPC server is stopping
            server.close()
            log.warning("TLS port: cannot relay %s to the gRPC server: %s", peer_name, exc)
            return
        with self._lock:
            self._open.update((client, server))
        back = threading.Thread(target=_pump, args=(server, client), name="tls-front-relay",
                                daemon=True)
        back.start()
        try:
            _pump(client, server)
            back.join()
        finally:
            with self._lock:
                self._open.difference_update((client, server))
            server.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Move bytes from ``source`` to ``sink`` until ``source`` ends, kernel-side; on an
    error both sockets are shut down, which ends the other direction too."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):  # a user over the pipe quota keeps the default
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    try:
        while moved := os.splice(source.fileno(), write_end, SPLICE_BYTES):
            while moved:
                moved -= os.splice(read_end, sink.fileno(), moved)
        sink.shutdown(socket.SHUT_WR)  # the end of one direction, not of the other
    except OSError as exc:
        if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.EBADF):
            log.warning("TLS port relay: %s", exc)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
    finally:
        os.close(read_end)
        os.close(write_end)


class PlaintextAudit:
    """``on_plaintext`` of a front: counts every attempt (``counted``), audits (kind
    ``plaintext``) and logs at most one per client host per ``interval_s``; that record
    says how many more came since the last. It remembers at most ``max_hosts`` hosts (the
    least recently recorded forgotten first), so a flood of attempts holds bounded memory."""

    REASON = "plaintext on a TLS port"

    def __init__(self, audit: Callable[[], AuditLog | None], counted: Callable[[], None],
                 interval_s: float = 60.0, max_hosts: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._audit = audit  # the current one: a reload may replace it
        self._counted = counted
        self._interval_s = interval_s
        self._max_hosts = max_hosts
        self._clock = clock
        self._lock = threading.Lock()
        self._hosts: dict[str, tuple[float, int]] = {}  # host: (last recorded, since then)

    def __call__(self, peer_name: str) -> None:
        self._counted()
        host = peer_name.rpartition(":")[0]
        with self._lock:
            now = self._clock()
            recorded, since = self._hosts.get(host, (None, 0))
            if recorded is not None and now - recorded < self._interval_s:
                self._hosts[host] = (recorded, since + 1)
                return
            self._hosts.pop(host, None)
            self._hosts[host] = (now, 0)  # last in insertion order: the latest recorded
            while len(self._hosts) > self._max_hosts:
                del self._hosts[next(iter(self._hosts))]
        reason = self.REASON + (f" ({since} more from this host since the last record)"
                                if since else "")
        log.warning("%s: refused a connection from %s", reason, peer_name)
        audit = self._audit()
        if audit is not None:
            audit.record("plaintext", None, "", peer_name, "UNAVAILABLE", reason)

    def __len__(self) -> int:
        return len(self._hosts)
