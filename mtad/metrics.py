"""Every metric of a run, computed from its Steps in one place (engine, UI and bench share it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mtad.events import Step, json_safe


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
    seconds: float
    tokens_per_second: float
    draft_seconds: float
    target_seconds: float
    other_seconds: float
    overhead_fraction: float
    joules: float | None = None
    joules_per_token: float | None = None
    energy_note: str | None = None

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


def summarize(steps: Sequence[Step], joules: float | None = None, energy_note: str | None = None) -> Metrics:
    """Fold a run's steps into its metrics (see DESIGN section 2 for each definition)."""
    new = sum(len(s.appended_ids) for s in steps)
    target_calls = sum(s.target_calls for s in steps)
    drafted = sum(len(s.draft_ids) for s in steps)
    accepted = sum(s.accepted for s in steps)
    lps = [lp for s in steps for lp in s.target_logprobs]
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
        seconds=secs,
        tokens_per_second=new / secs if secs > 0 else 0.0,
        draft_seconds=d,
        target_seconds=t,
        other_seconds=o,
        overhead_fraction=o / secs if secs > 0 else 0.0,
        joules=joules,
        joules_per_token=joules / new if joules is not None and new else None,
        energy_note=energy_note,
    )


def perplexity(target_logprobs: Sequence[float]) -> float:
    """exp(-mean log p_target) over the new tokens (unwarped target, T=1; paper eq. 1)."""
    if not target_logprobs:
        return float("nan")
    return math.exp(-sum(target_logprobs) / len(target_logprobs))
