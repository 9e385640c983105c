"""From the engine flags (:class:`~hybridkv.serving.cli.flags.engine.EngineArgs`) to a
loaded model and the engine config that fits its pool.

One process loads a :class:`ModelExecutor`; with pipeline stages or context ranks
(``--pipeline-parallel-size``, ``--context-parallel-size``) this process runs rank 0 and
starts the others, or, under torchrun, ranks other than 0 serve their stage instead of
the command (:func:`pipeline_worker_status`). Every loader takes one
:class:`~hybridkv.executor.load_options.LoadOptions` made by :func:`load_options`.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from hybridkv.serving.cli.builtin_models import BUILTIN_MODELS, resolve_model
from hybridkv.serving.cli.flags.engine import EngineArgs, engine_args, num_ranks
from hybridkv.serving.openai.chat_template import ChatTemplate

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from hybridkv.executor.load_options import LoadOptions
    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.memory.layout import LayerSpec
    from hybridkv.parallel.pipeline_executor import PipelineExecutor
    from hybridkv.scheduler import EngineConfig
    from hybridkv.scheduler.draft_proposer import DraftModelProposer

__all__ = ["EngineArgs", "LoadedModel", "load_model", "load_options"]


@attrs.frozen(kw_only=True)
class LoadedModel:
    """A model ready to serve: its executor, the engine config for its pool, its text side.

    Attributes:
        name: The name clients use (the built-in name or the folder's name).
        folder: The checkpoint folder.
        executor: The model executor, KV tensors allocated (stage 0's and the workers'
            with a pipeline, which is closed at exit or by the next ``load_model``).
        engine_config: Pool, batch limits and end tokens for :class:`Engine`.
        tokenizer: The checkpoint's tokenizer.
        chat_template: Its chat template (or the plain fallback).
        specs: Per-layer KV specs the layout was planned from (for layout reports).
        weights: The weight format loaded (``--weights`` with ``auto`` resolved).
        proposer: With ``--speculative-config`` of method ``draft_model``, the draft
            model's proposer (give it to the :class:`Engine`); None otherwise.
    """

    name: str
    folder: Path
    executor: ModelExecutor | PipelineExecutor
    engine_config: EngineConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    specs: list[LayerSpec]
    weights: str = "dtype"
    proposer: DraftModelProposer | None = None

    @property
    def max_model_len(self) -> int:
        """Most tokens of one request."""
        return self.engine_config.max_model_len


def load_model(settings: EngineArgs, *, quiet: bool = False) -> LoadedModel:
    """Resolve, convert if needed, and load ``settings.model``; lay out its KV pool.

    Raises:
        UsageError: the checkpoint has no tokenizer.json, or a setting is out of range.
        ModelNotFoundError, MissingExtraError: see :func:`resolve_model`.
        ModelConfigError, PolicyError: a layer policy for a kind the model lacks.
    """
    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.memory.layout import cached_layers
    from hybridkv.scheduler import EngineConfig
    from hybridkv.serving.cli.flags.values import UsageError

    name, folder = resolve_model(settings.model, revision=settings.revision)
    dtype, kv_memory = checkpoint_dtype(settings.dtype, folder), kv_bytes(settings, folder)
    settings = attrs.evolve(settings, dtype=dtype, kv_memory=kv_memory)
    weights = _weight_format(settings, builtin=name in BUILTIN_MODELS)
    if not quiet:
        print(f"loading {name} from {folder}", file=sys.stderr, flush=True)
    executor: ModelExecutor | PipelineExecutor
    options = load_options(settings, weights)
    if settings.num_ranks > 1:
        executor = _start_pipeline(folder, settings, options)
    else:
        executor = ModelExecutor.from_pretrained(folder, options)
    if executor.tokenizer is None:
        raise UsageError(f"the checkpoint {str(folder)!r} has no tokenizer.json")
    limit = executor.max_model_len
    if settings.max_model_len is not None:
        limit = min(limit, settings.max_model_len)
    config = EngineConfig.for_executor(
        executor,
        max_model_len=limit,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        eos_token_ids=executor.eos_token_ids,
        vocab_size=executor.config.vocab_size,
        speculative_config=settings.speculative_config,
    )
    return LoadedModel(
        name=name,
        folder=folder,
        executor=executor,
        engine_config=config,
        tokenizer=executor.tokenizer,
        chat_template=ChatTemplate.from_checkpoint(folder),
        specs=cached_layers(executor.specs),
        weights=weights,
        proposer=_draft_proposer(settings, executor, limit, quiet=quiet),
    )


def _draft_proposer(
    settings: EngineArgs,
    target: ModelExecutor | PipelineExecutor,
    max_model_len: int,
    *,
    quiet: bool,
) -> DraftModelProposer | None:
    """The draft model of ``--speculative-config``'s ``model``, loaded as the target is
    (dtype, threads) on the target's torch thread, with a quarter of its KV bytes."""
    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.scheduler.draft_proposer import DraftModelProposer

    spec = settings.speculative_config
    if spec is None or spec.model is None:
        return None
    assert isinstance(target, ModelExecutor), "engine_args refuses a draft beside stages"
    name, folder = resolve_model(spec.model)
    if not quiet:
        print(f"loading the draft model {name} from {folder}", file=sys.stderr, flush=True)
    options = attrs.evolve(
        load_options(settings, "dtype"), kv_cache_bytes=max(1 << 20, settings.kv_memory // 4)
    )
    draft = ModelExecutor.from_pretrained(folder, options, torch_thread=target.torch_thread)
    return DraftModelProposer(draft, vocab_size=target.vocab_size, max_model_len=max_model_len)


def _weight_format(settings: EngineArgs, *, builtin: bool) -> str:
    """``--weights`` with ``auto`` resolved: the machine's default for a built-in model
    (whose quality under it is measured), the model dtype for other checkpoints and
    across processes (int8 and int4 run there when asked for)."""
    from hybridkv.models.weights.precision import machine_default

    multi = settings.num_ranks > 1
    if settings.weights == "auto":
        return machine_default() if builtin and not multi else "dtype"
    return settings.weights


def load_options(settings: EngineArgs, weights: str = "dtype") -> LoadOptions:
    """What every loader of ``settings``' model takes (each pipeline stage the same)."""
    import torch

    from hybridkv.executor.load_options import LoadOptions

    spec = settings.speculative_config
    return LoadOptions(
        kv_cache_bytes=settings.kv_memory,
        block_size=settings.block_size,
        dtype=getattr(torch, settings.dtype),
        num_threads=settings.threads,
        uniform_layout=settings.uniform_kv,
        policies=settings.layer_policies,
        weights=weights,
        seed=settings.seed,
        text_only=settings.text_only,
        # Method mtp: the checkpoint's MTP layer, its memory in the pool, proposes.
        mtp_proposals=spec.num_speculative_tokens if spec and spec.method == "mtp" else 0,
    )


def checkpoint_dtype(dtype: str, folder: Path) -> str:
    """``--dtype`` with ``auto`` resolved to the checkpoint's ``torch_dtype`` (``dtype`` in
    newer configs) where it names one of ours, else float32."""
    if dtype != "auto":
        return dtype
    import json

    config = json.loads((folder / "config.json").read_text())
    named = config.get("torch_dtype") or config.get("dtype")
    return named if named in ("float32", "bfloat16", "float16") else "float32"


def kv_bytes(settings: EngineArgs, folder: Path) -> int:
    """The KV pool's bytes: ``--kv-memory``, or with ``--gpu-memory-utilization F`` (as
    vLLM) F times the device's memory (on the CPU, the host memory free now) less the
    checkpoint's weight bytes.

    Raises:
        UsageError: that share leaves nothing for the KV pool.
    """
    from hybridkv.serving.cli.flags.values import UsageError

    share = settings.memory_utilization
    if share is None:
        return settings.kv_memory
    weights = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    total, where = device_memory()
    budget = int(share * total) - weights
    if budget <= 0:
        raise UsageError(
            f"--gpu-memory-utilization {share}: {share * total / 2**30:.2f} GiB of the "
            f"{total / 2**30:.2f} GiB {where} leaves nothing for the KV pool after "
            f"{weights / 2**30:.2f} GiB of weights"
        )
    return budget


def device_memory() -> tuple[int, str]:
    """The bytes ``--gpu-memory-utilization`` is a share of, and what they are: the host
    memory available now (this engine runs on the CPU)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "of free host memory"
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return pages * os.sysconf("SC_PAGE_SIZE"), "of free host memory"


#: Pipelines load_model started. A pipeline owns the process group, so a process runs one
#: at a time: the next load closes the last (``bench --compare-uniform`` loads twice).
_pipelines: list[PipelineExecutor] = []


def _start_pipeline(folder: Path, settings: EngineArgs, options: LoadOptions) -> PipelineExecutor:
    from hybridkv.memory.offload import OffloadConfigError, parse_tier
    from hybridkv.parallel.pipeline_executor import PipelineExecutor
    from hybridkv.parallel.rank_offload import check_pipeline_tiers
    from hybridkv.serving.cli.flags.values import UsageError

    try:  # what the ranks' tiers cannot do is refused before any worker starts
        tiers = [parse_tier(text) for text in settings.kv_offload]
        check_pipeline_tiers(folder, options, settings.pipeline_parallel_size, tiers)
    except OffloadConfigError as exc:
        raise UsageError(str(exc)) from exc
    close_pipelines()
    atexit.unregister(close_pipelines)
    atexit.register(close_pipelines)  # stops the workers however the command ends
    pipeline = PipelineExecutor.from_pretrained(
        folder,
        options,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        context_parallel_size=settings.context_parallel_size,
        kv_interleave=_kv_interleave(settings),
        tensor_parallel_size=settings.tensor_parallel_size,
        max_steps_in_flight=1 if settings.kv_offload else None,
    )
    _pipelines.append(pipeline)
    return pipeline


def _kv_interleave(settings: EngineArgs) -> int:
    """The tokens context parallelism deals to a rank at a time."""
    return settings.block_size if settings.kv_interleave == "block" else 1


def close_pipelines() -> None:
    """Stop the pipeline load_model started, if any (also done at exit)."""
    while _pipelines:
        _pipelines.pop().close()


def pipeline_worker_status(args: argparse.Namespace) -> int | None:
    """Under torchrun, a rank other than 0 serves its pipeline stage instead of running the
    command: its exit status once rank 0 stops the pipeline. None for every other process.

    ``torchrun --nproc-per-node 2 --no-python hybridkv serve MODEL -pp 2`` starts two
    ranks: rank 0 serves HTTP and runs stage 0, rank 1 runs stage 1.
    """
    if num_ranks(args) < 2 or os.environ.get("RANK", "0") == "0":
        return None
    from hybridkv.parallel.pipeline_launch import StageSettings, run_torchrun_worker
    from hybridkv.serving.cli.flags.console import configure_logging

    configure_logging(getattr(args, "log_level", "warning"), getattr(args, "log_format", "text"))
    settings = engine_args(args)
    _, folder = resolve_model(settings.model, revision=settings.revision)
    stage = StageSettings.create(
        folder,
        load_options(settings),
        pipeline_parallel_size=settings.pipeline_parallel_size,
        context_parallel_size=settings.context_parallel_size,
        kv_interleave=_kv_interleave(settings),
        tensor_parallel_size=settings.tensor_parallel_size,
    )
    return run_torchrun_worker(stage)
