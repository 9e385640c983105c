"""A quantised LM head read at 4 bits: a cheap pass over the vocabulary, then the best
candidates of each row recomputed exactly.

A decode step's LM head is most of the weights it reads (Gemma 3 270M: 640 x 262,144,
168 MB at int8, the 18 layers 100 MB together). Storing it at 4 bits halves that but
moves the logits that matter: the built-in model's mean KL against float32 went from
0.006 to 0.055 (``benchmarks/decode/weight_quality.py --head four-bit``). The logits that
matter are few, so the head keeps both::

    rows x [M, K] --4-bit pass, all N--> coarse [M, N] --top k per row--> ids [M, k]
                  --exact rows W[ids] [M, k, K] @ x--> exact [M, k] --scatter--> logits

Sampling, greedy choice and logprobs see exact logits for the ``k`` best candidates
of the 4-bit pass, and the 4-bit values for the tail, whose probabilities are small
(its quality, ``benchmarks/decode/weight_quality.py --head``, and its time against the stored
head, ``benchmarks/decode/lm_head.py``, are in docs/benchmarks.md, "Decode on the CPU"). The
exact rows are the tied embedding's where the head is the embedding (the model dtype, no
copy), an int8 head's own rows otherwise; an int4 head (a float checkpoint under
``--weights int4``) is its own first pass, rescored where it is tied. From
:data:`STORED_ROWS` rows (a long prompt's logprobs, a decode batch of 64 requests) the
stored head is as fast, and takes over.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.weights.quantized_linear import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    fits_int4,
)

#: Candidates per row recomputed exactly (the cost barely moves between 64 and 256).
NUM_RESCORED = 256
#: Rows from which the stored head is as fast (its many-rows path is a matmul over weights
#: expanded to bfloat16); the crossover of the built-in model's head is measured by
#: ``benchmarks/decode/lm_head.py`` (docs/benchmarks.md).
STORED_ROWS = 64


class RescoredHead(nn.Module):
    """``x W^T`` for a quantised head ``W``: a 4-bit pass, the top candidates exact.

    Args:
        head: The head as stored (used as it is for many rows); an int4 head is its own
            4-bit pass.
        exact_rows: ``[N, K]`` rows holding ``W`` exactly (the tied embedding), or None
            to recompute from an int8 head's rows.
        num_rescored: Candidates per row recomputed.

    Raises:
        ValueError: a head with a bias, exact rows of another shape, or an int4 head
            without exact rows (nothing finer to rescore from).
    """

    def __init__(
        self,
        head: QuantizedLinear,
        exact_rows: torch.Tensor | None = None,
        *,
        num_rescored: int = NUM_RESCORED,
    ) -> None:
        super().__init__()
        if head.bias is not None:
            raise ValueError("a rescored head has no bias (LM heads have none)")
        if exact_rows is not None and exact_rows.shape != (head.out_features, head.in_features):
            raise ValueError(
                f"exact rows {tuple(exact_rows.shape)} do not match the head "
                f"({head.out_features}, {head.in_features})"
            )
        if exact_rows is None and not isinstance(head, Int8Linear):
            raise ValueError(f"a {type(head).__name__} head needs exact rows to rescore from")
        self.in_features, self.out_features = head.in_features, head.out_features
        self.head = head
        self.coarse = (
            head
            if isinstance(head, Int4Linear)
            else Int4Linear(head.expand(0, head.out_features, torch.float32))
        )
        # A plain tensor (the embedding's storage, not a second parameter of the model).
        self.exact_rows = None if exact_rows is None else exact_rows.detach()
        self.num_rescored = min(num_rescored, head.out_features)

    @classmethod
    def fits(cls, head: nn.Module, *, has_exact_rows: bool) -> bool:
        """Whether ``head`` can be rescored: quantised without a bias, in a shape the
        4-bit kernel packs, with something finer to rescore from."""
        return (
            isinstance(head, QuantizedLinear)
            and head.bias is None
            and fits_int4(head.out_features, head.in_features)
            and (has_exact_rows or isinstance(head, Int8Linear))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] >= STORED_ROWS:
            out: torch.Tensor = self.head(x)
            return out
        logits = self.coarse.matmul_bf16(rows.to(torch.bfloat16)).float()
        ids = logits.topk(self.num_rescored, dim=-1, sorted=False).indices
        exact = torch.bmm(self._rows(ids), rows.float().unsqueeze(-1)).squeeze(-1)
        logits.scatter_(-1, ids, exact)
        return logits.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``W[ids]``, ``[M, k, K]``."""
        if self.exact_rows is not None:
            return self.exact_rows[ids].float()
        head = self.head
        assert isinstance(head, Int8Linear), "checked at construction"
        return head.levels(ids).float() * head.scales[ids].float().unsqueeze(-1)

    def weight_bytes(self) -> int:
        """Bytes one decode pass reads: the 4-bit head (the rescored rows are few)."""
        return self.coarse.weight_bytes()

    def extra_repr(self) -> str:
        exact = "tied" if self.exact_rows is not None else "int8"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_rescored={self.num_rescored}, exact={exact}"
        )
