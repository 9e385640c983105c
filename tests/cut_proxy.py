"""A TCP proxy in front of a real redis-server that cuts the connection inside the reply
to every MGET of several keys (a load of blocks; redis-py retries a command on a new
connection, and each try is cut), at a chosen point of that reply.

::

    client ──▶ proxy ──▶ redis-server
           ◀── first MGET's reply: *N\\r\\n $L\\r\\n <block 0> \\r\\n $L\\r\\n <block 1> ...
                                  ^        ^                  ^
                     "before the reply"  "inside a block"  "between blocks"

Every other reply passes through unchanged.
"""

from __future__ import annotations

import contextlib
import socket
import threading

CUTS = ("before the reply", "inside a block", "between blocks")


def cut_offset(reply: bytes, cut: str) -> int:
    """How many bytes of an MGET ``reply`` pass before the connection is cut."""
    if cut == "before the reply":
        return 0
    header_end = reply.index(b"\r\n") + 2  # *N\r\n
    length_end = reply.index(b"\r\n", header_end) + 2  # $L\r\n of the first value
    length = int(reply[header_end + 1 : length_end - 2])
    if cut == "inside a block":
        return length_end + max(1, length // 2)
    assert cut == "between blocks"
    return length_end + length + 2


def _value_end(data: bytes, at: int = 0) -> int | None:
    """Where the RESP value starting at ``at`` ends, or None while it is incomplete."""
    line_end = data.find(b"\r\n", at)
    if line_end < 0:
        return None
    kind, body, after = data[at : at + 1], data[at + 1 : line_end], line_end + 2
    if kind in b"+-:_#,(":  # one line (RESP2 and RESP3)
        return after
    if kind in b"$=!":  # a length, then that many bytes
        length = int(body)
        end = after + length + 2 if length >= 0 else after
        return end if end <= len(data) else None
    assert kind in b"*~>%|", f"an unexpected RESP type {kind!r}"
    count = max(int(body), 0) * (2 if kind in b"%|" else 1)  # a map's are pairs
    for _ in range(count):
        found = _value_end(data, after)
        if found is None:
            return None
        after = found
    return after


def _commands(data: bytes) -> tuple[list[tuple[bytes, int]], bytes]:
    """The whole commands at the start of ``data`` (name, number of arguments) and the
    bytes left over."""
    out = []
    while (end := _value_end(data)) is not None:
        command, data = data[:end], data[end:]
        count = int(command[1 : command.index(b"\r\n")])
        name_start = command.index(b"\r\n", command.index(b"$")) + 2
        name = command[name_start : command.index(b"\r\n", name_start)].upper()
        out.append((name, count - 1))
    return out, data


class CutProxy:
    """Listens on a loopback port; :attr:`url` is the Redis URL through it.

    Attributes:
        num_keys: The keys of the first MGET whose reply was cut (None before one is).
        num_cuts: The replies cut.
    """

    def __init__(self, upstream_port: int, cut: str, *, min_keys: int = 2) -> None:
        self.upstream_port = upstream_port
        self.cut = cut
        self.min_keys = min_keys
        self.num_keys: int | None = None
        self.num_cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self._lock = threading.Lock()
        self._is_closed = False
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._spawn(self._accept)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, server]
            pending: list[int] = []  # keys of an MGET sent and not yet answered
            self._spawn(self._requests, client, server, pending)
            self._spawn(self._replies, server, client, pending)

    def _requests(self, client: socket.socket, server: socket.socket, pending: list[int]) -> None:
        """Forward commands, noting for each the keys of an MGET to cut (-1: pass it)."""
        buffered = b""
        while data := _recv(client):
            commands, buffered = _commands(buffered + data)
            cuts = [n if name == b"MGET" and n >= self.min_keys else -1 for name, n in commands]
            with self._lock:
                pending.extend(cuts)
            server.sendall(data)
        _close(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, pending: list[int]) -> None:
        """Forward replies one whole value at a time; cut inside an MGET's."""
        buffered = b""
        while data := _recv(server):
            buffered += data
            while (end := _value_end(buffered)) is not None:
                reply, buffered = buffered[:end], buffered[end:]
                with self._lock:
                    num_keys = pending.pop(0)
                    if num_keys >= 0:
                        self.num_keys = num_keys if self.num_keys is None else self.num_keys
                        self.num_cuts += 1
                if num_keys >= 0:
                    client.sendall(reply[: cut_offset(reply, self.cut)])
                    _close(client, server)
                    return
                client.sendall(reply)
        _close(client, server)

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            _close(sock)
        for thread in self._threads:
            thread.join(timeout=10)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
