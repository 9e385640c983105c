"""Import vLLM's scheduler and what it runs from an extracted source tree, uninstalled.

``load(DIR)``, where DIR holds the ``vllm`` package sources (the ``vllm/`` folder of a vLLM
wheel, unpacked), imports the modules straight from DIR: nothing of vLLM is installed or
copied. Both side-by-side adapters load vLLM here: ``allocator/vllm_scheduler.py`` builds and steps
the scheduler, ``common/vllm_reference.py`` drives the KV cache manager alone. Both build vLLM's
KV cache config from a trace's groups with :func:`kv_cache_config` and its prefix hasher
with :func:`request_block_hasher`.

What runs is vLLM's code: ``Scheduler`` (schedule, update_from_output), its
``KVCacheManager`` and block pool, ``Request``, ``SamplingParams``, the scheduler output
and ``EngineCoreOutput`` types, ``ModelRunnerOutput``, ``vllm.envs``, and the prefix hash.
Package ``__init__`` files are skipped (except ``vllm.utils`` and ``vllm.v1.engine``,
which define classes the scheduler uses), and the subsystems a text-only model without
KV connector, speculative decoding, structured outputs, LoRA or KV events never reaches
(configs, distributed, multimodal, platforms, compilation, profiling) become stand-in
modules. Their classes refuse to be built, so a run that touched one would fail loudly
rather than time a stand-in. A few small functions the hot path does call (the read-only
token list, the profiler scope, two multimodal helpers that return early for text) are
taken from DIR's own source files, not rewritten. (The config objects are plain
namespaces, built in ``allocator/vllm_scheduler.py``.)

Needs ``msgspec`` (vLLM's output and sampling types are msgspec structs) and pydantic.
"""

from __future__ import annotations

import ast
import bisect
import collections.abc
import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Subsystems that become stand-ins (a module and everything under it), and the modules
# under them that are vLLM's own after all.
_STUBBED = (
    "vllm.compilation",
    "vllm.config",
    "vllm.distributed",
    "vllm.exceptions",
    "vllm.logger",
    "vllm.lora",
    "vllm.multimodal",
    "vllm.outputs",
    "vllm.platforms",
    "vllm.pooling_params",
    "vllm.tokenizers",
    "vllm.utils.import_utils",
    "vllm.utils.mistral",
    "vllm.utils.torch_utils",
    "vllm.v1.hisparse",
    "vllm.v1.kv_hints",
    "vllm.v1.metrics.perf",
    "vllm.v1.serial_utils",
    "vllm.v1.spec_decode",
    "vllm.v1.structured_output",
    "vllm.v1.utils",
)
_REAL_UNDER_STUB = {"vllm.v1.structured_output.request", "vllm.v1.structured_output.backend_types"}
_RUN_INIT = {"vllm.utils", "vllm.v1.engine"}


class _StandIn:
    """A class of a subsystem the benchmark never turns on: building one is a bug."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"vLLM's {type(self).__name__} is a stand-in in this benchmark")


class _StandInModule(types.ModuleType):
    """A module whose unknown attributes are stand-in classes."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_StandIn,), {})
        setattr(self, name, value)
        return value


def _is_stubbed(name: str) -> bool:
    if name in _REAL_UNDER_STUB:
        return False
    return any(name == s or name.startswith(s + ".") for s in _STUBBED)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``vllm`` modules under DIR: stand-ins, bare packages, or DIR's own files."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        folder = self.root.joinpath(*fullname.split("."))
        if not _is_stubbed(fullname) and (not folder.is_dir() or fullname in _RUN_INIT):
            return None  # a source file (or a package whose __init__ runs): the path finder
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        spec.submodule_search_locations = [str(folder)] if folder.is_dir() else []
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return _StandInModule(spec.name) if _is_stubbed(spec.name) else None

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _DropAnnotations(ast.NodeTransformer):
    """Annotations name types of stand-in modules; they do nothing at run time."""

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        self.generic_visit(node)
        return node


def _borrow(root: Path, module_name: str, names: set[str], **namespace: object) -> None:
    """Run the top-level definitions ``names`` of DIR's source of ``module_name`` inside
    that (stand-in) module, with ``namespace`` as the imports they use."""
    module = importlib.import_module(module_name)
    path = root.joinpath(*module_name.split(".")).with_suffix(".py")
    body: list[ast.stmt] = []
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name in names:
            body.append(_DropAnnotations().visit(node))
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = {t.id for t in node.targets if isinstance(t, ast.Name)} & names
            if targets:
                body.append(node)
                found |= targets
    if missing := names - found:
        raise RuntimeError(f"{path} defines no {sorted(missing)}")
    module.__dict__.update(namespace)
    code = compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), path, "exec")
    exec(code, module.__dict__)


def _install_stand_ins(root: Path, envs: types.ModuleType) -> None:
    """Give the stand-in modules the values the scheduler's code reads from them."""
    null_publisher = types.SimpleNamespace(publish=lambda batch: None, shutdown=lambda: None)
    modules = {name: importlib.import_module(name) for name in _STUBBED}
    modules["vllm.logger"].init_logger = logging.getLogger
    modules["vllm.config"].get_current_vllm_config_or_none = lambda: None
    modules["vllm.platforms"].current_platform = types.SimpleNamespace(
        register_custom_kv_cache_specs=lambda config: None
    )
    importlib.import_module(
        "vllm.distributed.kv_events"
    ).EventPublisherFactory = types.SimpleNamespace(create=lambda config, rank=0: null_publisher)
    modules["vllm.utils.torch_utils"].get_dtype_size = lambda dtype: dtype.itemsize
    # A plain base, so that SamplingParams stays a msgspec struct with its own __init__.
    modules["vllm.v1.serial_utils"].PydanticMsgspecMixin = type("PydanticMsgspecMixin", (), {})
    _borrow(
        root,
        "vllm.v1.utils",
        {"ConstantList", "T", "record_function_or_nullcontext", "_PROFILER_FUNC"},
        AbstractContextManager=contextlib.AbstractContextManager,
        Generic=typing.Generic,
        Sequence=collections.abc.Sequence,
        TypeVar=typing.TypeVar,
        contextlib=contextlib,
        envs=envs,
        overload=typing.overload,
        record_function=None,
    )
    _borrow(
        root,
        "vllm.multimodal.utils",
        {"get_mm_features_in_window", "strip_covered_mm_data"},
        bisect=bisect,
        replace=dataclasses.replace,
    )


def load(src: str | Path) -> types.SimpleNamespace:
    """Import vLLM's scheduler from the source tree ``src`` (holding ``vllm/``)."""
    root = Path(src).resolve()
    if not (root / "vllm" / "v1" / "core" / "sched" / "scheduler.py").is_file():
        raise FileNotFoundError(f"{root} holds no vllm/v1/core/sched/scheduler.py")
    if "vllm" in sys.modules:
        raise RuntimeError("a vllm package is already imported; load the reference once")
    try:
        import msgspec  # noqa: F401
    except ImportError as error:
        raise RuntimeError("vLLM's scheduler needs msgspec: pip install msgspec") from error
    if "cbor2" not in sys.modules:
        try:
            import cbor2  # noqa: F401  (only vLLM's *_cbor hashes use it)
        except ImportError:
            sys.modules["cbor2"] = _StandInModule("cbor2")
    sys.meta_path.insert(0, _Finder(root))
    _install_stand_ins(root, importlib.import_module("vllm.envs"))
    version = importlib.import_module("vllm._version")
    return types.SimpleNamespace(
        scheduler=importlib.import_module("vllm.v1.core.sched.scheduler"),
        manager=importlib.import_module("vllm.v1.core.kv_cache_manager"),
        request=importlib.import_module("vllm.v1.request"),
        sampling=importlib.import_module("vllm.sampling_params"),
        outputs=importlib.import_module("vllm.v1.outputs"),
        spec=importlib.import_module("vllm.v1.kv_cache_interface"),
        kv_utils=importlib.import_module("vllm.v1.core.kv_cache_utils"),
        hashing=importlib.import_module("vllm.utils.hashing"),
        version=f"{version.__version__} ({version.__commit_id__})",
    )


def kv_cache_config(
    vllm: types.SimpleNamespace,
    groups: Sequence[dict[str, Any]],
    *,
    num_blocks: int,
    block_size: int,
) -> Any:
    """vLLM's ``KVCacheConfig`` for a trace's groups, one layer per group.

    Args:
        vllm: What :func:`load` returned.
        groups: ``{"type": "full"}`` or ``{"type": "sliding_window", "sliding_window": W}``.
        num_blocks: Pool size, the null block included.
        block_size: Tokens per block.
    """
    import torch

    spec = vllm.spec
    group_specs = []
    for index, group in enumerate(groups):
        # Head shape and dtype size only vLLM's tensors, and no tensor is allocated here.
        common = dict(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
        if group["type"] == "full":
            kv_spec = spec.FullAttentionSpec(**common)
        elif group["type"] == "sliding_window":
            kv_spec = spec.SlidingWindowSpec(**common, sliding_window=group["sliding_window"])
        else:
            raise ValueError(f"unsupported group type {group['type']!r}")
        group_specs.append(spec.KVCacheGroupSpec([f"layer.{index}"], kv_spec))
    return spec.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=group_specs
    )


def request_block_hasher(
    vllm: types.SimpleNamespace, block_size: int, hash_name: str
) -> Callable[[Any], list[Any]]:
    """vLLM's per-request block hasher for ``hash_name`` ("sha256", ...), with the root
    hash seeded first, as vLLM's engine core sets it up."""
    hash_fn = vllm.hashing.get_hash_fn_by_name(hash_name)
    vllm.kv_utils.init_none_hash(hash_fn)
    return vllm.kv_utils.get_request_block_hasher(block_size, hash_fn)
