"""From command-line flags to a loaded model and the engine config that fits its pool.

``serve``, ``generate``, ``demo`` and ``bench`` share these flags, so a user learns them
once: the KV byte budget, the block size, the per-step token budget, the running-request
limit, prefix caching, threads, dtype, and the memory policy of each kind of layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from hybridkv.serving.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL, resolve_model
from hybridkv.serving.chat import ChatTemplate

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from hybridkv.memory.layout import LayerSpec
    from hybridkv.models.executor import ModelExecutor
    from hybridkv.policies import MemoryPolicy
    from hybridkv.scheduler import EngineConfig

_DTYPES = ("float32", "bfloat16", "float16")


@attrs.frozen(kw_only=True)
class EngineArgs:
    """The engine and model settings a command line can choose."""

    model: str | None = None
    kv_memory: int = 1 << 30
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    threads: int | None = None
    dtype: str = "float32"
    uniform_kv: bool = False
    layer_policies: tuple[tuple[str, MemoryPolicy], ...] = ()


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The optional MODEL positional: a checkpoint folder or a built-in name."""
    names = ", ".join(BUILTIN_MODELS)
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        default=None,
        help=f"checkpoint folder (config.json, safetensors, tokenizer.json) or built-in "
        f"name ({names}); default: {DEFAULT_MODEL}",
    )


def add_engine_arguments(parser: argparse.ArgumentParser, *, kv_memory: str = "1GiB") -> None:
    """The flags every model-running command takes."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--kv-memory",
        default=kv_memory,
        metavar="SIZE",
        help=f"bytes of KV cache, shared by every layer group: 512MiB, 2GiB ({kv_memory})",
    )
    group.add_argument(
        "--block-size", type=int, default=16, metavar="N", help="tokens per KV page (16)"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        "--token-budget",
        type=int,
        default=512,
        metavar="N",
        help="tokens one engine step may run, prefill chunks and decodes together (512)",
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=32, metavar="N", help="most running requests (32)"
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="most tokens per request, prompt and output (default: the model's limit)",
    )
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse the KV pages of repeated prompt prefixes",
    )
    group.add_argument(
        "--threads", type=int, default=None, metavar="N", help="torch CPU threads (all cores)"
    )
    group.add_argument("--dtype", choices=_DTYPES, default="float32", help="weights and KV dtype")
    add_layer_policy_argument(group)


def add_layer_policy_argument(parser: argparse._ActionsContainer) -> None:
    """``--layer-policy KIND=NAME[:key=value,...]``, repeatable."""
    parser.add_argument(
        "--layer-policy",
        dest="layer_policies",
        action="append",
        default=[],
        metavar="KIND=NAME[:K=V,...]",
        help="memory policy of one kind of layer, kept and attended, instead of the "
        "config's: sliding_attention=full, full_attention=sliding_window:window=1024 "
        "(policy names: hybridkv.policies.policy_names())",
    )


def parse_layer_policies(texts: list[str]) -> tuple[tuple[str, MemoryPolicy], ...]:
    """``KIND=NAME[:key=value,...]`` flags as (layer kind, policy) pairs.

    Values that read as integers or floats are passed as numbers, others as strings.

    Raises:
        UsageError: a malformed flag, or one kind named twice.
        PolicyError: an unknown policy name or parameters it rejects.
    """
    from hybridkv.policies import make_policy
    from hybridkv.serving.cli import UsageError

    out: dict[str, MemoryPolicy] = {}
    for text in texts:
        kind, _, spec = (part.strip() for part in text.partition("="))
        name, _, params_text = (part.strip() for part in spec.partition(":"))
        items = [item.partition("=") for item in params_text.split(",")] if params_text else []
        if not kind or not name or any(not key.strip() or not eq for key, eq, _ in items):
            raise UsageError(
                f"--layer-policy {text!r} is not KIND=NAME[:key=value,...], such as "
                "full_attention=sliding_window:window=1024"
            )
        if kind in out:
            raise UsageError(f"--layer-policy names the layer kind {kind!r} twice")
        params = {key.strip(): _number_or_text(value.strip()) for key, _, value in items}
        out[kind] = make_policy(name, **params)
    return tuple(out.items())


def _number_or_text(value: str) -> object:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The parsed flags as :class:`EngineArgs`."""
    from hybridkv.serving.cli import UsageError, parse_size

    for flag in ("block_size", "max_num_batched_tokens", "max_num_seqs", "threads"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return EngineArgs(
        model=args.model,
        kv_memory=parse_size(args.kv_memory),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        threads=args.threads,
        dtype=args.dtype,
        uniform_kv=getattr(args, "uniform_kv", False),
        layer_policies=parse_layer_policies(getattr(args, "layer_policies", [])),
    )


@attrs.frozen(kw_only=True)
class LoadedModel:
    """A model ready to serve: its executor, the engine config for its pool, its text side.

    Attributes:
        name: The name clients use (the built-in name or the folder's name).
        folder: The checkpoint folder.
        executor: The model executor, KV tensors allocated.
        engine_config: Pool, batch limits and end tokens for :class:`Engine`.
        tokenizer: The checkpoint's tokenizer.
        chat_template: Its chat template (or the plain fallback).
        specs: Per-layer KV specs the layout was planned from (for layout reports).
    """

    name: str
    folder: Path
    executor: ModelExecutor
    engine_config: EngineConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    specs: list[LayerSpec]

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
    import torch

    from hybridkv.models.executor import ModelExecutor
    from hybridkv.scheduler import EngineConfig
    from hybridkv.serving.cli import UsageError

    name, folder = resolve_model(settings.model)
    dtype = getattr(torch, settings.dtype)
    if not quiet:
        print(f"loading {name} from {folder}", file=sys.stderr, flush=True)
    executor = ModelExecutor.from_pretrained(
        folder,
        kv_cache_bytes=settings.kv_memory,
        block_size=settings.block_size,
        dtype=dtype,
        num_threads=settings.threads,
        uniform_layout=settings.uniform_kv,
        policies=dict(settings.layer_policies),
    )
    if executor.tokenizer is None:
        raise UsageError(f"the checkpoint {str(folder)!r} has no tokenizer.json")
    limit = executor.max_model_len
    if settings.max_model_len is not None:
        limit = min(limit, settings.max_model_len)
    options: dict[str, Any] = {
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "eos_token_ids": executor.eos_token_ids,
        "vocab_size": executor.config.vocab_size,
    }
    config = EngineConfig.for_executor(executor, max_model_len=limit, **options)
    return LoadedModel(
        name=name,
        folder=folder,
        executor=executor,
        engine_config=config,
        tokenizer=executor.tokenizer,  # type: ignore[arg-type]
        chat_template=ChatTemplate.from_checkpoint(folder),
        specs=list(executor.specs),
    )
