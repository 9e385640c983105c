"""Verifying proposed tokens against the target model's distributions, exactly.

The target runs once over a request's last token and its ``k`` proposed tokens and gives
``k + 1`` distributions: ``p[i]`` is the target's distribution for the token after
position ``i``. Verification keeps the longest run of proposals it accepts and then one
token of the target's own, so a step emits between 1 and ``k + 1`` tokens.

- **Greedy** (temperature 0): proposal ``i`` is accepted while it is ``p[i]``'s argmax;
  the first that is not is replaced by the argmax, and after ``k`` acceptances the argmax
  of ``p[k]`` follows. The text is exactly the text without speculation.
- **Sampled**: the rejection rule of speculative sampling (Leviathan et al., Chen et al.,
  2023). Proposal ``x`` drawn from the draft's ``q[i]`` is accepted with probability
  ``min(1, p[i][x] / q[i][x])``; on the first rejection a token is drawn from the residual
  ``max(p[i] - q[i], 0)``, normalised, and verification stops. Each emitted token is then
  distributed as ``p`` itself, whatever the draft was. A proposer with no distribution
  (the n-gram lookup) is a draft whose ``q[i]`` puts all its mass on its proposal: then
  ``x`` is accepted with probability ``p[i][x]`` and the residual is ``p[i]`` without ``x``.

The distributions are the ones the sampler would draw from (after temperature, top-k/p,
penalties and the grammar's mask), so a masked token has probability 0 and is never
accepted or drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(target_argmax: Sequence[int], proposed: Sequence[int]) -> list[int]:
    """The tokens a greedy step emits: accepted proposals, then the target's own token.

    Args:
        target_argmax: The argmax of each of the ``k + 1`` target distributions.
        proposed: The ``k`` proposed tokens.
    """
    _check_lengths(len(target_argmax), len(proposed))
    out: list[int] = []
    for token, best in zip(proposed, target_argmax, strict=False):
        if token != best:
            break
        out.append(token)
    out.append(int(target_argmax[len(out)]))
    return out


def verify_sampled(
    target_probs: torch.Tensor,
    proposed: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a sampled step emits, by the rejection rule (see the module).

    Args:
        target_probs: ``[k + 1, vocab]``, each row a distribution.
        proposed: The ``k`` proposed tokens.
        draft_probs: ``[k, vocab]``, the draft's distributions the proposals were drawn
            from; None for a deterministic proposer (all mass on each proposal).
        generator: The request's generator (a seeded request draws the same tokens).
    """
    num = len(proposed)
    _check_lengths(target_probs.shape[0], num)
    if draft_probs is not None and draft_probs.shape[0] != num:
        raise ValueError(f"{draft_probs.shape[0]} draft distributions for {num} proposals")
    probs = target_probs.to(torch.float64)
    # One uniform per proposal, drawn up front: the draws do not depend on the outcome.
    uniforms = torch.rand(num, generator=generator, dtype=torch.float64, device=probs.device)
    out: list[int] = []
    for i, token in enumerate(proposed):
        p = probs[i]
        if draft_probs is None:
            q_token = 1.0
            residual = p.clone()
            residual[token] = 0.0
        else:
            q = draft_probs[i].to(torch.float64)
            q_token = float(q[token])
            residual = (p - q).clamp_min_(0.0)
        p_token = float(p[token])
        if q_token > 0.0 and float(uniforms[i]) * q_token < p_token:
            out.append(token)
            continue
        out.append(_draw(residual if float(residual.sum()) > 0.0 else p, generator))
        return out
    out.append(_draw(probs[num], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))


def _check_lengths(num_targets: int, num_proposed: int) -> None:
    if num_targets != num_proposed + 1:
        raise ValueError(f"{num_targets} target distributions for {num_proposed} proposals")


__all__ = ["verify_greedy", "verify_sampled"]
