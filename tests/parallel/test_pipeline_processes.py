"""Pipeline stages in worker processes over gloo: the same outputs as one process, steps
in flight through the engine, and the faults that must never hang or leak a process."""

from __future__ import annotations

import multiprocessing
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from safetensors.torch import load_file, save_file

from hybridkv.errors import HybridKVError
from hybridkv.executor.errors import BatchError
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.models.errors import CheckpointError, ParallelConfigError
from hybridkv.parallel.errors import PipelineError
from hybridkv.parallel.pipeline_executor import PipelineExecutor
from hybridkv.parallel.pipeline_launch import TorchrunEnv
from hybridkv.parallel.rank_layout import ParallelConfig
from hybridkv.scheduler import Engine, EngineConfig, SamplingParams
from hybridkv.scheduler.batch import ExecutorBrokenError, StepBatch, StepRequest

KV_BYTES = 1 << 20


def _pipeline(
    path: Path,
    num_stages: int,
    *,
    kv_cache_bytes: int = KV_BYTES,
    step_timeout_s: float = 30.0,
    tensor_parallel_size: int = 1,
) -> PipelineExecutor:
    options = LoadOptions(kv_cache_bytes=kv_cache_bytes, block_size=4, num_threads=1)
    return PipelineExecutor.from_pretrained(
        path,
        options,
        pipeline_parallel_size=num_stages,
        step_timeout_s=step_timeout_s,
        tensor_parallel_size=tensor_parallel_size,
    )


def _assert_no_workers_left(pipeline: PipelineExecutor) -> None:
    assert not multiprocessing.active_children()
    for pid in pipeline.worker_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3"])
def test_pipeline_matches_one_process(
    name, num_stages, tiny_models, make_driver, drive, run_scenario, check_same_outputs
) -> None:
    """2 and 3 stage processes give one process's tokens, and logits within 1e-5, through
    chunked prefill, a prefix hit and a preemption."""
    expected = run_scenario(make_driver(name))
    with _pipeline(tiny_models[name].path, num_stages) as pipeline:
        got = run_scenario(drive(pipeline))
    check_same_outputs(got, expected)
    stats = pipeline.stage_stats
    assert [s.stage for s in stats] == list(range(num_stages))
    assert len({s.num_steps for s in stats}) == 1  # every stage ran every step
    _assert_no_workers_left(pipeline)


# About 30 pages of 4 tokens per group in one process: three requests cannot all fit.
SMALL_POOL = 30 * 2 * 1024


@pytest.mark.asyncio
async def test_engine_keeps_two_steps_in_flight_and_matches_one_process(tiny_models, prompt_of):
    """Through the engine, with two steps in flight and preemptions, 2 stages give the
    tokens one process gives."""
    path = tiny_models["gemma3"].path
    prompts = [prompt_of(n, 30 + n) for n in (14, 19, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def run(executor) -> tuple[dict[int, list[int]], int]:
        config = EngineConfig.for_executor(
            executor, max_model_len=64, max_num_batched_tokens=16, max_prefill_chunk=8
        )
        outputs: dict[int, list[int]] = {}

        async def consume(engine: Engine, i: int) -> None:
            async with engine.generate(prompts[i], params) as stream:
                async for output in stream:
                    outputs[i] = list(output.token_ids)

        async with Engine(config, executor) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(consume, engine, i)
            return outputs, engine.stats().num_preemptions

    one = ModelExecutor.from_pretrained(path, LoadOptions(kv_cache_bytes=SMALL_POOL, block_size=4))
    with anyio.fail_after(60):
        expected, _ = await run(one)
        # Each stage holds half the layers: half the bytes give one process's page count.
        with _pipeline(path, 2, kv_cache_bytes=SMALL_POOL // 2) as pipeline:
            assert pipeline.pool == one.pool
            got, num_preemptions = await run(pipeline)
    assert got == expected
    assert num_preemptions > 0
    assert pipeline.peak_steps_in_flight == 2


def test_a_batch_that_does_not_fit_fails_only_its_step(tiny_models, prompt_of) -> None:
    """A block table mapping a new token to the null block fails that step; the next runs."""
    with _pipeline(tiny_models["llama"].path, 2) as pipeline:
        bad = StepRequest(
            request_id="bad", token_ids=[5, 6], start_position=0, block_tables=[[0]],
            sample=True, params=SamplingParams(temperature=0.0), output_index=0,
        )  # fmt: skip
        with pytest.raises(BatchError, match="'bad': block table of group 0 maps a position"):
            pipeline.execute(StepBatch((bad,)))
        good = StepRequest(
            request_id="good", token_ids=prompt_of(6, 1), start_position=0,
            block_tables=[[1, 2]], sample=True, params=SamplingParams(temperature=0.0),
            output_index=0,
        )  # fmt: skip
        assert pipeline.execute(StepBatch((good,))).token_ids[0] is not None


def test_more_stages_than_layers_is_refused_before_any_process_starts(tiny_models) -> None:
    """Five stages of a four-layer model: a clear error, and no process was started."""
    with pytest.raises(ParallelConfigError, match="pipeline_parallel_size=5 exceeds the model's 4"):
        _pipeline(tiny_models["llama"].path, 5)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("num_stages", "tp", "who"),
    [(2, 1, r"pipeline stage 1"), (1, 2, r"rank 1 \(tensor rank 1\)")],
)
def test_a_rank_that_cannot_load_is_named_at_start(tiny_models, tmp_path, num_stages, tp, who):
    """A checkpoint missing a tensor of the last layer: the stage (or tensor rank) holding
    it reports its error at start, named by its place in the layout."""
    source = tiny_models["llama"].path
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.3.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises((PipelineError, CheckpointError)) as info:
        _pipeline(tmp_path, num_stages, tensor_parallel_size=tp)
    if tp == 1:  # rank 0 holds no layer 3: only stage 1 fails
        assert re.search(who + r" \(pid \d+\) failed to load: CheckpointError", str(info.value))
    assert not multiprocessing.active_children()


async def _break_mid_stream(pipeline: PipelineExecutor, fault: signal.Signals) -> BaseException:
    """Stream a long request; send ``fault`` to the last stage after 3 tokens; the error."""
    config = EngineConfig.for_executor(pipeline, max_model_len=400)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    async with Engine(config, pipeline) as engine:
        with pytest.raises(HybridKVError) as info:
            async with engine.generate([5, 6, 7, 8], params) as stream:
                async for output in stream:
                    if len(output.token_ids) == 3:
                        os.kill(pipeline.worker_pids[-1], fault)
        assert not engine.is_running
        assert isinstance(engine.error, ExecutorBrokenError)
    return info.value


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("num_stages", "tp", "who"), [(3, 1, "pipeline stage 2"), (1, 2, "rank 1 (tensor rank 1)")]
)
async def test_a_killed_worker_fails_the_request_and_stops_the_engine(
    tiny_models, num_stages, tp, who
) -> None:
    """SIGKILL to a stage (or a tensor rank): the request fails naming it, the engine
    stops, no worker is left."""
    pipeline = _pipeline(tiny_models["llama"].path, num_stages, tensor_parallel_size=tp)
    try:
        with anyio.fail_after(30):
            error = await _break_mid_stream(pipeline, signal.SIGKILL)
    finally:
        pipeline.close()
    assert isinstance(error.__cause__, ExecutorBrokenError)
    assert f"{who} (pid {pipeline.worker_pids[-1]}) was killed by SIGKILL" in str(error.__cause__)
    _assert_no_workers_left(pipeline)


@pytest.mark.asyncio
@pytest.mark.parametrize(("num_stages", "tp"), [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
async def test_a_hung_worker_fails_the_request_within_the_step_timeout(
    tiny_models, num_stages, tp
) -> None:
    """SIGSTOP to a stage (or a tensor rank, which rank 0 then waits for inside a layer):
    after step_timeout_s the request fails, the workers are reaped."""
    path = tiny_models["llama"].path
    pipeline = _pipeline(path, num_stages, step_timeout_s=3.0, tensor_parallel_size=tp)
    try:
        with anyio.fail_after(60):  # a guard: without the step timeout it never fails
            error = await _break_mid_stream(pipeline, signal.SIGSTOP)
    finally:
        pipeline.close()
    assert isinstance(error.__cause__, ExecutorBrokenError)
    assert "a stage hangs" in str(error.__cause__)
    _assert_no_workers_left(pipeline)


_ORPHAN_SCRIPT = """
import sys
from hybridkv.executor.load_options import LoadOptions
from hybridkv.parallel.pipeline_executor import PipelineExecutor
from hybridkv.parallel.pipeline_launch import TorchrunEnv
from hybridkv.parallel.rank_layout import ParallelConfig

if __name__ == "__main__":
    options = LoadOptions(kv_cache_bytes=1 << 20, num_threads=1)
    pipeline = PipelineExecutor.from_pretrained(sys.argv[1], options, pipeline_parallel_size=3)
    print("workers", *pipeline.worker_pids, flush=True)
    sys.stdin.read()  # until the test kills this process
"""


def test_workers_exit_when_the_engine_process_is_killed(tiny_models, tmp_path) -> None:
    """SIGKILL to the engine's process (no cleanup runs there): its workers exit too."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(_ORPHAN_SCRIPT))
    engine = subprocess.Popen(
        [sys.executable, str(script), str(tiny_models["llama"].path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert engine.stdout is not None
        line = ""
        while not line.startswith("workers"):  # structlog's lines come first
            line = engine.stdout.readline()
            assert line, "the engine process ended early"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2
        # Process descriptors: readable once the worker exits (it is not our child).
        exits = [os.pidfd_open(pid) for pid in pids]
    finally:
        engine.kill()
        engine.wait()
        engine.stdout.close()  # type: ignore[union-attr]
        engine.stdin.close()  # type: ignore[union-attr]
    try:
        waiting = list(exits)
        while waiting:  # woken by each exit; 60 s bounds a worker that never notices
            ready, _, _ = select.select(waiting, [], [], 60)
            assert ready, f"workers still alive: {[p for p in pids if _is_alive(p)]}"
            waiting = [fd for fd in waiting if fd not in ready]
    finally:
        for fd in exits:
            os.close(fd)
    assert not [pid for pid in pids if _is_alive(pid)]


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead; it waits for its (new) parent to reap it.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_second_pipeline_in_one_process_is_refused_while_the_first_runs(tiny_models) -> None:
    """A pipeline owns the process group: a second one waits for the first to close."""
    path = tiny_models["llama"].path
    with _pipeline(path, 2), pytest.raises(ParallelConfigError, match="already initialised"):
        _pipeline(path, 2)
    with _pipeline(path, 2) as again:
        assert again.num_stages == 2


def test_a_launcher_world_must_have_one_rank_per_stage() -> None:
    """torchrun's variables are read as a world; three ranks for two stages is refused."""
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}  # fmt: skip
    launched = TorchrunEnv.read(env)
    assert launched is not None
    assert (launched.rank, launched.local_rank, launched.world_size) == (1, 1, 3)
    assert TorchrunEnv.read({"RANK": "0"}) is None
    with pytest.raises(ParallelConfigError, match="started 3 processes for pipeline_parallel"):
        launched.check(ParallelConfig(pipeline=2))
