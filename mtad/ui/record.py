"""What the page remembers of a run: per lane, the Steps, their token texts and their clocks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mtad.decoding.spec import SpecField
from mtad.events import Step
from mtad.metrics import Metrics, summarize
from mtad.text import token_pieces

LABELS = SpecField("label")
"""Each method's lane title, from its spec (``mtad.decoding.spec``)."""


@dataclass
class LaneEnergy:
    """The energy meter's verdict for one lane: joules, or why there are none."""

    available: bool = False
    reason: str = "no GPU"
    joules: float | None = None
    note: str | None = None
    source: str | None = None
    samples: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class LaneRecord:
    """One method's generation as the page shows it.

    ``appended_pieces[i]``/``rejected_pieces[i]`` are the exact texts of step i's kept and
    thrown-away tokens; ``wall_ends[i]`` is the lane's wall clock (seconds since the lane
    started) at the end of step i, used only to line energy samples up with tokens.
    """

    method: str
    prompt_ids: list[int]
    steps: list[Step] = field(default_factory=list)
    appended_pieces: list[list[str]] = field(default_factory=list)
    rejected_pieces: list[list[str]] = field(default_factory=list)
    wall_ends: list[float] = field(default_factory=list)
    state: str = "waiting"  # waiting | queued | compiling | running | done | stopped | error
    error: str | None = None
    energy: LaneEnergy = field(default_factory=LaneEnergy)
    context_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.context_ids:
            self.context_ids = list(self.prompt_ids)

    @property
    def label(self) -> str:
        return LABELS.get(self.method, self.method)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "stopped", "error")

    def add(self, step: Step, tokenizer: object, wall_end: float = 0.0) -> None:
        """Record a step and the text of its kept and rejected tokens."""
        rejected = step.draft_ids[step.accepted :]
        if rejected:
            before = self.context_ids + step.draft_ids[: step.accepted]
            self.rejected_pieces.append(token_pieces(tokenizer, before, rejected))
        else:
            self.rejected_pieces.append([])
        self.appended_pieces.append(token_pieces(tokenizer, self.context_ids, step.appended_ids))
        self.context_ids.extend(step.appended_ids)
        self.steps.append(step)
        self.wall_ends.append(wall_end)

    def metrics(self) -> Metrics:
        """The lane's numbers, from ``mtad.metrics.summarize`` and nothing else."""
        return summarize(self.steps, joules=self.energy.joules, energy_note=self.energy.note)

    def own_seconds(self) -> list[float]:
        """Cumulative seconds of the lane's own work at the end of each step (its own clock)."""
        out, total = [], 0.0
        for s in self.steps:
            total += s.seconds
            out.append(total)
        return out

    def token_counts(self) -> list[int]:
        """Cumulative new tokens at the end of each step."""
        out, total = [], 0
        for s in self.steps:
            total += len(s.appended_ids)
            out.append(total)
        return out

    def new_ids(self) -> list[int]:
        return self.context_ids[len(self.prompt_ids) :]

    def upto(self, n: int) -> LaneRecord:
        """The lane as it stood after its first ``n`` steps (for Replay): still running if steps follow.

        Joules are a whole-lane reading, so a partial lane has none; power samples are cut at its clock.
        """
        n = max(0, min(n, len(self.steps)))
        if n == len(self.steps):
            return self
        end = self.wall_ends[n - 1] if n else 0.0
        energy = LaneEnergy(
            available=self.energy.available,
            reason=self.energy.reason,
            samples=[s for s in self.energy.samples if s[0] <= end],
        )
        ids = list(self.prompt_ids) + [t for s in self.steps[:n] for t in s.appended_ids]
        return LaneRecord(
            method=self.method,
            prompt_ids=list(self.prompt_ids),
            steps=self.steps[:n],
            appended_pieces=self.appended_pieces[:n],
            rejected_pieces=self.rejected_pieces[:n],
            wall_ends=self.wall_ends[:n],
            state="running" if n else "waiting",
            energy=energy,
            context_ids=ids,
        )


@dataclass
class RunRecord:
    """A whole page run: the pair, the device, the settings and one lane per method."""

    pair: str
    device: str
    prompt: str
    settings: dict
    lanes: dict[str, LaneRecord] = field(default_factory=dict)

    def lane(self, method: str) -> LaneRecord | None:
        return self.lanes.get(method)

    def to_dict(self, with_steps: bool = True) -> dict:
        """JSON view of the run: per lane its state, text, metrics (from summarize) and steps."""
        lanes = {}
        for m, lane in self.lanes.items():
            d = {
                "label": lane.label,
                "state": lane.state,
                "error": lane.error,
                "iterations": len(lane.steps),
                "new_ids": lane.new_ids(),
                "text": "".join(p for ps in lane.appended_pieces for p in ps),
                "metrics": lane.metrics().to_dict(),
                "energy": {"available": lane.energy.available, "reason": lane.energy.reason},
            }
            if with_steps:
                d["steps"] = [s.to_dict() for s in lane.steps]
            lanes[m] = d
        return {"pair": self.pair, "device": self.device, "settings": self.settings, "lanes": lanes}


def nearest_iteration(lane: LaneRecord | None, value: object) -> int:
    """The 1-based iteration of ``lane`` nearest to ``value``, as the verification panel's slider sends it
    unchecked (a number typed past either end, or nothing)."""
    last = max(1, len(lane.steps)) if lane else 1
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return min(last, max(1, int(value) if ok else 1))
