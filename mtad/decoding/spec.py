"""The method spec: everything the rest of mtad knows about one decoder, in one object, and the registry.

Each decoder's module defines its ``SPEC`` next to its code; ``mtad.decoding`` registers the built-in ones
with :func:`register` (importing any module of the package runs that first), and the CLI, the bench, the
audit and the page read them from :func:`registry`, and check a method's settings with :func:`check`
(docs/extending.md: adding a decoder is one new file plus one ``register`` call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from mtad.events import Step
from mtad.settings import PARAMS, Param, Settings

Decoder = Callable[..., Iterator[Step]]
"""The one decoder signature: (pair, prompt ids, validated settings) -> Steps until the budget or EOS."""

PANELS = ("none", "target-beams", "sd", "mtad", "rollback", "kseq", "mss")
"""The page's verification panels: nothing drafted (AR), the target's own beams (MTJD), per-token ratio
against a uniform (SD), MTAD's joint prefix rule, BiLD's rollback (each NLL against τ2), and the multi-draft walks
(Spectr's K-SEQ, SpecInfer's MSS)."""


@dataclass(frozen=True)
class MethodSpec:
    """One decoder as the CLI, the bench, the audit and the page see it.

    ``params``: the settings it uses (``PARAMS`` entries, or a method's own version of one: BiLD's γ
    defaults to 10, MTJD calls γ its block length K); the bench sweeps and reports only these, and
    ``Settings.validate`` checks them against the ranges given here. ``step``: its one-iteration function
    on the shared ``DecodeState`` (ar, sd, mtad ...; most call an ``mtad.decoding.iteration.Iteration`` of
    their drafter, verifier and rule), or ``decoder``: a whole decoder that yields Steps itself (hf-assisted). ``exact``: its tokens follow the target's (warped) distribution exactly, so
    ``python -m mtad.audit`` must find no shift. ``drafts``: it runs the draft model. ``racer``: the page
    offers it as a lane. ``panel``: which verification panel (``PANELS``) explains an iteration; ``rule``:
    that panel's sentence on how it verifies; ``remark``: a line under the bench table where its
    columns read differently. ``verify_tokens``: how many tokens its widest verification feeds the target,
    when not γ + 1. ``feature_draft``: it can run a draft that reads the target's features
    (:mod:`mtad.models.feature_draft`: its drafter feeds the draft through the shared ``DecodeState`` and its
    verifier is one linear target forward, so the target's features of every kept position are known).
    """

    name: str
    label: str
    short: str
    colour: str
    params: tuple[Param, ...] = ()
    step: Callable | None = None
    decoder: Decoder | None = None
    exact: bool = False
    drafts: bool = True
    racer: bool = True
    panel: str = "sd"
    rule: str = ""
    remark: str = ""
    feature_draft: bool = False
    verify_tokens: Callable[[Settings], int] | None = None
    """The most tokens one of its verifications feeds the target, where that is more than γ + 1 (a token
    tree's nodes after the pending token): the compiled engine compiles each count up to it before a
    timed run (:func:`mtad.decoding.static_lm.warm_up_settings`)."""

    def __post_init__(self) -> None:
        if (self.step is None) == (self.decoder is None):
            raise ValueError(f"method {self.name!r}: give exactly one of step and decoder")
        if self.panel not in PANELS:
            raise ValueError(f"method {self.name!r}: panel must be one of {', '.join(PANELS)}; got {self.panel!r}")
        unknown = [p.field for p in self.params if p.field not in PARAMS]
        if unknown:
            raise ValueError(f"method {self.name!r}: {unknown[0]!r} is not a setting (mtad.settings.PARAMS)")
        wider = [p.field for p in self.params if p.lo < PARAMS[p.field].lo or p.hi > PARAMS[p.field].hi]
        if wider:
            raise ValueError(f"method {self.name!r}: its range for {wider[0]!r} is wider than the engine's")
        shared = Settings()
        for p in self.params:  # settings_for(name) must validate
            try:
                p.check(getattr(shared, p.field) if p.default is None else p.default)
            except ValueError as exc:
                raise ValueError(f"method {self.name!r}, its default: {exc}") from None

    @property
    def uses(self) -> tuple[str, ...]:
        """The ``Settings`` fields it depends on, in its spec's order."""
        return tuple(p.field for p in self.params)

    @property
    def param_map(self) -> dict[str, Param]:
        """Its params by field: its own ranges and names, for ``Settings.validate``."""
        return {p.field: p for p in self.params}

    @property
    def defaults(self) -> dict[str, object]:
        """Where its defaults differ from the ``Settings`` fields' (:func:`settings_for` applies them)."""
        return {p.field: p.default for p in self.params if p.default is not None}

    def note(self, settings: dict) -> str:
        """Its settings for a lane's title bar, e.g. ``W = 8, γ = 4, τ = 0.1`` (``Settings.to_dict`` values)."""
        return ", ".join(f"{p.symbol} = {settings.get(p.field):g}" for p in self.params if p.symbol)


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add a decoder to every consumer (CLI, bench, page, audit); refuses a name already taken by another."""
    taken = _REGISTRY.get(spec.name)
    if taken is not None and taken is not spec:
        raise ValueError(f"a method named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a decoder (a test's toy one); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def registry() -> dict[str, MethodSpec]:
    """Every registered method by name, in registration order (the built-in ones first: ``mtad.decoding``
    registers them, and Python runs it before any module of the package, this one included)."""
    return _REGISTRY


def method_names() -> tuple[str, ...]:
    """The registered method names: the CLI's ``--method`` choices, the bench's ``--methods``."""
    return tuple(registry())


def spec_of(method: str) -> MethodSpec:
    """The spec of a registered method, else ``ValueError`` listing them."""
    spec = registry().get(method)
    if spec is None:
        raise ValueError(f"method must be one of {', '.join(registry())}; got {method!r}")
    return spec


def check(settings: Settings) -> Settings:
    """``settings`` validated for its method: a registered name, each field in the method's own range where it
    has one (BiLD's γ, a toy method's), else the engine's (``Settings.validate``); ``ValueError`` naming the
    first bad field."""
    if settings.method not in _REGISTRY:
        raise ValueError(f"method must be one of {', '.join(_REGISTRY)}; got {settings.method!r}")
    own = spec_of(settings.method).param_map
    for field, param in own.items():
        param.check(getattr(settings, field))
    return settings.validate()


def settings_for(method: str, **fields: object) -> Settings:
    """Settings for ``method`` with its paper defaults (e.g. BiLD's γ 10); ``fields`` override them."""
    return Settings(method=method, **{**spec_of(method).defaults, **fields})


def uses_draft(method: str) -> bool:
    """Whether ``method`` runs the draft model (and so needs its context length and a draft cache)."""
    return spec_of(method).drafts


def racers() -> tuple[str, ...]:
    """The methods the page offers as lanes."""
    return tuple(n for n, s in registry().items() if s.racer)


class SpecField(Mapping[str, object]):
    """One spec field of every registered method, by name (``LABELS``, ``COLOURS``...), read from the
    registry at each look-up so that a method registered later is in it too."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __getitem__(self, method: str) -> object:
        return getattr(registry()[method], self.field)

    def __iter__(self) -> Iterator[str]:
        return iter(registry())

    def __len__(self) -> int:
        return len(registry())
