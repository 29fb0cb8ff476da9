"""The draft's distributions that drafted tokens were drawn from, kept in the form the draw made them.

A rule reads little of them: log q of each drafted token, and q at the target's top-k tokens (or over one
whole row) where SD resamples. Writing each drafted position's distribution over the whole 49k vocabulary costs a
pass over a row per draft forward and one more to spread the draft's columns over the vocabulary; where
every distribution lives on its top-k list (on the CPU, :func:`mtad.sampling._listed_distribution`) the lists are kept instead,
and a whole row is written only where a rule asks for one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from mtad.sampling import ListedDistribution


class DraftDistributions(NamedTuple):
    """Log q of the distributions behind drafts [..., g]: whole rows over the vocabulary ``rows`` [..., g, V], or the
    top-k lists ``lp`` and their token ids ``tokens`` [..., g, k] (then ``rows`` is None); ``vocab`` is V.
    Both forms give the same values, bit for bit. A NamedTuple, so a compiled rule takes it as its input."""

    rows: torch.Tensor | None
    lp: torch.Tensor | None
    tokens: torch.Tensor | None
    vocab: int

    @classmethod
    def of_steps(
        cls,
        steps: Sequence[torch.Tensor | ListedDistribution],
        vocab: int,
        spread: Callable[[torch.Tensor], torch.Tensor],
        tokens_of: Callable[[torch.Tensor], torch.Tensor],
    ) -> DraftDistributions:
        """The distributions of ``g`` draft steps, each [m, C] rows over the draft's columns or a :data:`ListedDistribution` distribution,
        stacked [m, g, ...]: lists where every step is one, else whole rows. ``spread`` writes column rows
        over the vocabulary (``DecodeState.draft_full``), ``tokens_of`` maps columns to token ids."""
        if all(isinstance(s, tuple) for s in steps):
            lp = torch.stack([s[0] for s in steps], dim=1)
            return cls(None, lp, tokens_of(torch.stack([s[1] for s in steps], dim=1)), vocab)
        rows = [_row(s[0], tokens_of(s[1]), vocab) if isinstance(s, tuple) else spread(s) for s in steps]
        return cls(torch.stack(rows, dim=1), None, None, vocab)

    @property
    def listed(self) -> bool:
        """Whether the distributions are kept as top-k lists."""
        return self.rows is None

    def seq(self, w: int) -> DraftDistributions:
        """The distributions of draft sequence ``w`` (of [m, g, ...]): [g, ...]."""
        return DraftDistributions(*(None if t is None else t[w] for t in self[:3]), self.vocab)

    def of(self, draft: torch.Tensor) -> torch.Tensor:
        """Log q [g] of the drafted tokens ``draft`` [g] (of one sequence's distributions), token i under distribution i."""
        if self.rows is not None:
            return self.rows.gather(1, draft[:, None])[:, 0]
        return torch.where(self.tokens == draft[:, None], self.lp, float("-inf")).amax(dim=-1)

    def at(self, i: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Log q [1, n] of distribution ``i`` (a 1-element tensor: no host read) at token ids ``tokens`` [1, n]
        (-inf off its list)."""
        if self.rows is not None:
            return self.rows.index_select(0, i).gather(1, tokens)
        lp, listed = self.lp.index_select(0, i), self.tokens.index_select(0, i)
        return torch.where(tokens[0, :, None] == listed, lp, float("-inf")).amax(dim=-1)[None]

    def row(self, i: torch.Tensor) -> torch.Tensor:
        """Warp ``i``'s log q over the whole vocabulary [V] (``i`` a 1-element tensor)."""
        if self.rows is not None:
            return self.rows.index_select(0, i)[0]
        return _row(self.lp.index_select(0, i), self.tokens.index_select(0, i), self.vocab)[0]

    def full(self) -> torch.Tensor:
        """Every distribution over the whole vocabulary [..., g, V]."""
        return self.rows if self.rows is not None else _row(self.lp, self.tokens, self.vocab)


def _row(lp: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Listed log q [..., k] at token ids [..., k] written into rows of -inf [..., V]."""
    return lp.new_full((*lp.shape[:-1], vocab), float("-inf")).scatter_(-1, tokens, lp)
