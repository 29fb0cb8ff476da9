"""One decoding iteration, written once: guard, propose, verify, accept, commit, ``Step``.

A method brings three parts (vLLM's proposer / scorer / sampler split):

- ``propose(st, g)``: its drafter, up to ``g`` draft tokens on the device (:func:`iid_draft`,
  :func:`mtad.decoding.mtad.beam_draft`, or its own);
- ``verify(st, proposal)``: its verifier, the target's forward over the proposal (:func:`verify_row`,
  :func:`mtad.decoding.multidraft.verified`, or its own);
- ``accept(st, proposal, scored)``: its rule, a :class:`Decision` of what is kept, still on the device.

:class:`Iteration` owns the rest, so that no decoder repeats it: the draft-length guard and the fall back to
the target's own token when there is no room to draft (:data:`TARGET`, which is AR), the wall clock, the
iteration's ONE host read (``to_host``), the ``Step`` and ``DecodeState.finish`` (commit, EOS cut, stamps).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from mtad.decoding.draft_distributions import DraftDistributions
from mtad.decoding.fused import fused
from mtad.decoding.state import DecodeState, to_host
from mtad.events import Step
from mtad.models.pair import ModelPair
from mtad.sampling import ListedDistribution, Warp, sample_logits, sample_logp, sample_token
from mtad.settings import Settings

P = TypeVar("P")  # a drafter's proposal
S = TypeVar("S")  # a verifier's scores

Value = torch.Tensor | list | int | float | None
"""A verdict's value: a device tensor (read in the iteration's one host read), or a host value a host-side
rule already holds (Spectr's and SpecInfer's walk, BiLD's rollback), passed through as it is."""


@dataclass
class Decision:
    """What a rule keeps of a proposal: the judged draft, how many of its tokens are kept, and the target's
    token after them, with what the ``Step`` records of them.

    ``draft``: the judged draft's token ids [g] (the followed candidate's, for several); None: nothing
    drafted. ``joint_p``/``joint_q``: per-prefix joint log p and log q of it, under the distributions the rule
    compared [g]. ``accepted``: how many drafts are kept (0-d). ``target_token``: the target's token after them (the bonus token when every draft passed, the recovered
    token when one was rejected, MTAD's draw at η + 1)
    (0-d). ``kept_logprobs``: the target's unwarped log p of the kept tokens, then anything (only the
    first accepted + 1 are kept). ``uniforms``: SD's draws, for the panel. ``more``: the method's own
    tensors (beams, walk trials), read in the same host read; ``record(step, values)`` then gets their
    host values (a tensor of two or more dimensions as nested lists) to fill the method's own ``Step``
    fields and, before the commit, reduce a cache fanned out over candidates to the kept one.
    """

    draft: Value
    joint_p: Value
    joint_q: Value
    accepted: Value
    target_token: Value
    kept_logprobs: Value
    draft_calls: int = 0
    uniforms: Value = None
    more: Sequence[Value] = ()
    record: Callable[[Step, list], None] | None = None


@dataclass(frozen=True)
class Iteration(Generic[P, S]):
    """A method's drafter, verifier and rule; calling it on a ``DecodeState`` runs one iteration.

    ``draft_budget``: how many tokens it may draft now (default ``DecodeState.draft_length``: gamma, less where the
    budget ends); at 0 or less the iteration is the target's own token (:data:`TARGET`)."""

    propose: Callable[[DecodeState, int], P]
    verify: Callable[[DecodeState, P], S]
    accept: Callable[[DecodeState, P, S], Decision]
    draft_budget: Callable[[DecodeState], int] = DecodeState.draft_length

    def __call__(self, st: DecodeState) -> Step:
        """Guard, propose, verify, accept, then :func:`commit_decision`: one ``Step``."""
        g = self.draft_budget(st)
        if g <= 0:
            return TARGET(st)
        t0 = st.begin()
        proposal = self.propose(st, g)
        return commit_decision(st, t0, self.accept(st, proposal, self.verify(st, proposal)))


def commit_decision(st: DecodeState, t0: float, verdict: Decision) -> Step:
    """Read the verdict in ONE host read, build its ``Step`` (kept drafts, then the target's token) and
    commit it with ``st.finish``: what every iteration ends with, MTJD's aside."""
    v = verdict
    draft, jp, jq, n, extra, kept_lps, us, *more = read(
        v.draft, v.joint_p, v.joint_q, v.accepted, v.target_token, v.kept_logprobs, v.uniforms, *v.more
    )
    draft = draft or []
    step = Step(
        index=0,
        method="",
        draft_ids=draft,
        log_p=jp or [],
        log_q=jq or [],
        accepted=n,
        from_target=[False] * n + [True],
        target_logprobs=kept_lps[: n + 1],
        uniforms=us,
        draft_calls=verdict.draft_calls,
    )
    if verdict.record is not None:
        verdict.record(step, more)
    return st.finish(t0, step, draft[:n] + [extra], n)


def read(*values: Value) -> list:
    """Host values of ``values`` in ONE host read (``to_host``) of the tensors among them: a tensor of two
    or more dimensions as nested lists, anything not a tensor as it is."""
    tensors = [v if isinstance(v, torch.Tensor) else None for v in values]
    host = to_host(*tensors)
    return [nested(h, v.shape) if isinstance(v, torch.Tensor) else v for v, h in zip(values, host, strict=True)]


def nested(flat: object, shape: torch.Size) -> object:
    """A flat list of ``to_host`` values in the nested lists of ``shape`` (scalars and 1-D lists as they are)."""
    if len(shape) < 2:
        return flat
    size = len(flat) // shape[0] if shape[0] else 0
    return [nested(flat[i * size : (i + 1) * size], shape[1:]) for i in range(shape[0])]


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The target's unwarped log p of ``tokens`` [n], token i under row i of ``logits``, on the device."""
    rows = torch.arange(tokens.numel(), device=tokens.device)
    return torch.log_softmax(logits, dim=-1)[rows, tokens]


@dataclass
class Drafts:
    """m draft sequences [m, g], the draft's distributions they were drawn from (:class:`DraftDistributions`), and the draft
    forwards they took."""

    tokens: torch.Tensor
    distributions: DraftDistributions
    calls: int

    @functools.cached_property
    def log_q(self) -> torch.Tensor:
        """The distributions over the whole vocabulary [m, g, V], written once where a rule reads them whole."""
        return self.distributions.full()


def iid_draft(st: DecodeState, g: int, m: int = 1, stop: Callable[[torch.Tensor], bool] | None = None) -> Drafts:
    """m independent sequences of up to g tokens from warp(q) (argmax when greedy), one batched draft
    forward per position: SD's draft (m = 1), Spectr's and SpecInfer's (m i.i.d.), BiLD's. The draft cache
    is left with m rows (reduce it with ``KVCache.keep_row``).

    ``stop``: a host-side check of each position's log q [m, C] before its tokens are drawn; True ends
    the drafts there, that forward counted in ``calls`` (BiLD's fallback)."""
    pending = st.pending(st.draft)
    st.draft.cache.fan_out(m)
    tokens = pending.expand(m, -1)
    drafted, distributions = [], []
    warp = st.warp
    for _ in range(g):
        if (
            stop is None
        ):  # the distribution over the draft's columns (or its top-k lists), and a column drawn from each row
            lq, col = sample_rows(st.run_draft(tokens), warp, st.uniforms((m,)), fuse=st.fused)
        else:  # the check looks before anything is drawn
            lq = st.draft_logq(tokens)
            if stop(lq):
                break
            col = sample_logp(lq, st.settings, generator=st.generator)
        tok = st.draft_tokens(col)
        drafted.append(tok)
        distributions.append(lq)
        tokens = tok[:, None]
    calls = len(drafted) + (len(drafted) < g)
    vocab = st.draft.vocab
    if not drafted:
        empty = torch.empty(m, 0, vocab, device=st.device)
        return Drafts(
            tokens=pending.new_empty(m, 0), distributions=DraftDistributions(empty, None, None, vocab), calls=calls
        )
    distributions = DraftDistributions.of_steps(distributions, vocab, st.draft_full, st.draft_tokens)
    return Drafts(tokens=torch.stack(drafted, dim=1), distributions=distributions, calls=calls)


def verify_row(st: DecodeState, drafts: Drafts) -> torch.Tensor:
    """One target forward over a one-row proposal (SD's, BiLD's); logits [g + 1, V]."""
    return st.run_target(drafts.tokens[0])


def propose_nothing(st: DecodeState, g: int) -> None:
    """The target-only proposal: nothing drafted."""
    return None


def verify_context(st: DecodeState, proposal: None) -> torch.Tensor:
    """One target forward over the unseen context; the next token's logits [V]."""
    return st.run_target(None)[0]


def target_token(st: DecodeState, proposal: None, logits: torch.Tensor) -> Decision:
    """The target's own token: argmax or a draw from its warped distribution, its unwarped log p for perplexity."""
    tok = sample_one(logits, st.warp, st.uniforms(), fuse=st.fused)
    lp = torch.log_softmax(logits, dim=-1).gather(0, tok.view(1))  # no host read of ``tok``
    return Decision(draft=None, joint_p=None, joint_q=None, accepted=0, target_token=tok, kept_logprobs=lp)


@fused
def sample_rows(
    logits: torch.Tensor, warp: Warp, u: torch.Tensor | None
) -> tuple[torch.Tensor | ListedDistribution, torch.Tensor]:
    """The run's distribution over ``logits`` [..., C] and one column a row drawn from it at uniforms ``u`` [..., 1]
    (:func:`~mtad.sampling.uniforms`; None when greedy: argmax). The distribution as :func:`sample_logits` keeps it:
    log q [..., C], or on the CPU, where it lives on the top-k lists, those lists (log q, columns [rows, k]).
    Compiled into a few kernels on a GPU (:mod:`mtad.decoding.fused`), where it is always whole rows."""
    flat = logits.reshape(-1, logits.shape[-1])
    lp, col = sample_logits(flat, warp, None if u is None else u.reshape(-1, 1))
    return (lp if isinstance(lp, tuple) else lp.view(logits.shape)), col.view(logits.shape[:-1])


@fused
def sample_one(logits: torch.Tensor, warp: Warp, u: torch.Tensor | None) -> torch.Tensor:
    """One token of [V] ``logits`` drawn from the run's distribution at uniform ``u`` [1] (None when greedy: argmax),
    0-d: the target's own token, which needs no distribution over the whole row. Compiled on a GPU, as :func:`sample_rows`."""
    return sample_token(logits.view(1, -1), warp, None if u is None else u.view(1, 1))[0]


TARGET = Iteration(propose_nothing, verify_context, target_token, draft_budget=lambda st: 1)
"""One token from the target alone: AR, and every method's last iterations where there is no room to draft."""


def run_steps(
    step: Callable[[DecodeState], Step], pair: ModelPair, prompt_ids: list[int], settings: Settings
) -> Iterator[Step]:
    """A step-wise decoder's Steps for a prompt: ``step`` (one iteration) looped on a fresh ``DecodeState``
    until the budget or EOS."""
    with torch.inference_mode():
        st = DecodeState.start(pair, prompt_ids, settings)
    while st.remaining > 0:
        with torch.inference_mode():  # no autograd bookkeeping on the decoders' many small tensor ops
            done = step(st)
        yield done
        if done.eos:
            return
