"""The front end's connections to its replicas (``serving/router/upstream.py``), against real
sockets: servers here answer as a replica would, or close, stall and garble as a broken
one does. On asyncio's loop and on uvloop's, the front end's."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc
import pytest

from hybridkv.serving.router.upstream import UpstreamConnectError, UpstreamError, UpstreamPool

Handler = Callable[[anyio.abc.SocketStream, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"


@pytest.fixture(params=[False, True], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """The front end's loops: asyncio's own, and uvloop (its default where installed)."""
    return "asyncio", {"use_uvloop": request.param}


class Server:
    """A TCP server whose ``handler`` gets each connection and its number (from 0)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.url = ""

    async def _serve(self, stream: anyio.abc.SocketStream) -> None:
        number, self.connections = self.connections, self.connections + 1
        async with stream:
            await self.handler(stream, number)


async def request_head(stream: anyio.abc.SocketStream) -> bytes:
    """Read one request up to its blank line (these requests have no body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive()
    return data


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    server.url = f"http://127.0.0.1:{port}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, server._serve)
        yield server
        tg.cancel_scope.cancel()


async def _get(pool: UpstreamPool, url: str) -> tuple[int, bytes]:
    answer = await pool.send(f"{url}/x", "GET", [("accept", "*/*")], b"")
    try:
        return answer.status_code, await answer.read()
    finally:
        await answer.aclose()


async def _connections_for(
    handler: Handler, num_requests: int, answer: tuple[int, bytes] = (200, b"hi")
) -> int:
    """The connections ``num_requests`` GETs in a row took, each answered ``answer``."""
    async with serving(handler) as server:
        pool = UpstreamPool()
        for _ in range(num_requests):
            assert await _get(pool, server.url) == answer
        await pool.aclose()
    return server.connections


async def _answer_each(stream: anyio.abc.SocketStream, number: int) -> None:
    while True:
        try:
            await request_head(stream)
        except anyio.EndOfStream:
            return
        await stream.send(OK)


@pytest.mark.anyio
async def test_a_connection_is_kept_for_the_next_request() -> None:
    assert await _connections_for(_answer_each, 3) == 1


@pytest.mark.anyio
async def test_a_stream_arrives_in_pieces_without_its_chunk_framing() -> None:
    sent = anyio.Event()

    async def stream_two(stream: anyio.abc.SocketStream, number: int) -> None:
        await request_head(stream)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        await stream.send(head + b"\r\n\r\n7\r\ndata: 1\r\n")
        await sent.wait()
        await stream.send(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await _answer_each(stream, number)

    async with serving(stream_two) as server:
        pool = UpstreamPool()
        answer = await pool.send(f"{server.url}/v1/completions", "POST", [], b"{}")
        assert answer.headers["content-type"] == "text/event-stream"
        pieces = answer.chunks(stall_s=60.0)
        assert await anext(pieces) == b"data: 1"  # before the second was even sent
        sent.set()
        assert [piece async for piece in pieces] == [b"data: 2"]
        await answer.aclose()
        assert await _get(pool, server.url) == (200, b"hi")  # read whole: kept
        assert server.connections == 1
        await pool.aclose()


@pytest.mark.anyio
async def test_a_connection_the_replica_closed_while_idle_is_not_used() -> None:
    async def answer_once(stream: anyio.abc.SocketStream, number: int) -> None:
        await request_head(stream)
        await stream.send(OK)  # then closes: its idle timeout, say

    assert await _connections_for(answer_once, 3) == 3


@pytest.mark.anyio
async def test_a_kept_connection_closed_unanswered_is_retried_on_a_new_one() -> None:
    """The replica closed the kept connection just as the request went out: it never
    answered, so the request goes again on a new connection."""

    async def close_on_second(stream: anyio.abc.SocketStream, number: int) -> None:
        await request_head(stream)
        await stream.send(OK)
        if number == 0:
            await request_head(stream)  # read, and closed without a byte of answer
        else:
            await _answer_each(stream, number)

    assert await _connections_for(close_on_second, 2) == 2


@pytest.mark.anyio
async def test_a_refused_connection_is_a_connect_error() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()  # nothing listens there now
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await UpstreamPool().send(f"http://127.0.0.1:{port}/x", "GET", [], b"")


async def _broken(reply: bytes) -> UpstreamError:
    async def send_and_close(stream: anyio.abc.SocketStream, number: int) -> None:
        await request_head(stream)
        await stream.send(reply)

    async with serving(send_and_close) as server:
        pool = UpstreamPool()
        with pytest.raises(UpstreamError) as caught:
            await _get(pool, server.url)
        assert server.connections == 1  # a broken answer is not sent again
        await pool.aclose()
    return caught.value


@pytest.mark.anyio
async def test_an_answer_cut_short_is_an_error() -> None:
    error = await _broken(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..")
    assert "mid-answer" in str(error)


@pytest.mark.anyio
async def test_an_answer_that_is_not_http_is_an_error() -> None:
    error = await _broken(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    assert "malformed" in str(error)


@pytest.mark.anyio
async def test_a_body_without_framing_ends_with_the_connection() -> None:
    async def unframed(stream: anyio.abc.SocketStream, number: int) -> None:
        await request_head(stream)
        await stream.send(b"HTTP/1.1 200 OK\r\n\r\nall of it")

    # Each on a connection of its own: one that ended its answer is not kept.
    assert await _connections_for(unframed, 2, (200, b"all of it")) == 2


@pytest.mark.anyio
async def test_a_stream_that_stalls_past_its_bound_is_an_error() -> None:
    done = anyio.Event()

    async def stall(stream: anyio.abc.SocketStream, number: int) -> None:
        await request_head(stream)
        await stream.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await done.wait()  # and never another byte

    async with serving(stall) as server:
        pool = UpstreamPool()
        answer = await pool.send(f"{server.url}/x", "POST", [], b"{}")
        pieces = answer.chunks(stall_s=0.2)
        assert await anext(pieces) == b"a"
        with pytest.raises(UpstreamError, match=r"no byte within 0\.2 s"):
            await anext(pieces)
        await answer.aclose()
        done.set()
        await pool.aclose()
