"""The attending fake: a policy that releases what its layers read changes the output or
fails the step, where the chaining fake cannot tell."""

from __future__ import annotations

import attrs
import pytest

from hybridkv.policies import FullAttention, SlidingWindow, Span
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor, FakeKVMismatchError
from hybridkv.scheduler.fake_attending import AttendingFakeExecutor

VOCAB = 97


@attrs.frozen
class ForgetfulWindow(SlidingWindow):
    """A user's window whose block arithmetic drops the oldest block it still reads: its
    ``live_spans`` keep ``window`` tokens, its override releases a block early."""

    def live_block_spans(self, num_tokens: int, block_size: int) -> tuple[Span, ...]:
        ((first, stop),) = super().live_block_spans(num_tokens, block_size)
        return ((min(first + 1, stop - 1), stop),)


def serve(fake: FakeExecutor, config: EngineConfig, prompt: list[int], n: int) -> list[int]:
    core = EngineCore(config)
    sink = CollectingSink()
    core.add_request(prompt, SamplingParams(max_tokens=n), sink, request_id="r")
    while core.has_work:
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
        core.flush()
    errors = [item for item in sink.items if isinstance(item, Exception)]
    if errors:
        raise errors[0]
    return [t for out in sink.items for t in out.new_token_ids]


def config_for(policies: list) -> EngineConfig:  # type: ignore[type-arg]
    return EngineConfig(
        policies=policies,
        num_blocks=64,
        block_size=4,
        max_model_len=128,
        vocab_size=VOCAB,
        max_prefill_chunk=8,
    )


@pytest.mark.parametrize("policy", [FullAttention(), SlidingWindow(window=6)])
def test_a_sound_policy_gives_the_reference_tokens(policy) -> None:  # type: ignore[no-untyped-def]
    config = config_for([FullAttention(), policy])
    fake = AttendingFakeExecutor(config.pool, vocab_size=VOCAB)
    prompt = [(7 * i + 3) % VOCAB for i in range(30)]
    assert serve(fake, config, prompt, 12) == fake.reference_tokens(prompt, 12)


def test_a_policy_that_releases_what_it_reads_is_caught() -> None:
    """The chaining fake serves ForgetfulWindow as if nothing were wrong; the attending
    fake fails the step at the first read of a released block."""
    config = config_for([FullAttention(), ForgetfulWindow(window=6)])
    prompt = [(7 * i + 3) % VOCAB for i in range(30)]
    chaining = FakeExecutor(config.pool, vocab_size=VOCAB)
    serve(chaining, config, prompt, 12)  # no complaint: it reads the last position only
    attending = AttendingFakeExecutor(config.pool, vocab_size=VOCAB)
    with pytest.raises(FakeKVMismatchError, match=r"reads position .* a policy released"):
        serve(attending, config, prompt, 12)


def test_a_window_chosen_for_layers_that_attend_everything_is_caught() -> None:
    """``attends`` says what the layers read: full attention kept as a window fails."""
    config = config_for([SlidingWindow(window=6)])
    fake = AttendingFakeExecutor(config.pool, attends=[FullAttention()], vocab_size=VOCAB)
    with pytest.raises(FakeKVMismatchError, match="group 0 reads position 0"):
        serve(fake, config, [(5 * i) % VOCAB for i in range(20)], 4)
