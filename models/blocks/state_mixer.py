"""What every state mixer (Mamba2, Gated DeltaNet) shares: its per-request state in pages
of the shared pool, and the order in which a step's requests read and write them.

A page of a state layer is one float32 row holding the state's parts side by side (a
mixer names their shapes: ``state_shapes``)::

    page row   [ part 0 (conv state) | part 1 (recurrent state) | ... ]

A step's tokens come request after request (prefill chunks, decodes and verifications
mixed; ``hybridkv.memory.state_pages`` states the contract). :meth:`PagedStateMixer.mix`
runs them in batch order, since a request may resume from a page an earlier request of
the step fills: a prefill chunk through the mixer's ``scan`` (writing the state at every
block end it crosses), consecutive one-token decodes batched through one ``step``, and a
request with proposed tokens one ``step`` per token, the state after its own token
written and those after the proposals kept for ``StepStates.write_verified``. A mixer
supplies ``scan`` and ``step`` over its own per-token inputs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridkv.memory.state_pages import StateAccess, StepStates, verified_writes

#: A request's state: its parts, each ``[requests, *part shape]``.
State = tuple[torch.Tensor, ...]
#: A mixer's per-token inputs (rows in the step's token order).
Inputs = tuple[torch.Tensor, ...]


class PagedStateMixer(nn.Module):
    """A mixer whose memory is a fixed-size state per request, in pages of the pool.

    Subclasses set ``state_shapes`` and implement :meth:`scan` and :meth:`step`.
    """

    state_shapes: tuple[tuple[int, ...], ...] = ()

    def scan(self, xs: Inputs, state: State, counts: list[int]) -> tuple[torch.Tensor, State]:
        """One request's tokens ``xs`` from ``state`` (parts ``[1, ...]``): outputs
        ``[L, width]`` and the state after each of ``counts`` tokens (parts
        ``[len(counts), ...]``; counts ascending, the last ``L``)."""
        raise NotImplementedError

    def step(self, xs: Inputs, state: State) -> tuple[torch.Tensor, State]:
        """One token of each of ``B`` requests (``xs`` rows ``[B, ...]``): outputs
        ``[B, width]`` and the states after (parts ``[B, ...]``), by the recurrence."""
        raise NotImplementedError

    def mix(self, xs: Inputs, pages: torch.Tensor, states: StepStates, width: int) -> torch.Tensor:
        """Every request of the step in batch order: outputs ``[num_tokens, width]``."""
        first_row = xs[0]
        out = first_row.new_empty(first_row.shape[0], width)
        first = 0
        run: list[tuple[int, StateAccess]] = []  # one-token steps waiting to run together
        written: set[int] = set()
        drafts = states.num_drafts or (0,) * len(states.accesses)
        for index, (access, num) in enumerate(zip(states.accesses, states.query_lens, strict=True)):
            rows = slice(first, first + num)
            if drafts[index]:
                self._decode(run, xs, pages, out)
                run, written = [], set()
                out[rows] = self._verify(access, _rows(xs, rows), pages, (states, index))
            elif num == 1 and access.read_page not in written:
                run.append((first, access))
                written.add(access.writes[0][1])
            else:
                self._decode(run, xs, pages, out)
                run, written = [], set()
                if num == 1:
                    run, written = [(first, access)], {access.writes[0][1]}
                else:
                    out[rows] = self._prefill(access, _rows(xs, rows), pages)
            first += num
        self._decode(run, xs, pages, out)
        return out

    # -- state pages ----------------------------------------------------------------

    def read_states(self, pages: torch.Tensor, page_ids: list[int | None]) -> State:
        """The states in ``page_ids`` (zeros for None), each part ``[len, *shape]``."""
        index = torch.tensor([p or 0 for p in page_ids], device=pages.device)
        rows = pages.index_select(0, index)
        if None in page_ids:
            fresh = torch.tensor([p is None for p in page_ids], device=pages.device)
            rows = rows.masked_fill(fresh[:, None], 0.0)
        sizes = [math.prod(shape) for shape in self.state_shapes]
        parts = torch.split(rows[:, : sum(sizes)], sizes, dim=1)
        return tuple(p.view(-1, *s) for p, s in zip(parts, self.state_shapes, strict=True))

    def write_states(self, pages: torch.Tensor, page_ids: list[int], state: State) -> None:
        """Write ``state`` (parts ``[len(page_ids), ...]``) into ``page_ids``."""
        rows = torch.cat([part.flatten(1).float() for part in state], dim=1)
        pages.index_copy_(0, torch.tensor(page_ids, device=pages.device), rows)

    # -- the three paths ------------------------------------------------------------

    def _prefill(self, access: StateAccess, xs: Inputs, pages: torch.Tensor) -> torch.Tensor:
        """One request's chunk, its state written at every block end it crosses."""
        state = self.read_states(pages, [access.read_page])
        out, after = self.scan(xs, state, [n for n, _ in access.writes])
        self.write_states(pages, [page for _, page in access.writes], after)
        return out

    def _decode(
        self,
        run: list[tuple[int, StateAccess]],
        xs: Inputs,
        pages: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """One token for each request of ``run``, batched: the recurrence."""
        if not run:
            return
        rows = torch.tensor([first for first, _ in run], device=out.device)
        state = self.read_states(pages, [a.read_page for _, a in run])
        y, after = self.step(tuple(x[rows] for x in xs), state)
        self.write_states(pages, [a.writes[0][1] for _, a in run], after)
        out[rows] = y

    def _verify(
        self,
        access: StateAccess,
        xs: Inputs,
        pages: torch.Tensor,
        where: tuple[StepStates, int],
    ) -> torch.Tensor:
        """A request's last token and its proposed ones, one step at a time (the
        arithmetic of a decode, so kept tokens match decoding them one by one). The state
        after each token is kept in ``states.pending`` for ``StepStates.write_verified``;
        only the state after the request's own token is written here."""
        state = self.read_states(pages, [access.read_page])
        outputs, kept = [], []
        for t in range(xs[0].shape[0]):
            y, state = self.step(tuple(x[t : t + 1] for x in xs), state)
            outputs.append(y)
            kept.append(state)
        states, index = where
        every = tuple(torch.cat(parts) for parts in zip(*kept, strict=True))
        # The request's own token is always kept: its state is written now, so that a
        # later step hitting the block it completed (cached at allocation) reads it even
        # before this step's verdict reaches a pipeline stage.
        first = verified_writes(access, 1)
        self.write_states(pages, [page for _, page in first], tuple(p[:1] for p in every))

        def write(page_ids: list[int], rows: list[int]) -> None:
            self.write_states(pages, page_ids, tuple(p[rows] for p in every))

        states.pending.append((index, write))
        return torch.cat(outputs)


def _rows(xs: Inputs, rows: slice) -> Inputs:
    return tuple(x[rows] for x in xs)
