"""Decoding settings and their validation: one place that says what is allowed."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

METHODS = ("ar", "sd", "mtad", "mtad-tree", "bild", "spectr", "specinfer", "hf-assisted", "mtjd")
"""The registered decoders (``mtad.decoding.DECODERS``, which a test keeps equal to this)."""
WITHOUT_DRAFT = ("ar", "mtjd")
"""Methods that run the target alone: AR, and MTJD (multi-token joint decoding, which MTAD approximates)."""
MULTI_DRAFT = ("spectr", "specinfer")
"""Methods that draft ``num_drafts`` i.i.d. sequences and verify them all in one target forward."""
METHOD_DEFAULTS: dict[str, dict[str, object]] = {"bild": {"gamma": 10}}
"""Where a method's paper default (Table 13 of the MTAD paper) differs from the shared field default."""
DRAFT_MODES = ("beam", "beam-sample")
GAMMA_RANGE = (1, 32)
BEAMS_RANGE = (1, 64)
DRAFTS_RANGE = (1, 16)


@dataclass(frozen=True)
class Settings:
    """Everything that decides what a decoder does, for any method.

    Sampling defaults are the paper's (T=1, top-k 20, top-p 0.9). ``greedy`` is the
    T→0 limit: argmax everywhere, no randomness. ``num_drafts`` (m) is Spectr's and SpecInfer's
    draft count; ``tau1``/``tau2`` are BiLD's fallback and rollback thresholds (paper defaults).

    MTJD reuses three fields: ``gamma`` is its block length K, ``beams`` its beam width W over the
    target and ``draft_mode`` its search (``beam``: top-W beam search; ``beam-sample``: stochastic beam
    sampling). The same fields, not new ones, so that MTAD and the MTJD it approximates run at the same
    K = γ, W and search by construction (the comparison of the two reads one ``Settings``).
    """

    method: str = "mtad"
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 20
    top_p: float = 0.9
    gamma: int = 4
    beams: int = 8
    tau: float = 0.1
    draft_mode: str = "beam"
    num_drafts: int = 4
    tau1: float = 0.9
    tau2: float = 2.0
    max_new_tokens: int = 128
    seed: int = 0

    def validate(self) -> Settings:
        """Raise ``ValueError`` naming the allowed range for the first bad field."""
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft mode must be one of {', '.join(DRAFT_MODES)}; got {self.draft_mode!r}")
        mtjd = self.method == "mtjd"
        _int_in("K (MTJD block length, gamma)" if mtjd else "gamma (draft length)", self.gamma, *GAMMA_RANGE)
        _int_in("beams (MTJD's beam width W over the target)" if mtjd else "beams", self.beams, *BEAMS_RANGE)
        if not _finite(self.tau) or not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must be between 0 and 1 (inclusive); got {self.tau}")
        _int_in("num drafts (m)", self.num_drafts, *DRAFTS_RANGE)
        if not _finite(self.tau1) or not 0.0 <= self.tau1 <= 1.0:
            raise ValueError(f"tau1 (BiLD fallback threshold) must be between 0 and 1 (inclusive); got {self.tau1}")
        if not _finite(self.tau2) or self.tau2 < 0:
            raise ValueError(f"tau2 (BiLD rollback threshold, in nats) must be a finite number >= 0; got {self.tau2}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1]; got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top-k must be an integer >= 0 (0 turns it off); got {self.top_k}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy); got {self.temperature}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max new tokens must be an integer >= 1; got {self.max_new_tokens}")
        if self.is_greedy and self.draft_mode == "beam-sample":
            raise ValueError(
                "greedy decoding (greedy on, or temperature 0) and stochastic beam sampling contradict each "
                "other: use draft mode 'beam' with greedy, or turn greedy off and set a temperature > 0 to sample"
            )
        return self

    @property
    def is_greedy(self) -> bool:
        """Greedy when asked for, or when the temperature is 0 (the T→0 limit)."""
        return self.greedy or self.temperature == 0

    @classmethod
    def for_method(cls, method: str, **fields: object) -> Settings:
        """Settings for ``method`` with its paper defaults (e.g. BiLD's gamma 10); ``fields`` override them."""
        return cls(method=method, **{**METHOD_DEFAULTS.get(method, {}), **fields})

    def with_(self, **changes: object) -> Settings:
        """A copy with some fields changed (frozen dataclass helper)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def uses_draft(method: str) -> bool:
    """Whether ``method`` runs the draft model (and so needs its context length and a draft cache)."""
    return method not in WITHOUT_DRAFT


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_in(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer from {lo} to {hi}; got {value}")
