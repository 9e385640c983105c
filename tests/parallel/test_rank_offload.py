"""Offload over ranks, piece by piece: the keys of each rank's share, what a rank moves,
how rank 0 reports a load every rank has reported, and what is refused. The engine runs
over real ranks are in ``test_composition.py``."""

from __future__ import annotations

import pytest

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.hashing import BlockHash
from hybridkv.memory.offload import (
    BlockLoad,
    BlockSave,
    HostTier,
    KVTransfers,
    LoadReport,
    LoadTask,
    OffloadConfig,
    OffloadConfigError,
    RedisTier,
    TierSpec,
)
from hybridkv.memory.offload.keys import parse_key, with_fingerprint
from hybridkv.parallel.rank_layout import ParallelConfig
from hybridkv.parallel.rank_offload import LoadGather, RankTransfers, plan_offload
from hybridkv.policies import FullAttention
from hybridkv.scheduler import Engine, EngineConfig
from hybridkv.scheduler.fake import FakeExecutor

OPTIONS = LoadOptions(kv_cache_bytes=1 << 20, block_size=4, num_threads=1)
HOST = TierSpec("host", capacity_bytes=1 << 20)
REDIS = TierSpec("redis", url="redis://127.0.0.1:6379/0")  # connects lazily: never here


def stage(tiny_models, name: str, index: int, num_stages: int) -> ModelExecutor:
    path = tiny_models[name].path
    return ModelExecutor.from_pretrained(
        path, OPTIONS, pipeline_stage=index, pipeline_parallel_size=num_stages
    )


def test_every_rank_s_keys_name_its_share(tiny_models) -> None:
    """Two tensor ranks of two stages: four fingerprints, rank 0's model's with each
    rank's place; a key moved to another share names the same group and block."""
    stage0 = stage(tiny_models, "llama", 0, 2)
    try:
        config = OffloadConfig.from_specs([REDIS])
        keys, setup = plan_offload(config, stage0, ParallelConfig(pipeline=2, tensor=2))
    finally:
        stage0.close()
    assert keys.layout == "tp=2 pp=2 cp=1" and keys.model  # the tiers' layout marker
    model = keys.fingerprint.split(".")[0]
    assert setup.fingerprints == tuple(
        f"{model}.tp{t}of2-pp{p}of2-cp0of1" for p in range(2) for t in range(2)
    )
    key = keys.key(0, BlockHash(b"\x01" * 16), "-")
    assert key.startswith(f"hkv:{setup.fingerprints[0]}:".encode())
    moved = with_fingerprint(key, setup.fingerprints[3])
    assert moved.startswith(f"hkv:{setup.fingerprints[3]}:".encode())
    assert parse_key(moved) == parse_key(key)


def test_a_group_past_stage_0_is_looked_up_in_the_remote_tier_or_refused(tiny_models) -> None:
    """Qwen3-Next over two stages: its full-attention group (1) has no layer on stage 0
    (its three DeltaNet states share one group). With Redis, rank 0 looks it up under stage
    1's keys; with host memory alone it could not, and says so."""
    stage0 = stage(tiny_models, "qwen3_next", 0, 2)
    try:
        layout = ParallelConfig(pipeline=2)
        keys, setup = plan_offload(OffloadConfig.from_specs([HOST, REDIS]), stage0, layout)
        assert keys.group_fingerprints == (setup.fingerprints[0], setup.fingerprints[1])
        with pytest.raises(OffloadConfigError, match=r"KV group 1 .* stage 1") as info:
            plan_offload(OffloadConfig.from_specs([HOST]), stage0, layout)
        assert "redis://" in str(info.value)
        with pytest.raises(OffloadConfigError, match="from_specs"):
            plan_offload(OffloadConfig(tiers=[HostTier(1 << 20)]), stage0, layout)
    finally:
        stage0.close()


def test_a_rank_moves_only_the_groups_it_holds_under_its_own_keys(tiny_models) -> None:
    """Stage 1 of Nemotron-H holds group 1 (its second Mamba2 layer) of the three: of a
    step's saves it stores that one's, under its share's keys; a load of all three groups
    is reported for the one it wrote."""
    stage1 = stage(tiny_models, "nemotron_h", 1, 2)
    host = HostTier(16 << 20)
    ranks = RankTransfers(stage1, OffloadConfig(tiers=[host]), "model.tp0of1-pp1of2-cp0of1")
    try:
        rank0_keys = [f"hkv:model.tp0of1-pp0of1-cp0of1:{g}.k:-:{g:032x}".encode() for g in range(3)]
        saves = tuple(BlockSave(g, 1, key) for g, key in enumerate(rank0_keys))
        ranks.run(KVTransfers(saves=saves), is_idle=False)
        assert ranks.worker.wait_saved()
        stored = sorted(parse_key(k)[0] for k in host.held_keys())
        assert stored == [1]
        assert all(k.startswith(b"hkv:model.tp0of1-pp1of2-cp0of1:") for k in host.held_keys())
        task = LoadTask("r", tuple(BlockLoad(g, 0, 2, key, 0) for g, key in enumerate(rank0_keys)))
        reports = ranks.run(KVTransfers(loads=(task,), num_loading=0), is_idle=True)
        while not reports:  # the loader thread answers within a few idle steps
            reports = ranks.run(KVTransfers(num_loading=1), is_idle=True)
        (report,) = reports
        assert sorted(report.loaded) == [(1, 0)] and not report.failed
    finally:
        ranks.close()
        stage1.close()


def test_a_shared_tier_holding_another_layout_s_blocks_is_refused(redis_server) -> None:
    """The first engine on a Redis tier records its rank layout there; an engine of the
    same model cut another way is refused when it starts, naming both layouts and the
    way out; one of the same layout starts."""
    config = EngineConfig(
        policies=[FullAttention()], num_blocks=32, block_size=4, max_model_len=32,
        enable_prefix_caching=True,
    )  # fmt: skip

    def start() -> None:
        executor = FakeExecutor.for_config(config)
        try:
            Engine(config, executor, offload=OffloadConfig(tiers=[RedisTier(redis_server.url)]))
        finally:
            executor.close()

    start()
    start()  # the same layout
    tier = RedisTier(redis_server.url)
    executor = FakeExecutor.for_config(config)
    marker = executor.attach_offload(OffloadConfig(tiers=[tier])).layout_key()
    executor.close()
    tier.put([(marker, b"tp=2 pp=1 cp=1")])
    with pytest.raises(OffloadConfigError, match="cut for tp=2 pp=1 cp=1; this engine is tp=1"):
        start()


def test_a_load_is_reported_once_every_rank_has_failed_wherever_one_did() -> None:
    """Three ranks report a two-group load over two steps; rank 0 reports it with the
    second step, failed in the block one rank failed, under rank 0's key."""
    task = LoadTask("r", (BlockLoad(0, 0, 5, b"k0", 0), BlockLoad(1, 0, 6, b"k1", 0)))
    gather = LoadGather(num_ranks=3)
    gather.expect(KVTransfers(loads=(task,)))
    first = [
        LoadReport(request_id="r", loaded=((0, 0), (1, 0)), num_bytes=8),
        LoadReport(request_id="r", loaded=((0, 0),), failed=((1, 0),), failed_keys=(b"theirs",)),
    ]
    assert gather.combine(first) == ()
    (done,) = gather.combine([LoadReport(request_id="r", loaded=((0, 0), (1, 0)), num_bytes=8)])
    assert done.loaded == ((0, 0),) and done.failed == ((1, 0),)
    assert done.failed_keys == (b"k1",) and done.num_bytes == 16
