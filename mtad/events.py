"""The trace every view consumes: one ``Step`` per decoding iteration, a ``Run`` per generation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class Step:
    """One decoding iteration: what was drafted, how it was judged, what was appended.

    ``log_p``/``log_q`` are per-prefix JOINT log-probabilities of the draft (index j-1 holds
    prefix j), under exactly the distributions the acceptance rule compared (warped when
    sampling, plain softmax at T=1 when greedy). ``target_logprobs`` are the target's unwarped
    T=1 log-probabilities of the appended tokens: the perplexity metric reads them.

    Multi-candidate methods (spectr, specinfer, mtad-tree) also fill ``candidates`` (every drafted
    sequence, in draft order), ``chosen`` (the candidate the kept tokens came from; ``draft_ids``,
    ``log_p`` and ``log_q`` describe it) and ``candidate_kept`` (per candidate, how many of its leading
    tokens were kept). ``accepted`` stays the number of draft tokens appended, so acceptance is
    accepted / ``len(draft_ids)`` for every method (docs/methods.md).

    For the page's verification panel, Spectr and SpecInfer fill ``walk`` (per position judged: the
    candidate tokens tried in order, their p(x), q(x) and uniform draws, Spectr's rho, the residual's
    top [token, probability] pairs after rejections, the accepted try or the token drawn instead), and
    BiLD fills ``draft_top_q`` (the little model's top probability at each position it checked against
    tau1; one more than the drafts when it fell back).
    """

    index: int
    method: str
    draft_ids: list[int] = field(default_factory=list)
    log_p: list[float] = field(default_factory=list)
    log_q: list[float] = field(default_factory=list)
    accepted: int = 0
    appended_ids: list[int] = field(default_factory=list)
    from_target: list[bool] = field(default_factory=list)
    target_logprobs: list[float] = field(default_factory=list)
    beams: list[list[int]] | None = None
    beam_scores: list[float] | None = None
    best_beam: int | None = None
    uniforms: list[float] | None = None
    candidates: list[list[int]] | None = None
    chosen: int | None = None
    candidate_kept: list[int] | None = None
    walk: list[dict] | None = None
    draft_top_q: list[float] | None = None
    target_calls: int = 0
    draft_calls: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    other_seconds: float = 0.0
    eos: bool = False

    @property
    def seconds(self) -> float:
        """Wall seconds of the whole iteration."""
        return self.draft_seconds + self.target_seconds + self.other_seconds

    @property
    def token_log_p(self) -> list[float]:
        """Per-token conditional log p_i(x_i) of the draft (differences of the joint)."""
        return _diffs(self.log_p)

    @property
    def token_log_q(self) -> list[float]:
        """Per-token conditional log q_i(x_i) of the draft."""
        return _diffs(self.log_q)

    def to_dict(self) -> dict:
        """JSON-safe dict: non-finite floats (log 0 = -inf) become None."""
        d = asdict(self)
        d["seconds"] = self.seconds
        return json_safe(d)


@dataclass
class Run:
    """A whole generation: the prompt, its settings, the steps and the text."""

    method: str
    prompt_ids: list[int]
    settings: dict
    steps: list[Step] = field(default_factory=list)
    text: str = ""
    device: str = "cpu"

    @property
    def new_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.appended_ids]

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "device": self.device,
            "settings": self.settings,
            "text": self.text,
            "prompt_ids": self.prompt_ids,
            "new_ids": self.new_ids,
            "steps": [s.to_dict() for s in self.steps],
        }


def _diffs(joint: list[float]) -> list[float]:
    out, prev = [], 0.0
    for v in joint:
        out.append(v - prev if math.isfinite(prev) else float("-inf"))
        prev = v
    return out


def json_safe(x: object) -> object:
    """Replace non-finite floats by None, recursively, so the result is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
