"""The Mamba2 mixer over a flat batch, its state in pages of the shared pool.

Weight names follow Bamba and Granite 4.0-H checkpoints (``in_proj``, ``conv1d``,
``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``). A step's tokens come request
after request (prefill chunks and decodes mixed); each request's state is read from and
written to the pages ``hybridkv.memory.state_pages`` names, which also states the
contract. A page of the layer is one float32 row::

    page row   [ conv state: conv_dim x (K-1) | SSM state: heads x head_dim x state_size ]

Requests run in batch order (a request may resume from a page an earlier request of the
step fills); consecutive one-token steps run as one batched recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels.ssm import (
    causal_conv1d_decode,
    causal_conv1d_states,
    ssd_decode,
    ssd_scan_states,
)
from hybridkv.memory.state_pages import StateAccess, StepStates, verified_writes
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.norms import GatedRMSNorm, SpreadGatedRMSNorm
from hybridkv.models.shapes.mamba2 import Mamba2Shape
from hybridkv.models.weights.cuts import TensorCut, held_run, param, rows_of, summed_columns


class Mamba2Mixer(nn.Module):
    """Projections, causal conv, SSD scan (prefill) or recurrence (decode), gated norm.

    ``inputs.kv_cache`` is the layer's state pages ``[num_blocks, state_values]`` float32,
    ``inputs.metadata`` its group's :class:`StepStates` for the step.
    """

    def __init__(self, shape: Mamba2Shape, eps: float) -> None:
        super().__init__()
        self.shape = shape
        inner, heads = shape.intermediate_size, shape.num_heads
        self.in_proj = nn.Linear(
            shape.hidden_size, inner + shape.conv_dim + heads, bias=shape.proj_bias
        )
        self.conv1d = nn.Conv1d(
            shape.conv_dim,
            shape.conv_dim,
            shape.conv_kernel,
            groups=shape.conv_dim,
            bias=shape.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = GatedRMSNorm(inner, inner // shape.num_groups, eps)
        self.out_proj = nn.Linear(inner, shape.hidden_size, bias=shape.proj_bias)
        self._conv_values = shape.conv_dim * (shape.conv_kernel - 1)

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's heads, their channels, their B/C groups (an even run, or, with
        fewer than ranks, the one its heads read) and their state; ``out_proj`` is summed
        over the group, and a norm group spread over ranks sums its squares over them:

            in_proj rows   [ gate: inner | x: inner | B: G*N | C: G*N | dt: H ]
            rank r keeps     inner/tp      inner/tp   its groups' N each   H/tp

        The convolution is per channel and the scan per head, so both run on the share
        alone, and the rank's state pages hold its heads' states only
        (``Mamba2Shape.tensor_share``).
        """
        rank, size = cut.rank, cut.size
        shape, share = self.shape, self.shape.tensor_share(size)
        inner, num_state = shape.intermediate_size, shape.num_groups * shape.state_size
        first_group, _ = held_run(shape.num_groups, size, rank)
        mine = torch.arange(rank * share.intermediate_size, (rank + 1) * share.intermediate_size)
        groups = torch.arange(
            first_group * shape.state_size, (first_group + share.num_groups) * shape.state_size
        )
        heads = torch.arange(rank * share.num_heads, (rank + 1) * share.num_heads)
        channels = torch.cat((mine, inner + groups, inner + num_state + groups))  # of x, B, C
        rows = torch.cat((mine, inner + channels, inner + shape.conv_dim + heads))
        self.set_submodule("in_proj", rows_of(self.in_proj, rows))
        conv = self.conv1d
        with torch.device("meta"):
            conv_share = nn.Conv1d(
                share.conv_dim,
                share.conv_dim,
                shape.conv_kernel,
                groups=share.conv_dim,
                bias=conv.bias is not None,
            )
        conv_share.weight = param(conv.weight.detach()[channels])
        if conv.bias is not None:
            conv_share.bias = param(conv.bias.detach()[channels])
        self.conv1d = conv_share
        self.dt_bias = param(self.dt_bias.detach()[heads])
        self.A_log = param(self.A_log.detach()[heads])
        self.D = param(self.D.detach()[heads])
        norm = self.norm
        weight = norm.weight.detach()[mine]
        if shape.num_groups % size == 0:  # whole norm groups on every rank
            local = GatedRMSNorm(share.intermediate_size, norm.group_size, norm.eps)
            local.weight = param(weight)
            self.norm = local
        else:
            spread = SpreadGatedRMSNorm(
                weight,
                group_index=rank * share.intermediate_size // norm.group_size,
                num_groups=shape.num_groups,
                group_size=norm.group_size,
                eps=norm.eps,
                reduce=cut.all_reduce,
            )
            self.set_submodule("norm", spread)
        self.set_submodule("out_proj", summed_columns(cut, self.out_proj, mine))
        self.shape = share
        self._conv_values = share.conv_dim * (share.conv_kernel - 1)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        shape = self.shape
        gate, xbc, dt = self.in_proj(hidden).split(
            [shape.intermediate_size, shape.conv_dim, shape.num_heads], dim=-1
        )
        dt = F.softplus(dt + self.dt_bias).clamp(shape.dt_min, shape.dt_max)
        pages, states = inputs.kv_cache, inputs.metadata
        assert isinstance(states, StepStates), "a Mamba2 layer in a group without state"
        out = torch.empty(
            hidden.shape[0], shape.intermediate_size, dtype=hidden.dtype, device=hidden.device
        )
        first = 0
        run: list[tuple[int, StateAccess]] = []  # one-token steps waiting to run together
        written: set[int] = set()
        drafts = states.num_drafts or (0,) * len(states.accesses)
        for index, (access, num) in enumerate(zip(states.accesses, states.query_lens, strict=True)):
            if drafts[index]:
                self._decode(run, xbc, dt, pages, out)
                run, written = [], set()
                rows = slice(first, first + num)
                out[rows] = self._verify(access, xbc[rows], dt[rows], pages, (states, index))
            elif num == 1 and access.read_page not in written:
                run.append((first, access))
                written.add(access.writes[0][1])
            else:
                self._decode(run, xbc, dt, pages, out)
                run, written = [], set()
                if num == 1:
                    run, written = [(first, access)], {access.writes[0][1]}
                else:
                    rows = slice(first, first + num)
                    out[rows] = self._prefill(access, xbc[rows], dt[rows], pages)
            first += num
        self._decode(run, xbc, dt, pages, out)
        projected: torch.Tensor = self.out_proj(self.norm(out, gate))
        return projected

    # -- state pages ----------------------------------------------------------------

    def _read(self, pages: torch.Tensor, page_ids: list[int | None]) -> torch.Tensor:
        """The states in ``page_ids`` (zeros for None), ``[len, state_values]`` float32."""
        index = torch.tensor([p or 0 for p in page_ids], device=pages.device)
        rows = pages.index_select(0, index)
        if None in page_ids:
            fresh = torch.tensor([p is None for p in page_ids], device=pages.device)
            rows = rows.masked_fill(fresh[:, None], 0.0)
        return rows

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        widths = [self._conv_values, rows.shape[1] - self._conv_values]
        conv, ssm = torch.split(rows, widths, dim=1)
        return (
            conv.view(-1, *self.shape.conv_shape),
            ssm.view(-1, *self.shape.ssm_shape),
        )

    def _write(
        self, pages: torch.Tensor, page_ids: list[int], conv: torch.Tensor, ssm: torch.Tensor
    ) -> None:
        rows = torch.cat([conv.flatten(1).float(), ssm.flatten(1).float()], dim=1)
        pages.index_copy_(0, torch.tensor(page_ids, device=pages.device), rows)

    # -- the two paths --------------------------------------------------------------

    def _prefill(
        self, access: StateAccess, xbc: torch.Tensor, dt: torch.Tensor, pages: torch.Tensor
    ) -> torch.Tensor:
        """One request's chunk through the scan, checkpointing every block it crosses."""
        shape = self.shape
        conv_state, ssm_state = self._split(self._read(pages, [access.read_page]))
        counts = [n for n, _ in access.writes]
        mixed, conv_states = causal_conv1d_states(
            xbc, conv_state[0], self.conv1d.weight[:, 0], self.conv1d.bias, counts
        )
        x, b, c = self._heads(mixed)
        y, ssm_states = ssd_scan_states(
            x, dt, self._a(), b, c, self.D, ssm_state[0], shape.chunk_size, counts[:-1]
        )
        self._write(pages, [p for _, p in access.writes], conv_states, ssm_states)
        return y.reshape(xbc.shape[0], -1)

    def _decode(
        self,
        run: list[tuple[int, StateAccess]],
        xbc: torch.Tensor,
        dt: torch.Tensor,
        pages: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """One token for each request of ``run``, batched: the recurrence."""
        if not run:
            return
        rows = torch.tensor([first for first, _ in run], device=xbc.device)
        conv_state, ssm_state = self._split(self._read(pages, [a.read_page for _, a in run]))
        mixed, conv_after = causal_conv1d_decode(
            xbc[rows], conv_state, self.conv1d.weight[:, 0], self.conv1d.bias
        )
        x, b, c = self._heads(mixed)
        y, ssm_after = ssd_decode(x, dt[rows], self._a(), b, c, self.D, ssm_state)
        self._write(pages, [a.writes[0][1] for _, a in run], conv_after, ssm_after)
        out[rows] = y.reshape(len(run), -1)

    def _verify(
        self,
        access: StateAccess,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        pages: torch.Tensor,
        where: tuple[StepStates, int],
    ) -> torch.Tensor:
        """A request's last token and its proposed ones, one recurrence step at a time (the
        arithmetic of a decode, so kept tokens match decoding them one by one). The state
        after each token is kept in ``states.pending`` for ``StepStates.write_verified``;
        only the state after the request's own token is written here."""
        conv, ssm = self._split(self._read(pages, [access.read_page]))
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        outputs, convs, ssms = [], [], []
        for t in range(xbc.shape[0]):
            mixed, conv = causal_conv1d_decode(xbc[t : t + 1], conv, weight, bias)
            x, b, c = self._heads(mixed)
            y, ssm = ssd_decode(x, dt[t : t + 1], self._a(), b, c, self.D, ssm)
            outputs.append(y.reshape(1, -1))
            convs.append(conv)
            ssms.append(ssm)
        states, index = where
        conv_all, ssm_all = torch.cat(convs), torch.cat(ssms)
        # The request's own token is always kept: its state is written now, so that a
        # later step hitting the block it completed (cached at allocation) reads it even
        # before this step's verdict reaches a pipeline stage.
        first = verified_writes(access, 1)
        self._write(pages, [page for _, page in first], conv_all[:1], ssm_all[:1])

        def write(page_ids: list[int], rows: list[int]) -> None:
            self._write(pages, page_ids, conv_all[rows], ssm_all[rows])

        states.pending.append((index, write))
        return torch.cat(outputs)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output ``[T, conv_dim]`` -> x ``[T, H, P]``, B and C ``[T, G, N]``."""
        shape = self.shape
        size = shape.num_groups * shape.state_size
        x, b, c = torch.split(mixed, [shape.intermediate_size, size, size], dim=-1)
        return (
            x.reshape(-1, shape.num_heads, shape.head_dim),
            b.reshape(-1, shape.num_groups, shape.state_size),
            c.reshape(-1, shape.num_groups, shape.state_size),
        )

    def _a(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())
