"""Predicted speeds and the fastest candidate: block efficiency from the pair's table over an iteration's
seconds timed here, against AR's seconds a token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtad.decoding import encode_prompt
from mtad.models.pair import ModelPair
from mtad.settings import Settings
from mtad.tuning.table import GAMMAS, METHODS, AcceptanceTable, Candidate, Row, describe_warp, shipped_table, warp_of
from mtad.tuning.timing import TIMING_PROMPT, Progress, cached_iteration_seconds, kept_seconds


@dataclass(frozen=True)
class Prediction:
    """One candidate's expected speed here: its tokens per target call (from the table) over its seconds an
    iteration (timed here), and that speed against AR's."""

    candidate: Candidate
    block_efficiency: float
    iteration_seconds: float
    ar_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.block_efficiency / self.iteration_seconds

    @property
    def speedup(self) -> float:
        """Predicted speed over AR's (one token per one-token forward and its bookkeeping)."""
        return self.tokens_per_second * self.ar_seconds


@dataclass(frozen=True)
class Tuning:
    """Every candidate's prediction, fastest first, and where the seconds came from."""

    predictions: list[Prediction]
    ar_seconds: float
    from_disk: bool

    def best(self, method: str) -> Prediction:
        """The fastest candidate of ``method``."""
        return next(p for p in self.predictions if p.candidate.method == method)

    def settings(self, base: Settings, method: str) -> Settings:
        """``base`` with ``method``'s fastest γ (and W)."""
        return self.best(method).candidate.settings(base)


def predict(rows: Sequence[Row], seconds: dict[Candidate, float], ar_seconds: float) -> list[Prediction]:
    """Each row's prediction where its seconds were timed, fastest first."""
    out = [
        Prediction(r.candidate, r.block_efficiency, seconds[r.candidate], ar_seconds)
        for r in rows
        if r.candidate in seconds
    ]
    return sorted(out, key=lambda p: p.tokens_per_second, reverse=True)


def table_for(pair: ModelPair, table: AcceptanceTable | None) -> AcceptanceTable:
    """``table``, else the pair's shipped one; ValueError saying how to make one when there is none."""
    table = table or shipped_table(pair.name)
    if table is None:
        raise ValueError(
            f"no acceptance table for the pair {pair.name!r}: measure one with "
            "mtad tuning measure --draft D --target T --prompts FILE --out TABLE.json, then give "
            "--acceptance TABLE.json to mtad tuning show, or with --tuned to generate or the bench"
        )
    return table


def timed_runs(
    pair: ModelPair, base: Settings, table: AcceptanceTable | None, methods: Sequence[str]
) -> tuple[list[Row], str, dict[str, Settings]]:
    """The table's rows of ``methods`` under ``base``'s warp, that warp in words, and the runs to time by name
    (AR's and each row's); ValueError when the table has no rows for that warp."""
    table = table_for(pair, table)
    rows = table.rows(base)
    if rows is None:
        raise ValueError(
            f"the {table.pair} acceptance table has no figures for {describe_warp(warp_of(base))}; it has "
            f"{'; '.join(table.described_warps())}"
        )
    rows = [r for r in rows if r.method in methods]
    warp = describe_warp(warp_of(base))
    runs = {f"{warp} | ar": base.with_(method="ar")}
    runs |= {f"{warp} | {r.candidate.label}": r.candidate.settings(base) for r in rows}
    return rows, warp, runs


def ranked(rows: list[Row], warp: str, seconds: dict[str, float], from_disk: bool) -> Tuning:
    """The rows' predictions from the seconds timed for :func:`timed_runs`' names."""
    ar = seconds[f"{warp} | ar"]
    by_candidate = {r.candidate: seconds[f"{warp} | {r.candidate.label}"] for r in rows}
    return Tuning(predict(rows, by_candidate, ar), ar, from_disk)


def fastest(
    pair: ModelPair,
    base: Settings,
    prompt_ids: list[int] | None = None,
    table: AcceptanceTable | None = None,
    methods: Sequence[str] = METHODS,
    refresh: bool = False,
    progress: Progress | None = None,
) -> Tuning:
    """Time AR and every candidate of ``methods`` in the table under ``base``'s warp on this machine (or read
    the seconds it timed before) and rank them, timed after ``prompt_ids`` (default: :data:`TIMING_PROMPT`);
    ValueError when the table has no rows for that warp. ``progress`` hears of each timing before it runs."""
    rows, warp, runs = timed_runs(pair, base, table, methods)
    if prompt_ids is None:
        prompt_ids = encode_prompt(pair, TIMING_PROMPT, base.with_(gamma=max(GAMMAS)))
    seconds, from_disk = cached_iteration_seconds(pair, runs, prompt_ids, refresh=refresh, progress=progress)
    return ranked(rows, warp, seconds, from_disk)


def known_fastest(
    pair: ModelPair, base: Settings, table: AcceptanceTable | None = None, methods: Sequence[str] = METHODS
) -> Tuning | None:
    """:func:`fastest` from what this machine timed before, timing nothing: None when some run was never
    timed here or the pair has no table for ``base``'s warp."""
    try:
        rows, warp, runs = timed_runs(pair, base, table, methods)
    except ValueError:
        return None
    kept = kept_seconds(pair)
    if any(name not in kept for name in runs):
        return None
    return ranked(rows, warp, kept, True)


def tuned(
    pair: ModelPair, settings: Settings, table: AcceptanceTable | None = None
) -> tuple[Settings, Prediction | None]:
    """``settings`` with its method's fastest γ (and W) on this machine, and that prediction; a method whose
    draft settings are not chosen here (not SD or MTAD) comes back unchanged, with None."""
    if settings.method not in METHODS:
        return settings, None
    tuning = fastest(pair, settings, table=table, methods=(settings.method,))
    return tuning.settings(settings, settings.method), tuning.best(settings.method)
