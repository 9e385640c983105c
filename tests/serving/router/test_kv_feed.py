"""A router's feed of one replica's events: a late joiner's snapshot, batches that went
missing filled from the replay socket, and nothing applied outside ``apply_pending``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridkv.parallel.kv_events import KVEventPublisher
from hybridkv.parallel.kv_events_config import KVEventsConfig
from hybridkv.serving.router.feed import ReplicaFeed
from hybridkv.serving.router.index import ReplicaIndex
from tests.parallel.test_kv_events import BS, make_core, run
from tests.serving.router.test_kv_index import Probe

WAIT_S = 60.0  # a bound on each wait on a busy machine, never a pause
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [3, 1, 4, 1, 5, 9, 2, 6, 8, 9, 7]]


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        buffer_steps=2,  # small: a late joiner gets a snapshot
        topic="kv",
    )
    with KVEventPublisher(config) as pub:
        yield pub


def test_a_feed_started_late_and_one_started_early_hold_what_the_engine_holds(
    publisher: KVEventPublisher,
) -> None:
    """A feed that joins after many batches gets a snapshot; one that was there from the
    start follows every batch (its gaps filled by replay). Both then answer as the
    engine's own lookup does."""
    early_index = ReplicaIndex(BS)
    early = ReplicaFeed(
        early_index,
        publisher.endpoint,
        replay_endpoint=publisher.replay_endpoint,
        topic="kv",
    )
    core, fake, _ = make_core(publisher)
    try:
        with early:
            run(core, fake, PROMPTS * 3, 5)
            publisher.drain()
            last = publisher.num_published - 1
            assert last > 2  # more batches than the replay buffer holds
            late_index = ReplicaIndex(BS)
            with ReplicaFeed(
                late_index,
                publisher.endpoint,
                replay_endpoint=publisher.replay_endpoint,
                topic="kv",
            ) as late:
                assert late.wait_until_received(last, WAIT_S)
                assert early.wait_until_received(last, WAIT_S)
                assert late_index.last_seq == -1  # nothing applied behind the router's back
                assert late.apply_pending() >= 1
                early.apply_pending()
            for prompt in PROMPTS:
                expected = core.kv.lookup(Probe("probe", prompt)).num_tokens
                assert late_index.resumable(prompt) == expected
                assert early_index.resumable(prompt) == expected
                assert expected > 0
    finally:
        fake.close()


def test_a_feed_without_a_replay_socket_follows_what_it_receives(
    publisher: KVEventPublisher,
) -> None:
    index = ReplicaIndex(BS)
    with ReplicaFeed(index, publisher.endpoint, topic="kv") as feed:
        # Empty batches until the subscription takes effect (it lags the connect).
        for _ in range(600):
            publisher.publish([])
            publisher.drain()
            if feed.wait_until_received(publisher.num_published - 1, 0.05):
                break
        else:
            raise AssertionError("the subscription never took effect")
        assert feed.apply_pending() >= 1
        assert index.last_seq == publisher.num_published - 1
