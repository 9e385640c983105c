"""The model executor: owns the KV tensors, runs one engine step, samples.

The KV tensors follow the layout plan (``hybridkv.executor.kv_caches`` has the memory
picture). Per step and per group, one :class:`PagedMetadata` is built from the requests'
block tables of that group, and every layer of the group reads it.

A step is three parts, which a pipeline stage runs separately (``models/pipeline_*``)::

    prepare(batch)              metadata of the groups this executor's layers use
    forward(inputs, hidden)     embed (first stage) and run the layers it holds
    finish(batch, ..., hidden)  logits, sampling, logprobs (last stage)

``execute`` runs all three on the executor's torch thread. An executor built for one
pipeline stage (``pipeline_stage``/``pipeline_parallel_size``) holds only that stage's
layers and their pages; the layout is planned for all stages, so its pool is theirs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch
from tokenizers import Tokenizer

from hybridkv.errors.events import get_logger
from hybridkv.executor.batch_checks import check_batch
from hybridkv.executor.grammars import GrammarError
from hybridkv.executor.kv_caches import allocate_kv_caches, kept_specs, layer_groups, sparse_groups
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.loader import ModelShard, StageSlice, load_checkpoint
from hybridkv.executor.logprobs import emitted_logprobs, step_prompt_logprobs
from hybridkv.executor.mtp_step import MtpProposer
from hybridkv.executor.offload_pages import KVPages, key_space
from hybridkv.executor.sampler import Sampler
from hybridkv.executor.speculative import draft_rows, kept_tokens, verify_rows, write_kept_states
from hybridkv.executor.torch_thread import TorchThread
from hybridkv.kernels import GatherWorkspace, PagedMetadata
from hybridkv.memory.layout import LayoutPlan, PoolSpec, memories, owns_pages
from hybridkv.memory.offload import KeySpace, LoadReport, OffloadConfig, TransferWorker
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.config import ModelConfig
from hybridkv.models.transformer import CausalLM
from hybridkv.scheduler.batch import StepBatch, StepRequest, StepResult
from hybridkv.scheduler.params import StructuredOutput

log = get_logger(__name__)

#: Called with (request id, float32 logits) for each token a request emits: its last
#: position's, or with proposals, the rows of the proposals kept and of its own token.
LogitsHook = Callable[[str, torch.Tensor], None]


class ModelExecutor:
    """Runs a :class:`StepBatch` through a model over paged KV caches (an ``Executor``).

    Attributes:
        model: The causal LM.
        config: Its parsed config.
        plan: The KV layout (groups, slots, pages) the caches follow.
        specs: Per layer, in layer order, its spec with the policy its KV group keeps
            (the specs the plan was made from; every layer, also in a pipeline stage).
        kv_caches: Per memory of the layers held (``memories``: a layer's, then the state
            beside it), its paged view ``[num_blocks, 2, kv_heads, block_size, head_dim]``.
        tokenizer: The checkpoint's ``tokenizers.Tokenizer``, or None.
        eos_token_ids: End-of-sequence tokens.
        max_model_len: Longest sequence (prompt and output) a request may reach.
    """

    #: It verifies proposed tokens (speculative decoding): ``executor/speculative.py``.
    verifies_proposals = True

    def __init__(
        self,
        model: CausalLM,
        plan: LayoutPlan,
        *,
        device: torch.device,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Tokenizer | None = None,
        sampler: Sampler | None = None,
        logits_hook: LogitsHook | None = None,
        torch_thread: TorchThread | None = None,
        mtp_proposals: int = 0,
    ) -> None:
        # Every torch call of this executor runs on one thread (see executor/torch_thread.py).
        self.torch_thread = torch_thread or TorchThread()
        self.model = model
        self.config: ModelConfig = model.config
        self.plan = plan
        self.device = device
        dtype = next(model.parameters()).dtype
        self.specs = tuple(kept_specs(self.config, plan, dtype))
        held = [self.specs[i] for i in model.layer_range]
        self._num_layer_caches = len(memories(held))  # the MTP layer's come after
        held += self.specs[self.config.num_layers :] if len(model.mtp) else []
        self._held = held
        self.kv_caches = self.torch_thread.run(allocate_kv_caches, plan, held, dtype, device)
        self._layer_groups = layer_groups(plan, held)
        # Metadata is built only for the groups of the layers held (all, without stages).
        self._groups = sorted({g for g in self._layer_groups if g is not None})
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = self.config.max_position_embeddings
        self.sampler = sampler or Sampler(eos_token_ids=self.eos_token_ids)
        self.logits_hook = logits_hook
        # Gather buffers reused by every step and layer: a fresh one per step pays page
        # faults on its first layer (benchmarks/decode/attention.py measures decode attention).
        self._workspace = GatherWorkspace()
        # With a KV connector: moves pages to and from offload tiers (attach_offload).
        self.transfers: TransferWorker | None = None
        #: Tokens its MTP layer proposes after each step (speculative method mtp).
        self.mtp_proposals = mtp_proposals if len(model.mtp) else 0
        self._mtp = None
        if self.mtp_proposals:
            n = self._num_layer_caches
            mtp_caches = zip(self.kv_caches[n:], self._layer_groups[n:], strict=True)
            memories_ = [(cache, group) for cache, group in mtp_caches if group is not None]
            self._mtp = MtpProposer(model, plan, memories_, mtp_proposals, self._workspace)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        options: LoadOptions,
        *,
        logits_hook: LogitsHook | None = None,
        pipeline_stage: int = 0,
        pipeline_parallel_size: int = 1,
        torch_thread: TorchThread | None = None,
        shard: ModelShard | None = None,
    ) -> ModelExecutor:
        """Load a checkpoint folder and lay out ``options.kv_cache_bytes`` of KV cache.

        Each layer keeps and attends what its memory policy says: the config's (full
        attention, its sliding window), or the one ``options.policies`` chooses for its
        kind::

            options = LoadOptions(kv_cache_bytes=1 << 30,
                                  policies={"full_attention": SinkWindow(4, 64)})
            ModelExecutor.from_pretrained(path, options)

        Args:
            path: Folder with config.json and safetensors weights (tokenizer.json optional).
            options: How to load it and lay out its pool (``executor/load_options.py``).
            logits_hook: Called with each sampled request's last-position logits.
            pipeline_stage: Load only this stage's layers and allocate only their pages.
            pipeline_parallel_size: Stages the model is split into (the layout is
                planned for all of them: ``kv_cache_bytes`` is per stage).
            torch_thread: The thread to run its torch work on, shared with other
                executors of the process (one OpenMP team: ``executor/torch_thread.py``);
                None for a thread of its own. ``close`` ends it either way.
            shard: Keep only this share of every layer (a tensor-parallel rank's).

        Raises:
            CheckpointError: a folder without config.json or safetensors weights.
            ModelConfigError: a config we cannot run, or ``policies`` naming a layer kind
                the model has no attention layers of.
            ParallelConfigError: more stages than layers, or a stage index outside them.
            PolicyError: a value of ``policies`` that is not a MemoryPolicy.
            WeightFormatError: int8/int4 weights off the CPU.
        """
        thread = torch_thread or TorchThread()
        stage = StageSlice(pipeline_stage, pipeline_parallel_size)
        loaded = load_checkpoint(path, options, stage, thread, shard)
        return cls(
            loaded.model,
            loaded.plan,
            device=loaded.device,
            eos_token_ids=loaded.eos_token_ids,
            tokenizer=loaded.tokenizer,
            sampler=Sampler(eos_token_ids=loaded.eos_token_ids, seed=options.seed),
            logits_hook=logits_hook,
            torch_thread=thread,
            mtp_proposals=options.mtp_proposals,
        )

    def close(self) -> None:
        """End the executor's torch thread; later steps run on the caller's thread."""
        if self.transfers is not None:
            self.transfers.close()
        self.torch_thread.close()

    def attach_offload(self, config: OffloadConfig) -> KeySpace:
        """Move pages to and from ``config``'s tiers at the start of each step (see
        ``hybridkv.scheduler.connector``); returns the model's key space."""
        self.transfers = TransferWorker(self.kv_pages(), config)
        return self.key_space()

    def key_space(self) -> KeySpace:
        """The key space of its model and layout (``executor/offload_pages.py``)."""
        dtype = next(self.model.parameters()).dtype
        return self.torch_thread.run(key_space, self.model, self.config, self.plan, dtype)

    def kv_pages(self) -> KVPages:
        """Page access to the groups of the layers held, for a transfer worker (each page
        once: a layer reading another's pages adds none)."""
        span = self.plan.state_span
        spans = {g.group_id: span for g in self.plan.groups if g.policy.keeps_state}
        held = memories(self._held)
        owned = [i for i, spec in enumerate(held) if owns_pages(spec)]
        caches = [self.kv_caches[i] for i in owned]
        groups = [g for g in (self._layer_groups[i] for i in owned) if g is not None]
        return KVPages(caches, groups, self.device, state_spans=spans)

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Read the vocabulary (once) and compile ``spec`` for the steps to come, on the
        caller's thread: a server calls it from a worker thread before queueing a request,
        so no step pays for a compile.

        Raises:
            GrammarError: llguidance refuses the grammar, or the checkpoint has no
                tokenizer to build masks from.
        """
        if self.tokenizer is None:
            raise GrammarError("structured output needs the checkpoint's tokenizer.json")
        self.sampler.compile_grammar(spec, self.tokenizer, self.vocab_size)

    @property
    def pool(self) -> PoolSpec:
        """The block pool the KV caches are laid out for."""
        return self.plan.pool

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: sampled token ids are below it."""
        return self.config.vocab_size

    def execute(self, batch: StepBatch) -> StepResult:
        """Write and attend every request's tokens in one forward pass; sample where asked.

        Runs on the executor's torch thread.

        Raises:
            BatchError: a request's block tables do not match the layout.
        """
        return self.torch_thread.run(self._execute, batch)

    def _execute(self, batch: StepBatch) -> StepResult:
        loads: tuple[LoadReport, ...] = ()
        if self.transfers is not None:  # before any layer writes a page
            loads = self.transfers.run(batch.transfers, is_idle=not batch.requests)
        try:
            check_batch(batch, self.plan, self.max_model_len)
            if not batch.requests:
                return StepResult(token_ids=(), kv_loads=loads)
            inputs = self.prepare(batch)
            hidden = self.forward(inputs)
            result = self.finish(batch, inputs, hidden)
            if result.num_accepted is not None:
                write_kept_states(inputs.caches, kept_tokens(batch, result))
            if self._mtp is not None:  # its cache for the tokens kept, and its proposals
                with torch.inference_mode():
                    result = attrs.evolve(result, proposals=self._mtp.run(batch, hidden, result))
        except BaseException:
            if self.transfers is not None:
                self.transfers.undeliver(loads)  # reported by the next step instead
            raise
        return attrs.evolve(result, kv_loads=loads) if loads else result

    def prepare(self, batch: StepBatch) -> StageInputs:
        """Paged metadata of the groups this executor's layers use, token ids if it embeds.

        Call it on the executor's torch thread, with a checked, non-empty batch.
        """
        requests = batch.requests
        query_lens = [r.num_tokens for r in requests]
        context_lens = [r.start_position + r.num_tokens for r in requests]
        bs, groups = self.plan.block_size, self.plan.groups
        kv_groups = [g for g in self._groups if not groups[g].policy.keeps_state]
        built = PagedMetadata.build_groups(
            query_lens,
            context_lens,
            [[r.block_tables[g] for r in requests] for g in kv_groups],
            bs,
            device=self.device,
            workspace=self._workspace,
            sparse=sparse_groups(self.plan, kv_groups),
        )
        metadata: dict[int, PagedMetadata | StepStates] = dict(zip(kv_groups, built, strict=True))
        drafts = [r.num_draft_tokens for r in requests]
        for g in self._groups:  # state (Mamba2) groups: which page each request reads, writes
            if groups[g].policy.keeps_state:
                tables = [r.block_tables[g] for r in requests]
                metadata[g] = StepStates.build(
                    query_lens, context_lens, tables, bs, self.plan.state_span, drafts
                )
        input_ids = None
        if self.model.is_first or self.model.config.reads_token_ids:
            ids = [t for r in requests for t in r.token_ids]
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return StageInputs(
            query_lens=query_lens,
            positions=built[0].positions if built else _positions(requests, self.device),
            caches=[
                (cache, None if group is None else metadata[group])
                for cache, group in zip(self.kv_caches, self._layer_groups, strict=True)
            ],
            input_ids=input_ids,
        )

    def forward(self, inputs: StageInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layers held: from the token ids (first stage) or the previous stage's
        ``hidden`` states; returns ``[num_tokens, hidden_size]`` (or per residual stream)."""
        caches = inputs.caches[: self._num_layer_caches]
        with torch.inference_mode():
            ids = inputs.input_ids
            if hidden is None:
                assert ids is not None, "a later stage needs hidden states"
                hidden = self.model.embed(ids)
            return self.model.run_layers(hidden, inputs.positions, caches, input_ids=ids)

    def finish(self, batch: StepBatch, inputs: StageInputs, hidden: torch.Tensor) -> StepResult:
        """Sample where asked, with logprobs and prompt logprobs (the last stage); verify
        proposed tokens where a request has them (``executor/speculative.py``)."""
        requests = batch.requests
        with torch.inference_mode():
            prompt = step_prompt_logprobs(
                requests, hidden, inputs.query_lens, self.model.compute_logits
            )
            sampled = self._sample(requests, hidden, inputs.query_lens)
        return attrs.evolve(sampled, prompt_logprobs=prompt)

    def _sample(
        self, requests: Sequence[StepRequest], hidden: torch.Tensor, query_lens: list[int]
    ) -> StepResult:
        """Per request, the token sampled after its last position (where ``sample``), and
        that token's log-probabilities (where ``params.logprobs`` asks; None if nowhere);
        a request with proposals emits the kept ones before it."""
        tokens: list[int | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sample]
        if not rows:
            return StepResult(token_ids=tokens)
        spans = draft_rows(query_lens, requests)
        logits = self.model.compute_logits(hidden[[row for span in spans for row in span]])
        # Per sampled request, its rows of ``logits``: one, or k + 1 with k proposals.
        firsts = list(itertools.accumulate((len(span) for span in spans), initial=0))
        plain = [n for n, i in enumerate(rows) if not requests[i].num_draft_tokens]
        emitted: dict[int, list[int]] = {}
        if len(plain) < len(rows):
            for n, i in enumerate(rows):
                if requests[i].num_draft_tokens:
                    own = logits[firsts[n] : firsts[n + 1]]
                    emitted[n] = verify_rows(self.sampler, own, requests[i], self.tokenizer)
        if plain:
            # Without proposals every row is a plain one: no copy of the logits.
            chosen = logits
            if len(plain) < len(logits):
                chosen = logits[[firsts[n + 1] - 1 for n in plain]]
            drawn = self.sampler.sample(
                chosen, [requests[rows[n]] for n in plain], tokenizer=self.tokenizer
            )
            emitted.update((n, [token]) for n, token in zip(plain, drawn, strict=True))
        for n, i in enumerate(rows):
            tokens[i] = emitted[n][-1]
        if self.logits_hook is not None:
            for n, i in enumerate(rows):
                for row in range(firsts[n], firsts[n] + len(emitted[n])):
                    self.logits_hook(requests[i].request_id, logits[row])
        accepted = None
        if len(plain) < len(rows):
            accepted = [0] * len(requests)
            for n, i in enumerate(rows):
                accepted[i] = len(emitted[n]) - 1
        logprobs, before = emitted_logprobs(requests, rows, logits, firsts, emitted)
        return StepResult(
            token_ids=tokens,
            logprobs=logprobs,
            num_accepted=None if accepted is None else tuple(accepted),
            accepted_logprobs=before,
        )


def _positions(requests: Sequence[StepRequest], device: torch.device) -> torch.Tensor:
    """Each token's position in its request (a model without attention builds no paged
    metadata, which holds them otherwise)."""
    spans = [torch.arange(r.start_position, r.start_position + r.num_tokens) for r in requests]
    return torch.cat(spans).to(device)


@attrs.frozen(eq=False)
class StageInputs:
    """What :meth:`ModelExecutor.prepare` builds for one step, before any layer runs.

    Attributes:
        query_lens: Tokens run per request.
        positions: ``[num_tokens]`` position of each token within its request.
        caches: Per memory of the layers held (``memories``), its KV cache and its
            group's paged metadata (a state group's: its :class:`StepStates`; None for a
            layer keeping nothing).
        input_ids: ``[num_tokens]`` token ids where the executor embeds, else None.
    """

    query_lens: list[int]
    positions: torch.Tensor
    caches: list[tuple[torch.Tensor, PagedMetadata | StepStates | None]]
    input_ids: torch.Tensor | None
