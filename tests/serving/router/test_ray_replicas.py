"""The replica table a Ray Serve router ranks with: reports in, feeds followed, replicas
ranked by the prefix their events show against their load (no Ray needed)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from hybridkv.memory.cache_events import CacheEvent
from hybridkv.parallel.kv_event_wire import encode_batch
from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor
from hybridkv.serving.router.index import ReplicaIndex
from hybridkv.serving.router.ranking import RouterWeights
from hybridkv.serving.router.ray.replicas import ReplicaReport, ReplicaTable

BS = 4
PREFIX = list(range(1, 33))  # eight blocks
WEIGHTS = RouterWeights(tokens_per_request=8)


class Recorder:
    """An engine's event sink that keeps each batch's payload, as it would be sent."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, events: list[CacheEvent]) -> None:
        self.payloads.append(encode_batch(0.0, events))


class RecordedFeed:
    """A feed of a recorder's batches, applied when the table asks (no socket, no
    thread): what a ReplicaFeed delivers once every batch has arrived."""

    def __init__(self, index: ReplicaIndex, recorder: Recorder) -> None:
        self.index = index
        self.recorder = recorder
        self.num_applied = 0
        self.is_closed = False

    def apply_pending(self) -> int:
        new = self.recorder.payloads[self.num_applied :]
        for seq, payload in enumerate(new, self.num_applied):
            self.index.apply(seq, payload)
        self.num_applied += len(new)
        return len(new)

    def close(self) -> None:
        self.is_closed = True


class Replicas:
    """Engine cores on the fake executor, each publishing to a recorder that a table
    follows through a RecordedFeed (its report's endpoint names the recorder)."""

    def __init__(self, *names: str) -> None:
        self.recorders = {name: Recorder() for name in names}
        self.cores = {name: self._core(self.recorders[name]) for name in names}
        self.feeds: dict[str, RecordedFeed] = {}
        self.table = ReplicaTable(WEIGHTS, follow=self._follow)

    @staticmethod
    def _core(recorder: Recorder) -> tuple[EngineCore, FakeExecutor]:
        config = EngineConfig(
            policies=[FullAttention(), SlidingWindow(window=8)],
            num_blocks=64,
            block_size=BS,
            max_model_len=128,
            vocab_size=64,
        )
        return EngineCore(config, kv_events=recorder), FakeExecutor.for_config(config)

    def _follow(self, index: ReplicaIndex, report: ReplicaReport) -> RecordedFeed:
        assert report.endpoint is not None
        feed = RecordedFeed(index, self.recorders[report.endpoint])
        self.feeds[report.endpoint] = feed
        return feed

    def report(self, name: str, **fields: int | str | None) -> ReplicaReport:
        values: dict[str, int | str | None] = {"block_size": BS, "endpoint": name}
        return ReplicaReport(**(values | fields))  # type: ignore[arg-type]

    def serve(self, name: str, prompt: list[int]) -> None:
        """Run one prompt to its end on replica ``name``."""
        core, fake = self.cores[name]
        request_id = f"{name}-{core.stats().num_finished}"
        core.add_request(
            prompt, SamplingParams(max_tokens=2), CollectingSink(), request_id=request_id
        )
        while core.has_work:
            plan = core.plan()
            if plan.runs:
                core.apply(plan, fake.execute(plan.batch))
            core.flush()


def test_a_report_travels_in_routing_stats() -> None:
    """A report comes back from the stats it writes; stats without one, or with one that
    does not parse, give None (the router then ranks that replica by load alone)."""
    report = ReplicaReport(
        block_size=16, endpoint="tcp://10.0.0.2:5557", num_running=3, free_tokens=640
    )
    assert ReplicaReport.from_stats(report.to_stats()) == report
    assert ReplicaReport.from_stats(None) is None
    assert ReplicaReport.from_stats({"hybridkv": {"block_size": 0}}) is None
    assert ReplicaReport.from_stats({"hybridkv": {"block_size": 16, "port": 1}}) is None


def test_the_replica_whose_events_show_the_prefix_ranks_first() -> None:
    """A prompt sharing a prefix that one replica's events show goes there first."""
    replicas = Replicas("a", "b")
    replicas.serve("b", [*PREFIX, 50])
    table = replicas.table
    table.update({"a": replicas.report("a"), "b": replicas.report("b")})
    assert table.followed == {"a", "b"}
    assert table.rank(["a", "b"], [*PREFIX, 60]) == ["b", "a"]
    assert table.resumable([*PREFIX, 60]) == {"a": 0, "b": len(PREFIX)}


def test_replicas_without_events_are_ranked_by_load() -> None:
    """Without a report, or with one naming no events, a replica is ranked by its queue
    (and one without a report counts as idle)."""
    replicas = Replicas("a", "b", "c")
    replicas.serve("b", [*PREFIX, 50])
    table = replicas.table
    table.update(
        {
            "a": replicas.report("a", endpoint=None, num_waiting=2),
            "b": replicas.report("b", endpoint=None, num_running=1),
            "c": None,
        }
    )
    assert table.followed == frozenset()
    assert table.rank(["a", "b", "c"], [*PREFIX, 60]) == ["c", "b", "a"]


def test_a_replica_whose_free_pages_cannot_hold_the_prompt_ranks_after() -> None:
    """A replica's reported free pages reach the router: one too full for the prompt
    ranks after an idle one, though the names would put it first."""
    replicas = Replicas("a", "b")
    table = replicas.table
    table.update({"a": replicas.report("a", free_tokens=4), "b": replicas.report("b")})
    assert table.loads()["a"].free_tokens == 4
    assert table.rank(["a", "b"], [*PREFIX, 60]) == ["b", "a"]


def test_requests_in_flight_count_until_they_complete() -> None:
    """Requests this router sent to a replica count against it until they end, even
    before its report says so."""
    replicas = Replicas("a", "b")
    table = replicas.table
    table.update({"a": replicas.report("a"), "b": replicas.report("b")})
    table.routed("a", "r1", None)
    assert table.rank(["a", "b"], None) == ["b", "a"]
    table.completed("a", "r1")
    assert table.rank(["a", "b"], None) == ["a", "b"]


def test_a_prompt_sent_is_remembered_before_its_events() -> None:
    """A prefix just sent to a replica draws the next prompt sharing it there, before that
    replica has published anything."""
    replicas = Replicas("a", "b")
    table = replicas.table
    table.update({"a": replicas.report("a"), "b": replicas.report("b")})
    table.routed("b", "r1", [*PREFIX, 50])
    table.completed("b", "r1")
    assert table.rank(["a", "b"], [*PREFIX, 60]) == ["b", "a"]
    assert table.rank(["a", "b"], [*PREFIX, 60], extra_keys=("tenant",)) == ["a", "b"]


def test_a_replica_that_left_is_forgotten() -> None:
    """A replica missing from an update, or whose actor died, is no longer followed: its
    feed is handed back to be closed, and it ranks last as unknown."""
    replicas = Replicas("a", "b")
    table = replicas.table
    table.update({"a": replicas.report("a"), "b": replicas.report("b")})
    assert table.update({"a": replicas.report("a")}) == [replicas.feeds["b"]]
    assert table.followed == {"a"}
    assert table.rank(["b", "a"], [*PREFIX, 60]) == ["a", "b"]
    assert table.forget("a") == [replicas.feeds["a"]]
    assert table.names == frozenset()


def test_a_replica_that_moved_its_events_is_followed_anew() -> None:
    """A report naming other sockets (a restarted engine) replaces the replica's feed."""
    replicas = Replicas("a", "b")
    table = replicas.table
    table.update({"a": replicas.report("a")})
    old = replicas.feeds["a"]
    assert table.update({"a": replicas.report("a", endpoint="b")}) == [old]
    assert table.followed == {"a"}


def test_a_replica_of_another_layout_is_ranked_by_load_alone() -> None:
    """Block hashes compare only at one block size: a replica reporting another is not
    followed, and one warning names it."""
    replicas = Replicas("a", "b")
    replicas.serve("b", [*PREFIX, 50])
    table = replicas.table
    with capture_logs() as logs:
        for _ in range(2):
            table.update({"a": replicas.report("a"), "b": replicas.report("b", block_size=8)})
    assert table.followed == {"a"}
    assert [log["replica"] for log in logs if log["event"] == "ray_replica_layout_differs"] == ["b"]
    assert table.rank(["b", "a"], [*PREFIX, 60]) == ["a", "b"]


@pytest.mark.parametrize("token_ids", [None, []])
def test_a_request_without_a_prompt_is_ranked_by_load(token_ids: list[int] | None) -> None:
    """No prompt, no hit: the least loaded replica first."""
    replicas = Replicas("a", "b")
    replicas.serve("a", [*PREFIX, 50])
    table = replicas.table
    table.update({"a": replicas.report("a", num_waiting=1), "b": replicas.report("b")})
    assert table.rank(["a", "b"], token_ids) == ["b", "a"]
