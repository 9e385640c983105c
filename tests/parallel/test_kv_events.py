"""KV events on the wire: vLLM's format, a real ZMQ subscriber, replay and snapshots."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import msgpack
import pytest
import zmq
from hypothesis import given, settings

from hybridkv.memory.cache_events import AllBlocksCleared, CacheEvent
from hybridkv.memory.offload import HostTier, OffloadConfig
from hybridkv.memory.offload.keys import parse_key
from hybridkv.parallel.kv_event_wire import encode_batch, wire_hash
from hybridkv.parallel.kv_events import KVEventPublisher
from hybridkv.parallel.kv_events_config import KVEventsConfig, KVEventsConfigError
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor

BS = 4
POLL_MS = 30_000  # a bound on each wait for a message (a busy machine), never a pause

Key = tuple[str, int, int]


class WireConsumer:
    """A router's index, rebuilt from payloads alone, decoded positionally as a consumer
    written for vLLM does (ignoring trailing fields it does not know)."""

    def __init__(self) -> None:
        self.blocks: set[Key] = set()
        self.last_seq = -1

    def apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        for event in events:
            tag = event[0]
            if tag == "AllBlocksCleared":
                self.blocks.clear()
            elif tag == "BlockRemoved":
                _, hashes, medium, group = event
                self.blocks -= {(medium, group, h) for h in hashes}
            else:
                hashes, medium, group = event[1], event[6], event[9]
                assert len(event[3]) in (0, len(hashes) * event[4])  # token_ids, block_size
                self.blocks |= {(medium, group, h) for h in hashes}
        self.last_seq = seq


def engine_blocks(core: EngineCore, tier: HostTier) -> set[Key]:
    pool = core.kv.pool
    held = {
        ("GPU", g, wire_hash(h)) for g in range(core.kv.num_groups) for h in pool.cached_blocks(g)
    }
    for key in tier.held_keys():
        group, block_hash = parse_key(key)
        held.add(("CPU", group, wire_hash(block_hash)))
    return held


class Recorder:
    """A sink that keeps each batch's payload, as the publisher would send it."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, events: list[CacheEvent]) -> None:
        self.payloads.append(encode_batch(0.0, events))


def make_core(kv_events: Any, num_blocks: int = 24) -> tuple[EngineCore, FakeExecutor, HostTier]:
    config = EngineConfig(
        policies=[FullAttention(), SlidingWindow(window=6), MambaLike()],
        num_blocks=num_blocks,
        block_size=BS,
        max_model_len=128,
        vocab_size=50,
        max_prefill_chunk=16,
    )
    fake = FakeExecutor.for_config(config)
    tier = HostTier(2048)  # small: its LRU drops blocks too
    offload = OffloadConfig(tiers=[tier], save_interval=8)
    keys = fake.attach_offload(offload)
    core = EngineCore(config, offload=(offload, keys), kv_events=kv_events)
    return core, fake, tier


def run(core: EngineCore, fake: FakeExecutor, prompts: list[list[int]], max_tokens: int) -> None:
    for k, prompt in enumerate(prompts):
        core.add_request(
            prompt, SamplingParams(max_tokens=max_tokens), CollectingSink(), request_id=f"r{k}"
        )
        for _ in range(500):
            if not core.has_work:
                break
            plan = core.plan()
            if plan.runs:
                core.apply(plan, fake.execute(plan.batch))
            core.flush()
    assert fake.transfers is not None and fake.transfers.wait_saved()
    core.flush()  # the tier's stores the saver thread reported since


prompts = st.lists(
    st.lists(st.integers(0, 5), min_size=1, max_size=14).map(lambda p: [7, 8, 9, 10, 11, *p]),
    min_size=1,
    max_size=6,
)


@settings(max_examples=15, deadline=None)
@given(prompts=prompts, max_tokens=st.integers(1, 6))
def test_a_consumer_of_the_wire_holds_what_the_engine_caches(
    prompts: list[list[int]], max_tokens: int
) -> None:
    """After random requests with eviction in the pool and in a host tier, the payloads
    alone rebuild the pool's prefix-cache map and the tier's blocks."""
    recorder = Recorder()
    core, fake, tier = make_core(recorder)
    try:
        run(core, fake, prompts * 2, max_tokens)
        consumer = WireConsumer()
        for seq, payload in enumerate(recorder.payloads):
            consumer.apply(seq, payload)
        assert consumer.blocks == engine_blocks(core, tier)
    finally:
        fake.close()


def test_vllms_own_struct_definitions_decode_the_events() -> None:
    """vLLM's msgspec structs decode every event, and an older consumer's (without the
    group fields) too: hybridkv's fields trail vLLM's."""
    msgspec = pytest.importorskip("msgspec")
    from tests.parallel.vllm_event_structs import Batch, BlockStored, OldBatch

    recorder = Recorder()
    core, fake, _ = make_core(recorder)
    try:
        run(core, fake, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1]], 4)
    finally:
        fake.close()
    decoded = [msgspec.msgpack.decode(p, type=Batch) for p in recorder.payloads]
    stored = [e for b in decoded for e in b.events if isinstance(e, BlockStored)]
    assert {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored
    } == {
        (0, "full_attention", None),
        (1, "sliding_window", 6),
        (2, "mamba", None),
    }
    assert {e.medium for e in stored} == {"GPU", "CPU"}
    old = [msgspec.msgpack.decode(p, type=OldBatch) for p in recorder.payloads]
    assert sum(len(b.events) for b in old) == sum(len(b.events) for b in decoded)


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv-events",
    )
    with KVEventPublisher(config) as pub:
        yield pub


def subscribe(pub: KVEventPublisher, context: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    """A SUB socket that receives from now on: empty batches go out until one arrives
    (a subscription takes effect some time after connecting)."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(pub.endpoint)
    for _ in range(600):  # a bound of 30 s on a busy machine, not a pause
        pub.publish([])
        if sub.poll(50):
            while sub.poll(0):
                sub.recv_multipart()
            return sub
    raise AssertionError("the subscription never took effect")


def replay(
    pub: KVEventPublisher, context: zmq.Context[zmq.Socket[bytes]], start: int
) -> list[tuple[int, bytes]]:
    """Ask the replay socket for everything from ``start`` (a DEALER: a REQ socket
    takes one reply per request, and a replay is many)."""
    assert pub.replay_endpoint is not None
    with context.socket(zmq.DEALER) as dealer:
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(POLL_MS), "the replay did not answer"
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                return out
            out.append((int.from_bytes(seq_bytes, "big"), payload))


def test_a_zmq_subscriber_rebuilds_the_engines_cache(publisher: KVEventPublisher) -> None:
    """Live batches on the PUB socket ([topic, seq, payload]) rebuild the engine's state;
    a gap is filled from the replay socket."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with subscribe(publisher, context) as sub:
        core, fake, tier = make_core(publisher)
        try:
            run(core, fake, [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [3, 1, 4, 1, 5, 9, 2, 6, 8]] * 3, 5)
            publisher.drain()
            consumer = WireConsumer()
            last = publisher.num_published - 1
            while consumer.last_seq < last:
                assert sub.poll(POLL_MS), "a published batch never arrived"
                topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                assert topic == b"kv-events"
                if consumer.last_seq < 0:  # started mid-stream: fetch what came before
                    for old_seq, old in replay(publisher, context, 0):
                        consumer.apply(old_seq, old)
                consumer.apply(seq, payload)
            assert consumer.blocks == engine_blocks(core, tier)
            assert publisher.num_dropped == 0
        finally:
            fake.close()


def test_a_late_joiner_gets_a_snapshot(publisher: KVEventPublisher) -> None:
    """Asking from a sequence number older than the replay buffer returns one batch that
    clears and then stores every block held, numbered as the last batch it covers."""
    small = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        buffer_steps=1,
    )
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with KVEventPublisher(small) as pub:
        core, fake, tier = make_core(pub)
        try:
            run(core, fake, [[2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [2, 7, 1, 8, 2, 8, 4, 5]], 3)
            pub.drain()
            answer = replay(pub, context, 0)
            assert [seq for seq, _ in answer] == [pub.num_published - 1]
            assert msgpack.unpackb(answer[0][1])[1][0] == ["AllBlocksCleared"]
            consumer = WireConsumer()
            consumer.apply(*answer[0])
            assert consumer.blocks == engine_blocks(core, tier)
        finally:
            fake.close()


def test_a_consumer_within_the_buffer_gets_the_batches_it_missed(
    publisher: KVEventPublisher,
) -> None:
    """A start the buffer still holds is answered with those batches, in order."""
    for _ in range(3):
        publisher.publish([AllBlocksCleared()])
    publisher.drain()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    assert [seq for seq, _ in replay(publisher, context, 1)] == [1, 2]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}', "endpiont"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"publisher": "zmq"}', "enable_kv_cache_events"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_cache_events": true, "endpoint": "5557"}', "endpoint"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_config_is_refused_by_name(text: str, named: str) -> None:
    """Unknown keys, unknown publishers and bad values are refused, naming the key."""
    with pytest.raises(KVEventsConfigError, match=named):
        KVEventsConfig.from_json(text)


def test_vllms_example_config_is_accepted() -> None:
    """vLLM's documented keys and defaults parse as they are."""
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv-events", "buffer_steps": 100,'
        ' "hwm": 1000, "max_queue_size": 10}'
    )
    assert config.is_publishing and config.topic == "kv-events"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').is_publishing


@pytest.mark.asyncio
async def test_the_async_engine_publishes_through_its_kv_events_option() -> None:
    """``Engine(..., kv_events=publisher)``: a finished request's blocks reach a consumer
    that asks the replay socket, and match the engine's pool."""
    import anyio

    from hybridkv.scheduler import Engine

    config = EngineConfig(
        policies=[FullAttention(), SlidingWindow(window=6)],
        num_blocks=32,
        block_size=BS,
        max_model_len=128,
        vocab_size=50,
    )
    settings = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
    )
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with KVEventPublisher(settings) as pub:
        async with Engine(config, FakeExecutor.for_config(config), kv_events=pub) as engine:
            with anyio.fail_after(10):
                stream = engine.generate(list(range(1, 14)), SamplingParams(max_tokens=4))
                async with stream:
                    async for _ in stream:
                        pass
                await engine.wait_until(lambda s: s.num_running + s.num_waiting == 0)
            engine.core.flush()
            pub.drain()
            consumer = WireConsumer()
            for seq, payload in replay(pub, context, 0):
                consumer.apply(seq, payload)
            pool = engine.core.kv.pool
            held = {("GPU", g, wire_hash(h)) for g in range(2) for h in pool.cached_blocks(g)}
            assert held and consumer.blocks == held
