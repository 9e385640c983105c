"""The transfer worker reports every block of a load that a tier did not deliver,
however the tier failed, and keeps loading afterwards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from hybridkv.memory.offload import HostTier, KVBlock, OffloadConfig, encode
from hybridkv.memory.offload.transfers import BlockLoad, KVTransfers, LoadTask
from hybridkv.memory.offload.worker import TransferWorker


class Pages:
    """Pages of one KV cache, as a dict."""

    def __init__(self) -> None:
        self.written: dict[tuple[int, int], KVBlock] = {}

    def read_pages(self, group: int, pages: Sequence[int]) -> list[KVBlock]:
        return [self.written[group, page] for page in pages]

    def write_pages(self, group: int, pages: Sequence[int], blocks: Sequence[KVBlock]) -> None:
        for page, block in zip(pages, blocks, strict=True):
            self.written[group, page] = block


class FaultyTier(HostTier):
    """A host tier whose ``get`` misbehaves as ``fault`` says, while it is set."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.fault: Callable[[list[Any]], Any] | None = None

    def get(self, keys: Sequence[bytes]) -> Any:
        values = super().get(keys)
        return values if self.fault is None else self.fault(values)


def _raise(values: list[Any]) -> Any:
    raise RuntimeError("a tier's own bug")


FAULTS: dict[str, Callable[[list[Any]], Any]] = {
    "raises": _raise,
    "short reply": lambda values: values[:-1],
    "not a list": lambda values: b"OK",
    "not bytes": lambda values: [123] * len(values),
    "truncated values": lambda values: [bytes(v)[:-3] for v in values],
}


def _task(name: str, tier: HostTier) -> LoadTask:
    blocks = []
    for i in range(3):
        key = f"{name}/{i}".encode()
        tier.put([(key, encode(KVBlock("float32", (2,), bytes([i]) * 8)))])
        blocks.append(BlockLoad(group=i % 2, block=i, page=10 + i, key=key, tier=0))
    return LoadTask(request_id=name, blocks=tuple(blocks))


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_a_failing_tier_fails_every_block_it_did_not_deliver(fault: str) -> None:
    """Each (group, block) of the load is reported failed, counted, and the worker
    loads the next request's blocks as usual."""
    tier, pages = FaultyTier(), Pages()
    config = OffloadConfig(tiers=[tier])
    worker = TransferWorker(pages, config, idle_wait_s=60.0)  # a bound, not a delay
    try:
        tier.fault = FAULTS[fault]
        (report,) = worker.run(KVTransfers(loads=(_task("a", tier),)), is_idle=True)
        assert report.failed == ((0, 0), (1, 1), (0, 2)) and not report.loaded
        assert len(report.failed_keys) == 3
        assert config.stats.num_failed_blocks == 3
        tier.fault = None
        (report,) = worker.run(KVTransfers(loads=(_task("b", tier),)), is_idle=True)
        assert report.loaded == ((0, 0), (1, 1), (0, 2)) and not report.failed
        assert bytes(pages.written[1, 11].data) == bytes([1]) * 8
    finally:
        worker.close()
