"""The KV event publisher: an engine's cache events over ZMQ, as vLLM publishes them.

One background thread owns the sockets; the engine only queues batches (never waits)::

    engine loop ── publish(events) ──> queue (max_queue_size; full: dropped, counted)
                                          │  publisher thread
                                          v
    PUB  endpoint          [topic, seq (8 bytes, big-endian), payload]     every batch
    ROUTER replay_endpoint [id, b"", start seq] -> [id, b"", seq, payload] per buffered
                           batch from start, then [id, b"", -1 (8 bytes), b""]

``payload`` is a msgpack ``KVEventBatch`` (``kv_event_wire.py``). A consumer that missed
batches asks the replay socket from the first it missed; one that asks from before the
oldest batch still buffered (``buffer_steps``), a late joiner asking from 0 for
instance, gets a snapshot instead: one batch, ``[AllBlocksCleared, BlockStored ...]``,
carrying the sequence number of the last batch it covers (``kv_event_mirror.py``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType

import zmq

from hybridkv.errors.events import get_logger
from hybridkv.memory.cache_events import CacheEvent
from hybridkv.parallel.kv_event_mirror import CacheMirror
from hybridkv.parallel.kv_event_wire import encode_batch
from hybridkv.parallel.kv_events_config import KVEventsConfig, KVEventsConfigError

log = get_logger(__name__)

#: The replay's end marker: sequence number -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits for a batch before it looks at the replay socket again.
_POLL_MS = 50
_STOP = None


class KVEventPublisher:
    """Publishes batches of cache events (a ``CacheEventSink``) until :meth:`close`.

    Args:
        config: The sockets, buffers and topic (it must be publishing).
        data_parallel_rank: Written into every batch, as vLLM does.
    """

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0) -> None:
        if not config.is_publishing:
            raise KVEventsConfigError(
                "kv-events-config does not publish (enable it, publisher zmq)"
            )
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0
        self.num_published = 0
        self._queue: queue.Queue[list[CacheEvent] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._mirror = CacheMirror()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        #: The endpoints bound or connected (a wildcard port resolved).
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise KVEventsConfigError(f"kv-events-config sockets failed: {self._error}")

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Queue one step's events; a full queue drops them (and counts)."""
        try:
            self._queue.put_nowait(list(events))
        except queue.Full:
            if not self.num_dropped:
                log.warning("kv_events_dropped", max_queue_size=self.config.max_queue_size)
            self.num_dropped += 1

    def drain(self) -> None:
        """Wait until every batch queued so far is sent (tests, and orderly shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the publisher thread ----------------------------------------------------------

    def _run(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = context.socket(zmq.PUB)
        replay = None
        try:
            pub.set_hwm(self.config.hwm)
            self.endpoint = _open(pub, self.config.endpoint)
            if self.config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
                self.replay_endpoint = _last_endpoint(replay)
        except zmq.ZMQError as exc:
            self._error = exc
        self._ready.set()
        try:
            if self._error is None:
                self._serve(pub, replay)
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _serve(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        topic = self.config.topic.encode()
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._answer(replay)
            try:
                events = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            try:
                if events is _STOP:
                    return
                seq = self.num_published
                payload = encode_batch(time.time(), events, self.data_parallel_rank)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self._mirror.apply(events)
                self.num_published += 1
            finally:
                self._queue.task_done()

    def _answer(self, replay: zmq.Socket[bytes]) -> None:
        """Answer one replay request: buffered batches from its start, or a snapshot."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", num_frames=len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        buffer = self._buffer
        if self.num_published and (not buffer or start < buffer[0][0]):
            last = self.num_published - 1
            payload = encode_batch(time.time(), self._mirror.snapshot(), self.data_parallel_rank)
            replay.send_multipart((client, b"", last.to_bytes(8, "big"), payload))
        else:
            for seq, payload in buffer:
                if seq >= start:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def _open(socket: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind or connect as vLLM does (bind a wildcard, ipc or inproc address); the address
    in use (a wildcard port resolved)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
        return _last_endpoint(socket)
    socket.connect(endpoint)
    return endpoint


def _last_endpoint(socket: zmq.Socket[bytes]) -> str:
    value = socket.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
