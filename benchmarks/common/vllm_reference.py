"""Drive vLLM's own KVCacheManager from an extracted source tree, for side-by-side timing.

Used by ``benchmarks/allocator/allocator.py --reference-src DIR``, where DIR holds the ``vllm``
package sources (for example the ``vllm/`` folder of a vLLM wheel, unpacked), imported by
``_vllm_source.load``: nothing of vLLM is installed or copied.

The allocator is vLLM's (``KVCacheManager``, its coordinator and block pool); the request
object is ours. It carries the fields the allocator reads and is driven the way vLLM's
scheduler drives its own (``num_computed_tokens`` advanced after each allocation, block
hashes extended with vLLM's own hasher whenever a token is appended).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common.vllm_source import kv_cache_config, load, request_block_hasher

__all__ = ["ReferenceAllocator", "load"]


class ReferenceRequest:
    """The fields of a vLLM request that its KV cache manager reads."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        block_hasher: Callable[[ReferenceRequest], list[Any]],
        status: Any,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.status = status
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
        self.prefix_cache_hit_limit: int | None = None  # vLLM 0.34: no bound
        self._block_hasher = block_hasher
        self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def _all_token_ids(self) -> list[int]:  # vLLM 0.34's block hasher reads this name
        return self.all_token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    def get_max_cache_hit_length(self, bound: int | None = None) -> int:
        """The longest hit vLLM 0.34 allows: all but the last token (and ``bound``)."""
        return min(n for n in (self.num_tokens - 1, bound) if n is not None)

    def append_output_token_ids(self, token: int) -> None:
        """Append a sampled token and hash any block it fills (as vLLM's request does)."""
        self.all_token_ids.append(token)
        self.block_hashes.extend(self._block_hasher(self))


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
        use_eagle: bool = False,
    ) -> None:
        config = kv_cache_config(vllm, groups, num_blocks=num_blocks, block_size=block_size)
        self._hasher = request_block_hasher(vllm, block_size, hash_name)
        self.manager = vllm.manager.KVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            use_eagle=use_eagle,  # what its scheduler sets for EAGLE and MTP drafts
        )
        self._empty = self.manager.empty_kv_cache_blocks
        # vLLM's own states: the manager compares a request's status against them.
        self._status = vllm.request.RequestStatus
        self._reserve = reserve_full_isl
        self._num_usable = num_blocks - 1
        self.requests: dict[int, ReferenceRequest] = {}
        self._hits: dict[int, tuple[Any, int]] = {}
        self.num_running = 0

    # -- the replay's verbs (see benchmarks/allocator/allocator.py) --------------------------------

    def add(self, index: int, prompt: list[int]) -> None:
        self.requests[index] = ReferenceRequest(
            str(index), prompt, self._hasher, self._status.WAITING
        )

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
            request.status = self._status.RUNNING
            self.num_running += 1
        return new

    def spare_chunk(self, index: int, num_new: int, at_least: int) -> int:
        """vLLM's scheduler never shortens a chunk to spare cached blocks."""
        return num_new

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
        if request.status == self._status.RUNNING:
            self.num_running -= 1
        if preempted:
            request.status = self._status.PREEMPTED
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
