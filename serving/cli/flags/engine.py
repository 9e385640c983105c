"""The engine flags every model-running command shares, and the settings they make.

``serve``, ``generate``, ``demo`` and ``bench`` share these flags, so a user learns them
once: the KV byte budget, the block size, the per-step token budget, the running-request
limit, prefix caching, threads, dtype, weights, the memory policy of each kind of layer,
pipeline stages (``--pipeline-parallel-size N``), context-parallel ranks per stage
(``--context-parallel-size N``: every request's tokens and KV pages shared by N processes)
and speculative decoding (``--speculative-config JSON``, vLLM's).

``serve`` also takes the scheduling flags (:func:`add_scheduling_arguments`): the order of
waiting requests (``--scheduling-policy``, vLLM's) and the share of the running slots one
request's choices may hold (``--max-running-share``).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

import attrs

from hybridkv.models.weights.formats import WEIGHT_CHOICES
from hybridkv.serving.cli.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL
from hybridkv.serving.cli.flags.values import add_import_argument

if TYPE_CHECKING:
    from hybridkv.policies import MemoryPolicy
    from hybridkv.scheduler.speculation import SpeculativeConfig

_DTYPES = ("float32", "bfloat16", "float16")
#: vLLM's ``--kv-cache-dtype`` values; the KV pages here are in the model dtype (``auto``).
_KV_CACHE_DTYPES = ("auto", *_DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")


@attrs.frozen(kw_only=True)
class EngineArgs:
    """The engine and model settings a command line can choose."""

    model: str | None = None
    #: A hub name's branch, tag or commit (``--revision``); None: the default branch.
    revision: str | None = None
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
    pipeline_parallel_size: int = 1
    weights: str = "auto"
    context_parallel_size: int = 1
    kv_interleave: str = "token"
    #: vLLM's --gpu-memory-utilization: KV bytes are this share of the device's memory
    #: (free host memory on the CPU) less the weights; None: ``kv_memory``.
    memory_utilization: float | None = None
    seed: int | None = None
    speculative_config: SpeculativeConfig | None = None
    tensor_parallel_size: int = 1
    #: ``--kv-offload`` values (a pipeline then keeps one step in flight).
    kv_offload: tuple[str, ...] = ()
    #: ``--text-only``: serve a multimodal checkpoint's text model.
    text_only: bool = False

    @property
    def num_ranks(self) -> int:
        """Processes the model runs in: stages times context ranks times tensor ranks."""
        return self.pipeline_parallel_size * self.context_parallel_size * self.tensor_parallel_size


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The optional MODEL positional (or ``--model``, vLLM's spelling): a checkpoint
    folder or a built-in name."""
    names = ", ".join(BUILTIN_MODELS)
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        default=None,
        help=f"checkpoint folder (config.json, safetensors, tokenizer.json), .gguf file, "
        f"built-in name ({names}) or hub name (org/name: the local hub cache first, else "
        f"downloaded unless HF_HUB_OFFLINE is set); default: {DEFAULT_MODEL}",
    )
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as MODEL")
    parser.add_argument(
        "--revision",
        default=None,
        metavar="REV",
        help="a hub name's branch, tag or commit (default: its default branch)",
    )
    parser.add_argument(
        "--text-only",
        action="store_true",
        help="serve a multimodal checkpoint's text model, without its vision tower (such "
        "a checkpoint is refused without it)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser, *, kv_memory: str = "1GiB") -> None:
    """The flags every model-running command takes."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--kv-memory",
        default=None,
        metavar="SIZE",
        help=f"bytes of KV cache, shared by every layer group: 512MiB, 2GiB ({kv_memory})",
    )
    parser.set_defaults(kv_memory_default=kv_memory)
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
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's spelling of prefix caching on (default) or off",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="as vLLM: the share of the device's memory (on the CPU, of the free host "
        "memory) for the weights and the KV pool; replaces --kv-memory",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=_KV_CACHE_DTYPES,
        default="auto",
        help="the KV pages' dtype: auto (or --dtype's name) keeps the model dtype; fp8 is "
        "refused (not built)",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads, per pipeline stage (all cores, shared among the stages)",
    )
    group.add_argument(
        "--dtype",
        choices=("auto", *_DTYPES),
        default="float32",
        help="weights and KV dtype; auto: the checkpoint's torch_dtype (float32 if it names none)",
    )
    group.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default="auto",
        help="storage of the linear layers and LM head: dtype (--dtype's), int8 or int4 "
        "weight-only; auto: this machine's default for built-in models, dtype otherwise",
    )
    add_layer_policy_argument(group)
    group.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        metavar="N",
        help="split the layers into N pipeline stages, one process each, steps overlapping; "
        "--kv-memory is then per stage (1)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split every layer's heads, MLP and vocabulary among N processes per stage "
        "(an all-reduce after attention and after the MLP); --kv-memory is per process (1)",
    )
    group.add_argument(
        "--context-parallel-size",
        "-cp",
        type=int,
        default=1,
        metavar="N",
        help="share every request's tokens and KV pages among N processes per stage "
        "(ring attention for prefills, all-gather for decodes); --kv-memory is per process, "
        "so requests may be N times longer (1)",
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='as vLLM: speculative decoding, such as \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\' (n-gram prompt lookup); '
        'or a draft model sharing the tokenizer (\'{"model": "FOLDER", '
        '"num_speculative_tokens": 3}\'); off by default',
    )
    group.add_argument(
        "--kv-interleave",
        choices=("token", "block"),
        default="token",
        help="context parallelism deals a request's KV to the processes a token or a "
        "block at a time (token)",
    )


def add_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--scheduling-policy fcfs|priority`` and ``--max-running-share F``."""
    group = parser.add_argument_group("scheduling")
    group.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs: requests in arrival order, a request 'priority' other than 0 is refused; "
        "priority: lower 'priority' values first (signed 64-bit), ties by arrival. Enable it "
        "only where whoever sets priorities may jump the queue (fcfs)",
    )
    group.add_argument(
        "--max-running-share",
        type=float,
        default=0.5,
        metavar="F",
        help="largest share of --max-num-seqs the n/best_of choices of one request run in "
        "at once; its other choices wait while other requests are admitted (0.5; 1 turns "
        "the cap off)",
    )


def scheduling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~hybridkv.scheduler.EngineConfig` fields the scheduling flags set.

    Raises:
        UsageError: ``--max-running-share`` outside (0, 1].
    """
    from hybridkv.serving.cli.flags.values import UsageError

    share = args.max_running_share
    if not 0.0 < share <= 1.0:  # NaN fails too
        raise UsageError(f"--max-running-share must be in (0, 1], got {share}")
    return {"scheduling_policy": args.scheduling_policy, "max_running_share": share}


def add_layer_policy_argument(parser: argparse._ActionsContainer) -> None:
    """``--layer-policy KIND=NAME[:key=value,...]`` and ``--import MODULE``, repeatable."""
    parser.add_argument(
        "--layer-policy",
        dest="layer_policies",
        action="append",
        default=[],
        metavar="KIND=NAME[:K=V,...]",
        help="memory policy of one kind of layer, kept and attended, instead of the "
        "config's: sliding_attention=full, full_attention=sliding_window:window=1024 "
        "(names: `hybridkv policies`)",
    )
    add_import_argument(parser)


def parse_layer_policies(texts: list[str]) -> tuple[tuple[str, MemoryPolicy], ...]:
    """``KIND=NAME[:key=value,...]`` flags as (layer kind, policy) pairs.

    Values that read as integers or floats are passed as numbers, others as strings.

    Raises:
        UsageError: a malformed flag, or one kind named twice.
        PolicyError: an unknown policy name or parameters it rejects.
    """
    from hybridkv.policies import make_policy
    from hybridkv.serving.cli.flags.values import UsageError

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


#: The flags that run the model in several processes.
_RANK_FLAGS = ("pipeline_parallel_size", "context_parallel_size", "tensor_parallel_size")


def num_ranks(args: argparse.Namespace) -> int:
    """Processes the parsed flags run the model in (before they are checked)."""
    return math.prod(getattr(args, flag, 1) for flag in _RANK_FLAGS)


def _number_or_text(value: str) -> object:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def kv_memory_flag(args: argparse.Namespace) -> str:
    """``--kv-memory`` as given, or the command's default."""
    return str(args.kv_memory or args.kv_memory_default)


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The parsed flags as :class:`EngineArgs`."""
    from hybridkv.memory.sizes import parse_size
    from hybridkv.serving.cli.flags.values import UsageError

    flags = ("block_size", "max_num_batched_tokens", "max_num_seqs", "threads")
    for flag in (*flags, *_RANK_FLAGS):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    model, named = args.model, getattr(args, "model_flag", None)
    if model is not None and named is not None and model != named:
        raise UsageError(f"MODEL {model!r} and --model {named!r} name two models")
    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    if kv_dtype not in ("auto", args.dtype):
        raise UsageError(
            f"--kv-cache-dtype {kv_dtype}: the KV pages are in the model dtype here "
            f"(--dtype {args.dtype}); fp8 KV caches are not built"
        )
    utilization = getattr(args, "gpu_memory_utilization", None)
    if utilization is not None:
        if not 0 < utilization <= 1:
            raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        if args.kv_memory is not None:
            raise UsageError("--gpu-memory-utilization and --kv-memory both size the pool")
    from hybridkv.serving.cli.flags.speculative import speculative_config

    return EngineArgs(
        speculative_config=speculative_config(
            getattr(args, "speculative_config", None),
            getattr(args, "context_parallel_size", 1),
            num_ranks(args),
        ),
        model=model or named,
        revision=getattr(args, "revision", None),
        kv_memory=parse_size(kv_memory_flag(args)),
        memory_utilization=utilization,
        seed=getattr(args, "engine_seed", None),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        threads=args.threads,
        dtype=args.dtype,
        uniform_kv=getattr(args, "uniform_kv", False),
        layer_policies=parse_layer_policies(getattr(args, "layer_policies", [])),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        weights=getattr(args, "weights", "auto"),
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        kv_interleave=getattr(args, "kv_interleave", "token"),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        kv_offload=tuple(getattr(args, "kv_offload", None) or ()),
        text_only=getattr(args, "text_only", False),
    )
