"""Tiny random checkpoints of each architecture, their transformers reference, a driver.

A pytest plugin of the suite (``tests/conftest.py`` names it), shared by the tests of
``models/``, ``executor/`` and ``parallel/``.

Checkpoints are written once per session with ``save_pretrained`` (safetensors) after every
weight, norms included, is re-randomised: default norm weights (zeros or ones) would hide
a wrong ``1 + weight``. The reference model is the same folder loaded by transformers
with eager attention, in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from hybridkv.executor.batch_checks import check_batch
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import LogitsHook, ModelExecutor
from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler.batch import StepBatch, StepRequest, StepResult
from hybridkv.scheduler.params import SamplingParams

WINDOW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
KV_BYTES = 1 << 20

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **_COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        rope_theta=5000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **_COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    )
    return Gemma2ForCausalLM(config)


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    s, f = "sliding_attention", "full_attention"
    config = Gemma3TextConfig(
        **_COMMON,
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=[s, s, f, s, s, f],
        query_pre_attn_scalar=24,
        rope_theta=100_000.0,
        rope_local_base_freq=500.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        final_logit_softcapping=None,
    )
    return Gemma3ForCausalLM(config)


#: Mamba2 fields of the tiny hybrids: SSD chunks of 8 positions, so prefills cross them;
#: a state of 3200 bytes, which an attention page of 16 tokens holds.
_MAMBA2: dict[str, Any] = {
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "mamba_chunk_size": 8,
}


def _bamba() -> Any:
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        **_COMMON, **_MAMBA2, num_hidden_layers=4, num_key_value_heads=2, attn_layer_indices=[1]
    )
    return BambaForCausalLM(config)


def _granite(**fields: Any) -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    m, a = "mamba", "attention"
    config = GraniteMoeHybridConfig(
        **{**_COMMON, **_MAMBA2, **fields},
        num_hidden_layers=4,
        num_key_value_heads=2,
        layer_types=[m, a, m, m],
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=3.0,
    )
    return GraniteMoeHybridForCausalLM(config)


def _granite_moe() -> Any:
    """Granite 4.0-H with experts (4, two per token) beside the shared MLP, and rope."""
    return _granite(
        intermediate_size=32,
        shared_intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="rope",
    )


def _granite_dense() -> Any:
    """Granite 4.0-H without experts and without position embeddings."""
    return _granite(shared_intermediate_size=96, num_local_experts=0)


BUILDERS: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "bamba": _bamba,
    "granite_moe": _granite_moe,
    "granite_dense": _granite_dense,
}


def _randomise(model: Any, seed: int) -> None:
    """Every parameter redrawn around its own mean (norms keep their 0 or 1 centre)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(param.mean() + noise)


@attrs.frozen
class TinyModel:
    """A saved tiny checkpoint and its transformers reference."""

    name: str
    path: Path
    reference: Any

    def reference_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reference logits at every position of ``token_ids``, float32 ``[len, vocab]``."""
        with torch.no_grad():
            ids = torch.tensor([list(token_ids)])
            return self.reference(input_ids=ids).logits[0].float()


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """One tiny checkpoint per architecture, saved as safetensors, with its reference."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    out = {}
    for seed, (name, build) in enumerate(BUILDERS.items()):
        model = build()
        _randomise(model, seed)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        reference = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        out[name] = TinyModel(name, path, reference)
    return out


@attrs.define
class TrackedRequest:
    """A request as the KV cache manager sees it, plus what the driver tracks."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = attrs.Factory(list)
    num_computed: int = 0
    admitted: bool = False
    hit_tokens: int = 0
    extra_keys: tuple[object, ...] = ()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output


class Driver:
    """Feeds an executor hand-built step batches, with pages from a real KV cache manager.

    Each :meth:`step` runs every active request: the rest of its prompt (at most
    ``chunk`` tokens) or one decode token. Logits of each sampled step are recorded.
    """

    def __init__(self, executor: ModelExecutor, *, prefix_caching: bool = True) -> None:
        self.executor = executor
        plan = executor.plan
        self.kv = KVCacheManager.for_pool(plan.pool, enable_prefix_caching=prefix_caching)
        self.active: dict[str, TrackedRequest] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        executor.logits_hook = self._record

    def _record(self, request_id: str, logits: torch.Tensor) -> None:
        self.logits.setdefault(request_id, []).append(logits.clone())

    def add(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams = GREEDY
    ) -> TrackedRequest:
        seq = TrackedRequest(request_id, list(prompt), params)
        self.active[request_id] = seq
        return seq

    def preempt(self, request_id: str) -> None:
        """Free the request's pages; its next step recomputes it from scratch."""
        seq = self.active[request_id]
        self.kv.free(request_id)
        seq.num_computed, seq.admitted = 0, False

    def step(self, chunk: int | None = None, only: Sequence[str] | None = None) -> None:
        requests, seqs = [], []
        for seq in self.active.values():
            hit = None
            if only is not None and seq.request_id not in only:
                continue
            if not seq.admitted:
                hit = self.kv.lookup(seq)
                seq.num_computed = seq.hit_tokens = hit.num_tokens
            pending = len(seq.all_token_ids) - seq.num_computed
            n = pending if chunk is None else min(chunk, pending)
            pages = self.kv.allocate(seq, n, hit)
            assert pages is not None, "tiny pool exhausted"
            seq.admitted = True
            start = seq.num_computed
            requests.append(
                StepRequest(
                    request_id=seq.request_id,
                    token_ids=seq.all_token_ids[start : start + n],
                    start_position=start,
                    block_tables=[list(t) for t in self.kv.block_tables(seq.request_id)],
                    sample=start + n == len(seq.all_token_ids),
                    params=seq.params,
                    output_index=len(seq.output),
                )
            )
            seqs.append(seq)
        result = self.executor.execute(StepBatch(tuple(requests)))
        tokens = result.token_ids
        for seq, request, token in zip(seqs, requests, tokens, strict=True):
            seq.num_computed += request.num_tokens
            if token is not None:
                seq.output.append(token)
        self.kv.check_integrity()

    def run(self, num_tokens: int, chunk: int | None = None) -> None:
        """Step until every active request has ``num_tokens`` outputs."""
        while any(len(s.output) < num_tokens for s in self.active.values()):
            self.step(chunk, only=[r for r, s in self.active.items() if len(s.output) < num_tokens])


@pytest.fixture
def make_driver(tiny_models: dict[str, TinyModel]) -> Callable[..., Driver]:
    """Build a driver over a fresh executor of one tiny model."""

    def build(name: str, *, prefix_caching: bool = True, **kwargs: Any) -> Driver:
        kwargs.setdefault("kv_cache_bytes", KV_BYTES)
        kwargs.setdefault("block_size", 4)
        executor = ModelExecutor.from_pretrained(tiny_models[name].path, LoadOptions(**kwargs))
        return Driver(executor, prefix_caching=prefix_caching)

    return build


def _prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=generator).tolist()


@pytest.fixture
def prompt_of() -> Callable[[int, int], list[int]]:
    """``prompt_of(length, seed)``: a deterministic random prompt in the tiny vocabulary."""
    return _prompt_of


def assert_matches_reference(model: TinyModel, driver: Driver, request_id: str) -> None:
    """Every sampled step's logits within 1e-4 of transformers, and the same greedy tokens."""
    seq = driver.active[request_id]
    recorded = torch.stack(driver.logits[request_id])
    assert len(recorded) == len(seq.output)
    full = model.reference_logits(seq.prompt + seq.output[:-1])
    expected = full[len(seq.prompt) - 1 :]
    torch.testing.assert_close(recorded, expected, atol=1e-4, rtol=0)
    assert seq.output == expected.argmax(-1).tolist()


@pytest.fixture
def check_reference() -> Callable[[TinyModel, Driver, str], None]:
    """``check_reference(model, driver, request_id)``: compare with transformers."""
    return assert_matches_reference


#: Every request's generated tokens, and its logits at each sampled step.
Outputs = tuple[dict[str, list[int]], dict[str, torch.Tensor]]


def _run_scenario(driver: Driver, prompt_of: Callable[[int, int], list[int]]) -> Outputs:
    """Chunked prefill, a prefix hit and a preemption (then recompute) in one run."""
    shared = prompt_of(26, 4)
    driver.add("a", shared + prompt_of(5, 5))
    driver.add("c", prompt_of(18, 7))
    driver.run(3, chunk=7)
    driver.preempt("c")
    second = driver.add("b", shared + prompt_of(6, 6))
    driver.run(6, chunk=7)
    assert second.hit_tokens >= 24, "b resumes from a's cached pages"
    tokens = {rid: list(seq.output) for rid, seq in driver.active.items()}
    return tokens, {rid: torch.stack(rows) for rid, rows in driver.logits.items()}


@pytest.fixture
def run_scenario() -> Callable[[Driver], Outputs]:
    """``run_scenario(driver)``: the pipeline tests' workload, its tokens and logits."""
    return lambda driver: _run_scenario(driver, _prompt_of)


def assert_same_outputs(got: Outputs, expected: Outputs, atol: float = 1e-5) -> None:
    """The same tokens for every request, and logits within ``atol``."""
    assert got[0] == expected[0]
    assert got[1].keys() == expected[1].keys()
    for rid, logits in expected[1].items():
        torch.testing.assert_close(got[1][rid], logits, atol=atol, rtol=0)


@pytest.fixture
def check_same_outputs() -> Callable[[Outputs, Outputs], None]:
    """``check_same_outputs(got, expected)``: same tokens, logits within 1e-5."""
    return assert_same_outputs


@pytest.fixture
def drive() -> Callable[..., Driver]:
    """``drive(executor)``: a Driver over any executor (a pipeline, chained stages)."""
    return Driver


class ChainedStages:
    """Stage executors run one after the other in this process: a pipeline without
    processes, testing the slicing of the model and of its pages on their own."""

    def __init__(self, stages: Sequence[ModelExecutor]) -> None:
        self.stages = list(stages)
        self.plan = stages[0].plan
        self.logits_hook: LogitsHook | None = None

    def execute(self, batch: StepBatch) -> StepResult:
        first, last = self.stages[0], self.stages[-1]
        check_batch(batch, first.plan, first.max_model_len)
        if not batch.requests:
            return StepResult(token_ids=())
        hidden = None
        for stage in self.stages:
            inputs = stage.prepare(batch)
            hidden = stage.forward(inputs, hidden)
        assert hidden is not None
        last.logits_hook = self.logits_hook
        return last.finish(batch, inputs, hidden)


@pytest.fixture
def chain() -> type[ChainedStages]:
    """``chain(stages)``: stage executors chained in one process, run as one executor."""
    return ChainedStages


async def _serve_all(
    executor: Any, config: Any, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> tuple[dict[int, list[int]], Any]:
    """Every prompt through one async Engine at once; each one's tokens, and the stats."""
    import anyio

    from hybridkv.scheduler import Engine

    outputs: dict[int, list[int]] = {}

    async def consume(engine: Engine, i: int) -> None:
        async with engine.generate(prompts[i], params) as stream:
            async for output in stream:
                outputs[i] = list(output.token_ids)

    with anyio.fail_after(60):
        async with Engine(config, executor) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(consume, engine, i)
            stats = engine.stats()
    return outputs, stats


@pytest.fixture
def serve_all() -> Callable[..., Any]:
    """``await serve_all(executor, config, prompts, params)``: (tokens by index, stats)."""
    return _serve_all
