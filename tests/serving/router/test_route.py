"""The data-parallel front end over live replicas in this process: forwarding, routing by
what each replica's KV events say it holds, and replicas that fail."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from hybridkv.parallel.kv_events import KVEventPublisher
from hybridkv.parallel.kv_events_config import KVEventsConfig
from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import FakeExecutor
from hybridkv.serving.http.headers import FREE_TOKENS_HEADER
from hybridkv.serving.http.uvicorn_server import bound_port, open_socket, serve_http
from hybridkv.serving.openai.chat_template import ChatTemplate
from hybridkv.serving.openai.prompts import Prompter
from hybridkv.serving.router.front_end import REPLICA_HEADER, Forwarder, build_route_app
from hybridkv.serving.router.replicas import Replica, ReplicaSet
from hybridkv.testing import LiveServer, default_config, live_server, word_tokenizer

MODEL = "fake-model"
WAIT_S = 60.0  # a bound on waits for events on a busy machine, never a pause


def words(start: int, count: int) -> str:
    return " ".join(f"w{3 + (start + i) % 58}" for i in range(count))


class Cluster:
    """Replicas (live servers publishing KV events) and front ends over them, all in one
    portal's loop."""

    def __init__(self, portal: BlockingPortal, stack: contextlib.ExitStack) -> None:
        self.portal = portal
        self.stack = stack
        self.servers: list[LiveServer] = []
        self.publishers: list[KVEventPublisher] = []
        self._stops: dict[int, contextlib.ExitStack] = {}

    def replica(
        self, wrap_app: Callable[[Any], Any] | None = None, offload: Any = None
    ) -> LiveServer:
        stops = self.stack.enter_context(contextlib.ExitStack())
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
        )
        publisher = stops.enter_context(KVEventPublisher(config))
        engine_config = default_config(policies=[FullAttention(), SlidingWindow(window=16)])
        server = stops.enter_context(
            live_server(
                engine_config,
                FakeExecutor.for_config(engine_config),
                tokenizer=word_tokenizer(),
                model=MODEL,
                portal=self.portal,
                kv_events=publisher,
                wrap_app=wrap_app,
                offload=offload,
            )
        )
        self._stops[len(self.servers)] = stops
        self.servers.append(server)
        self.publishers.append(publisher)
        return server

    def stop(self, index: int) -> None:
        """Stop replica ``index``'s server (its port then refuses connections)."""
        self._stops[index].close()

    def front_end(self, policy: str = "prefix") -> tuple[str, ReplicaSet]:
        replicas = [Replica(str(i), s.url) for i, s in enumerate(self.servers)]
        future, (url, routed, server) = self.portal.start_task(_front_end, replicas, policy)

        def stop() -> None:
            self.portal.call(setattr, server, "should_exit", True)
            future.result(timeout=WAIT_S)

        self.stack.callback(stop)
        return url, routed

    def published(self, index: int) -> int:
        """The last batch replica ``index`` published, every queued one sent."""
        publisher = self.publishers[index]
        publisher.drain()
        return publisher.num_published - 1


async def _front_end(
    replicas: list[Replica],
    policy: str,
    *,
    task_status: anyio.abc.TaskStatus[tuple[str, ReplicaSet, Any]],
) -> None:
    prompter = Prompter(
        word_tokenizer(),
        ChatTemplate.plain(),
        max_model_len=256,
        limiter=anyio.CapacityLimiter(2),
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
        routed = ReplicaSet(replicas, client, policy)
        try:
            for replica in replicas:
                await routed.probe(replica)
            app = build_route_app(Forwarder(routed, prompter))
            sock = open_socket("127.0.0.1", 0)
            port = bound_port(sock)
            async with anyio.create_task_group() as tg:
                server = await tg.start(serve_http, app, sock)
                task_status.started((f"http://127.0.0.1:{port}", routed, server))
        finally:
            await routed.aclose()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        yield Cluster(portal, stack)


def complete(url: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0} | extra
    return httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S)


def test_answers_are_the_replicas_and_say_which_one(cluster: Cluster) -> None:
    one = cluster.replica()
    cluster.replica()
    url, _ = cluster.front_end()
    direct = complete(one.url, words(0, 9)).json()
    routed = complete(url, words(0, 9))
    assert routed.status_code == 200
    assert routed.headers[REPLICA_HEADER] in {"0", "1"}
    assert routed.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    # The official client streams through the front end as from a replica.
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=MODEL, prompt=words(0, 9), max_tokens=4, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == direct["choices"][0]["text"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_prompt_goes_where_the_events_say_its_prefix_is(cluster: Cluster) -> None:
    """Each replica served one long prompt before the front end started; a new front
    end learns it from their events (a replayed snapshot) and sends each prompt's
    follow-up there, though a load-only policy would send both to replica 0."""
    cluster.replica()
    cluster.replica()
    prompts = [words(0, 40), words(20, 40)]
    for server, prompt in zip(cluster.servers, prompts, strict=True):
        assert complete(server.url, prompt).status_code == 200
    url, routed = cluster.front_end()
    for i, replica in enumerate(routed.replicas.values()):
        assert replica.feed is not None
        assert replica.feed.wait_until_received(cluster.published(i), WAIT_S)
    for i, prompt in enumerate(prompts):
        answer = complete(url, f"{prompt} w60 w61")
        assert answer.headers[REPLICA_HEADER] == str(i)
    # The chat endpoint is tokenized through the template too.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompts[1]}]}
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat | {"max_tokens": 2})
    assert answer.status_code == 200


def test_the_front_end_weighs_each_replicas_free_pages_from_its_load(
    cluster: Cluster,
) -> None:
    """A poll of every replica's /load gives the router the prompt its free pages hold;
    /health and /metrics show it, and a replica that cannot be read is forgotten."""
    for _ in range(2):
        cluster.replica()
    url, routed = cluster.front_end()
    replicas = list(routed.replicas.values())
    for replica in replicas:
        cluster.portal.call(routed.poll_load, replica)
    for server, replica in zip(cluster.servers, replicas, strict=True):
        load = httpx.get(f"{server.url}/load", timeout=WAIT_S).json()
        assert replica.free_tokens == load["free_tokens"] > 0
    health = httpx.get(f"{url}/health").json()["replicas"]
    assert health["1"]["free_tokens"] == replicas[1].free_tokens
    metrics = httpx.get(f"{url}/metrics").text
    assert f'hybridkv_router_replica_free_tokens{{replica="0"}} {replicas[0].free_tokens}' in (
        metrics
    )
    # Replica 0 has no room for a prompt that replica 1 has room for: it goes to 1,
    # though ties of load and hit would send it to 0.
    replicas[0].free_tokens = 0
    assert complete(url, words(0, 12)).headers[REPLICA_HEADER] == "1"
    cluster.stop(0)
    cluster.portal.call(routed.poll_load, replicas[0])
    assert replicas[0].free_tokens is None


def test_an_answer_tells_the_front_end_its_replicas_load(cluster: Cluster) -> None:
    """Each generation's answer carries its replica's free tokens in a header: the front
    end takes them from there (so that a replica it hears from needs no poll) and does
    not pass the header on."""
    for _ in range(2):
        cluster.replica()
    url, routed = cluster.front_end()
    direct = complete(cluster.servers[0].url, words(0, 12))
    assert int(direct.headers[FREE_TOKENS_HEADER]) > 0
    for stream in (False, True):
        answer = complete(url, words(20, 12), stream=stream)
        assert answer.status_code == 200 and FREE_TOKENS_HEADER not in answer.headers
        heard = routed.replicas[answer.headers[REPLICA_HEADER]]
        assert heard.load_heard_at > -math.inf and heard.free_tokens is not None
        assert heard.free_tokens > 0
    never_polled = [r for r in routed.replicas.values() if r.load_heard_at == -math.inf]
    assert all(r.free_tokens is None for r in never_polled)


def test_replicas_sharing_a_redis_server_are_credited_with_each_others_blocks(
    cluster: Cluster, redis_server: Any
) -> None:
    """Two replicas save to one real redis-server, a third to its own host memory. Each
    names its Redis store at /kv_events; once replica 0's saves are published, the
    router credits replica 1, which never saw the prompt, with loading them."""
    from hybridkv.memory.offload import HostTier, OffloadConfig, RedisTier

    for tier in (RedisTier(redis_server.url), RedisTier(redis_server.url), HostTier(1 << 20)):
        cluster.replica(offload=OffloadConfig(tiers=[tier], save_interval=4))
    prompt = words(0, 40)
    assert complete(cluster.servers[0].url, prompt).status_code == 200
    transfers = cluster.servers[0].executor.transfers
    assert transfers is not None and transfers.wait_saved(WAIT_S)
    # The saver thread's stores go out with the next step's events.
    assert complete(cluster.servers[0].url, "w5").status_code == 200
    infos = [httpx.get(f"{s.url}/kv_events", timeout=WAIT_S).json() for s in cluster.servers]
    stores = [info["shared_tiers"] for info in infos]
    assert stores[0] == stores[1] and set(stores[0]) == {"REDIS"}
    assert stores[2] == {}
    url, routed = cluster.front_end()
    feed = routed.replicas["0"].feed
    assert feed is not None and feed.wait_until_received(cluster.published(0), WAIT_S)
    ids = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    ids = ids["tokens"]
    routed.order(ids)  # applies what the feeds received
    router = routed.prefix_router
    assert router is not None
    discount = router.weights.tier_discount
    assert router.saved_tokens("1", ids) >= discount * 32
    assert router.saved_tokens("2", ids) == 0


def test_a_stopped_replica_leaves_the_rotation_and_its_requests_retry(
    cluster: Cluster,
) -> None:
    cluster.replica()
    cluster.replica()
    url, _ = cluster.front_end(policy="round-robin")
    cluster.stop(0)
    for start in range(4):  # round-robin would send two of these to replica 0
        answer = complete(url, words(start, 6))
        assert answer.status_code == 200
        assert answer.headers[REPLICA_HEADER] == "1"
    health = httpx.get(f"{url}/health").json()["replicas"]
    assert health["0"]["healthy"] is False
    assert "cannot connect" in health["0"]["reason"]
    assert health["1"]["healthy"] is True
    metrics = httpx.get(f"{url}/metrics").text
    assert 'hybridkv_router_replica_healthy{replica="0"} 0.0' in metrics
    assert 'hybridkv_router_failed_tries_total{replica="0"} 1.0' in metrics
    # Replica 1's own metrics, labelled with its name.
    assert 'hybridkv_requests_running{replica="1"}' in metrics
    cluster.stop(1)
    answer = complete(url, words(0, 6))
    assert answer.status_code == 503
    assert "no replica" in answer.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 503


def test_a_replica_that_fails_mid_stream_ends_the_stream_with_an_error_event(
    cluster: Cluster,
) -> None:
    cluster.replica(wrap_app=_breaks_after_first_chunk)
    url, routed = cluster.front_end()
    body = {"model": MODEL, "prompt": words(0, 6), "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=WAIT_S) as answer:
        assert answer.status_code == 200
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "replica 0 failed while streaming" in error["message"]
    assert events[-1] == "data: [DONE]"
    # One broken stream alone takes no replica out (a client can break one too): a
    # refused connection or a failed health probe does.
    assert routed.replicas["0"].healthy
    assert routed.replicas["0"].in_flight == 0


def _after_first_chunk(fault: Callable[[], Awaitable[None]]) -> Callable[[Any], Any]:
    """Wraps a replica's app: its streams send their first chunk, then ``fault`` runs
    before each later one."""

    def wrap(app: Any) -> Any:
        async def wrapped(scope: Any, receive: Any, send: Any) -> None:
            sent = 0

            async def counting(message: Any) -> None:
                nonlocal sent
                if message["type"] == "http.response.body" and message.get("more_body"):
                    sent += 1
                    if sent > 1:
                        await fault()
                await send(message)

            await app(scope, receive, counting)

        return wrapped

    return wrap


async def _die() -> None:
    raise ConnectionResetError("the replica died")  # the connection drops


_breaks_after_first_chunk = _after_first_chunk(_die)
#: A replica that hangs after its first chunk, as a SIGSTOPped one.
_hangs_after_first_chunk = _after_first_chunk(anyio.sleep_forever)


def test_a_replica_taken_out_of_rotation_releases_its_streams(cluster: Cluster) -> None:
    """When a replica leaves the rotation (a failed probe), a stream it holds ends at
    once with an error event naming why, and the replica holds no request."""
    cluster.replica(wrap_app=_hangs_after_first_chunk)
    url, routed = cluster.front_end()
    body = {"model": MODEL, "prompt": words(0, 6), "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=WAIT_S) as answer:
        lines = (line for line in answer.iter_lines() if line.startswith("data: "))
        assert '"text"' in next(lines)
        replica = routed.replicas["0"]
        cluster.portal.call(routed.mark_down, replica, "/health answered 503")
        events = list(lines)
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "it left the rotation (/health answered 503)" in error["message"]
    assert events[-1] == "data: [DONE]"
    assert replica.in_flight == 0 and not replica.forwards


async def _loop_module() -> str:
    import asyncio

    return type(asyncio.get_running_loop()).__module__


def test_the_front_end_runs_on_uvloop_where_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    from hybridkv.serving.cli.route import run_front_end

    assert run_front_end("auto", _loop_module).startswith("uvloop")
    assert run_front_end("uvloop", _loop_module).startswith("uvloop")
    assert run_front_end("asyncio", _loop_module).startswith("asyncio")


def test_the_front_end_runs_on_asyncio_where_uvloop_is_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybridkv.serving.cli import route
    from hybridkv.serving.cli.flags.values import UsageError
    from hybridkv.serving.cli.main import build_parser

    monkeypatch.setattr(route, "_has_uvloop", lambda: False)
    assert route.run_front_end("auto", _loop_module).startswith("asyncio")
    # Asked for by name, it is refused as the flags are read (before any replica starts).
    args = build_parser().parse_args(["route", "m", "--replica", "http://a:1", "--loop", "uvloop"])
    with pytest.raises(UsageError, match="--loop uvloop: uvloop is not installed"):
        route.front_end_settings(args)
