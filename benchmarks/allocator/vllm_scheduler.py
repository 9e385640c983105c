"""Step vLLM's own Scheduler with a fake model, for side-by-side timing.

Used by ``benchmarks/allocator/scheduler.py --reference-src DIR`` (DIR: an unpacked vLLM source
tree, imported by ``_vllm_source.load``). Each step is what vLLM's engine core does around
its model: ``schedule()``, then ``update_from_output()`` with a ``ModelRunnerOutput``
holding one sampled token for every request whose sequence is computed (none for a
partial prefill chunk), as vLLM's model runner returns it. The fake model's tokens are
given per request, so both engines generate the same sequences.
"""

from __future__ import annotations

import time
import types
from collections.abc import Sequence
from typing import Any

from benchmarks.common.vllm_source import kv_cache_config, load, request_block_hasher

__all__ = ["ReferenceScheduler", "load"]


def _vllm_config(
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool,
) -> types.SimpleNamespace:
    """The fields of ``VllmConfig`` the scheduler reads, at vLLM's defaults except for the
    workload's sizes and: synchronous scheduling (one batch in flight, as our core), the
    V2 model runner (what vLLM picks on a GPU without unsupported features)."""
    ns = types.SimpleNamespace
    scheduler = ns(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_active_seqs=None,
        max_num_scheduled_tokens=None,
        long_prefill_token_threshold=0,
        long_prefill_token_threshold_adaptive=False,
        policy="fcfs",
        prefill_schedule_interval=1,
        scheduler_reserve_full_isl=True,
        watermark=0.0,
        disable_chunked_mm_input=False,
        enable_chunked_prefill=True,
        async_scheduling=False,
    )
    cache = ns(
        num_gpu_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        mamba_cache_mode="none",
        enable_mamba_shared_prefix_checkpoint=False,
    )
    model = ns(
        max_model_len=max_model_len,
        runner_type="generate",
        uses_mrope=False,
        is_encoder_decoder=False,
        is_diffusion=False,
        supports_multimodal_inputs=False,
        return_sampling_mask=False,
    )
    parallel = ns(
        data_parallel_index=0,
        data_parallel_size=1,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    observability = ns(
        per_request_spec_decode_metrics=None,
        kv_cache_metrics=False,
        kv_cache_metrics_sample=0.0,
        enable_logging_iteration_details=False,
        enable_mfu_metrics=False,
    )
    return ns(
        scheduler_config=scheduler,
        cache_config=cache,
        model_config=model,
        parallel_config=parallel,
        observability_config=observability,
        lora_config=None,
        speculative_config=None,
        kv_events_config=None,
        kv_transfer_config=None,
        ec_transfer_config=None,
        ec_manager_config=ns(get_encoder_cache_manager_obj=lambda: None),
        aux_output_config=ns(enabled=False),
        is_mm_encoder_only=False,
        use_v2_model_runner=True,
        max_concurrent_batches=1,
        max_in_flight_tokens=max_num_batched_tokens,
        num_speculative_tokens=0,
        num_lookahead_tokens=0,
        num_prefill_lookahead_tokens=0,
        num_hash_lookahead_tokens=0,
    )


class _NoStructuredOutputs:
    """Stands in for the structured-output manager: no request of the benchmark uses one."""

    @staticmethod
    def accept_tokens(request: Any, token_ids: list[int]) -> bool:
        if request.use_structured_output:
            raise RuntimeError(f"request {request.request_id} asks for structured output")
        return True


class ReferenceScheduler:
    """vLLM's ``Scheduler`` with a fake model, stepped one step at a time.

    Args:
        vllm: What :func:`load` returned.
        groups: KV cache groups: ``{"type": "full"}`` or
            ``{"type": "sliding_window", "sliding_window": W}``.
        num_blocks: Pool size, the null block included.
        block_size: Tokens per block.
        max_model_len: Longest request.
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Token budget of one step.
        enable_prefix_caching: Reuse cached prompt blocks.
        hash_name: vLLM's name of the prefix-cache hash (its default, "sha256").
    """

    def __init__(
        self,
        vllm: types.SimpleNamespace,
        groups: Sequence[dict[str, Any]],
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        hash_name: str = "sha256",
    ) -> None:
        kv_config = kv_cache_config(vllm, groups, num_blocks=num_blocks, block_size=block_size)
        config = _vllm_config(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler = vllm.scheduler.Scheduler(
            config, kv_config, _NoStructuredOutputs(), block_size=block_size, log_stats=False
        )
        self._vllm = vllm
        self._hasher = None
        if enable_prefix_caching:  # as vLLM's engine core sets it up
            self._hasher = request_block_hasher(vllm, block_size, hash_name)
        self._outputs: dict[str, Sequence[int]] = {}
        self.num_finished = 0
        self.num_output_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def add(self, request_id: str, prompt: list[int], output_token_ids: Sequence[int]) -> None:
        """Queue a request whose fake model samples ``output_token_ids``, one a step."""
        vllm = self._vllm
        params = vllm.sampling.SamplingParams(max_tokens=len(output_token_ids), ignore_eos=True)
        request = vllm.request.Request(
            request_id, list(prompt), params, None, block_hasher=self._hasher
        )
        self._outputs[request_id] = output_token_ids
        self.scheduler.add_request(request)

    def step(self) -> tuple[float, float, int, bool]:
        """One step: microseconds of ``schedule()`` plus ``update_from_output()`` in wall
        and thread CPU time, requests scheduled, and whether all of them only decoded.
        Building the fake model output between the two is not timed."""
        scheduler = self.scheduler
        clock, cpu = time.perf_counter, time.thread_time
        t0, c0 = clock(), cpu()
        out = scheduler.schedule()
        t1, c1 = clock(), cpu()
        req_ids = list(out.num_scheduled_tokens)
        requests, outputs = scheduler.requests, self._outputs
        sampled = []
        for req_id in req_ids:  # a token only where the whole sequence is computed
            request = requests[req_id]
            due = request.num_computed_tokens >= request.num_tokens
            sampled.append([outputs[req_id][request.num_output_tokens]] if due else [])
        model_output = self._vllm.outputs.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        t2, c2 = clock(), cpu()
        engine_outputs = scheduler.update_from_output(out, model_output)
        wall = (t1 - t0 + clock() - t2) * 1e6
        used = (c1 - c0 + cpu() - c2) * 1e6
        for client_outputs in engine_outputs.values():
            for item in client_outputs.outputs:
                self.num_output_tokens += len(item.new_token_ids)
                self.num_finished += item.finish_reason is not None
        num = len(req_ids)
        return wall, used, num, bool(num) and out.total_num_scheduled_tokens == num
