"""Every metric of a run, and of a group of runs, computed in one place (engine, UI and bench share it).

The definitions are in docs/metrics.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from mtad.events import Step, json_safe

REPEAT_N = 4
"""Repetition is counted over n-grams of this many tokens."""
LOOP_REPETITION = 0.15
"""A text with this share of repeated 4-grams or more is called a loop: the target's own samples (AR, SD)
stay well below it, MTAD's loops above it (docs/metrics.md)."""


@dataclass
class Metrics:
    """The paper's figures for one run. ``acceptance`` is None for AR (nothing drafted);
    ``joules``/``joules_per_token`` are None where no energy meter is available."""

    new_tokens: int
    iterations: int
    target_calls: int
    draft_calls: int
    drafted: int
    accepted: int
    block_efficiency: float
    acceptance: float | None
    perplexity: float
    nll_sum: float
    seconds: float
    tokens_per_second: float
    draft_seconds: float
    target_seconds: float
    other_seconds: float
    overhead_fraction: float
    joules: float | None = None
    joules_per_token: float | None = None
    energy_note: str | None = None
    ngrams: int = 0
    repeated_ngrams: int = 0
    repetition: float | None = None
    later_target_seconds: float = 0.0
    later_target_calls: int = 0
    undrafted_iterations: int = 0  # iterations that drafted nothing (BiLD's fallbacks, a budget's last token)

    @property
    def loops(self) -> bool:
        """The text repeats itself: a low perplexity then rewards the loop, not the decoder."""
        return self.repetition is not None and self.repetition >= LOOP_REPETITION

    @property
    def target_call_seconds(self) -> float | None:
        """Seconds of one target forward after the first step (whose forward also reads the prompt, and would
        weigh more in a run of fewer calls): set beside AR's one-token forward, what a verification costs on
        this device; None without such a call."""
        return self.later_target_seconds / self.later_target_calls if self.later_target_calls else None

    def to_dict(self) -> dict:
        return json_safe(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> Metrics:
        """Back from :meth:`to_dict` (a bench record): an NLL sum saved as None (infinite) is infinite again;
        a field a record predates keeps its default."""
        values = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if values["nll_sum"] is None:
            values["nll_sum"] = math.inf
        return cls(**values)


def summarize(steps: Sequence[Step], joules: float | None = None, energy_note: str | None = None) -> Metrics:
    """Fold a run's steps into its metrics (docs/metrics.md defines each)."""
    new = sum(len(s.appended_ids) for s in steps)
    target_calls = sum(s.target_calls for s in steps)
    drafted = sum(len(s.draft_ids) for s in steps)
    accepted = sum(s.accepted for s in steps)
    lps = [lp for s in steps for lp in s.target_logprobs]
    ngrams, repeated = repeated_ngrams([t for s in steps for t in s.appended_ids])
    d, t, o = (sum(getattr(s, k) for s in steps) for k in ("draft_seconds", "target_seconds", "other_seconds"))
    secs = d + t + o
    return Metrics(
        new_tokens=new,
        iterations=len(steps),
        target_calls=target_calls,
        draft_calls=sum(s.draft_calls for s in steps),
        drafted=drafted,
        accepted=accepted,
        block_efficiency=new / target_calls if target_calls else 0.0,
        acceptance=accepted / drafted if drafted else None,
        perplexity=perplexity(lps),
        nll_sum=-math.fsum(lps),
        seconds=secs,
        tokens_per_second=new / secs if secs > 0 else 0.0,
        draft_seconds=d,
        target_seconds=t,
        other_seconds=o,
        overhead_fraction=o / secs if secs > 0 else 0.0,
        joules=joules,
        joules_per_token=joules / new if joules is not None and new else None,
        later_target_seconds=t - steps[0].target_seconds if steps else 0.0,  # all but the first step's
        later_target_calls=target_calls - steps[0].target_calls if steps else 0,
        energy_note=energy_note,
        ngrams=ngrams,
        repeated_ngrams=repeated,
        repetition=repeated / ngrams if ngrams else None,
        undrafted_iterations=sum(1 for s in steps if not s.draft_ids),
    )


def position_counts(steps: Sequence[Step]) -> tuple[list[int], list[int]]:
    """Per draft position i (1, 2, …): how many iterations drafted a token there with every token before
    it kept (``reached``), and how many of those kept it too (``kept``). Their ratio is the acceptance
    curve: the chance that the i-th draft token is kept given the ones before it were; a run's counts
    add up over runs."""
    reached: list[int] = []
    kept: list[int] = []
    for s in steps:
        for i in range(min(len(s.draft_ids), s.accepted + 1)):
            if i == len(reached):
                reached.append(0)
                kept.append(0)
            reached[i] += 1
            kept[i] += i < s.accepted
    return reached, kept


def excluded_by_position(steps: Sequence[Step]) -> tuple[list[int], list[int]]:
    """Per draft position (0-based), over a run's steps: how many iterations drafted a token there after tokens
    the warped target allows (``reached``), and how many of those tokens it gives probability 0 (``excluded``,
    a joint log p turning −∞): the draft's disagreement with the target's top-k / top-p, which no τ accepts."""
    reached: list[int] = []
    excluded: list[int] = []
    for step in steps:
        for i, joint in enumerate(step.log_p):
            if i == len(reached):
                reached.append(0)
                excluded.append(0)
            reached[i] += 1
            if not math.isfinite(joint):
                excluded[i] += 1
                break
    return reached, excluded


def acceptance_by_position(reached: Sequence[int], kept: Sequence[int]) -> list[float | None]:
    """The acceptance curve from :func:`position_counts` (summed over any number of runs)."""
    return [k / r if r else None for r, k in zip(reached, kept, strict=True)]


def repeated_ngrams(ids: Sequence[int], n: int = REPEAT_N) -> tuple[int, int]:
    """How many n-grams a token sequence has, and how many of them occurred earlier in it (overlaps
    count): ``repeated / total`` is the share of the text that repeats itself."""
    seen: set[tuple[int, ...]] = set()
    total = repeated = 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        total += 1
        repeated += gram in seen
        seen.add(gram)
    return total, repeated


def repetition(ids: Sequence[int], n: int = REPEAT_N) -> float | None:
    """The share of a sequence's n-grams that repeat an earlier one; None when it has none."""
    total, repeated = repeated_ngrams(ids, n)
    return repeated / total if total else None


def speedup(run: Metrics, baseline: Metrics) -> float | None:
    """``run``'s tokens per second over ``baseline``'s (the page's "× AR": both lanes of the same run, on
    the same device); None when the baseline has no speed."""
    if not baseline.tokens_per_second or not math.isfinite(baseline.tokens_per_second):
        return None
    return run.tokens_per_second / baseline.tokens_per_second


@dataclass(frozen=True)
class SpeedEquation:
    """A lane's × AR taken apart: tokens per target call ÷ what a call costs, in units of AR's seconds per token
    (AR writes one token a call: its one-token call with its bookkeeping). The cost is one verification (the
    target's forwards, the prompt's read included), the drafting and the rest (bookkeeping), each per target
    call; all from the runs' own Steps, so the product is the measured × AR (docs/metrics.md)."""

    tokens_per_call: float
    verification: float
    drafting: float
    rest: float
    measured: float

    @property
    def cost(self) -> float:
        """What one target call of this lane costs, with its drafting and rest, in AR's token steps."""
        return self.verification + self.drafting + self.rest

    @property
    def product(self) -> float:
        """tokens per call ÷ cost: the × AR the terms give."""
        return self.tokens_per_call / self.cost if self.cost > 0 else math.nan

    def text(self) -> str:
        """The equation with its numbers: ``2.4 tokens a call ÷ (1.7 + 0.4 + 0.1) = 1.09×, measured 1.09×``."""
        terms = " + ".join(f"{x:.2g}" for x in (self.verification, self.drafting, self.rest))
        tokens = f"{self.tokens_per_call:.2g}"
        return (
            f"{tokens} token{'' if tokens == '1' else 's'} a call ÷ ({terms}) = {self.product:.2f}×, "
            f"measured {self.measured:.2f}×"
        )

    def to_dict(self) -> dict:
        return json_safe({**asdict(self), "product": self.product, "text": self.text()})


def speed_equation(run: Metrics | Pooled, baseline: Metrics | Pooled) -> SpeedEquation | None:
    """``run``'s :class:`SpeedEquation` against ``baseline`` (the AR lane or row of the same run and device);
    None when either wrote no token in no time, or ``run`` made no target call."""
    if not (run.target_calls and run.new_tokens and run.seconds > 0 and baseline.new_tokens and baseline.seconds > 0):
        return None
    unit = baseline.seconds / baseline.new_tokens  # AR's seconds per token

    def per_call(seconds: float) -> float:
        return seconds / run.target_calls / unit

    return SpeedEquation(
        tokens_per_call=run.new_tokens / run.target_calls,
        verification=per_call(run.target_seconds),
        drafting=per_call(run.draft_seconds),
        rest=per_call(run.other_seconds),
        measured=(run.new_tokens / run.seconds) / (baseline.new_tokens / baseline.seconds),
    )


def versus_weight_read_bound(ar: Metrics | Pooled, bound_seconds: float | None) -> float | None:
    """How many times the weight-read bound AR's seconds per token are: AR's seconds per new token ÷ the seconds
    reading the target's weights once takes on this device (the least a one-token forward can take when memory
    is the limit); None without either."""
    if not bound_seconds or not ar.new_tokens or not ar.seconds > 0:
        return None
    return ar.seconds / ar.new_tokens / bound_seconds


def weight_read_text(times: float, weight_bytes: int, bytes_per_second: float) -> str:
    """The status line's and the bench's sentence for :func:`versus_weight_read_bound`."""
    bound = weight_bytes / bytes_per_second
    return (
        f"AR at {times:.1f}× the weight-read bound ({weight_bytes / 1e6:.3g} MB of target weights ÷ "
        f"{bytes_per_second / 1e9:.1f} GB/s read = {bound * 1e3:.2f} ms a token)"
    )


def target_call_ratio(run: Metrics | Pooled, baseline: Metrics | Pooled) -> float | None:
    """``run``'s seconds a target call over ``baseline``'s (AR's one-token forward, on the same device): what a
    verification costs against it, for the page's cards and the bench's rows alike; None when either has no
    timed call."""
    mine, theirs = run.target_call_seconds, baseline.target_call_seconds
    return mine / theirs if mine and theirs else None


def perplexity(target_logprobs: Sequence[float]) -> float:
    """exp(-mean log p_target) over the new tokens (unwarped target, T=1; paper eq. 1)."""
    if not target_logprobs:
        return float("nan")
    return math.exp(-sum(target_logprobs) / len(target_logprobs))


@dataclass
class Pooled:
    """A group of runs (one bench row) as the paper reports it: totals over all its runs, not means of
    per-run ratios. ``joules_per_token`` pools only the runs with an energy reading (None if none has); the
    totals of seconds and target calls feed :func:`speed_equation`."""

    runs: int
    new_tokens: int
    perplexity: float
    tokens_per_second: float | None
    block_efficiency: float | None
    acceptance: float | None
    overhead_fraction: float | None
    joules_per_token: float | None
    metered_runs: int
    repetition: float | None = None
    target_call_seconds: float | None = None
    seconds: float = 0.0
    target_calls: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    other_seconds: float = 0.0

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


def perplexity_of(nll: float, tokens: int) -> float:
    """Perplexity of ``tokens`` new tokens whose negative log-likelihoods add up to ``nll``: exp(nll / tokens)
    (the paper's eq. 1 over all of them); NaN without tokens."""
    return math.exp(nll / tokens) if tokens else float("nan")


def pool(runs: Sequence[Metrics]) -> Pooled:
    """Pooled figures of several runs: perplexity = exp(total NLL / total new tokens) (paper eq. 1 over
    all tokens), speed = total tokens / total seconds, J/token = total joules / total tokens of the
    metered runs, block efficiency, acceptance and repetition as ratios of totals, and the seconds of one target
    call (:attr:`Metrics.target_call_seconds` pooled: the runs' target seconds after their first step over their
    target calls there); None where a total is 0."""
    tokens = sum(m.new_tokens for m in runs)
    seconds = sum(m.seconds for m in runs)
    calls = sum(m.target_calls for m in runs)
    later_calls = sum(m.later_target_calls for m in runs)
    drafted = sum(m.drafted for m in runs)
    metered = [m for m in runs if m.joules is not None]
    metered_tokens = sum(m.new_tokens for m in metered)
    nll = math.fsum(m.nll_sum for m in runs)
    return Pooled(
        runs=len(runs),
        new_tokens=tokens,
        perplexity=perplexity_of(nll, tokens),
        tokens_per_second=tokens / seconds if seconds > 0 else None,
        block_efficiency=tokens / calls if calls else None,
        acceptance=sum(m.accepted for m in runs) / drafted if drafted else None,
        overhead_fraction=sum(m.other_seconds for m in runs) / seconds if seconds > 0 else None,
        joules_per_token=sum(m.joules for m in metered) / metered_tokens if metered_tokens else None,
        metered_runs=len(metered),
        repetition=sum(m.repeated_ngrams for m in runs) / grams if (grams := sum(m.ngrams for m in runs)) else None,
        target_call_seconds=sum(m.later_target_seconds for m in runs) / later_calls if later_calls else None,
        seconds=seconds,
        target_calls=calls,
        draft_seconds=sum(m.draft_seconds for m in runs),
        target_seconds=sum(m.target_seconds for m in runs),
        other_seconds=sum(m.other_seconds for m in runs),
    )
