"""One context-parallel rank of a model: its share of each step's tokens and KV pages.

Every rank of a context group (``cp`` ranks, one pipeline stage) holds the same layers and
the same page ids; it runs a :class:`ModelExecutor`'s model on its own tokens of the step
(``context_shards``) and its attention layers exchange K/V or partial outputs
(``context_attention``). The engine sees one pool of *virtual* blocks of
``block_size * cp`` tokens and as many pages as one rank has::

    engine's block table of a request     [ 7 | 3 | 12 ]              virtual blocks of 8
    rank 0, page 7: tokens 0 2 4 6        rank 1, page 7: tokens 1 3 5 7   (interleave 1)

so at equal memory per rank a request can be ``cp`` times longer. Rank 0 runs every
request's last token (a decode on every rank, a prefill's last chunk on rank 0), so it
samples alone; hidden states of other rows travel only for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from hybridkv.executor.kv_caches import layer_groups
from hybridkv.executor.model_executor import LogitsHook, ModelExecutor, StageInputs
from hybridkv.memory.layout import (
    AttentionSpec,
    LayoutPlan,
    ModelLayer,
    NoCacheSpec,
    PoolSpec,
    memories,
)
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ParallelConfigError
from hybridkv.parallel.context_attention import ContextLayer, ContextStep
from hybridkv.parallel.context_group import ContextRanks
from hybridkv.parallel.context_shards import KVInterleave
from hybridkv.scheduler.batch import StepBatch, StepResult


def check_context_split(specs: Sequence[ModelLayer], *, sinks: bool = False) -> None:
    """Refuse layers context parallelism cannot shard, naming the first and why.

    Raises:
        ParallelConfigError: a state layer (its recurrence runs token after token, so a
            request's tokens cannot be split among ranks), an attention layer whose
            keys are not one window (a multi-span policy, chunked-local: the ring
            attends each shard to one window of keys), or, with ``sinks``, attention
            with a learned sink per head (gpt-oss), which the ring's merge leaves out;
            a layer reading another layer's cache (Gemma 4), which computes no keys for
            the ring to attend; latent attention (DeepSeek V3), whose ring would pass
            latents the merge does not expand.
    """
    if sinks:
        raise ParallelConfigError(
            "context parallelism merges each rank's share of a softmax; the model's "
            "attention sinks (a learned logit per head, gpt-oss) are not part of that merge"
        )
    for spec in memories(specs):
        if isinstance(spec, NoCacheSpec):
            continue  # runs on each rank's tokens alone
        if not isinstance(spec, AttentionSpec):
            raise ParallelConfigError(
                f"context parallelism splits a request's tokens among ranks; layer "
                f"{spec.name!r} is a state layer, whose recurrence runs them in order"
            )
        if spec.reads is not None:
            raise ParallelConfigError(
                f"context parallelism attends each rank's new keys; layer {spec.name!r} "
                f"computes none (it reads the cache of {spec.reads!r})"
            )
        if spec.latent:
            raise ParallelConfigError(
                f"context parallelism attends keys and values of each head; layer "
                f"{spec.name!r} keeps one latent a token (one vector read as key and value: "
                "multi-head latent attention, DeepSeek V4's window), which its ring does "
                "not pass"
            )
        if spec.policy.attention_window() is None:
            raise ParallelConfigError(
                f"context parallelism needs attention layers whose keys are one window "
                f"(full or sliding); layer {spec.name!r} keeps {spec.policy!r}"
            )


@attrs.frozen(eq=False)
class ContextInputs(StageInputs):
    """:class:`StageInputs` of this rank's tokens, with the step's sharded attention."""

    step: ContextStep


class ContextParallelExecutor:
    """A :class:`ModelExecutor` whose steps are shared with the other ranks of ``ranks``.

    It has the ``prepare`` / ``forward`` / ``finish`` steps a pipeline stage runs
    (``parallel/pipeline_stage.py``); processes are started by ``PipelineExecutor``.

    Args:
        inner: This rank's model and pages (laid out with the per-rank block size).
        ranks: Its context group.
        kv_interleave: Tokens dealt to a rank at a time (1, or the block size).

    Raises:
        ParallelConfigError: a layer it cannot shard (``check_context_split``), or an
            interleave that does not divide the block size.
    """

    def __init__(self, inner: ModelExecutor, ranks: ContextRanks, kv_interleave: int = 1) -> None:
        check_context_split(inner.specs)
        self.inner = inner
        self.ranks = ranks
        self.place = KVInterleave(ranks.size, inner.plan.block_size, kv_interleave)
        self.plan: LayoutPlan = attrs.evolve(inner.plan, block_size=self.place.virtual_block_size)
        self.torch_thread = inner.torch_thread
        self.model = inner.model
        self.config: ModelConfig = inner.config
        self.specs = inner.specs
        self.tokenizer = inner.tokenizer
        self.eos_token_ids = inner.eos_token_ids
        self.max_model_len = inner.max_model_len
        held = [self.specs[i] for i in self.model.layer_range]
        self._layer_groups = layer_groups(self.plan, held)

    @property
    def pool(self) -> PoolSpec:
        """The engine's pool: this rank's page count, virtual blocks of ``bs * cp``."""
        return self.plan.pool

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head."""
        return self.inner.vocab_size

    @property
    def logits_hook(self) -> LogitsHook | None:
        """Called by rank 0 with each sampled request's logits."""
        return self.inner.logits_hook

    @logits_hook.setter
    def logits_hook(self, hook: LogitsHook | None) -> None:
        self.inner.logits_hook = hook

    def prepare(self, batch: StepBatch) -> ContextInputs:
        """This rank's tokens of the step, their positions, the layers' sharded attention."""
        requests = batch.requests
        query_lens = [r.num_tokens for r in requests]
        context_lens = [r.start_position + r.num_tokens for r in requests]
        groups = sorted({g for g in self._layer_groups if g is not None})
        tables = {g: [r.block_tables[g] for r in requests] for g in groups}
        step = ContextStep(
            query_lens, context_lens, tables, self.place, self.ranks, self.inner.device
        )
        input_ids = None
        if self.model.is_first:
            ids = torch.tensor([t for r in requests for t in r.token_ids], dtype=torch.long)
            input_ids = ids.to(self.inner.device)[step.global_rows]
        caches: list[tuple[torch.Tensor, Any]] = [
            (cache, None if group is None else ContextLayer(step, group))
            for cache, group in zip(self.inner.kv_caches, self._layer_groups, strict=True)
        ]
        return ContextInputs(
            query_lens=query_lens,
            positions=step.positions,
            caches=caches,
            input_ids=input_ids,
            step=step,
        )

    def forward(self, inputs: StageInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layers held over this rank's tokens."""
        return self.inner.forward(inputs, hidden)

    def finish(self, batch: StepBatch, inputs: StageInputs, hidden: torch.Tensor) -> StepResult:
        """Sample on rank 0 (every request's last token is there); other ranks only send
        their rows when a request asks for prompt logprobs, and return no tokens."""
        assert isinstance(inputs, ContextInputs)
        every_row = any(r.prompt_logprob_token_ids for r in batch.requests)
        with torch.inference_mode():
            full = inputs.step.gather_hidden(hidden, every_row=every_row)
        if self.ranks.rank != 0:
            return StepResult(token_ids=(None,) * len(batch.requests))
        return self.inner.finish(batch, inputs, full)

    def close(self) -> None:
        """End the executor's torch thread."""
        self.inner.close()
