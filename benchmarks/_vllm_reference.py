"""Drive vLLM's own KVCacheManager from an extracted source tree, for side-by-side timing.

Used by ``benchmarks/allocator.py --reference-src DIR``, where DIR holds the ``vllm``
package sources (for example the ``vllm/`` folder of a vLLM wheel, unpacked). Nothing of
vLLM is installed or copied: this module imports the allocator modules straight from DIR.

Only the allocator is loaded (``vllm.v1.core`` and ``vllm.v1.kv_cache_interface``). Package
``__init__`` files under ``vllm`` are skipped, and the few modules the allocator imports for
features a replay never turns on (KV events, metrics, multimodal, logging, configs, the
engine's request class) are replaced by small stand-ins. The request object is ours as well:
it carries the fields the allocator reads and is driven the way vLLM's scheduler drives its
own (``num_computed_tokens`` advanced after each allocation, block hashes extended with
vLLM's own hasher whenever a token is appended).
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class _Placeholder:
    """Any class the allocator imports but a replay never uses (events, stats)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass


class _StubModule(types.ModuleType):
    """A module whose unknown attributes are placeholder classes."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Placeholder,), {})
        setattr(self, name, value)
        return value


class RequestStatus(enum.IntEnum):
    """The request states the allocator compares against (admission watermark)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()


class ReferenceRequest:
    """The fields of a vLLM request that its KV cache manager reads."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        block_hasher: Callable[[ReferenceRequest], list[Any]],
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[Any] = []
        self.lora_request = None
        self.cache_salt = None
        self.mm_features: list[Any] = []
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.session_id = None
        self.shared_prefix_boundary = 0
        self.skip_reading_prefix_cache = False
        self.kv_cache_report_mode = "incremental"
        self._block_hasher = block_hasher
        self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token: int) -> None:
        """Append a sampled token and hash any block it fills (as vLLM's request does)."""
        self.all_token_ids.append(token)
        self.block_hashes.extend(self._block_hasher(self))


def _install_stubs() -> None:
    def stub(name: str) -> _StubModule:
        module = _StubModule(name)
        sys.modules[name] = module
        return module

    stub("vllm.config").get_current_vllm_config_or_none = lambda: None
    stub("vllm.distributed.kv_events")
    stub("vllm.logger").init_logger = logging.getLogger
    stub("vllm.multimodal.utils")
    # The platform hook registers out-of-tree cache specs: none here.
    stub("vllm.platforms").current_platform = types.SimpleNamespace(
        register_custom_kv_cache_specs=lambda config: None
    )
    stub("vllm.utils.torch_utils").get_dtype_size = lambda dtype: dtype.itemsize
    stub("vllm.v1.metrics.stats")
    request = stub("vllm.v1.request")
    request.Request = ReferenceRequest
    request.RequestStatus = RequestStatus
    stub("vllm.v1.utils")
    try:
        import cbor2  # noqa: F401  (only vLLM's *_cbor hashes use it)
    except ImportError:
        sys.modules["cbor2"] = _StubModule("cbor2")


class _BarePackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``vllm`` packages under DIR without running their ``__init__`` files."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        folder = self.root.joinpath(*fullname.split("."))
        if not folder.is_dir():
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def load(src: str | Path) -> types.SimpleNamespace:
    """Import vLLM's allocator modules from the source tree ``src`` (holding ``vllm/``)."""
    root = Path(src).resolve()
    if not (root / "vllm" / "v1" / "core" / "kv_cache_manager.py").is_file():
        raise FileNotFoundError(f"{root} holds no vllm/v1/core/kv_cache_manager.py")
    if "vllm" in sys.modules:
        raise RuntimeError("a vllm package is already imported; load the reference once")
    sys.meta_path.insert(0, _BarePackages(root))
    _install_stubs()
    manager = importlib.import_module("vllm.v1.core.kv_cache_manager")
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    spec = importlib.import_module("vllm.v1.kv_cache_interface")
    hashing = importlib.import_module("vllm.utils.hashing")
    version = "unknown"
    try:
        version_mod = importlib.import_module("vllm._version")
        version = f"{version_mod.__version__} ({version_mod.__commit_id__})"
    except (ImportError, AttributeError):
        pass
    return types.SimpleNamespace(
        manager=manager, utils=utils, spec=spec, hashing=hashing, version=version
    )


class ReferenceAllocator:
    """One vLLM ``KVCacheManager`` built for a trace's groups, behind the replay's verbs.

    Args:
        vllm: What :func:`load` returned.
        groups: Trace groups: ``{"type": "full"}`` or
            ``{"type": "sliding_window", "sliding_window": W}``.
        num_blocks: Pool size, the null block included.
        block_size: Tokens per block.
        max_model_len: Longest request.
        hash_name: vLLM's name of the prefix-cache hash ("sha256", ...).
        reserve_full_isl: Admit only when the whole prompt fits (vLLM's
            ``full_sequence_must_fit``), as the trace recorded.
    """

    name = "vllm"

    def __init__(
        self,
        vllm: types.SimpleNamespace,
        groups: Sequence[dict[str, Any]],
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int,
        hash_name: str = "sha256",
        reserve_full_isl: bool = True,
    ) -> None:
        import torch

        spec_mod = vllm.spec
        group_specs = []
        for index, group in enumerate(groups):
            common = dict(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
            if group["type"] == "full":
                kv_spec = spec_mod.FullAttentionSpec(**common)
            elif group["type"] == "sliding_window":
                kv_spec = spec_mod.SlidingWindowSpec(
                    **common, sliding_window=group["sliding_window"]
                )
            else:
                raise ValueError(f"unsupported group type {group['type']!r}")
            group_specs.append(spec_mod.KVCacheGroupSpec([f"layer.{index}"], kv_spec))
        config = spec_mod.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=group_specs
        )
        hash_fn = vllm.hashing.get_hash_fn_by_name(hash_name)
        vllm.utils.init_none_hash(hash_fn)
        self._hasher = vllm.utils.get_request_block_hasher(block_size, hash_fn)
        self.manager = vllm.manager.KVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
        self._empty = self.manager.empty_kv_cache_blocks
        self._reserve = reserve_full_isl
        self._num_usable = num_blocks - 1
        self.requests: dict[int, ReferenceRequest] = {}
        self._hits: dict[int, tuple[Any, int]] = {}
        self.num_running = 0

    # -- the replay's verbs (see benchmarks/allocator.py) --------------------------------

    def add(self, index: int, prompt: list[int]) -> None:
        self.requests[index] = ReferenceRequest(str(index), prompt, self._hasher)

    def step_starts(self) -> None:
        self.manager.new_step_starts()

    def lookup(self, index: int) -> int:
        blocks, num_hit, _ = self.manager.get_computed_blocks(self.requests[index])
        self._hits[index] = (blocks, num_hit)
        return num_hit

    def admit(self, index: int, num_new: int, use_hit: bool) -> Any:
        request = self.requests[index]
        blocks, num_hit = self._hits.pop(index)
        if not use_hit:
            blocks, num_hit = self._empty, 0
        new = self.manager.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
            full_sequence_must_fit=self._reserve,
            has_scheduled_reqs=self.num_running > 0,
        )
        if new is not None:
            request.num_computed_tokens = num_hit + num_new
            request.status = RequestStatus.RUNNING
            self.num_running += 1
        return new

    def extend(self, index: int, num_new: int) -> Any:
        request = self.requests[index]
        new = self.manager.allocate_slots(request, num_new)
        if new is not None:
            request.num_computed_tokens += num_new
        return new

    def append(self, index: int, token: int) -> None:
        self.requests[index].append_output_token_ids(token)

    def free(self, index: int, preempted: bool) -> None:
        request = self.requests[index]
        self.manager.free(request)
        request.num_computed_tokens = 0
        if request.status == RequestStatus.RUNNING:
            self.num_running -= 1
        if preempted:
            request.status = RequestStatus.PREEMPTED
            request.num_preemptions += 1
        else:
            del self.requests[index]

    # -- results -------------------------------------------------------------------------

    @staticmethod
    def num_new_pages(result: Any) -> int:
        return sum(len(blocks) for blocks in result.blocks)

    def num_table_entries(self, index: int) -> int:
        return sum(len(ids) for ids in self.manager.get_block_ids(str(index)))

    def num_blocks_used(self) -> int:
        return self._num_usable - self.manager.block_pool.get_num_free_blocks()
