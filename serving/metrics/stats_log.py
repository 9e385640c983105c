"""The periodic stats line of a server, as vLLM logs one: every ``interval_s`` seconds
while requests run or wait, one ``engine_stats`` event at info::

    engine_stats running=3 waiting=0 kv_usage=0.41 pages_per_group=[812, 96, 96]
                 prefix_hit_rate=0.62 tokens_per_s=1840.5 output_tokens_per_s=212.0

An idle engine logs once when it becomes idle and then stays quiet.
"""

from __future__ import annotations

import anyio
import anyio.abc

from hybridkv.errors.events import get_logger
from hybridkv.scheduler import Engine, EngineStats

log = get_logger(__name__)


def stats_fields(stats: EngineStats) -> dict[str, object]:
    """The fields of one stats line."""
    return {
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv_usage": round(stats.kv_usage, 3),
        "pages_per_group": list(stats.blocks_used_per_group),
        "prefix_hit_rate": round(stats.prefix_hit_rate, 3),
        "tokens_per_s": round(stats.tokens_per_second, 1),
        "output_tokens_per_s": round(stats.output_tokens_per_second, 1),
    }


async def log_stats(
    engine: Engine,
    interval_s: float,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Log the engine's stats every ``interval_s`` seconds while it has work, until
    cancelled (run it in the server's task group)."""
    task_status.started()
    was_busy = False
    while True:
        await anyio.sleep(interval_s)
        stats = engine.stats()
        busy = stats.num_running + stats.num_waiting > 0
        if busy or was_busy:
            log.info("engine_stats", **stats_fields(stats))
        was_busy = busy
