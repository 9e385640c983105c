"""What the prefix cache keeps under pressure: the prefixes requests resume from."""

from __future__ import annotations

from typing import Any

import attrs

from hybridkv.memory import KVCacheManager
from hybridkv.policies import FullAttention, SlidingWindow

FULL = FullAttention()


@attrs.define
class Req:
    """What the manager reads of a request."""

    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[Any, ...] = ()


def serve(mgr: KVCacheManager, request_id: str, tokens: list[int], reply: list[int]) -> int:
    """Run one request to its end (prompt, then one token a step); returns its hit."""
    req = Req(request_id, list(tokens))
    hit = mgr.lookup(req)
    assert mgr.allocate(req, len(tokens) - hit.num_tokens, hit) is not None
    for token in reply:
        req.all_token_ids.append(token)
        assert mgr.allocate(req, 1) is not None
    mgr.free(request_id)
    mgr.check_integrity()
    return hit.num_tokens


def fill(mgr: KVCacheManager, num_blocks: int) -> None:
    """Allocate ``num_blocks`` fresh pages in every group to an unrelated request."""
    req = Req("filler", [7] * (num_blocks * mgr.block_size))
    assert mgr.allocate(req, len(req.all_token_ids)) is not None


def test_sessions_served_in_turn_resume_their_whole_conversation() -> None:
    """Two chats take turns in a tight pool: every later turn hits its whole history
    (blocks a window dropped went first; before, a session's window blocks outlived the
    next session's prefix and its next turn missed)."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=9)], num_blocks=26, block_size=4)
    chats = {"a": list(range(100, 124)), "b": list(range(200, 224))}
    hits = []
    for turn in range(3):
        for name, history in chats.items():
            reply = [300 + 10 * turn + k for k in range(6)]
            hits.append(serve(mgr, f"{name}{turn}", history, reply[:-1]))
            chats[name] = [*history, *reply, 400 + turn]
    assert hits == [0, 0, 28, 28, 36, 36]


def test_blocks_a_window_dropped_are_reused_before_a_kept_prefix() -> None:
    """Pages no resumable prefix needs are taken first; the kept prefix still hits."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=30, block_size=4)
    serve(mgr, "a", list(range(24)), [])
    kept = [p for p in range(1, 30) if mgr.pool.is_kept(p)]
    # full: blocks 0..5; window: block 5 alone, as a hit after 6 blocks reads [20, 24)
    assert len(kept) == 7
    fill(mgr, (mgr.num_free_blocks - len(kept)) // 2)
    assert all(mgr.pool.is_free(p) for p in kept)
    assert mgr.lookup(Req("b", [*range(24), 9])).num_tokens == 24


def test_a_full_attention_prefix_shrinks_one_block_at_a_time() -> None:
    """Evicting from a full-attention prefix leaves a hit one block shorter."""
    mgr = KVCacheManager([FULL], num_blocks=6, block_size=4)
    serve(mgr, "a", list(range(16)), [50])  # blocks 0..3 cached, block 4 holds 1 token
    fill(mgr, 2)  # the unhashed page, then block 3 of the kept prefix
    assert mgr.lookup(Req("b", [*range(16), 9])).num_tokens == 12


def test_a_window_prefix_gives_up_every_group_together() -> None:
    """Losing one page of a hybrid prefix frees all its pages before another prefix's
    (neither was resumed yet: the newer one, b, goes first)."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=19, block_size=4)
    serve(mgr, "a", list(range(16)), [])
    serve(mgr, "b", list(range(100, 116)), [])
    cold = mgr.num_free_blocks - sum(map(mgr.pool.is_kept, range(1, 19)))
    fill(mgr, cold // 2 + 1)  # one kept page more than the cold ones: b goes, wholly
    assert mgr.lookup(Req("b2", [*range(100, 116), 9])).num_tokens == 0
    assert mgr.lookup(Req("a2", [*range(16), 9])).num_tokens == 16
    assert sum(map(mgr.pool.is_kept, range(1, 19))) == 5  # a: 4 full + 1 window block


def test_a_continued_prefix_is_no_longer_kept_for_itself() -> None:
    """The request resuming a prefix gives it up: the window blocks it drops turn cold."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=40, block_size=4)
    serve(mgr, "a", list(range(16)), [])
    window_pages = [p for p in range(1, 40) if mgr.pool.is_kept(p)][4:]
    req = Req("a2", [*range(16), *range(50, 58)])
    hit = mgr.lookup(req)
    mgr.allocate(req, 8, hit)
    mgr.allocate(req, 0)  # the release scan of the next step: blocks 2 and 3 are dead
    assert hit.num_tokens == 16
    assert not any(mgr.pool.is_kept(p) for p in window_pages)
    mgr.check_integrity()


def test_a_shared_prefix_is_kept_across_the_requests_that_branch_off_it() -> None:
    """A hit in the middle of a kept path keeps that branch point for the next one."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=60, block_size=4)
    system = list(range(16))
    serve(mgr, "a", [*system, *range(100, 116)], [])
    assert serve(mgr, "b", [*system, *range(200, 216)], []) == 16  # branches off a
    fill(mgr, (mgr.num_free_blocks - sum(map(mgr.pool.is_kept, range(1, 60)))) // 2)
    assert mgr.lookup(Req("c", [*system, *range(300, 316)])).num_tokens == 16


def test_a_hit_cut_short_by_one_group_keeps_no_branch() -> None:
    """Where another group ran out first, the path is not shared up to the hit: not kept."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=40, block_size=4)
    serve(mgr, "a", list(range(24)), [])
    window_block_5 = mgr.lookup(Req("x", [*range(24), 1])).block_tables[1][5]
    mgr.pool.uncache(window_block_5)  # the window can now resume only up to block 5
    num_kept = sum(map(mgr.pool.is_kept, range(1, 40)))
    req = Req("b", [*range(24), 1])
    hit = mgr.lookup(req)
    mgr.allocate(req, 5, hit)
    assert hit.num_tokens == 20
    assert sum(map(mgr.pool.is_kept, range(1, 40))) == num_kept
    mgr.check_integrity()


def test_a_window_dropping_a_block_mid_block_keeps_the_prefix_resumable() -> None:
    """A request ending inside a block can be resumed from that block's start: the window
    block the prefix reads is released only when the next block starts."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=6)], num_blocks=30, block_size=4)
    req = Req("a", list(range(10)))
    mgr.allocate(req, 10)
    req.all_token_ids.append(10)
    mgr.allocate(req, 1)  # position 10 reads [5, 10): block 0 is dead there
    assert mgr.block_tables("a")[1][0] != 0  # but a hit after 2 blocks reads [3, 8)
    mgr.free("a")
    fill(mgr, (mgr.num_free_blocks - 4) // 2)
    assert mgr.lookup(Req("b", [*range(11), 5])).num_tokens == 8


def test_a_conversation_extends_the_prefix_it_resumed() -> None:
    """A full-attention turn that resumes where the last one ended grows that kept prefix
    by its own blocks: one prefix per conversation, its history not counted again."""
    mgr = KVCacheManager([FULL], num_blocks=40, block_size=4)
    serve(mgr, "t1", list(range(16)), [50, 51])
    (first,) = mgr.pool.kept_prefixes()
    serve(mgr, "t2", [*range(16), 50, 51, 52, 53, 54, 55], [56])
    (kept,) = mgr.pool.kept_prefixes()
    assert kept is first and kept.num_blocks == 5


def test_two_requests_resuming_one_end_make_it_a_branch() -> None:
    """Two continuations of the same end share it: it is kept for both, as a branch."""
    mgr = KVCacheManager([FULL], num_blocks=40, block_size=4)
    serve(mgr, "t1", list(range(16)), [])
    reqs = [Req(f"t2{k}", [*range(16), *[k] * 6]) for k in (1, 2)]
    for req in reqs:
        hit = mgr.lookup(req)
        assert mgr.allocate(req, 6, hit) is not None and hit.num_tokens == 16
    for req in reqs:
        mgr.free(req.request_id)
    mgr.check_integrity()
    lengths = sorted((p.num_blocks, p.is_branch) for p in mgr.pool.kept_prefixes())
    assert lengths == [(4, True), (5, False), (5, False)]


def test_sessions_in_a_loop_larger_than_the_pool_keep_some_resumable() -> None:
    """Four chats served in turn through a pool that keeps fewer: every round some hit.
    Least recently used evicted each one just before its turn, and no turn hit at all."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=22, block_size=4)
    chats = {n: list(range(100 * n, 100 * n + 16)) for n in range(4)}
    rounds = []
    for turn in range(4):
        hits = []
        for name, history in chats.items():
            reply = [5000 + 10 * turn + k for k in range(4)]
            hits.append(serve(mgr, f"{name}-{turn}", history, reply[:-1]))
            chats[name] = [*history, *reply]
        rounds.append(hits)
    assert all(any(hits) for hits in rounds[1:]), rounds


def test_a_turn_that_missed_its_evicted_prefix_still_measures_its_reuse() -> None:
    """The conversation came back though its prefix was given up: the next turn's end is
    kept with the distance measured, like one that hit."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=14, block_size=4)
    first = [*range(16)]
    serve(mgr, "t1", first, [])
    fill(mgr, 6)  # 12 of the 13 pages: t1's prefix (5 pages) is evicted
    mgr.free("filler")
    assert serve(mgr, "t2", [*first, 1, 2, 3, 4, 5], []) == 0
    (kept,) = (p for p in mgr.pool.kept_prefixes() if p.num_blocks == 5)
    assert kept.reuse_distance > 0


def test_a_reuse_distance_does_not_depend_on_whether_the_requests_between_hit() -> None:
    """The eviction order's clock counts demand (tokens given slots, hits included), so a
    conversation measures the same distance whether a request served in its gap hit or
    recomputed. On a clock of pages taken, the miss took 5 pages where the hit took 1,
    and the sessions of one loop were ordered by that luck."""

    def distance(between_hits: bool) -> int:
        mgr = KVCacheManager([FULL], num_blocks=64, block_size=4)
        other = [*range(500, 516)]
        serve(mgr, "other-1", other, [])
        chat = [*range(16)]
        serve(mgr, "chat-1", chat, [])
        asked = other if between_hits else [*range(600, 616)]
        assert (serve(mgr, "other-2", [*asked, 1, 2], []) > 0) is between_hits
        turn = Req("chat-2", [*chat, 9, 9])
        hit = mgr.lookup(turn)
        assert hit.num_tokens == 16 and mgr.allocate(turn, 2, hit) is not None
        (resumed,) = (p for p in mgr.pool.kept_prefixes() if p.num_pins)
        return resumed.reuse_distance

    assert distance(between_hits=True) == distance(between_hits=False) == 18
