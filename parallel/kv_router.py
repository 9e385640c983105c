"""Choosing a replica for a request: the prefill it saves against the load it joins.

Each replica's :class:`~hybridkv.parallel.kv_index.ReplicaIndex` (fed by its KV events)
says how many of a prompt's tokens it resumes in every group, from its pool or from a
tier. A replica's score is what the request would not recompute there, less the load it
has beyond the least loaded candidate's and a slack, both in tokens::

    allowed = least + max(slack_requests, slack_ratio x least)
    score   = max(pool hit, tier_discount x tier hit, provisional hit)
              - tokens_per_request x max(0, waiting + running - allowed)

and the best score wins; among equals, the replica the router has sent the fewest
prompt tokens to compute (the tokens of each prompt it sent there that were not
credited as saved), then the less loaded, then the name. Within the slack, load does not
count: a session's next turn and a second sighting of a shared system prompt go where
their prefix is even while every replica is busy (``benchmarks/routing.py`` measured
that with one request costing a whole prompt, shared prompts spread over all replicas
and no replica could keep any of them). A tier's hit counts less: its blocks must be
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

from hybridkv.parallel.kv_index import ReplicaIndex


@attrs.frozen(kw_only=True)
class ReplicaLoad:
    """What a replica reports of its load (its engine's stats, its ``/metrics``)."""

    num_waiting: int = 0
    num_running: int = 0


@attrs.frozen(kw_only=True)
class RouterWeights:
    """How the router trades a hit against load.

    The defaults are ``benchmarks/routing.py``'s measurement (docs/benchmarks.md,
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
        # Prompt tokens sent to each replica and not credited as saved there.
        self._computed: dict[str, float] = dict.fromkeys(indexes, 0.0)

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
        hashes = self._hashes(token_ids, extra_keys)
        least = min((_queued(loads, name) for name in candidates), default=0)
        weights = self.weights
        allowed = least + max(weights.slack_requests, weights.slack_ratio * least)
        return sorted(candidates, key=lambda name: self._rank(name, hashes, loads, allowed))

    def sent(
        self, name: str, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> None:
        """Remember prompt ``token_ids`` at ``name`` (its provisional blocks). It takes
        the prompt, not the last one ranked: requests ranked meanwhile may have gone
        elsewhere."""
        hashes = self._hashes(token_ids, extra_keys)
        self._computed[name] += max(0.0, len(token_ids) - self._saved(name, hashes))
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
        hashes: list[int],
        loads: Mapping[str, ReplicaLoad],
        allowed: float,
    ) -> tuple[float, float, int, str]:
        queued = _queued(loads, name)
        excess = max(0.0, queued - allowed)
        score = self._saved(name, hashes) - self.weights.tokens_per_request * excess
        return (-score, self._computed[name], queued, name)

    def _saved(self, name: str, hashes: list[int]) -> float:
        index = self.indexes[name]
        full_only = self.full_attention_only
        pool = index.resumable_blocks(hashes, full_attention_only=full_only)
        tier = max(
            index.resumable_blocks(hashes, medium, full_attention_only=full_only)
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


def _queued(loads: Mapping[str, ReplicaLoad], name: str) -> int:
    load = loads.get(name, ReplicaLoad())
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
            load = loads.get(name, ReplicaLoad())
            return (load.num_waiting, load.num_running, name)

        return sorted(candidates, key=queued)

    def sent(
        self, name: str, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> None:
        pass


__all__ = ["LeastLoaded", "PrefixRouter", "ReplicaLoad", "RoundRobin", "Router", "RouterWeights"]
