"""Choosing a replica for a request: the prefill it saves against the load it joins.

Each replica's :class:`~hybridkv.serving.router.index.ReplicaIndex` (fed by its KV events)
says how many of a prompt's tokens it resumes in every group, from its pool or from a
tier. A replica's score is what the request would not recompute there, less the load it
has beyond the least loaded candidate's and a slack, both in tokens::

    allowed = least + max(slack_requests, slack_ratio x least)
    excess  = max(0, waiting + running - allowed) + (1 if the prompt's uncomputed
              tokens exceed the replica's free pages' headroom, else 0)
    score   = max(pool hit, tier_discount x tier hit, provisional hit)
              - tokens_per_request x excess

and the best score wins; among equals, the replica the router has sent the fewest
prompt tokens to compute (the tokens of each prompt it sent there that were not
credited as saved), then the less loaded, then the name. Within the slack, load does not
count: a session's next turn and a second sighting of a shared system prompt go where
their prefix is even while every replica is busy (``benchmarks/routing/policies.py`` measured
that with one request costing a whole prompt, shared prompts spread over all replicas
and no replica could keep any of them). A replica whose free pages cannot hold what the
prompt must compute (``memory/headroom.py``; its ``/load``) makes it wait for a running
request to end, which costs as one request more. Replicas sharing a tier (one Redis
server, :meth:`PrefixRouter.share`) are each credited with the blocks any of them stored
there. A tier's hit counts less: its blocks must be
loaded before the step runs. Events lag the routing decision by a step or more, so the
router also remembers, per replica, the block hashes of the prompts it sent there last
(``provisional``, a few prompts' worth): a second sighting of a shared prefix goes where
the first was sent before that replica has published it, and once the memory has moved
on the events decide.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Protocol

import attrs

from hybridkv.serving.router.index import ReplicaIndex


@attrs.frozen(kw_only=True)
class ReplicaLoad:
    """What a replica reports of its load (its engine's stats, its ``/load``).

    Attributes:
        num_waiting: Requests queued.
        num_running: Requests running.
        free_tokens: The longest prompt its free pages hold now
            (:func:`~hybridkv.memory.headroom.token_headroom`); None: not reported.
    """

    num_waiting: int = 0
    num_running: int = 0
    free_tokens: int | None = None


#: A replica that reported nothing.
_IDLE = ReplicaLoad()


@attrs.frozen(kw_only=True)
class RouterWeights:
    """How the router trades a hit against load.

    The defaults are ``benchmarks/routing/policies.py``'s measurement (docs/benchmarks.md,
    "Routing data-parallel replicas"): a longer memory of what was sent made the router
    rank by that memory instead of the events (a full-attention-only router then chose
    alike), and a cheaper request let shared prompts pile onto one replica.

    Attributes:
        tier_discount: Share of a tier hit's tokens counted as saved (it must be loaded).
        tokens_per_request: The prefill, in tokens, one request beyond the slack is
            taken to cost the new one.
        provisional_blocks: Block hashes remembered per replica for the prompts last
            sent there: enough to bridge the events' lag of a step or a few, short
            enough that the events decide after that.
        slack_requests: Requests waiting and running a replica may have beyond the
            least loaded candidate before its load counts against its hit.
        slack_ratio: The same slack as a share of the least loaded candidate's
            requests (the larger of the two applies).
    """

    tier_discount: float = 0.5
    tokens_per_request: float = 512.0
    provisional_blocks: int = 256
    slack_requests: int = 4
    slack_ratio: float = 0.5


class Router(Protocol):
    """What a front end asks of a routing policy: replicas in the order to try them."""

    def rank(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        candidates: Collection[str],
        extra_keys: tuple[Hashable, ...] = (),
    ) -> list[str]:
        """``candidates``, best first, for a prompt of ``token_ids``."""
        ...

    def sent(
        self, name: str, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> None:
        """A request of prompt ``token_ids`` went to ``name`` (the first that took it)."""
        ...


class PrefixRouter:
    """Routes requests over replicas by their indexes (see the module docstring).

    Args:
        indexes: Per replica name, its index (the same block size and hash on all).
        weights: The trade-off.
        full_attention_only: Credit a replica with its full-attention run alone, as
            routers that read only full-attention events do (a baseline to compare with:
            it overstates hits its window and state groups cannot resume).
    """

    def __init__(
        self,
        indexes: Mapping[str, ReplicaIndex],
        weights: RouterWeights | None = None,
        *,
        full_attention_only: bool = False,
    ) -> None:
        if not indexes:
            raise ValueError("a router needs at least one replica")
        sizes = {index.hasher.block_size for index in indexes.values()}
        if len(sizes) > 1:
            raise ValueError(f"replicas differ in block size: {sorted(sizes)}")
        self.indexes = dict(indexes)
        self.weights = weights or RouterWeights()
        self._block_size = sizes.pop()
        self.full_attention_only = full_attention_only
        self._sent: dict[str, OrderedDict[int, None]] = {name: OrderedDict() for name in indexes}
        # Per replica, the store each shared tier of it is (``share``); per replica and
        # medium, the other replicas of the same store.
        self._stores: dict[str, dict[str, str]] = {name: {} for name in indexes}
        self._peers: dict[tuple[str, str], list[str]] = {}
        # Prompt tokens sent to each replica and not credited as saved there.
        self._computed: dict[str, float] = dict.fromkeys(indexes, 0.0)
        # Prompts ranked and not yet sent, for ``sent``: a front end ranks others while
        # one waits for its replica's answer (the oldest forgotten past the bound).
        self._ranked: OrderedDict[int, _Ranked] = OrderedDict()

    def set_index(self, name: str, index: ReplicaIndex) -> None:
        """Follow replica ``name`` (new, or restarted) with ``index``, forgetting what was
        sent to it before."""
        if index.hasher.block_size != self._block_size:
            raise ValueError(
                f"replica {name!r} has block size {index.hasher.block_size}, "
                f"the others {self._block_size}"
            )
        self.indexes[name] = index
        self._sent[name] = OrderedDict()
        self._computed[name] = 0.0
        self._stores[name] = {}
        self._find_peers()

    def share(self, name: str, medium: str, store: str) -> None:
        """Replica ``name``'s ``medium`` tier (``REDIS``) is the store named ``store``
        (``KVConnector.shared_stores``): what any replica of that store published in
        that medium counts for each of them, less the tier discount."""
        if name not in self.indexes:
            raise ValueError(f"no index for replica {name!r}")
        self._stores[name][medium] = store
        self._find_peers()

    def _find_peers(self) -> None:
        self._peers = {
            (name, medium): [
                other
                for other, theirs in self._stores.items()
                if other != name and theirs.get(medium) == store
            ]
            for name, mine in self._stores.items()
            for medium, store in mine.items()
        }

    def choose(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        extra_keys: tuple[Hashable, ...] = (),
    ) -> str:
        """The replica for a prompt of ``token_ids``; it is remembered there."""
        best = self.rank(token_ids, loads, self.indexes, extra_keys)[0]
        self.sent(best, token_ids, extra_keys)
        return best

    def rank(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        candidates: Collection[str],
        extra_keys: tuple[Hashable, ...] = (),
    ) -> list[str]:
        """``candidates`` best first; :meth:`sent` then remembers the prompt where it
        went (a front end tries the next one when the first fails)."""
        unknown = set(candidates) - self.indexes.keys()
        if unknown:
            raise ValueError(f"no index for replicas {sorted(unknown)}")
        ranked = _Ranked(token_ids, extra_keys, self._hashes(token_ids, extra_keys))
        self._ranked[id(token_ids)] = ranked  # it holds token_ids: the id stays theirs
        if len(self._ranked) > _RANKED_KEPT:
            self._ranked.popitem(last=False)
        least = min((_queued(loads, name) for name in candidates), default=0)
        weights = self.weights
        allowed = least + max(weights.slack_requests, weights.slack_ratio * least)
        return sorted(candidates, key=lambda name: self._rank(name, ranked, loads, allowed))

    def sent(
        self, name: str, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> None:
        """Remember prompt ``token_ids`` at ``name`` (its provisional blocks). It takes
        the prompt, not the last one ranked: requests ranked meanwhile may have gone
        elsewhere."""
        last = self._ranked.pop(id(token_ids), None)
        if last is not None and last.of(token_ids, extra_keys):  # what rank found
            hashes = last.hashes
            saved = last.saved.get(name)
        else:
            hashes, saved = self._hashes(token_ids, extra_keys), None
        if saved is None:
            saved = self._saved(name, hashes)
        self._computed[name] += max(0.0, len(token_ids) - saved)
        sent = self._sent[name]
        for block in hashes:
            sent[block] = None
            sent.move_to_end(block)
        while len(sent) > self.weights.provisional_blocks:
            sent.popitem(last=False)

    def saved_tokens(
        self, name: str, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> float:
        """The prefill tokens replica ``name`` would not recompute for this prompt."""
        return self._saved(name, self._hashes(token_ids, extra_keys))

    def _rank(
        self,
        name: str,
        ranked: _Ranked,
        loads: Mapping[str, ReplicaLoad],
        allowed: float,
    ) -> tuple[float, float, int, str]:
        load = loads.get(name, _IDLE)
        queued = load.num_waiting + load.num_running
        saved = ranked.saved[name] = self._saved(name, ranked.hashes)
        excess = max(0.0, queued - allowed)
        if load.free_tokens is not None and ranked.num_tokens - saved > load.free_tokens:
            excess += 1.0
        score = saved - self.weights.tokens_per_request * excess
        return (-score, self._computed[name], queued, name)

    def _saved(self, name: str, hashes: list[int]) -> float:
        index = self.indexes[name]
        full_only = self.full_attention_only
        pool = index.resumable_blocks(hashes, full_attention_only=full_only)
        tier = max(
            index.resumable_blocks(
                hashes,
                medium,
                full_attention_only=full_only,
                peers=[self.indexes[peer] for peer in self._peers.get((name, medium), ())],
            )
            for medium in ("CPU", "REDIS")
        )
        sent = self._sent[name]
        run = 0
        while run < len(hashes) and hashes[run] in sent:
            run += 1
        best = max(float(pool), self.weights.tier_discount * tier, float(run))
        return best * self._block_size

    def _hashes(self, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...]) -> list[int]:
        """The prompt's wire hashes, computed once for every replica (they share a block
        size and hash)."""
        return next(iter(self.indexes.values())).wire_hashes(token_ids, extra_keys)


#: Prompts ranked and not yet sent that a router keeps (a request whose every try failed
#: is never sent, and is forgotten once this many more were ranked).
_RANKED_KEPT = 256


class _Ranked:
    """A prompt :meth:`PrefixRouter.rank` ranked: its hashes and what each replica
    saves, which :meth:`PrefixRouter.sent` reuses when told of the same prompt next
    (hashing a long prompt was half of a route's time, ``benchmarks/routing/policies.py``)."""

    __slots__ = ("extra_keys", "hashes", "num_tokens", "saved", "token_ids")

    def __init__(
        self, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...], hashes: list[int]
    ) -> None:
        self.token_ids = token_ids
        self.num_tokens = len(token_ids)
        self.extra_keys = extra_keys
        self.hashes = hashes
        self.saved: dict[str, float] = {}

    def of(self, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...]) -> bool:
        """Whether this is the prompt ``token_ids`` (the same object, unchanged)."""
        return (
            token_ids is self.token_ids
            and len(token_ids) == self.num_tokens
            and extra_keys == self.extra_keys
        )


def _queued(loads: Mapping[str, ReplicaLoad], name: str) -> int:
    load = loads.get(name, _IDLE)
    return load.num_waiting + load.num_running


class RoundRobin:
    """Each request to the next replica in turn (a baseline; vLLM's external balancers)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        candidates: Collection[str],
        extra_keys: tuple[Hashable, ...] = (),
    ) -> list[str]:
        order = sorted(candidates)
        if not order:
            return order
        start = next(self._turn) % len(order)
        return order[start:] + order[:start]

    def sent(
        self, name: str, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> None:
        pass


class LeastLoaded:
    """The replica with the fewest requests waiting and running (ties: the name), as
    vLLM's data-parallel balancer ranks engines by queue lengths (a baseline)."""

    def rank(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        candidates: Collection[str],
        extra_keys: tuple[Hashable, ...] = (),
    ) -> list[str]:
        def queued(name: str) -> tuple[int, int, str]:
            load = loads.get(name, _IDLE)
            return (load.num_waiting, load.num_running, name)

        return sorted(candidates, key=queued)

    def sent(
        self, name: str, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> None:
        pass


__all__ = ["LeastLoaded", "PrefixRouter", "ReplicaLoad", "RoundRobin", "Router", "RouterWeights"]
