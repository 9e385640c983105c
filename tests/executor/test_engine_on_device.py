"""The engine on the device under check (CUDA; the CPU in ``make gpu-check DRY_RUN=1``):
tiny random Llama, Gemma 3 and Bamba give the CPU's tokens through chunked prefill, a
prefix hit, a preemption, the async engine, and pages round-tripped through pinned host
memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hybridkv.memory.offload import HostTier, OffloadConfig

pytestmark = pytest.mark.cuda

MODELS = ["llama", "gemma3", "bamba"]
#: bf16 on two devices: logits within this of each other (the tiny models' logits are
#: a few units wide), and tokens equal wherever the CPU's top two are further apart.
BF16_ATOL = 0.15


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """float32 on CUDA means float32: no TF32 in matrix products or convolutions."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _scenario_on(
    device: torch.device, dtype: torch.dtype, name: str, make_driver: Any, run_scenario: Any
) -> Any:
    driver = make_driver(name, device=str(device), dtype=dtype)
    try:
        tokens, logits = run_scenario(driver)
    finally:
        driver.executor.close()
    return tokens, {rid: rows.float().cpu() for rid, rows in logits.items()}


@pytest.mark.parametrize("name", MODELS)
def test_float32_steps_give_the_cpus_tokens_and_logits(
    check_device: torch.device, name: str, make_driver: Any, run_scenario: Any
) -> None:
    """Chunked prefill, a prefix hit and a preemption: the same tokens, logits within 1e-4."""
    got = _scenario_on(check_device, torch.float32, name, make_driver, run_scenario)
    expected = _scenario_on(torch.device("cpu"), torch.float32, name, make_driver, run_scenario)
    assert got[0] == expected[0]
    for rid, rows in expected[1].items():
        torch.testing.assert_close(got[1][rid], rows, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_steps_give_the_cpus_tokens_within_its_rounding(
    check_device: torch.device, name: str, make_driver: Any, run_scenario: Any
) -> None:
    """In bf16 each request's tokens equal the CPU's up to the first step where the CPU's
    best two logits are within the tolerance, and the logits agree until then."""
    got = _scenario_on(check_device, torch.bfloat16, name, make_driver, run_scenario)
    expected = _scenario_on(torch.device("cpu"), torch.bfloat16, name, make_driver, run_scenario)
    for rid, rows in expected[1].items():
        top2 = rows.topk(2, dim=-1).values
        near_tie = ((top2[:, 0] - top2[:, 1]) < 2 * BF16_ATOL).nonzero()
        clear = int(near_tie[0, 0]) + 1 if len(near_tie) else len(rows)
        assert got[0][rid][:clear] == expected[0][rid][:clear]
        torch.testing.assert_close(got[1][rid][:clear], rows[:clear], atol=BF16_ATOL, rtol=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["gemma3", "bamba"])
async def test_the_engine_and_a_host_tier_give_the_cpus_tokens(
    check_device: torch.device,
    name: str,
    tiny_models: Any,
    prompt_of: Callable[[int, int], list[int]],
    serve_in_turn: Any,
) -> None:
    """The async engine on the device answers as on the CPU; with a host tier, a flushed
    prefix (K/V pages, and Bamba's state pages spanning several of them) loads back from
    pinned host memory and the answers stay the same."""
    path = tiny_models[name].path
    document = prompt_of(72, 5)
    prompts = [[*document, 7, 8], *(prompt_of(60, 100 + k) for k in range(3)), [*document, 9]]
    expected, _ = await serve_in_turn(path, prompts)
    assert (await serve_in_turn(path, prompts, device=str(check_device)))[0] == expected
    offload = OffloadConfig(tiers=[HostTier(64 << 20)], save_interval=16)
    assert (await serve_in_turn(path, prompts, offload, device=str(check_device)))[0] == expected
    assert offload.stats.hit_tokens["host"] >= 64
