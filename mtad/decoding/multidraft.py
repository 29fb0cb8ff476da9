"""Several draft sequences verified in one target forward: the batch-of-rows and token-tree forwards,
and the position-by-position walk that Spectr (K-SEQ) and SpecInfer (MSS) share, as one
:class:`mtad.decoding.iteration.Iteration` (:func:`multi_draft`) over i.i.d. drafts.

Two layouts for the one target forward (:func:`layout`):
- ``tree`` (default): one row, the candidates merged into a token tree (shared prefixes once) with a
  4-D tree attention mask and per-node positions (:mod:`mtad.decoding.tree`). The tree feeds fewer
  tokens whenever drafts share a prefix (beams nearly always do) and never copies the cache m times;
  rows were faster only for m=2 drafts that share nothing.
- ``rows``, the fallback: one batch row per candidate, the target's cache fanned out with
  ``KVCache.fan_out`` and reduced to the kept row with ``KVCache.keep_row``.
  It needs nothing but a standard cache, so it runs on any architecture and any attention
  kernel (flash-attention ignores custom 4-D masks), and with one candidate it is exactly the
  single-draft forward (so MTAD-all-beams with W = 1 is MTAD token for token).
Both are tested to give a cache equal to a full recompute on Llama, OPT and Qwen2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mtad.decoding.iteration import Decision, Drafts, Iteration, iid_draft, logprobs_of
from mtad.decoding.state import DecodeState
from mtad.decoding.tree import TokenTree, keep_path, verify_tree
from mtad.events import Step
from mtad.models.cpu_attention import NAME as CPU_SDPA
from mtad.sampling import probs, sample

Rule = Callable[..., tuple[int | None, torch.Tensor]]
"""A multi-candidate acceptance rule at one position: (p, q, candidate tokens, generator, trace=None) ->
(index of the accepted candidate, or None and the distribution to sample the replacement from). With a
:class:`Trial`, the rule also leaves there, as device tensors, what it compared (for the page's panel)."""

TOP = 3  # tokens of a residual distribution the panel lists


@dataclass
class Trial:
    """What a rule compared at one position of the walk, kept on the device until the iteration's one
    host read: per tried candidate p(x) (for SpecInfer, under the residual it was judged against), q(x)
    and the uniform draw; Spectr's rho; after a rejection, the top tokens of the residual (SpecInfer: after
    each rejection; Spectr: once, when none passed)."""

    tokens: list[int]
    p: list[torch.Tensor] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    u: torch.Tensor | None = None
    rho: float | None = None
    residuals: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (probs, tokens) top TOP
    accepted: int | None = None
    draw: int | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        """Every device tensor of the trial, in a fixed order (see :meth:`to_dict`)."""
        return [*self.p, *self.q, self.u, *(t for r in self.residuals for t in r)]

    def to_dict(self, values: list) -> dict:
        """The trial as plain data, ``values`` being :meth:`tensors` read by ``to_host``."""
        k, r = len(self.p), len(self.residuals)
        p, q, u, rest = values[:k], values[k : 2 * k], values[2 * k], values[2 * k + 1 :]
        tops = [[[int(t), pr] for pr, t in zip(rest[2 * j], rest[2 * j + 1], strict=True)] for j in range(r)]
        return {
            "tokens": self.tokens,
            "p": p,
            "q": q,
            "u": u[: len(p)] if u is not None else None,
            "rho": self.rho,
            "residuals": tops,
            "accepted": self.accepted,
            "draw": self.draw,
        }


def residual_top(dist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``TOP`` likeliest tokens of a distribution and their probabilities, on the device."""
    top = dist.topk(min(TOP, dist.numel()))
    return top.values, top.indices


def verify_rows(st: DecodeState, drafts: torch.Tensor) -> torch.Tensor:
    """One target forward over every candidate [m, g] as m batch rows; logits [m, g + 1, V].

    The target cache is left with m rows: reduce it with :func:`keep_row` before committing."""
    m, g = drafts.shape
    pending = st.pending(st.target)
    st.target.cache.fan_out(m)
    tokens = torch.cat([pending.expand(m, -1), drafts], dim=1)
    t0 = st.timer.mark()
    logits = st.target.feed(tokens, keep=g + 1)
    st.spans["target"].append((t0, st.timer.mark()))
    return logits


@dataclass
class Walk:
    """The outcome of a verification walk: which candidate was followed and how far."""

    chosen: int
    accepted: int
    target_token: int


def walk(
    cands: list[list[int]],
    p_at: Callable[[int, int], torch.Tensor],
    q_at: Callable[[int, int], torch.Tensor],
    rule: Rule,
    generator: torch.Generator,
    greedy: bool,
    trials: list[Trial] | None = None,
) -> Walk:
    """Verify candidate sequences position by position, as Spectr and SpecInfer do.

    At depth i the live candidates are those that agree with the accepted prefix; their i-th tokens
    (one per candidate, duplicates included: they are the i.i.d. draws the rule's exactness rests on)
    go to ``rule`` with the target's p and the draft's q at that prefix (``p_at(w, i)``: probabilities
    after candidate w's first i tokens). An accepted token narrows the live set to the candidates
    carrying it; a rejection ends the walk with a draw from the rule's residual. Greedy: accept the
    candidate equal to argmax p, else the target's argmax. ``trials``, when given, receives one
    :class:`Trial` per position judged.
    """
    live = list(range(len(cands)))
    depth = len(cands[0])
    for i in range(depth):
        p = p_at(live[0], i)
        tokens = [cands[w][i] for w in live]
        trial = Trial(tokens) if trials is not None else None
        if trial is not None:
            trials.append(trial)
        if greedy:
            best = int(p.argmax())
            if trial is not None:
                trial.p, trial.q = list(p[tokens].unbind()), list(q_at(live[0], i)[tokens].unbind())
                trial.accepted = tokens.index(best) if best in tokens else None
                trial.draw = None if best in tokens else best
            if best not in tokens:
                return Walk(live[0], i, best)
            x = best
        else:
            k, residual = rule(p, q_at(live[0], i), tokens, generator, trial)
            if k is None:
                extra = int(sample(residual, generator=generator))
                if trial is not None:
                    trial.draw = extra
                return Walk(live[0], i, extra)
            x = tokens[k]
            if trial is not None:
                trial.accepted = k
        live = [w for w in live if cands[w][i] == x]
    p = p_at(live[0], depth)
    extra = int(p.argmax()) if greedy else int(sample(p, generator=generator))
    return Walk(live[0], depth, extra)


def kept_lengths(cands: list[list[int]], kept: list[int]) -> list[int]:
    """Per candidate, how many of its leading tokens equal the kept accepted prefix."""
    out = []
    for c in cands:
        n = 0
        while n < len(kept) and c[n] == kept[n]:
            n += 1
        out.append(n)
    return out


@dataclass
class Verified:
    """Target logits for every candidate prefix, however the forward was laid out."""

    at: Callable[[int, int], torch.Tensor]  # (candidate w, position i) -> logits after its first i tokens
    keep: Callable[[int, int], None]  # (chosen candidate, accepted n) -> reduce the target cache to it


def rows_verified(st: DecodeState, drafts: torch.Tensor) -> Verified:
    """:func:`verify_rows` as a :class:`Verified`."""
    logits = verify_rows(st, drafts)
    return Verified(at=lambda w, i: logits[w, i], keep=lambda w, n: st.target.cache.keep_row(w))


def tree_verified(
    st: DecodeState, drafts: torch.Tensor, ids: list[list[int]] | None = None, live: list[bool] | None = None
) -> Verified:
    """:func:`mtad.decoding.tree.verify_tree` as a :class:`Verified`. ``ids``: the drafts' token ids when
    the caller has already read them; ``live``: which candidates to put in the tree (the others are
    left out of the forward; asked for any position, they get the context's logits, and the caller
    must not accept any of their tokens)."""
    ids = drafts.tolist() if ids is None else ids
    live = [True] * len(ids) if live is None else live
    kept = [w for w, ok in enumerate(live) if ok]
    tree = TokenTree.from_sequences([ids[w] for w in kept])
    paths = [tree.paths[kept.index(w)] if ok else [] for w, ok in enumerate(live)]
    k = len(st.ids) - st.target.length
    logits = verify_tree(st, tree)
    context = len(st.ids)

    def at(w: int, i: int) -> torch.Tensor:
        """Logits after candidate w's first i tokens (a candidate left out has only the context's)."""
        return logits[k - 1] if i == 0 or not live[w] else logits[k + paths[w][i - 1]]

    return Verified(at=at, keep=lambda w, n: keep_path(st.target, context, paths[w][:n]))


TREE_ATTENTION = ("eager", "sdpa", CPU_SDPA)
"""Attention kernels that honour a custom 4-D additive mask (flash-attention kernels do not)."""


def layout(st: DecodeState, candidates: int) -> str:
    """``tree`` where the target's attention honours a 4-D mask and there is more than one candidate,
    else ``rows`` (see the module docstring for why)."""
    kernel = getattr(st.target.model.config, "_attn_implementation", None) or "eager"
    return "tree" if candidates > 1 and kernel in TREE_ATTENTION else "rows"


def verified(st: DecodeState, drafts: torch.Tensor, how: str | None = None) -> Verified:
    """Every candidate's target logits from one forward, laid out as ``how`` (default :func:`layout`)."""
    how = how or layout(st, drafts.shape[0])
    return (tree_verified if how == "tree" else rows_verified)(st, drafts)


def walk_accept(st: DecodeState, drafts: Drafts, checked: Verified, rule: Rule) -> Decision:
    """The walk with ``rule`` down the candidates (host-side: it reads p and q as it goes); the accepted
    prefix of the followed candidate plus one target token, both caches reduced to that candidate."""
    g = drafts.tokens.shape[1]
    cands = drafts.tokens.tolist()

    @functools.cache  # the walk reads only the positions along its path, each at most twice
    def p_at(w: int, i: int) -> torch.Tensor:
        return probs(st.judged(checked.at(w, i)).double())

    @functools.cache
    def q_at(w: int, i: int) -> torch.Tensor:
        return probs(drafts.log_q[w, i].double())

    trials: list[Trial] = []
    out = walk(cands, p_at, q_at, rule, st.generator, st.settings.is_greedy, trials)
    n, w = out.accepted, out.chosen
    rows = torch.stack([checked.at(w, i) for i in range(g + 1)])  # [g + 1, V]
    checked.keep(w, n)
    st.draft.cache.keep_row(w)

    draft = drafts.tokens[w]
    lp_x = st.judged(rows[:g]).gather(1, draft[:, None])[:, 0]
    lq_x = drafts.log_q[w].gather(1, draft[:, None])[:, 0]
    kept = cands[w][:n] + [out.target_token]
    kept_lp = logprobs_of(rows[: n + 1], torch.tensor(kept, device=st.device))

    def record(step: Step, values: list) -> None:
        """Every candidate, the followed one, and the walk as the page's panel reads it."""
        walked = []
        for trial in trials:
            n_t = len(trial.tensors())
            walked.append(trial.to_dict(values[:n_t]))
            values = values[n_t:]
        step.candidates, step.chosen, step.walk = cands, w, walked
        step.candidate_kept = kept_lengths(cands, kept[:n])

    more = [t for trial in trials for t in trial.tensors()]
    return Decision(
        cands[w], lp_x.cumsum(0), lq_x.cumsum(0), n, out.target_token, kept_lp, draft_calls=g, more=more, record=record
    )


def iid_drafts(st: DecodeState, g: int) -> Drafts:
    """``num_drafts`` i.i.d. drafts of g tokens (:func:`mtad.decoding.iteration.iid_draft`)."""
    return iid_draft(st, g, st.settings.num_drafts)


def verify_drafts(st: DecodeState, drafts: Drafts, how: str | None = None) -> Verified:
    """Every draft's target logits from one forward, laid out as ``how`` (default :func:`layout`)."""
    return verified(st, drafts.tokens, how)


def multi_draft(rule: Rule, how: str | None = None) -> Iteration:
    """A multi-draft method's iteration: m i.i.d. drafts, one target forward (``how``: ``rows`` or ``tree``,
    default :func:`layout`), the walk with ``rule``; it appends the accepted prefix of the followed
    candidate plus one target token."""
    return Iteration(
        propose=iid_drafts,
        verify=functools.partial(verify_drafts, how=how),
        accept=functools.partial(walk_accept, rule=rule),
    )


def multi_step(st: DecodeState, rule: Rule, how: str | None = None) -> Step:
    """One iteration of :func:`multi_draft` with ``rule``."""
    return multi_draft(rule, how)(st)
