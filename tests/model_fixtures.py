"""Tiny random checkpoints of each architecture, their transformers reference, a driver.

A pytest plugin of the suite (``tests/conftest.py`` names it), shared by the tests of
``models/``, ``executor/`` and ``parallel/``.

Checkpoints are written once per session with ``save_pretrained`` (safetensors) after every
weight, norms included, is re-randomised: default norm weights (zeros or ones) would hide
a wrong ``1 + weight``. The reference model is the same folder loaded by transformers
with eager attention, in float32.
"""

from __future__ import annotations

import random
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
from hybridkv.testing.tiny_models import TINY_ARCHITECTURES, save_tiny

#: The attention-only architectures of TINY_ARCHITECTURES: the first three, then those
#: added on the shared blocks.
NEW_FAMILIES = (
    *("qwen2", "qwen3", "mistral", "smollm3", "seed_oss", "olmo3", "exaone4"),
    *("qwen3_moe", "phi3", "cohere2", "gpt_oss", "ministral3", "llama4"),
    *("granite_swa", "granitemoe_swa", "afmoe", "mimo_v2_flash", "gemma4", "gemma4_moe"),
    *("deepseek_v3", "deepseek_v32"),
)
ATTENTION = ("llama", "gemma2", "gemma3", *NEW_FAMILIES)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
KV_BYTES = 1 << 20


class ReferenceModelProposer:
    """transformers' greedy continuation, each token wrong with probability ``miss``."""

    def __init__(self, reference: Any, vocab_size: int, miss: float, seed: int) -> None:
        self.reference = reference
        self.vocab_size = vocab_size
        self.miss = miss
        self._random = random.Random(seed)

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        with torch.no_grad():
            out = self.reference.generate(
                torch.tensor([list(tokens)]), max_new_tokens=k, do_sample=False, pad_token_id=0
            )
        right = out[0, len(tokens) :].tolist()
        return tuple(
            (t + 1) % self.vocab_size if self._random.random() < self.miss else t for t in right
        )


@attrs.frozen
class TinyModel:
    """A saved tiny checkpoint and its transformers reference."""

    name: str
    path: Path
    reference: Any

    @classmethod
    def load(cls, name: str, path: Path, *, multimodal: bool = False) -> TinyModel:
        """The checkpoint at ``path`` with transformers' eager float32 model of it (the
        whole image-text model where ``multimodal``) as the reference."""
        import transformers

        auto = "AutoModelForImageTextToText" if multimodal else "AutoModelForCausalLM"
        reference = getattr(transformers, auto).from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32
        )
        return cls(name, path, reference.eval())

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
    torch.set_num_threads(1)
    return {
        name: TinyModel.load(name, save_tiny(name, tmp_path_factory.mktemp(name), seed=seed))
        for seed, name in enumerate(TINY_ARCHITECTURES)
    }


@pytest.fixture(scope="session")
def tiny_multimodal(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """One tiny multimodal checkpoint per builder (with the byte tokenizer), and the
    whole multimodal model as its reference."""
    from hybridkv.testing import byte_tokenizer
    from hybridkv.testing.tiny_models import save_redrawn
    from hybridkv.testing.tiny_multimodal import MULTIMODAL_BUILDERS

    out = {}
    for name, build in MULTIMODAL_BUILDERS.items():
        folder = save_redrawn(build(), tmp_path_factory.mktemp(f"multimodal_{name}"))
        byte_tokenizer().save(str(folder / "tokenizer.json"))
        out[name] = TinyModel.load(name, folder, multimodal=True)
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
            tokens = seq.all_token_ids
            requests.append(
                StepRequest(
                    request_id=seq.request_id,
                    token_ids=tokens[start : start + n],
                    start_position=start,
                    block_tables=[list(t) for t in self.kv.block_tables(seq.request_id)],
                    sample=start + n == len(tokens),
                    params=seq.params,
                    output_index=len(seq.output),
                    next_token_id=tokens[start + n] if start + n < len(tokens) else None,
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


async def _serve_in_turn(
    path: Path, prompts: Sequence[Sequence[int]], offload: Any = None, *, device: str = "cpu"
) -> tuple[list[list[int]], Any]:
    """Each prompt through one Engine in turn (greedy, 6 tokens, EOS ignored) over a pool
    of about 40 pages of 4 tokens per group, so that later prompts flush earlier ones;
    with an ``OffloadConfig``, each one's pages saved before the next. The tokens, and
    the engine (its stats)."""
    from hybridkv.scheduler import EngineConfig

    options = LoadOptions(kv_cache_bytes=40 * 2 * 1024, block_size=4, device=device)
    executor = ModelExecutor.from_pretrained(path, options)
    config = EngineConfig.for_executor(executor, max_model_len=128, max_prefill_chunk=16)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs, _, engine = await run_in_turn(executor, config, prompts, params, offload)
    return outputs, engine


async def run_in_turn(
    executor: ModelExecutor,
    config: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    offload: Any = None,
) -> tuple[list[list[int]], list[int], Any]:
    """Each prompt through one Engine in turn, with an ``OffloadConfig`` each one's pages
    saved before the next; each one's tokens and cached prompt tokens, and the engine
    (its stats). Closes the executor."""
    import anyio

    from hybridkv.scheduler import Engine

    outputs, cached = [], []
    try:
        with anyio.fail_after(120):
            async with Engine(config, executor, offload=offload) as engine:
                for prompt in prompts:
                    async with engine.generate(prompt, params) as stream:
                        async for out in stream:
                            tokens, hit = list(out.token_ids), out.num_cached_tokens
                    outputs.append(tokens)
                    cached.append(hit)
                    if executor.transfers is not None:
                        assert executor.transfers.wait_saved()
    finally:
        executor.close()
    return outputs, cached, engine


@pytest.fixture
def serve_in_turn() -> Callable[..., Any]:
    """``await serve_in_turn(path, prompts, offload=None, device="cpu")``: (tokens, engine)."""
    return _serve_in_turn
