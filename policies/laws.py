"""The laws every memory policy keeps, checked: for a policy author's tests.

``check_policy_laws(MyPolicy(...))`` runs a policy through the rules the allocator relies
on and raises :class:`PolicyLawError` naming the first one broken, with the token count
and block size where it breaks:

* ``live_spans(n)`` is sorted, disjoint, non-empty spans inside ``[0, n)``;
* no resurrection: a position dead at ``n`` is dead at every later count;
* ``attention_window()``, where it names a window, is exactly the live spans;
* the derived methods a policy may override for speed keep their meaning:
  ``live_block_spans``, ``is_hit_usable`` and ``longest_hit`` answer what the generic ones
  derived from ``live_spans`` answer; ``max_live_blocks`` never counts fewer blocks than
  the generic peak (an admission bound may be larger), ``first_live_block`` never passes
  a live block, ``next_release`` never skips a block's death, and ``page_blocks`` names
  only blocks the step touches (a state's, the block it ends in among them).

It checks token counts up to ``max_tokens`` at a few block sizes and every cache pattern of
``hit_blocks`` blocks: a sampled proof, as the tests of the built-in policies are.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.policies.base import MemoryPolicy, cdiv
from hybridkv.policies.errors import PolicyError


class PolicyLawError(PolicyError):
    """A memory policy breaks a law the allocator relies on (the message says which)."""


def check_policy_laws(
    policy: MemoryPolicy,
    *,
    max_tokens: int = 200,
    block_sizes: Sequence[int] = (1, 3, 4, 16),
    hit_blocks: int = 7,
) -> None:
    """Raise :class:`PolicyLawError` at the first law ``policy`` breaks (see the module).

    Args:
        policy: The policy to check.
        max_tokens: Token counts ``0 .. max_tokens`` are checked.
        block_sizes: Block sizes the block arithmetic is checked at.
        hit_blocks: Prefix hits are checked over every cache pattern of this many blocks.
    """
    name = type(policy).__name__
    _check_spans(policy, name, max_tokens)
    _check_window(policy, name, max_tokens)
    for bs in block_sizes:
        _check_blocks(policy, name, max_tokens, bs)
        _check_hits(policy, name, bs, hit_blocks)


def _fail(name: str, law: str, where: str) -> PolicyLawError:
    return PolicyLawError(f"{name} breaks a policy law: {law} ({where})")


def _check_spans(policy: MemoryPolicy, name: str, max_tokens: int) -> None:
    previous: set[int] | None = None
    for n in range(max_tokens + 1):
        spans = policy.live_spans(n)
        end = 0
        for start, stop in spans:
            if not (end <= start < stop <= n):
                raise _fail(
                    name,
                    "live_spans must be sorted, disjoint, non-empty spans inside [0, n)",
                    f"live_spans({n}) = {spans}",
                )
            end = stop
        live = {p for start, stop in spans for p in range(start, stop)}
        if previous is not None:
            back = sorted(live - previous - {n - 1})
            if back:
                raise _fail(
                    name,
                    "no resurrection: a position dead at n stays dead",
                    f"position {back[0]} is dead at {n - 1} tokens and live at {n}",
                )
        previous = live


def _check_window(policy: MemoryPolicy, name: str, max_tokens: int) -> None:
    window = policy.attention_window()
    if window is None:
        return
    for p in range(max_tokens + 1):
        first = 0 if window.size is None else max(0, p - window.size + 1)
        expected = ((first, p),) if first < p else ()
        if tuple(policy.live_spans(p)) != expected:
            raise _fail(
                name,
                "attention_window() must be exactly the live spans",
                f"window {window.size}: live_spans({p}) = {policy.live_spans(p)}, "
                f"the window reads {expected}",
            )


def _check_blocks(policy: MemoryPolicy, name: str, max_tokens: int, bs: int) -> None:
    generic = MemoryPolicy
    for n in range(max_tokens + 1):
        where = f"{n} tokens, block size {bs}"
        spans, want = policy.live_block_spans(n, bs), generic.live_block_spans(policy, n, bs)
        if spans != want:
            raise _fail(
                name,
                "live_block_spans must answer what the generic one derives from live_spans",
                f"{where}: {spans!r}, the generic answer {want!r}",
            )
        first, lowest = policy.first_live_block(n, bs), generic.first_live_block(policy, n, bs)
        if first > lowest:
            raise _fail(
                name,
                "first_live_block must not pass the first live block",
                f"{where}: {first}, block {lowest} is live",
            )
        most, peak = policy.max_live_blocks(n, bs), generic.max_live_blocks(policy, n, bs)
        if most < peak:
            raise _fail(
                name,
                "max_live_blocks must not undercount the generic peak",
                f"{where}: {most}, the generic answer {peak}",
            )
        for end in range(n + 1, min(n + 2 * bs, max_tokens) + 1):
            pages = policy.page_blocks(n, end, bs)
            touched = range(n // bs, cdiv(end, bs))
            ends_in = (end - 1) // bs in pages if pages is not None else True
            if pages is not None and (
                (policy.keeps_state and not ends_in) or any(i not in touched for i in pages)
            ):
                raise _fail(
                    name,
                    "page_blocks must name only blocks a step touches (a state's: the block "
                    "it ends in among them)",
                    f"a step over [{n}, {end}), block size {bs}: {pages!r}",
                )
        held = {i for a, b in policy.live_block_spans(n, bs) for i in range(a, b)}
        release = policy.next_release(n, bs)
        for later in range(n + 1, min(release, max_tokens + 1)):
            alive = {i for a, b in policy.live_block_spans(later, bs) for i in range(a, b)}
            dead = sorted(i for i in held if i < later // bs and i not in alive)
            if dead:
                raise _fail(
                    name,
                    "next_release must not skip a block's death",
                    f"next_release({n}, {bs}) = {release}, but block {dead[0]} is dead at "
                    f"{later} tokens",
                )


def _check_hits(policy: MemoryPolicy, name: str, bs: int, num_blocks: int) -> None:
    generic = MemoryPolicy
    for mask in range(1 << num_blocks):
        cached = [bool(mask >> i & 1) for i in range(num_blocks)]
        got = policy.longest_hit(num_blocks, bs, cached.__getitem__)
        want = generic.longest_hit(policy, num_blocks, bs, cached.__getitem__)
        if got != want:
            raise _fail(
                name,
                "longest_hit must answer what the generic search finds",
                f"block size {bs}, cached blocks {cached}: {got}, the generic answer {want}",
            )
        for k in range(1, num_blocks + 1):
            usable = policy.is_hit_usable(k * bs, bs, cached.__getitem__)
            if usable != generic.is_hit_usable(policy, k * bs, bs, cached.__getitem__):
                raise _fail(
                    name,
                    "is_hit_usable must answer what the generic one derives",
                    f"a hit of {k} blocks of {bs}, cached blocks {cached}: {usable}",
                )
