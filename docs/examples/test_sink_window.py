"""A user's policy and its tests, with hybridkv's pytest plugin (docs/guides/testing.md)."""

from typing import ClassVar

import attrs
import openai
import pytest

from hybridkv.policies import FullAttention, MemoryPolicy, Span
from hybridkv.policies.base import positive
from hybridkv.scheduler import SamplingParams
from hybridkv.testing import AttendingFakeExecutor, check_policy_laws, wait_until_free


@attrs.frozen
class SinkWindow(MemoryPolicy):
    """StreamingLLM: the first ``sinks`` tokens and the last ``window``."""

    name: ClassVar[str] = "sink_window_example"
    sinks: int = attrs.field(validator=positive)
    window: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = max(0, num_tokens - self.window + 1)
        if start <= self.sinks:
            return ((0, num_tokens),) if num_tokens else ()
        return ((0, self.sinks), (start, num_tokens))


def test_the_policy_keeps_the_allocators_laws() -> None:
    check_policy_laws(SinkWindow(sinks=4, window=16))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_engine_serves_what_the_policy_keeps(hybridkv_engine) -> None:
    """Every token is drawn from every position the policy keeps live, read back from
    the pages: a policy that frees a page it still reads fails, or changes the tokens."""
    engine = hybridkv_engine(
        executor_class=AttendingFakeExecutor,
        policies=[FullAttention(), SinkWindow(sinks=4, window=16)],
        max_num_batched_tokens=16,  # prefill in chunks, so pages are freed mid-prompt
    )
    prompt = [(7 * i + 3) % 64 for i in range(50)]
    async with engine:
        tokens: list[int] = []
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        async with engine.generate(prompt, params) as stream:
            async for out in stream:
                tokens += out.new_token_ids
        await wait_until_free(engine)  # every page back once the request ended
    assert tokens == engine.executor.reference_tokens(prompt, 20)


def test_the_server_answers_with_the_policy(hybridkv_make_server) -> None:
    server = hybridkv_make_server(policies=[FullAttention(), SinkWindow(sinks=4, window=16)])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model=server.model, prompt="w2 w3 w4", max_tokens=5)
    assert reply.choices[0].finish_reason in ("stop", "length")
    server.wait_until_free()
