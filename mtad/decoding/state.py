"""Shared machinery of every decoder: the generation's state (its models over their caches, the token buffer, the
clock, the random generator), the phase timer and the iteration's one host read."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from mtad.decoding.context_bias import ContextBias, weights_of
from mtad.decoding.features import FeatureLM, Features
from mtad.decoding.fused import fused_enabled
from mtad.decoding.kv import CachedLM
from mtad.decoding.protocols import LanguageModel, TreeLanguageModel
from mtad.decoding.rules import log_tau
from mtad.decoding.spec import spec_of, uses_draft
from mtad.decoding.static_lm import StaticLM, compiles_draft
from mtad.events import Step
from mtad.models.devices import to_device
from mtad.models.pair import ModelPair
from mtad.sampling import Warp, log_probs, make_generator, uniforms
from mtad.settings import Settings


def target_lm(pair: ModelPair, features: Features | None = None) -> TreeLanguageModel:
    """The target as the pair's engine runs it: eager over a ``DynamicCache``, or compiled over a static one.
    ``features``: keep its last hidden states there (a draft reads them; eager only)."""
    if pair.engine == "compiled":
        if features is not None:
            raise ValueError("this pair's draft reads the target's features: run it with --engine eager")
        return StaticLM(pair.target, pair.vocab_size)
    return CachedLM(pair.target, pair.vocab_size, features)


def draft_lm(pair: ModelPair) -> LanguageModel:
    """The draft as the pair's engine runs it: on the compiled engine it is compiled too when its layers are
    Llama layers (a shortlist draft's are), else it stays eager."""
    if compiles_draft(pair):
        return StaticLM(pair.draft, pair.vocab_size)
    return CachedLM(pair.draft, pair.vocab_size)


def reads_features(pair: ModelPair) -> bool:
    """Whether the pair's draft reads the target's features (:mod:`mtad.models.feature_draft`)."""
    return bool(getattr(pair.draft, "reads_features", False))


class PhaseTimer:
    """Seconds in draft and target forwards, timed without stalling the device.

    CPU: ``perf_counter`` marks. CUDA: timing events recorded on the stream around each forward (no host
    sync), read only after the iteration's one host sync (``to_host``), when they have completed. An
    iteration's wall time is ``perf_counter`` from ``begin`` to its end, which comes after that sync."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> torch.cuda.Event | float:
        """A point in time: an event recorded on the current stream (CUDA), else ``perf_counter``."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, spans: list[tuple]) -> float:
        """Total seconds of (start, end) mark pairs; on CUDA, only once the work they enclose has run."""
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in spans) / 1000.0
        return sum(end - start for start, end in spans)


@dataclass
class DecodeState:
    """Everything one generation carries between iterations."""

    settings: Settings
    ids: list[int]
    prompt_len: int
    target: TreeLanguageModel
    draft: LanguageModel | None
    device: torch.device
    eos_ids: frozenset[int]
    generator: torch.Generator
    timer: PhaseTimer
    steps_done: int = 0
    started: float = field(default_factory=time.perf_counter)
    fused: bool = False  # the bookkeeping runs compiled (:mod:`mtad.decoding.fused`)
    context: ContextBias | None = None  # the draft's context n-gram bias, where its weights ask for one
    spans: dict[str, list[tuple]] = field(default_factory=lambda: {"draft": [], "target": []})

    @classmethod
    def start(cls, pair: ModelPair, prompt_ids: list[int], settings: Settings) -> DecodeState:
        """Fresh caches, buffer, generator and timer for one generation (set-up time is billed to the first
        iteration, so a run's seconds cover all of its work)."""
        started = time.perf_counter()
        needs_draft = uses_draft(settings.method)
        features = (
            Features(pair.target.config.hidden_size, pair.device) if needs_draft and reads_features(pair) else None
        )
        st = cls(
            settings=settings,
            ids=list(prompt_ids),
            prompt_len=len(prompt_ids),
            target=target_lm(pair, features),
            draft=draft_lm(pair) if needs_draft and features is None else None,
            device=pair.device,
            eos_ids=pair.eos_ids,
            generator=make_generator(pair.device, settings.seed),
            timer=PhaseTimer(pair.device),
            started=started,
            fused=fused_enabled(pair) and (settings.is_greedy or settings.top_k > 0),  # top-k off: transformers' warps
        )
        if features is not None:
            st.draft = FeatureLM(pair.draft, pair.vocab_size, features, lambda: st.target.length, st.run_context)
        elif st.draft is not None and (weights := weights_of(pair.draft, exact=spec_of(settings.method).exact)):
            st.context = ContextBias(st.draft, weights)
        return st

    @functools.cached_property
    def warp(self) -> Warp:
        """The run's sampling distribution as the fused bookkeeping takes it: its values 0-d tensors on the device
        where that runs compiled (:mod:`mtad.decoding.fused`), made once a generation."""
        return Warp.of(self.settings, self.device if self.fused else None)

    @functools.cached_property
    def log_tau(self) -> float | torch.Tensor | None:
        """MTAD's threshold as its rule takes it (:func:`~mtad.decoding.rules.longest_passing`): log τ, None
        where nothing passes (τ >= 1); a 0-d tensor on the device where the rule runs compiled."""
        tau = self.settings.tau
        if tau >= 1.0:
            return None
        value = log_tau(tau)
        return to_device(torch.tensor(value, dtype=torch.float64), self.device) if self.fused else value

    def uniforms(self, rows: tuple[int, ...] = ()) -> torch.Tensor | None:
        """The uniforms one draw a row of ``rows`` is made at (:func:`~mtad.sampling.uniforms`), from the run's
        generator; None when greedy (argmax draws nothing)."""
        return None if self.settings.is_greedy else uniforms(rows, self.generator, self.device)

    @property
    def remaining(self) -> int:
        return self.settings.max_new_tokens - (len(self.ids) - self.prompt_len)

    def draft_length(self) -> int:
        """Draft at most gamma, and never more than leaves room for the target's own token."""
        return min(self.settings.gamma, self.remaining - 1)

    def pending(self, lm: LanguageModel) -> torch.Tensor:
        """The tokens ``lm`` has not seen yet, as a [1, n] tensor. On CUDA they are copied from pinned memory
        without blocking: a copy from pageable memory would wait for the queued draft work (a host sync)."""
        return to_device(torch.tensor([self.ids[lm.length :]], dtype=torch.long), self.device)

    def run_target(self, draft: torch.Tensor | None) -> torch.Tensor:
        """One target forward over the unseen context plus ``draft`` [g]; logits [g+1, V]."""
        tokens = self.pending(self.target)
        g = 0 if draft is None else draft.numel()
        if g:
            tokens = torch.cat([tokens, draft.view(1, -1)], dim=1)
        t0 = self.timer.mark()
        logits = self.target.feed(tokens, keep=g + 1)[0]
        self.spans["target"].append((t0, self.timer.mark()))
        return logits

    def run_context(self, tokens: torch.Tensor) -> None:
        """One target forward over committed context ``tokens`` [1, n] it has not seen (a feature-reading
        draft needs their features before the first verification), timed and counted as a target call."""
        t0 = self.timer.mark()
        self.target.feed(tokens, keep=1)
        self.spans["target"].append((t0, self.timer.mark()))

    def run_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """One draft forward over ``tokens`` [B, n]; the last position's logits over the draft's
        columns [B, C] (C = V, or a shortlist draft's K: map indices with :meth:`draft_tokens`)."""
        return self.run_next(self.draft, tokens)

    def run_next(self, lm: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
        """One forward of ``lm`` (the draft or the target) over ``tokens`` [B, n], timed in its own phase;
        the last position's logits [B, C] over its columns (a shortlist draft's, else the vocabulary)."""
        phase = "draft" if lm is self.draft else "target"
        lm.prepare(tokens)
        t0 = self.timer.mark()
        logits = lm.feed(tokens, keep=1, columns=True)[:, -1]
        self.spans[phase].append((t0, self.timer.mark()))
        if self.context is not None and lm is self.draft:  # the bias is the draft's distribution, so q includes it
            logits = self.context.add(logits, lm)
        return logits

    def tokens_of(self, lm: LanguageModel, index: torch.Tensor) -> torch.Tensor:
        """Token ids of column indices of :meth:`run_next`'s output for ``lm``."""
        return index if lm.columns is None else lm.columns.take(index)  # take: no host read of a 0-d index

    def draft_logq(self, tokens: torch.Tensor) -> torch.Tensor:
        """One draft forward, judged: log q over the draft's columns [B, C]. Off a shortlist q is 0,
        so warping and normalising over the columns alone gives the same values, in a sixth of the work."""
        return self.judged(self.run_draft(tokens))

    def draft_tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of column indices of :meth:`draft_logq`'s output."""
        return self.tokens_of(self.draft, index)

    def draft_full(self, logq: torch.Tensor) -> torch.Tensor:
        """Column log q [..., C] spread over the whole vocabulary [..., V] (-inf off the shortlist)."""
        cols = self.draft.columns
        if cols is None:
            return logq
        full = logq.new_full((*logq.shape[:-1], self.draft.vocab), float("-inf"))
        return full.index_copy_(-1, cols, logq)

    def judged(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities under the run's own (warped or greedy T=1) distribution."""
        return log_probs(logits, self.settings)

    def commit(self, appended: list[int], accepted_in_cache: int) -> list[int]:
        """Append tokens (cut after EOS), and crop both caches to the kept context."""
        for i, t in enumerate(appended):
            if t in self.eos_ids:
                appended = appended[: i + 1]
                break
        base = len(self.ids)
        keep = base + min(accepted_in_cache, len(appended))  # never past an EOS that ended the text
        self.target.rollback(keep)
        if self.draft is not None:
            self.draft.rollback(keep)
        self.ids.extend(appended)
        return appended

    def begin(self) -> float:
        """Start an iteration's wall clock and its per-phase spans."""
        self.spans = {"draft": [], "target": []}
        return self.started if self.steps_done == 0 else time.perf_counter()

    def finish(self, t0: float, step: Step, proposed: list[int], accepted_in_cache: int) -> Step:
        """Commit ``proposed`` (accepted drafts + target token), trim the trace to what was kept
        after an EOS cut, and stamp the step's index, method, target forwards and phase times.

        ``target_calls`` is the number of target forwards the iteration ran (each one is timed, so
        each left a span): one for every decoder that verifies in one forward, K for MTJD's beam search."""
        kept = self.commit(proposed, accepted_in_cache)
        step.appended_ids = kept
        step.accepted = min(step.accepted, len(kept))  # an EOS inside the accepted drafts ends the kept ones
        step.from_target = step.from_target[: len(kept)]
        step.target_logprobs = step.target_logprobs[: len(kept)]
        step.eos = kept[-1] in self.eos_ids
        step.index = self.steps_done
        step.method = self.settings.method
        step.target_calls = len(self.spans["target"])
        wall = time.perf_counter() - t0  # after the iteration's host sync, so the device work is done
        step.draft_seconds = self.timer.seconds(self.spans["draft"])
        step.target_seconds = self.timer.seconds(self.spans["target"])
        step.other_seconds = wall - step.draft_seconds - step.target_seconds
        self.steps_done += 1
        return step


@functools.cache
def _empty_f64(device: torch.device) -> torch.Tensor:
    """An empty float64 tensor on ``device``, made once."""
    return torch.empty(0, dtype=torch.float64, device=device)


def to_host(*tensors: torch.Tensor | None) -> list:
    """Copy several device tensors to Python lists in ONE host sync per iteration."""
    present = [t if t.dim() == 1 else t.reshape(-1) for t in tensors if t is not None]
    # cat promotes every part to float64 through an empty float64 first part (exact for ids and counts), so
    # no conversion runs per tensor
    flat = torch.cat([_empty_f64(present[0].device), *present]).tolist() if present else []
    out, i = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        n = t.numel()
        vals = flat[i : i + n]
        i += n
        if not t.is_floating_point():
            vals = [int(v) for v in vals]
        out.append(vals[0] if t.dim() == 0 else vals)
    return out


def kept_logprobs(logits: torch.Tensor, draft: torch.Tensor, n: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """The target's unwarped log-probabilities [g+1] of what an iteration appends: the first ``n``
    drafts, then ``extra`` at position n (entries past n are padding the caller drops), on the device."""
    rows = torch.arange(draft.numel() + 1, device=draft.device)
    kept = torch.where(rows < n, torch.cat([draft, draft[:1]]), extra)
    return torch.log_softmax(logits, dim=-1)[rows, kept]
