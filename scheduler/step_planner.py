"""Planning one step: which requests run, how many tokens each, who is preempted.

``plan_step`` is synchronous and touches only what it is given (the running list, the
waiting queue, the KV cache manager): no clock, no I/O, no event loop, so it is tested
on its own. Order of business::

    1. running requests, most urgent first: each gets its next chunk (1 token to decode,
       up to ``prefill_chunk`` of a prompt) within the step's token budget; when the pool
       cannot supply it, the least urgent running request (largest priority, latest
       arrival) is preempted, repeatedly; a request that is itself the least urgent
       halves its prefill chunk before it preempts itself. A prefill chunk is first
       shortened (not below ``min_prefill_chunk``) where a shorter one spares a kept
       prefix its pages (``KVCacheManager.spare_chunk``: pools with sliding-window
       groups). Requests of a step still in flight (``in_step``) are neither planned
       nor preempted: their step has not been applied, and their blocks are in use;
    2. only if nobody was preempted: waiting requests, most urgent first, while the
       budget, ``max_num_seqs`` and the pool allow. Admission looks up the prefix cache
       and allocates every group at once; the first refusal ends admission (no
       overtaking, so a large request is not starved by small ones). Into an empty pool
       the first chunk is halved until it fits: a window group holds all of a chunk's
       pages until the next step, so a whole-prompt chunk can need more than the pool.
       The one exception to "no overtaking": a copy whose parent already runs
       ``max_copies_running`` copies (``SamplingParams.parent_id``) is passed over,
       keeping its place, so that one request's ``n`` choices never hold every slot;
    3. with speculative decoding: decodes of step 1, most urgent first, add the tokens
       the speculator proposes (``scheduler/speculator.py``), with the budget and pages
       left over, and only in a step that preempted nobody: a proposal never preempts or
       delays anyone, and one that does not fit is dropped.

The running list stays sorted by urgency, so the preemption victim is its last entry
that is in no step: never a request already planned in this step or in flight.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import attrs

from hybridkv.memory.manager import KVCacheManager, PrefixHit
from hybridkv.scheduler.batch import StepBatch, StepRequest
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.queue import WaitingQueue
from hybridkv.scheduler.request import Request, RequestStatus
from hybridkv.scheduler.speculator import Speculator


@attrs.frozen(kw_only=True)
class StepPlan:
    """One planned step.

    Attributes:
        batch: What the executor runs; ``batch.requests[i]`` belongs to ``scheduled[i]``.
        scheduled: The requests of the step, in batch order.
        admitted: Those of ``scheduled`` that were waiting before this step.
        preempted: Requests that lost their pages in this step (now waiting).
        rejected: Waiting requests that cannot run even in an empty pool (still queued:
            the caller fails them). Admission checks make this a safety net.
        num_tokens: Tokens the step runs, over all requests.
        loading: Waiting requests admitted to load their prefix from an offload tier
            (running, ``in_step`` until the load is reported; in no batch).
        planned_at: The engine's clock when it was planned (speculative decoding times
            steps by it).
    """

    batch: StepBatch
    scheduled: Sequence[Request]
    admitted: Sequence[Request]
    preempted: Sequence[Request]
    rejected: Sequence[Request]
    num_tokens: int
    loading: Sequence[Request] = ()
    planned_at: float = 0.0

    @property
    def runs(self) -> bool:
        """Whether the executor runs it: requests, or a connector's transfers alone."""
        return bool(self.scheduled) or self.batch.transfers is not None


#: Admits a waiting request to load what an offload tier adds to its prefix hit; True if
#: it did (pages allocated), False to admit it as usual, None to keep it waiting this step
#: (a remote tier's answer is on its way; see ``scheduler/connector.py``).
Loader = Callable[[Request, PrefixHit], bool | None]


def plan_step(
    running: list[Request],
    waiting: WaitingQueue,
    kv: KVCacheManager,
    config: EngineConfig,
    max_requests: int | None = None,
    loader: Loader | None = None,
    speculator: Speculator | None = None,
) -> StepPlan:
    """Plan the next step, allocating its pages; updates ``running`` and ``waiting``.

    ``running`` must be sorted by urgency (priority, then arrival) and stays so. Every
    planned request is marked ``in_step``; the caller applies the step's results (or its
    failure) afterwards. ``max_requests`` caps the requests of the step (None: only the
    budget and ``max_num_seqs`` do), so that several steps in flight share the requests.
    """
    cap = len(running) + len(waiting) if max_requests is None else max_requests
    budget = config.max_num_batched_tokens
    chunk, floor = config.prefill_chunk, config.min_prefill_chunk
    scheduled: list[Request] = []
    items: list[StepRequest] = []
    preempted: list[Request] = []
    decodes: list[int] = []  # items that decode an output token: they may speculate
    allocate = kv.allocate

    i = 0
    while i < len(running) and budget > 0 and len(items) < cap:
        request = running[i]
        if request.in_step:  # its step is still in flight
            i += 1
            continue
        num_new = min(len(request.all_token_ids) - request.num_computed_tokens, budget, chunk)
        if num_new > floor:
            num_new = kv.spare_chunk(request, num_new, at_least=floor)
        while allocate(request, num_new) is None:
            victim = _victim(running, i)
            if victim != i:
                _preempt(running.pop(victim), kv, waiting, preempted)
            elif num_new > 1:
                # The least urgent one left: a smaller prefill chunk beats preempting itself.
                num_new //= 2
            else:
                _preempt(running.pop(i), kv, waiting, preempted)
                break
        else:
            if num_new == len(request.all_token_ids) - request.num_computed_tokens == 1:
                decodes.append(len(items))  # a decode (or a prompt's last token)
            items.append(_step_item(request, num_new, kv))
            scheduled.append(request)
            budget -= num_new
            i += 1

    admitted: list[Request] = []
    rejected: list[Request] = []
    loading: list[Request] = []
    if not preempted:
        budget = _admit(
            running, waiting, kv, config, budget, (admitted, rejected, loading), items, cap, loader
        )
        scheduled.extend(admitted)
    # A step that preempted has no pages to spare for proposals.
    if speculator and decodes and budget > 0 and not preempted and speculator.allows(len(running)):
        budget = _speculate(decodes, items, scheduled, kv, speculator, budget)
    return StepPlan(
        batch=StepBatch(tuple(items)),
        scheduled=scheduled,
        admitted=admitted,
        preempted=preempted,
        rejected=rejected,
        num_tokens=config.max_num_batched_tokens - budget,
        loading=loading,
    )


def share_of_ready(running: list[Request], waiting: WaitingQueue, free_steps: int) -> int | None:
    """The most requests one step should take while ``free_steps`` more may be in flight.

    Without a cap one step would take every ready request and the next find none (a request
    is in at most one step in flight): a pipeline's stages would not overlap. None when
    only one step is free.
    """
    if free_steps <= 1:
        return None
    ready = sum(1 for r in running if not r.in_step) + len(waiting)
    return max(1, -(-ready // free_steps))


def _admit(
    running: list[Request],
    waiting: WaitingQueue,
    kv: KVCacheManager,
    config: EngineConfig,
    budget: int,
    outcomes: tuple[list[Request], list[Request], list[Request]],
    items: list[StepRequest],
    cap: int,
    loader: Loader | None,
) -> int:
    """Move waiting requests into ``running`` while they fit; returns the budget left.

    ``outcomes``: the admitted, rejected and loading lists to fill.
    """
    admitted, rejected, loading = outcomes
    chunk = config.prefill_chunk
    num_groups = kv.num_groups
    num_running = len(running)
    copies = _Copies(running, config.max_copies_running)
    while budget > 0 and num_running < config.max_num_seqs and len(items) < cap:
        # A first allocation always takes a fresh page per group (the one after the hit):
        # without that many free pages, skip hashing the prompt for a lookup.
        if kv.num_free_blocks < num_groups:
            break
        request = waiting.peek()
        if request is None:
            break
        if copies.is_full(request):
            copies.hold(waiting.pop())  # its parent has its share: the next one may go
            continue
        # Prompt logprobs need every prompt position computed: no prefix hit (as vLLM).
        computes_all = request.params.prompt_logprobs is not None
        hit = PrefixHit(0, (), []) if computes_all else kv.lookup(request)
        decision = False if loader is None or computes_all else loader(request, hit)
        if decision is None:
            copies.hold(waiting.pop())  # its tiers answer off the loop: it keeps its place
            continue
        if decision:
            waiting.pop()  # it runs once its load is reported (EngineCore)
            request.status = RequestStatus.RUNNING
            request.is_preempted = False
            loading.append(request)
            copies.admitted(request)
            num_running += 1
            continue
        num_new = _first_chunk(
            request, hit, min(budget, chunk), kv, config, is_alone=not num_running
        )
        if num_new is None:
            if not num_running:  # the whole pool could not take one token: never will
                rejected.append(request)
            break  # else wait for running requests to free pages
        waiting.pop()
        if not request.num_preemptions:
            request.num_cached_tokens = hit.num_tokens
        request.num_computed_tokens = hit.num_tokens
        request.status = RequestStatus.RUNNING
        request.is_preempted = False
        items.append(_step_item(request, num_new, kv))
        admitted.append(request)
        copies.admitted(request)
        budget -= num_new
        num_running += 1
    for request in copies.held:
        waiting.push(request)  # with its own key: its place in the queue is kept
    for request in (*admitted, *loading):
        bisect.insort(running, request, key=_urgency)
    return budget


class _Copies:
    """Running copies per parent (``SamplingParams.parent_id``), counted on first need,
    and the waiting copies passed over because their parent has its share."""

    def __init__(self, running: list[Request], limit: int) -> None:
        self._running = running
        self._limit = limit
        self._counts: dict[str, int] | None = None
        self.held: list[Request] = []

    def is_full(self, request: Request) -> bool:
        parent = request.params.parent_id
        if parent is None:
            return False
        if self._counts is None:
            self._counts = {}
            for other in self._running:
                key = other.params.parent_id
                if key is not None:
                    self._counts[key] = self._counts.get(key, 0) + 1
        return self._counts.get(parent, 0) >= self._limit

    def hold(self, request: Request) -> None:
        self.held.append(request)

    def admitted(self, request: Request) -> None:
        parent = request.params.parent_id
        if parent is not None and self._counts is not None:
            self._counts[parent] = self._counts.get(parent, 0) + 1


def _first_chunk(
    request: Request,
    hit: PrefixHit,
    limit: int,
    kv: KVCacheManager,
    config: EngineConfig,
    *,
    is_alone: bool,
) -> int | None:
    """Allocate a newcomer's first chunk (at most ``limit`` tokens); its size, or None."""
    num_new = min(len(request.all_token_ids) - hit.num_tokens, limit)
    if num_new > config.min_prefill_chunk:
        num_new = kv.spare_chunk(request, num_new, hit, at_least=config.min_prefill_chunk)
    while kv.allocate(request, num_new, hit) is None:
        if not is_alone or num_new == 1:
            return None
        # Nothing runs, so the whole pool is there: a smaller first chunk must fit (a
        # window group holds a whole chunk's pages until the next step releases them).
        num_new //= 2
    return num_new


def _step_item(request: Request, num_new: int, kv: KVCacheManager) -> StepRequest:
    """The batch entry running ``request``'s next ``num_new`` tokens; marks it in step."""
    tokens = request.all_token_ids
    start = request.num_computed_tokens
    end = start + num_new
    request.in_step = True
    item = StepRequest(
        request_id=request.request_id,
        token_ids=tokens[start:end],
        start_position=start,
        block_tables=kv.block_tables(request.request_id),
        sample=end == len(tokens),
        params=request.params,
        output_index=len(tokens) - request.num_prompt_tokens,
        # The live list, not a copy, and only where the sampler reads it.
        all_token_ids=tokens if request.params.needs_processing else (),
        next_token_id=tokens[end] if end < len(tokens) else None,
    )
    if request.prompt_logprobs is None or start + 1 >= request.num_prompt_tokens:
        return item  # the common case: no prompt logprobs due
    targets = tokens[start + 1 : min(end + 1, request.num_prompt_tokens)]
    return attrs.evolve(item, prompt_logprob_token_ids=targets)


def _speculate(
    decodes: list[int],
    items: list[StepRequest],
    scheduled: list[Request],
    kv: KVCacheManager,
    speculator: Speculator,
    budget: int,
) -> int:
    """Add proposed tokens to the decodes at ``decodes`` (indices into ``items``, most
    urgent first) with what the step left; returns the budget left."""
    rows = sum(item.num_tokens for item in items)
    requests = [scheduled[index] for index in decodes]
    drafts = speculator.proposals(requests, rows, len(items), budget)
    for index, request, draft in zip(decodes, requests, drafts, strict=True):
        if draft and kv.reserve_lookahead(request, len(draft)):
            item = items[index]
            items[index] = attrs.evolve(
                item, token_ids=[*item.token_ids, *draft], num_draft_tokens=len(draft)
            )
            budget -= len(draft)
    return budget


def _urgency(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)


def _victim(running: list[Request], first: int) -> int:
    """Index of the least urgent running request in no step, at ``first`` or after it.

    ``running[first]`` itself is in no step (it is being planned), so one always exists.
    """
    i = len(running) - 1
    while running[i].in_step:
        i -= 1
    return i


def _preempt(
    request: Request, kv: KVCacheManager, waiting: WaitingQueue, preempted: list[Request]
) -> None:
    """Free a running request's blocks and queue it for recomputation from its tokens."""
    # The victim comes after every request planned so far, so its pages were last
    # allocated by a step that has run: their cached blocks hold real K/V and stay cached.
    kv.free(request.request_id)
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    request.is_preempted = True
    request.status = RequestStatus.WAITING
    waiting.push(request)
    preempted.append(request)
