"""Following one replica's KV events into its index, from a router's side of the socket.

A thread owns the ZMQ sockets and only queues what arrives; the router's own thread
applies it (:meth:`ReplicaFeed.apply_pending`) just before it reads the index, so the
index is never read while it changes::

    replica PUB  ──[topic, seq, payload]──> SUB  ─┐
    replica ROUTER <──[b"", start]── DEALER       ├─> pending ──apply_pending()──> index
                   ──[b"", seq, payload]...──>   ─┘

On start the feed asks the replay socket for everything from batch 0 (a snapshot, when
the replica no longer buffers that far back), and again from the first batch it missed
whenever a live batch skips ahead: a subscription takes effect some time after it
connects, and a PUB socket drops what a slow subscriber cannot take. Without a replay
socket, what is missed stays missed (the index then holds less than the replica and
never more than it once had).
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType

import zmq

from hybridkv.errors.events import get_logger
from hybridkv.serving.router.index import ReplicaIndex

log = get_logger(__name__)

_POLL_MS = 100
#: How long a replay may take to answer before the feed goes on without it.
REPLAY_TIMEOUT_MS = 10_000


class ReplicaFeed:
    """Subscribes to a replica's events until :meth:`close`.

    Args:
        index: Where the batches go (only through :meth:`apply_pending`).
        endpoint: The replica's PUB endpoint, as a consumer connects to it
            (``tcp://host:5557``).
        replay_endpoint: Its ROUTER endpoint, or None.
        topic: The topic it publishes under.
    """

    def __init__(
        self,
        index: ReplicaIndex,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
    ) -> None:
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        #: Batches received, in the order to apply them.
        self._pending: deque[tuple[int, bytes]] = deque()
        self._next_seq = 0  # the thread's: the first batch it has not received
        self._received = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-feed", daemon=True)
        self._thread.start()

    def wait_until_received(self, seq: int, timeout: float) -> bool:
        """Whether batch ``seq`` (or a snapshot covering it) arrived within ``timeout``
        seconds (tests, and a front end that must see a replica's state)."""
        with self._received:
            return self._received.wait_for(lambda: self._next_seq > seq, timeout)

    def apply_pending(self) -> int:
        """Apply every batch received so far to the index; returns how many."""
        count = 0
        while self._pending:
            seq, payload = self._pending.popleft()
            self.index.apply(seq, payload)
            count += 1
        return count

    def close(self) -> None:
        """Stop the thread and close its sockets."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> ReplicaFeed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the feed's thread ----------------------------------------------------------

    def _run(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            self._replay()
            while not self._stop.is_set():
                if not sub.poll(_POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq > self._next_seq:
                    self._replay()
                if seq >= self._next_seq:
                    self._receive(seq, frames[2])
        except zmq.ZMQError as exc:
            log.warning("kv_feed_failed", endpoint=self.endpoint, error=str(exc))
        finally:
            sub.close(linger=0)

    def _receive(self, seq: int, payload: bytes) -> None:
        with self._received:
            self._pending.append((seq, payload))
            self._next_seq = max(self._next_seq, seq + 1)
            self._received.notify_all()

    def _replay(self) -> None:
        """Ask for every batch from the first not received (a snapshot when the replica
        no longer buffers it)."""
        if self.replay_endpoint is None:
            return
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        with context.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", self._next_seq.to_bytes(8, "big")))
            waited = 0
            while not self._stop.is_set():
                if not dealer.poll(_POLL_MS):  # short polls: close() never waits long
                    waited += _POLL_MS
                    if waited >= REPLAY_TIMEOUT_MS:
                        log.warning("kv_feed_replay_timeout", endpoint=self.replay_endpoint)
                        return
                    continue
                waited = 0
                frames = dealer.recv_multipart()
                if len(frames) != 3 or not frames[2]:  # the end marker
                    return
                # A snapshot carries the number of the last batch it covers; the index
                # skips any batch it already followed.
                self._receive(int.from_bytes(frames[1], "big", signed=True), frames[2])


__all__ = ["ReplicaFeed"]
