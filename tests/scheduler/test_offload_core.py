"""The engine core with a KV connector over the fake executor: loads, saves, failures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from hybridkv.memory import BlockHash, BlockHasher
from hybridkv.memory.offload import HostTier, OffloadConfig
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor, reference_tokens
from hybridkv.scheduler.request import Request

VOCAB = 50
BS = 4


def make(
    num_blocks: int = 40, tier_bytes: int = 1 << 20, proposer: Any = None, **options: Any
) -> tuple[EngineCore, FakeExecutor, OffloadConfig]:
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=6), SlidingWindow(window=6)],
        "num_blocks": num_blocks,
        "block_size": BS,
        "max_model_len": 256,
        "vocab_size": VOCAB,
        "max_prefill_chunk": 16,
    }
    settings.update(options)
    config = EngineConfig(**settings)
    fake = FakeExecutor.for_config(config)
    offload = OffloadConfig(tiers=[HostTier(tier_bytes)], save_interval=16)
    keys = fake.attach_offload(offload)
    return EngineCore(config, offload=(offload, keys), proposer=proposer), fake, offload


@pytest.fixture
def engine() -> Iterator[tuple[EngineCore, FakeExecutor, OffloadConfig]]:
    core, fake, offload = make()
    yield core, fake, offload
    fake.close()


def run(core: EngineCore, fake: FakeExecutor, prompt: list[int], rid: str, n: int = 4) -> Request:
    sink = CollectingSink()
    request = core.add_request(prompt, SamplingParams(max_tokens=n), sink, request_id=rid)
    for _ in range(2000):
        if not core.has_work:
            break
        plan = core.plan()
        if plan.runs:
            core.apply(plan, fake.execute(plan.batch))
        core.flush()
        core.kv.check_integrity()
    else:
        raise AssertionError("requests did not finish")
    assert fake.transfers is not None and fake.transfers.wait_saved()
    tokens = [t for out in sink.items for t in out.new_token_ids]
    assert tokens == reference_tokens(prompt, n, VOCAB)
    return request


def flush_pool(core: EngineCore, fake: FakeExecutor, num: int = 4) -> None:
    """Other prompts take every page, so the pool's prefix cache forgets the first."""
    for k in range(num):
        run(core, fake, [(7 * k + i) % VOCAB for i in range(60)], f"other{k}")


def block_key(core: EngineCore, tokens: list[int], *, group: int, block: int) -> bytes:
    """The tier key of ``group``'s page of block ``block`` of ``tokens``."""
    hasher = BlockHasher(BS)
    hashes: list[BlockHash] = []
    hasher.extend(hashes, hasher.root(()), tokens, (block + 1) * BS)
    assert core.offload is not None
    return core.offload.connector.keys.key(group, hashes[block], "-")


def prompt(n: int = 70, first: int = 1) -> list[int]:
    return [first] + [(3 * i + 5) % VOCAB for i in range(n - 1)]


def test_a_flushed_prefix_loads_from_the_tier(engine: Any) -> None:
    """After the pool forgot a prompt, its repeat loads the prefix and samples the same."""
    core, fake, offload = engine
    run(core, fake, prompt(), "a")
    flush_pool(core, fake)
    assert (
        core.kv.lookup(
            core.add_request(prompt(), SamplingParams(), CollectingSink(), request_id="probe")
        ).num_tokens
        == 0
    )
    core.abort("probe")
    with capture_logs() as logs:
        again = run(core, fake, [*prompt(), 9, 9], "b")
    # 17 blocks shared; the windows' blocks 15 and 16 were saved for the boundaries at
    # 64 (the interval) and 72 (where "a" ended).
    assert again.num_cached_tokens == 68
    assert offload.stats.hit_tokens["host"] == 68
    events = [e["event"] for e in logs]
    assert "kv_load_started" in events and "kv_load_finished" in events


def test_window_groups_save_only_what_a_resume_needs(engine: Any) -> None:
    """A window group stores the blocks before each boundary it may resume at, not all."""
    core, fake, offload = engine
    run(core, fake, prompt(), "a")
    saved = [k.split(b":")[2] for k in offload.tiers[0]._values]
    full = sum(1 for g in saved if g.startswith(b"0."))
    window = sum(1 for g in saved if g.startswith(b"1."))
    assert full == 18  # 73 tokens computed: 18 full blocks
    assert window < full


def test_a_corrupt_block_shrinks_the_resumed_prefix(engine: Any) -> None:
    """A corrupt block of one window group: the request resumes a shorter prefix every
    group can resume, recomputes the rest, and samples the same tokens."""
    core, fake, offload = engine
    run(core, fake, prompt(), "a")
    flush_pool(core, fake)
    tier: HostTier = offload.tiers[0]
    buffer = tier._values[block_key(core, prompt(), group=2, block=16)]
    buffer[-1] ^= 0xFF
    with capture_logs() as logs:
        again = run(core, fake, [*prompt(), 9, 9], "b")
    assert "kv_load_failed" in [e["event"] for e in logs]
    assert again.num_cached_tokens == 64  # the boundary saved before it
    assert offload.stats.num_failed_blocks >= 1


def test_a_missing_block_of_the_full_group_shrinks_the_prefix(engine: Any) -> None:
    """A block the tier lost between lookup and load: recompute from before it."""
    core, fake, offload = engine
    run(core, fake, prompt(), "a")
    flush_pool(core, fake)
    tier: HostTier = offload.tiers[0]
    real_get = tier.get
    lost = block_key(core, prompt(), group=0, block=5)

    def losing_get(keys: Any) -> Any:
        values = real_get(keys)
        return [None if k == lost else v for k, v in zip(keys, values, strict=True)]

    tier.get = losing_get  # type: ignore[method-assign]
    again = run(core, fake, [*prompt(), 9, 9], "b")
    assert again.num_cached_tokens == 16  # the saved boundary before block 5


def test_a_stored_prefix_larger_than_the_free_pool_loads_what_fits() -> None:
    """With most pages held by a running request, the load takes a shorter prefix that
    fits instead of waiting for pages that may never come (vLLM #39734)."""
    core, fake, _ = make(num_blocks=48)
    try:
        run(core, fake, prompt(120), "a")
        flush_pool(core, fake)
        hog_sink, sink = CollectingSink(), CollectingSink()
        hog = [(5 * i + 2) % VOCAB for i in range(60)]
        core.add_request(hog, SamplingParams(max_tokens=40), hog_sink, request_id="hog")
        for _ in range(6):  # the hog's prefill, then a few decodes
            plan = core.plan()
            core.apply(plan, fake.execute(plan.batch))
        b = core.add_request([*prompt(120), 9], SamplingParams(max_tokens=4), sink, request_id="b")
        with capture_logs() as logs:
            for _ in range(2000):
                if not core.has_work:
                    break
                plan = core.plan()
                if plan.runs:
                    core.apply(plan, fake.execute(plan.batch))
                core.flush()
                core.kv.check_integrity()
        started = [e for e in logs if e["event"] == "kv_load_started"]
        assert started and started[0]["num_tokens"] < 116  # a shorter prefix than stored
        assert b.num_cached_tokens == started[0]["num_tokens"]
        tokens = [t for out in sink.items for t in out.new_token_ids]
        assert tokens == reference_tokens([*prompt(120), 9], 4, VOCAB)
    finally:
        fake.close()


def flush_long(core: EngineCore, fake: FakeExecutor) -> None:
    """Two long prompts that need most of the pool: the kept prefix of the first turn
    gives up its last blocks (and its state there)."""
    for k in range(2):
        run(core, fake, [(11 * k + 3 * i + 1) % VOCAB for i in range(150)], f"long{k}")


@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.parametrize("span", [1, 3])
def test_a_state_group_resumes_from_the_tier_where_every_group_can(
    span: int, speculate: bool
) -> None:
    """A Bamba-like pool (two mamba groups, one full; a state page spans ``span`` pages):
    after the pool lost the end of a conversation, its next turn loads the full group's
    blocks and the state groups' checkpoint at the end of the previous turn, and samples
    what the fake model samples from scratch (the fake checks every state it reads). With
    speculative decoding, only kept tokens' blocks and states reach the tier."""
    from hybridkv.scheduler.speculation import SpeculativeConfig
    from hybridkv.testing import ReferenceProposer

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3) if speculate else None
    core, fake, offload = make(
        num_blocks=60,
        policies=[MambaLike(), FullAttention(), MambaLike()],
        state_span=span,
        speculative_config=spec,
        proposer=ReferenceProposer(VOCAB, miss=0.3, seed=span),
    )
    try:
        first = run(core, fake, prompt(), "a")
        turn = [*first.all_token_ids, 9, 9]
        flush_long(core, fake)
        assert core.kv.lookup(first).num_tokens < 72  # the pool lost the turn's end
        again = run(core, fake, turn, "b")
        # "a" ended after 70 + 3 computed tokens: its last filled block ends at 72, where
        # its states were saved (the state after 72 tokens, block 17's page).
        assert again.num_cached_tokens == 72
        assert offload.stats.hit_tokens["host"] > 0
    finally:
        fake.close()


def test_no_state_in_the_tier_means_no_resume_from_it() -> None:
    """With the state group's pages gone from the tier, the full group's blocks alone do
    not make a resume: the request resumes from what every group has in the pool."""
    core, fake, offload = make(num_blocks=60, policies=[MambaLike(), FullAttention()])
    try:
        first = run(core, fake, prompt(), "a")
        turn = [*first.all_token_ids, 9, 9]
        flush_long(core, fake)
        offload.tiers[0].delete([block_key(core, turn, group=0, block=b) for b in range(18)])
        local = core.kv.lookup(first).num_tokens
        assert local < 72
        again = run(core, fake, turn, "b")
        assert again.num_cached_tokens == local
    finally:
        fake.close()
