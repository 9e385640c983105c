"""Leak checks: every request ended, no page held, the pool's books exact.

An aborted request's pages are freed once the step running it returns, so a live engine
is checked by waiting for that state (:func:`wait_until_free`, on the engine's events,
never a sleep); a stopped one is checked at once (:func:`check_no_leaks`).
"""

from __future__ import annotations

import anyio

from hybridkv.scheduler import Engine, EngineStats


class LeakError(AssertionError):
    """An engine holds pages, or requests, that nothing will free."""


def _held(stats: EngineStats) -> str:
    return (
        f"{stats.num_running} running, {stats.num_waiting} waiting, pages held per group "
        f"{list(stats.blocks_used_per_group)}"
    )


def _is_free(stats: EngineStats) -> bool:
    return stats.num_running + stats.num_waiting + sum(stats.blocks_used_per_group) == 0


async def wait_until_free(engine: Engine, *, timeout: float = 60.0) -> EngineStats:
    """The engine's stats once no request runs or waits and no page is held, with the
    pool's books checked; call it on the engine's loop.

    ``timeout`` bounds a wait that should end within a step or two; it is not a delay.

    Raises:
        LeakError: pages or requests were still held after ``timeout`` seconds.
    """
    try:
        with anyio.fail_after(timeout):
            stats = await engine.wait_until(_is_free)
    except TimeoutError:
        raise LeakError(f"still held after {timeout} s: {_held(engine.stats())}") from None
    engine.core.kv.check_integrity()
    return stats


def check_no_leaks(engine: Engine) -> None:
    """Assert, now, that ``engine`` holds no request and no page and that its pool's books
    are exact (reference counts, free queue, kept prefixes). For an engine that stopped,
    or one known to be idle.

    Raises:
        LeakError: what is still held.
    """
    stats = engine.stats()
    if not _is_free(stats):
        raise LeakError(f"the engine holds {_held(stats)}")
    engine.core.kv.check_integrity()
