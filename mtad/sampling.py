"""Logit warping (temperature, then top-k, then top-p) and seeded sampling."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mtad.models.devices import to_device
from mtad.settings import Settings


class Warp(NamedTuple):
    """What the warps read of a run's :class:`~mtad.settings.Settings`. Made for a device
    (:meth:`of`), the temperature and top-p are 0-d tensors there: a compiled function takes them as
    inputs (:mod:`mtad.decoding.fused`), so a visitor's new value runs the same graph, not a new one."""

    is_greedy: bool
    tempered: bool
    temperature: float | torch.Tensor
    top_k: int
    nucleus: bool
    top_p: float | torch.Tensor

    @classmethod
    def of(cls, settings: Settings, device: torch.device | None = None) -> Warp:
        """``settings``' distribution, its values as Python numbers, or as 0-d fp32 tensors on ``device`` (made once a
        generation: on a GPU they are a copy from the host)."""
        t, p = settings.temperature, settings.top_p
        if device is not None:  # one copy in, without blocking
            t, p = to_device(torch.tensor([t, p], dtype=torch.float32), device).unbind()
        return cls(settings.is_greedy, settings.tempered, t, settings.top_k, settings.nucleus, p)


def warper(settings: Settings | Warp) -> LogitsProcessorList:
    """transformers' own warpers in the paper's order: temperature, top-k, top-p."""
    procs = LogitsProcessorList()
    if settings.is_greedy:
        return procs
    if settings.tempered:
        procs.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k > 0:
        procs.append(TopKLogitsWarper(settings.top_k))
    if settings.nucleus:
        procs.append(TopPLogitsWarper(settings.top_p))
    return procs


def log_probs(logits: torch.Tensor, settings: Settings | Warp) -> torch.Tensor:
    """Log-probabilities the run samples from and judges with, over the last dim.

    Sampling: log softmax of the warped logits (filtered tokens get -inf), normalised by the kept mass that
    :func:`warp` already summed rather than by a second pass over every logit. Greedy: the plain log
    softmax at T=1, which is what the paper's rule compares when nothing is sampled.
    """
    logits = _fp32(logits)
    if settings.is_greedy:
        return torch.log_softmax(logits, dim=-1)
    shape = logits.shape
    flat = logits if logits.dim() == 2 else logits.reshape(-1, shape[-1])
    top = _top_list(flat, settings)
    if top is None:
        return torch.log_softmax(warper(settings)(None, flat), dim=-1).reshape(shape)
    out = _distribution(top.x, top.vals, top.idx, top.keep_top, top.kept_ties, top.log_mass)
    return out if logits.dim() == 2 else out.reshape(shape)


def _distribution(
    x: torch.Tensor,
    vals: torch.Tensor,
    idx: torch.Tensor,
    keep_top: torch.Tensor | None,
    kept_ties: torch.Tensor,
    log_mass: torch.Tensor | None = None,
    at: torch.Tensor | None = None,
) -> torch.Tensor:
    """The warped distribution over whole rows [rows, V] from its top list (:class:`TopList`'s fields): ``x`` less
    ``log_mass`` (log p; None: the kept logits themselves) where a token is kept, -inf elsewhere. ``at``:
    the rows of ``x`` the list describes (None: all of them).

    Where no row keeps a tie of the k-th logit that ``topk`` left out (most rows: top-p cuts inside the
    list) the distribution lives on the list alone, and is written into a row of -inf: one pass over the row
    instead of six. Knowing that needs a host read, free on the CPU only; on a GPU the general path runs,
    so the decoders' one read an iteration stays one."""
    if _none_on_cpu(kept_ties):
        listed = vals if log_mass is None else vals - log_mass  # x's own values at idx: the same bits
        if keep_top is not None:
            listed = listed.where(keep_top, float("-inf"))
        return x.new_full((vals.shape[0], x.shape[-1]), float("-inf")).scatter_(-1, idx, listed)
    if at is not None:
        x = x.index_select(0, at)
    keep = _keep(x == vals[..., -1:], idx, keep_top, kept_ties)
    return torch.where(keep, x if log_mass is None else x - log_mass, float("-inf"))


def reads_free(t: torch.Tensor) -> bool:
    """Whether reading ``t`` on the host is free: on the CPU, outside a compiled graph. On a GPU a read waits
    for the device, and in a compiled graph it cannot happen: there the callers take their device paths, so
    the decoders' one read an iteration stays one."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


ListedDistribution = tuple[torch.Tensor, torch.Tensor]
"""A distribution on its top-k lists in token order (:func:`_listed_distribution`): log p [rows, k] (-inf where top-p drops a
token) and the tokens (columns) [rows, k]."""


def _listed_distribution(top: TopList, at: torch.Tensor | None = None) -> ListedDistribution | None:
    """The distribution of rows ``at`` (all: None) on their top-k lists alone, in token order: log p [rows, k] (-inf
    where top-p drops a token) and the tokens [rows, k]; None unless no row keeps a tie the list left out,
    which only the CPU knows for free (:func:`_none_on_cpu`; elsewhere the callers draw from whole rows).
    Every token off the list has p = 0 then, so a draw over the list in token order is the draw over the
    whole row in its order: the same token at the same uniform, to rounding, without passes over the row."""
    if not _none_on_cpu(top.kept_ties):
        return None
    pick_row = (lambda t: t) if at is None else (lambda t: t.index_select(0, at))  # noqa: E731
    lp = pick_row(top.vals) - pick_row(top.log_mass)
    if top.keep_top is not None:
        lp = lp.where(pick_row(top.keep_top), float("-inf"))
    idx, order = pick_row(top.idx).sort(dim=-1)
    return lp.gather(-1, order), idx


def _sample_listed(lp: torch.Tensor, idx: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row of a listed distribution (:func:`_listed_distribution`) drawn at uniforms ``u`` [rows, 1]: [rows]."""
    return idx.gather(-1, sample(probs(lp), u)[:, None])[:, 0]


def _distribution_of(logits: torch.Tensor, settings: Settings | Warp, top: TopList | None) -> torch.Tensor:
    """:func:`log_probs` of [rows, C] ``logits`` from their top list ``top`` already made (None: greedy, or
    top-k off, where :func:`log_probs` needs none)."""
    if top is None:
        return log_probs(logits, settings)
    return _distribution(top.x, top.vals, top.idx, top.keep_top, top.kept_ties, top.log_mass)


def sample_logits(
    logits: torch.Tensor, settings: Settings | Warp, u: torch.Tensor | None
) -> tuple[torch.Tensor | ListedDistribution, torch.Tensor]:
    """The run's distribution over [rows, C] ``logits`` and a column a row drawn from it at uniforms ``u`` [rows, 1]
    (None when greedy: argmax), as :func:`sample_logp` draws it. The distribution is kept as the draw made it: on the
    top-k lists where it lives there (:func:`_listed_distribution`: log p and columns [rows, k], in token order), without
    writing whole rows; else :func:`log_probs` over whole rows [rows, C]."""
    logits = _fp32(logits)
    top = None if settings.is_greedy else _top_list(logits, settings)
    listed = None if top is None else _listed_distribution(top)
    if listed is None:
        lp = _distribution_of(logits, settings, top)
        return lp, sample_logp(lp, settings, u)
    return listed, _sample_listed(*listed, u)


def sample_token(logits: torch.Tensor, settings: Settings | Warp, u: torch.Tensor | None) -> torch.Tensor:
    """A column a row of [rows, C] ``logits`` drawn from the run's distribution at uniforms ``u`` [rows, 1] (None when
    greedy: argmax): :func:`sample_logits`'s draw, for a caller that keeps no distribution."""
    return sample_logits(logits, settings, u)[1]


def _none_on_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is all zero (False) where reading that is free (:func:`reads_free`); elsewhere always
    False, and the caller takes its general path."""
    return reads_free(t) and not t.any()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, without a dispatch where it already is (the warps run many times an iteration)."""
    return t if t.dtype == torch.float32 else t.float()


def warp(logits: torch.Tensor, settings: Settings | Warp) -> torch.Tensor:
    """Temperature, then top-k, then top-p on [rows, V] logits, as transformers' warpers do.

    With top-k on (the paper's k=20), top-p only has to look at the top-k survivors: one ``topk``
    replaces the full-vocabulary sort of ``TopPLogitsWarper``, a large share of MTAD's bookkeeping.
    Like ``TopKLogitsWarper``, every token tied with the k-th logit survives
    top-k: bf16 logits tie there often, and ``topk`` alone would
    keep an arbitrary k of them. Those extra ties rank after the top k, among themselves by token
    id, and top-p keeps as many of them as its mass rule allows; on a GPU all without a host read, so the
    decoders' one read per iteration stays one (on the CPU, where a read is free, :func:`_none_on_cpu`
    skips the ties' work where there is none). Without top-k, transformers' warpers run as they are.
    """
    top = _top_list(logits, settings)
    if top is None:
        return warper(settings)(None, logits)
    return _distribution(top.x, top.vals, top.idx, top.keep_top, top.kept_ties)


class TopList(NamedTuple):
    """A warped distribution over [rows, V] in the top-k list's terms (:func:`_top_list`)."""

    x: torch.Tensor  # the tempered logits [rows, V]
    vals: torch.Tensor  # their top k, largest first [rows, k]
    idx: torch.Tensor  # where those are [rows, k]
    keep_top: torch.Tensor | None  # which of the list top-p keeps (None: all, top-p off) [rows, k]
    kept_ties: torch.Tensor  # how many of the ties the list left out it keeps [rows, 1]
    log_mass: torch.Tensor  # the log of the kept mass, the distribution's log-normaliser [rows, 1]


TIES_SEEN = 16
"""How many ties of the k-th logit that top-k's list leaves out :func:`_top_list` can count from one ``topk``
(bf16 logits of a 49,152-token vocabulary had at most 7 in 2,000 random rows)."""


def _top_list(logits: torch.Tensor, settings: Settings | Warp) -> TopList | None:
    """Top-k, then top-p on its list and the k-th logit's ties it left out (they hold mass): what
    :func:`log_probs`, :func:`top_log_probs` and :class:`RowDistributions` read the distribution from; None where top-k is off.

    ``topk`` takes :data:`TIES_SEEN` values more than the list (as fast, for a few dozen): where the last of
    them is below the k-th logit in every row, they hold every tie the list left out, and counting those
    costs nothing. Knowing that is a host read, free on the CPU; elsewhere, or where a row has more ties,
    they are counted over whole rows (two passes as long as the top-k itself)."""
    width = logits.shape[-1]
    if not 0 < settings.top_k < width:
        return None
    x = logits / settings.temperature if settings.tempered else logits
    k = settings.top_k
    vals, idx = x.topk(min(k + TIES_SEEN, width), dim=-1)
    vals, idx, beyond = vals[..., :k], idx[..., :k], vals[..., k:]
    kth = vals[..., -1:]
    if _none_on_cpu(beyond[..., -1:] == kth):
        left_out = (beyond == kth).sum(dim=-1, keepdim=True, dtype=torch.int32)
    else:  # >= counts faster than == on the CPU
        left_out = (x >= kth).sum(dim=-1, keepdim=True, dtype=torch.int32) - k
    return TopList(x, vals, idx, *_top_p_on_list(vals, left_out, settings))


def _keep(
    ties: torch.Tensor, idx: torch.Tensor, keep_top: torch.Tensor | None, kept_ties: torch.Tensor
) -> torch.Tensor:
    """Which tokens of [rows, V] the warped distribution keeps: the top-k list's kept ones (``keep_top``; all where
    top-p is off), then the first ``kept_ties`` of the k-th logit's ties that ``topk`` left out, by token id.
    Overwrites ``ties``."""
    if keep_top is None:
        return ties.scatter_(-1, idx, True)
    ties.scatter_(-1, idx, False)  # the k-th logit's ties that topk left out, ranked after the top k
    tie_rank = ties.cumsum(dim=-1, dtype=torch.int32)  # by token id, from 1
    return (ties & (tie_rank <= kept_ties)).scatter_(-1, idx, keep_top)


class RowDistributions:
    """The run's distribution over [rows, V] logits, read only where a rule looks: each drafted token's log p under
    its own row, and one whole row to draw from.

    Warping every row whole (:func:`log_probs`) costs several passes over rows x V; a verification rule
    needs log p of one token per row and the distribution of the row it stops at. The same top-k list, ties and
    top-p cut as :func:`log_probs`, so the values are the same, bit for bit."""

    def __init__(self, logits: torch.Tensor, settings: Settings | Warp) -> None:
        self.top = None if settings.is_greedy else _top_list(_fp32(logits), settings)
        self.full = log_probs(logits, settings) if self.top is None else None  # whole rows: greedy, or no top-k

    def of(self, tokens: torch.Tensor) -> torch.Tensor:
        """log p [g] of ``tokens`` [g], token i under row i (-inf where warping drops it)."""
        g = tokens.numel()
        col = tokens.view(g, 1)
        if self.full is not None:
            return self.full[:g].gather(1, col)[:, 0]
        top = self.top
        x, kth = top.x[:g], top.vals[:g, -1:]
        logit = x.gather(1, col)
        at = top.idx[:g] == col  # where the token sits in its row's top-k list, if it does
        listed = at.any(dim=-1, keepdim=True)
        tie = (logit == kth) & ~listed  # a tie of the k-th logit that the list left out
        if top.keep_top is None:
            kept = listed | tie
        else:
            kept = (at & top.keep_top[:g]).any(dim=-1, keepdim=True)
            tie = tie & (top.kept_ties[:g] > 0)  # a left-out tie in a row that keeps some of them
            if not _none_on_cpu(tie):  # (rare: the passes over the rows below are skipped where that is known)
                # its rank among the left-out ties, by token id: those up to it at or above the k-th logit,
                # less the listed ones (all at or above it)
                ids = torch.arange(x.shape[-1], device=col.device)
                upto = ((x >= kth) & (ids <= col)).sum(dim=-1, keepdim=True, dtype=torch.int32)
                rank = upto - (top.idx[:g] <= col).sum(dim=-1, keepdim=True, dtype=torch.int32)
                kept = kept | (tie & (rank <= top.kept_ties[:g]))
        return torch.where(kept, logit - top.log_mass[:g], float("-inf"))[:, 0]

    def probs_at(self, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row ``i``'s probabilities (a 1-element tensor: no host read): on its top-k list in token order,
        with those tokens, where the distribution lives there (:func:`_listed_distribution`: [k], [1, k]); else over the whole
        row, and None."""
        listed = None if self.top is None else _listed_distribution(self.top, at=i)
        if listed is None:
            return probs(self.row(i)), None
        lp, tokens = listed
        return probs(lp)[0], tokens

    def sample(self, i: torch.Tensor, settings: Settings | Warp, u: torch.Tensor | None) -> torch.Tensor:
        """A token of row ``i`` drawn at uniform ``u`` [1] as :func:`sample_logp` draws it (argmax when greedy),
        from the row's list where its distribution lives there: 0-d."""
        if settings.is_greedy:
            return sample_logp(self.row(i), settings, u)
        p, tokens = self.probs_at(i)
        drawn = sample(p, u)
        return drawn if tokens is None else tokens[0].take(drawn)

    def row(self, i: torch.Tensor) -> torch.Tensor:
        """The whole distribution, log p [V], of row ``i`` (a 1-element tensor: no host read)."""
        if self.full is not None:
            return self.full.index_select(0, i)[0]
        pick_row = lambda t: None if t is None else t.index_select(0, i)  # noqa: E731
        top = self.top
        fields = (top.vals, top.idx, top.keep_top, top.kept_ties, top.log_mass)
        return _distribution(top.x, *map(pick_row, fields), at=i)[0]


def top_log_probs(logits: torch.Tensor, settings: Settings | Warp, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``n`` first tokens of each row of [rows, V] ``logits`` in the warped distribution's order and their log p
    under it (-inf where top-p drops them), without the whole rows' distribution: what a beam step needs.

    The same distribution as :func:`log_probs` (the top-k list in ``topk``'s order, then the ties of the k-th logit
    it left out; top-p keeps a prefix), to rounding: the left-out ties are only counted, for the mass they
    hold. None where this does not apply (greedy, top-k off, or ``n`` past top-k): use
    :func:`log_probs`."""
    top = None if settings.is_greedy or n > settings.top_k else _top_list(_fp32(logits), settings)
    if top is None:
        return None
    out = top.vals[..., :n] - top.log_mass
    keep = top.keep_top
    return out if keep is None else out.where(keep[..., :n], float("-inf")), top.idx[..., :n]


def _top_p_on_list(
    vals: torch.Tensor, left_out: torch.Tensor, settings: Settings | Warp
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Top-p on a sorted top-k list ``vals`` [rows, k] followed by ``left_out`` [rows, 1] more tokens tied with
    its last: which of the list it keeps (None: all, top-p off), how many of the left-out ties [rows, 1], and
    the log of the kept mass [rows, 1], the warped distribution's log-normaliser.

    transformers drops a token when the mass ranked strictly above it is >= top_p (the first stays: nothing
    is above it); the left-out tie of rank r has the list's mass and r - 1 ties' above it."""
    # in-place steps where a fresh tensor is not needed: these run on [rows, k] lists, several times an
    # iteration, where each operation's dispatch costs more than its arithmetic
    top, top_p = vals[..., :1], settings.top_p
    weights = vals.sub(top).exp_()
    tie_weight = weights[..., -1:]
    # no row has ties beyond the list (most often; free to know on the CPU only): the ties' terms below are
    # zeros, left out with the same bits, and the rows keep none of them
    ties = not _none_on_cpu(left_out)
    total = weights.sum(dim=-1, keepdim=True)
    if ties:
        total.add_(left_out * tie_weight)
    if not settings.nucleus:
        return None, left_out, total.log_().add_(top)
    probs = weights / total
    keep_top = probs.cumsum(dim=-1).sub_(probs) < top_p
    if not ties:
        return keep_top, left_out, (weights * keep_top).sum(dim=-1, keepdim=True).log_().add_(top)
    kept_ties = probs.sum(dim=-1, keepdim=True).neg_().add_(top_p).div_(probs[..., -1:]).ceil_()
    # never more than there are, whatever the rounding
    kept_ties = torch.minimum(kept_ties.nan_to_num_(nan=0.0).clamp_min_(0), left_out)
    mass = (weights * keep_top).sum(dim=-1, keepdim=True).add_(kept_ties * tie_weight)
    return keep_top, kept_ties, mass.log_().add_(top)


def sample_logp(
    logp: torch.Tensor,
    warp: Settings | Warp,
    u: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token a row of normalised log-probabilities ``logp`` [..., V]: the argmax when greedy, else a draw
    (:func:`sample`) at uniforms ``u`` [..., 1], drawn from ``generator`` when not given. Given uniforms keep the
    draw apart from the generator, so that it runs inside a compiled graph (:mod:`mtad.decoding.fused`)."""
    if warp.is_greedy:
        return logp.argmax(dim=-1)
    return sample(probs(logp), u, generator)


def probs(logp: torch.Tensor) -> torch.Tensor:
    """The probabilities of normalised log-probabilities ``logp`` over the last dim.

    ``softmax`` rather than ``exp``: on the CPU, ``exp`` of the -inf entries warping leaves (all but
    the top-k of a 49k vocabulary) takes a much slower path; ``softmax`` does not, and
    for normalised rows it is ``exp`` up to rounding.
    """
    return torch.softmax(logp, dim=-1)


def uniforms(
    rows: torch.Size, generator: torch.Generator | None, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One uniform in [0, 1) per row of ``rows`` (a shape), [..., 1] in the dtype of the weights they will
    be inverted against (:func:`sample`)."""
    return torch.rand((*rows, 1), generator=generator, device=device, dtype=dtype)


def sample(
    probs: torch.Tensor, u: torch.Tensor | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One draw a row of (unnormalised, non-negative) ``probs`` [..., V] at uniforms ``u`` [..., 1] (drawn
    from ``generator`` when not given), by inverting the cumulative sum.

    Exact for any weights: the draw is the first index whose cumulative weight exceeds u * total, u uniform in
    [0, 1), so a zero weight is never drawn. ``torch.multinomial`` draws the same distribution but costs far more
    over a 49k vocabulary on the CPU.
    """
    if u is None:
        u = uniforms(probs.shape[:-1], generator, probs.device, probs.dtype)
    flat = probs if probs.dim() == 2 else probs.reshape(-1, probs.shape[-1])
    cdf = flat.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = u.reshape(total.shape) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u * total may round up to total
    drawn = torch.searchsorted(cdf, u, right=True)
    return drawn.view(-1) if probs.dim() == 2 else drawn.reshape(probs.shape[:-1])


def make_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on the model's device so draws are reproducible from ``seed``."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen
