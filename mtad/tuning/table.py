"""A pair's acceptance table: tokens per target call of each candidate setting, measured on held-out prompts.

Block efficiency depends on the draft, the target, the sampling warp (temperature, top-k, top-p) and the rule's settings, not on the
machine (up to the dtype's rounding), so it is measured once per pair and warp, and the pair's preset names
the file (``acceptance =`` in ``assets/pairs.toml``); the machine's part, an iteration's seconds, is timed
where the pair runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from operator import itemgetter
from pathlib import Path

from mtad.bench.run import Case, run_bench
from mtad.metrics import Metrics, pool
from mtad.models.pair import ModelPair
from mtad.prompts import Prompt
from mtad.settings import Settings

GAMMAS = (1, 2, 3, 4)
"""Draft lengths a table measures: 1 up to the paper's 4 (a verification of up to 5 tokens, which the
compiled engine's warm-up compiles anyway)."""
BEAMS = (1, 2, 4, 8)
"""MTAD's beam counts a table measures: from one beam up to the paper's 8."""
METHODS = ("sd", "mtad")
"""The decoders whose draft settings are chosen."""


@dataclass(frozen=True)
class Candidate:
    """One setting to choose among: a method, its draft length and (MTAD) its beam count."""

    method: str
    gamma: int
    beams: int | None = None

    @property
    def label(self) -> str:
        """E.g. ``mtad γ=1 W=2``, as a bench row names it."""
        return f"{self.method} γ={self.gamma}" + ("" if self.beams is None else f" W={self.beams}")

    def settings(self, base: Settings) -> Settings:
        """``base`` with this candidate's method, γ and W."""
        beams = base.beams if self.beams is None else self.beams
        return base.with_(method=self.method, gamma=self.gamma, beams=beams)


def candidates(methods: Sequence[str] = METHODS) -> list[Candidate]:
    """Every candidate a table measures for ``methods``: SD per γ, MTAD per γ and W."""
    out = []
    for method in methods:
        for gamma in GAMMAS:
            out += [Candidate(method, gamma, w) for w in BEAMS] if method == "mtad" else [Candidate(method, gamma)]
    return out


def warp_of(settings: Settings) -> dict[str, object]:
    """What a block efficiency depends on besides the pair and the candidate: greedy or the sampling warp,
    MTAD's τ and its draft's search. Greedy needs no warp."""
    warp = (
        {}
        if settings.is_greedy
        else {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p}
    )
    return {"greedy": settings.is_greedy, **warp, "tau": settings.tau, "draft_mode": settings.draft_mode}


@dataclass
class Row:
    """One candidate's measured tokens per target call, with the counts behind it."""

    method: str
    gamma: int
    beams: int | None
    block_efficiency: float
    new_tokens: int
    target_calls: int

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.method, self.gamma, self.beams)


@dataclass
class AcceptanceTable:
    """Block efficiency per candidate and sampling warp for one pair, and how it was measured."""

    pair: str
    prompts: str
    max_new_tokens: int
    seeds: list[int]
    dtype: str
    date: str
    commit: str | None
    warps: list[dict] = field(default_factory=list)
    """Each ``{"warp": warp_of(...), "rows": [Row as a dict, ...]}``."""
    prompt_ids: list[str] = field(default_factory=list)
    """The ids of the prompts measured, in order (a file's first N when measured with a limit)."""

    def rows(self, settings: Settings) -> list[Row] | None:
        """The rows measured under ``settings``' warp, or None if the table has none for it."""
        want = warp_of(settings)
        for entry in self.warps:
            if entry["warp"] == want:
                return [Row(**r) for r in entry["rows"]]
        return None

    def described_warps(self) -> list[str]:
        """Each warp the table holds, in words (for the message when a warp is missing)."""
        return [describe_warp(e["warp"]) for e in self.warps]

    def merged(self, other: AcceptanceTable) -> AcceptanceTable:
        """This table and ``other``, measured the same way on other seeds, pooled: each row's tokens and
        target calls summed (so its block efficiency is that of all the runs), warps matched by value.
        ValueError naming what differs, so that a table never pools figures of two experiments."""
        for name in ("pair", "prompts", "prompt_ids", "max_new_tokens", "dtype"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(
                    f"cannot pool tables of different {name}: {getattr(self, name)!r}, {getattr(other, name)!r}"
                )
        if shared := sorted(set(self.seeds) & set(other.seeds)):
            raise ValueError(f"both tables hold seed(s) {shared}: pool only new seeds")
        theirs = {json.dumps(e["warp"], sort_keys=True): e["rows"] for e in other.warps}
        warps = []
        for entry in self.warps:
            rows = theirs.pop(json.dumps(entry["warp"], sort_keys=True), None)
            if rows is None:
                raise ValueError(f"the other table has no figures for {describe_warp(entry['warp'])}")
            warps.append({"warp": entry["warp"], "rows": pooled_rows(entry["rows"], rows)})
        if theirs:
            raise ValueError(
                f"the other table has warps this one lacks: {', '.join(describe_warp(json.loads(k)) for k in theirs)}"
            )
        return AcceptanceTable(
            pair=self.pair,
            prompts=self.prompts,
            max_new_tokens=self.max_new_tokens,
            seeds=sorted(self.seeds + other.seeds),
            dtype=self.dtype,
            date=max(self.date, other.date),
            commit=other.commit or self.commit,  # the newer measurement's
            warps=warps,
            prompt_ids=self.prompt_ids,
        )

    def save(self, path: Path | str) -> None:
        """Write the table atomically: a new file flushed to disk, then renamed over the old one, so that a
        crash or a full disk leaves the old table whole, never a half-written one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("w", encoding="utf-8") as fh:
                fh.write(json.dumps(asdict(self), indent=1, ensure_ascii=False) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> AcceptanceTable:
        """The table in ``path``; ValueError naming the file when it cannot be read as one."""
        try:
            fields = json.loads(Path(path).read_text())
            if "laws" in fields:  # tables written before 0.2.0 named each warp a "law"
                fields["warps"] = [{"warp": e["law"], "rows": e["rows"]} for e in fields.pop("laws")]
            return cls(**fields)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot read the acceptance table {path}: {exc}") from None


def pooled_rows(mine: list[dict], theirs: list[dict]) -> list[dict]:
    """Rows of one warp from two tables, candidate by candidate, with summed counts."""
    key = itemgetter("method", "gamma", "beams")
    by_candidate = {key(r): r for r in theirs}
    if set(by_candidate) != {key(r) for r in mine}:
        raise ValueError("the two tables measured different candidates")
    out = []
    for r in mine:
        tokens = r["new_tokens"] + by_candidate[key(r)]["new_tokens"]
        calls = r["target_calls"] + by_candidate[key(r)]["target_calls"]
        out.append({**r, "block_efficiency": round(tokens / calls, 4), "new_tokens": tokens, "target_calls": calls})
    return out


def describe_warp(warp: dict) -> str:
    """``greedy, τ 0.1, beam`` or ``T 1, top-k 20, top-p 0.9, τ 0.1, beam``."""
    head = "greedy" if warp["greedy"] else f"T {warp['temperature']:g}, top-k {warp['top_k']}, top-p {warp['top_p']:g}"
    return f"{head}, τ {warp['tau']:g}, {warp['draft_mode']}"


def table_path(pair_name: str) -> Path | None:
    """Where a preset's table is (its ``acceptance`` in the presets file), or None."""
    from mtad.models.presets import presets

    preset = presets().get(pair_name)
    return Path(preset.acceptance) if preset is not None and preset.acceptance else None


def shipped_table(pair_name: str) -> AcceptanceTable | None:
    """The table a preset names, or None when it names none."""
    path = table_path(pair_name)
    return AcceptanceTable.load(path) if path is not None else None


def blank(
    pair: ModelPair,
    prompts: Sequence[Prompt],
    warps: Sequence[Settings],
    seeds: Sequence[int],
    methods: Sequence[str] = METHODS,
    commit: str | None = None,
    prompts_name: str = "",
) -> AcceptanceTable:
    """The table :func:`measure` will write, every row at zero: what ``--extend`` pools with the table on disk
    before hours of measuring, so that a mismatch is refused at once."""
    zero = dict(block_efficiency=0.0, new_tokens=0, target_calls=0)
    rows = [
        asdict(Row(c.method, c.gamma, c.beams if c.method == "mtad" else None, **zero)) for c in candidates(methods)
    ]
    return AcceptanceTable(
        pair=pair.name,
        prompts=prompts_name,
        max_new_tokens=warps[0].max_new_tokens,
        seeds=list(seeds),
        dtype=str(pair.dtype).replace("torch.", ""),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        commit=commit,
        prompt_ids=[p.id for p in prompts],
        warps=[{"warp": warp_of(w), "rows": rows} for w in warps],
    )


def measure(
    pair: ModelPair,
    prompts: Sequence[Prompt],
    encoded: Sequence[list[int]],
    warps: Sequence[Settings],
    seeds: Sequence[int],
    methods: Sequence[str] = METHODS,
    progress: bool = True,
    commit: str | None = None,
    prompts_name: str = "",
) -> AcceptanceTable:
    """Run every candidate under every warp on ``prompts`` through the bench's runner and keep each one's
    pooled block efficiency (new tokens over target calls, ``mtad.metrics.pool``)."""
    table = blank(pair, prompts, warps, seeds, methods, commit, prompts_name)
    table.warps.clear()
    for warp in warps:
        cases = [Case(c.settings(warp).validate()) for c in candidates(methods)]
        result = run_bench(pair, cases, prompts, encoded, seeds, repeats=1, warmup=0, progress=progress)
        if result.failures or result.interrupted:
            raise RuntimeError(f"the acceptance table was not finished: {result.failures or 'interrupted'}")
        rows = []
        for case in cases:
            runs = [Metrics.from_dict(r) for r in result.records if r["case"] == case.label]
            pooled = pool(runs)
            s = case.settings
            rows.append(
                asdict(
                    Row(
                        method=s.method,
                        gamma=s.gamma,
                        beams=s.beams if s.method == "mtad" else None,
                        block_efficiency=round(pooled.block_efficiency, 4),
                        new_tokens=pooled.new_tokens,
                        target_calls=sum(m.target_calls for m in runs),
                    )
                )
            )
        table.warps.append({"warp": warp_of(warp), "rows": rows})
    return table
