"""Decoding settings and their validation: one place that says what is allowed."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

DRAFT_MODES = ("beam", "beam-sample")


@dataclass(frozen=True)
class Param:
    """One decoding setting a method may use: the ``Settings`` field, the name its errors give, the range the
    engine allows (``hi`` inf: no upper bound; ``choices`` for a string), its symbol in a lane's title and a
    bench row, and the page's widget label and range (a span a visitor needs, never wider than the engine's).

    A method's spec lists the ones it uses; :meth:`own` gives a method its own name, default or range."""

    field: str
    name: str
    lo: float = 0
    hi: float = math.inf
    kind: type = int
    symbol: str = ""
    page_name: str = ""
    page_range: tuple[float, float] | None = None
    choices: tuple[str, ...] = ()
    default: object = None
    """This method's default where it differs from the ``Settings`` field's (BiLD drafts γ = 10)."""

    def own(self, **changes: object) -> Param:
        """The same setting as one method sees it (its own default, range, name or symbol)."""
        return replace(self, **changes)

    @property
    def widget_range(self) -> tuple[float, float]:
        """The page's range for this setting: its own cap where it has one, else the engine's."""
        return self.page_range or (self.lo, self.hi)

    def check(self, value: object) -> None:
        """Raise ``ValueError`` naming the setting and what it allows when ``value`` is out of range."""
        if self.choices:
            if value not in self.choices:
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}; got {value!r}")
        elif self.kind is int:
            _int_in(self.name, value, int(self.lo), int(self.hi))
        elif math.isinf(self.hi):
            if not _finite(value) or value < self.lo:
                raise ValueError(f"{self.name} must be a finite number >= {self.lo:g}; got {value}")
        elif not _finite(value) or not self.lo <= value <= self.hi:
            raise ValueError(f"{self.name} must be between {self.lo:g} and {self.hi:g} (inclusive); got {value}")


PARAMS: dict[str, Param] = {
    p.field: p
    for p in (
        Param("draft_mode", "draft mode", kind=str, choices=DRAFT_MODES),
        Param("gamma", "gamma (draft length)", 1, 32, symbol="γ", page_name="draft length γ", page_range=(1, 12)),
        Param("beams", "beams", 1, 64, symbol="W", page_name="beams W", page_range=(1, 16)),
        Param("tau", "tau", 0.0, 1.0, float, "τ", "τ (MTAD threshold)"),
        Param("num_drafts", "num drafts (m)", 1, 16, symbol="m", page_name="drafts m", page_range=(1, 8)),
        Param("tau1", "tau1 (BiLD fallback threshold)", 0.0, 1.0, float, "τ1", "τ1 (BiLD fallback)"),
        Param(
            "tau2", "tau2 (BiLD rollback threshold, in nats)", 0.0, math.inf, float, "τ2", "τ2 (BiLD rollback, nats)"
        ).own(page_range=(0.0, 10.0)),  # nats; the engine allows any value >= 0, the page a useful span
    )
}
"""The one home of every method setting's range: ``Settings.validate``, the CLI's help, the page's widgets
and each method's spec (``mtad.decoding.spec``) read them here."""


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
        """Raise ``ValueError`` naming the allowed range for the first bad field, each field checked against
        the engine's range for it (``PARAMS``); a method's own narrower ranges and its name are checked with
        the registry, :func:`mtad.decoding.spec.check`."""
        for field, param in PARAMS.items():
            param.check(getattr(self, field))
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

    @property
    def tempered(self) -> bool:
        """Whether a temperature other than 1 divides the logits."""
        return self.temperature != 1.0

    @property
    def nucleus(self) -> bool:
        """Whether top-p cuts the distribution (below 1)."""
        return self.top_p < 1.0

    def with_(self, **changes: object) -> Settings:
        """A copy with some fields changed (frozen dataclass helper)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_in(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer from {lo} to {hi}; got {value}")
