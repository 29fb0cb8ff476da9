"""The bench's aggregation: one row per case, pooled figures (docs/metrics.md) plus per-run mean and spread.

Pooled figures come from ``mtad.metrics.pool`` and per-run ones from the records ``summarize`` made: this
file only groups runs, it defines no metric.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import fields

from mtad.metrics import (
    Metrics,
    acceptance_by_position,
    perplexity_of,
    pool,
    speed_equation,
    target_call_ratio,
)

DRAWS = 10_000
"""Resamples of the prompts behind an interval (a perplexity difference's, a task score's)."""

PER_RUN = tuple(f.name for f in fields(Metrics) if f.name != "energy_note")
"""Every numeric field of ``Metrics``: each is kept per row as mean and sample std over the runs."""


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample std, n) over the values that are not None/NaN; std is None below two values."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None, None, 0
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else None, len(vals)


def pooled_curve(records: Sequence[dict]) -> list[float | None]:
    """The acceptance curve of a row: every run's per-position counts added up, then divided."""
    reached: list[int] = []
    kept: list[int] = []
    for r in records:
        for i, (n, k) in enumerate(zip(r.get("position_reached", []), r.get("position_kept", []), strict=True)):
            if i == len(reached):
                reached.append(0)
                kept.append(0)
            reached[i] += n
            kept[i] += k
    return acceptance_by_position(reached, kept)


def finished_prompts(records: Sequence[dict], runs_per_prompt: int) -> set[int]:
    """Prompt indices every case finished (all its seeds and repeats): with a time budget, the first M."""
    by_case: dict[str, dict[int, int]] = {}
    for r in records:
        counts = by_case.setdefault(r["case"], {})
        counts[r["prompt_index"]] = counts.get(r["prompt_index"], 0) + 1
    done = [{i for i, n in counts.items() if n >= runs_per_prompt} for counts in by_case.values()]
    return set.intersection(*done) if done else set()


def perplexity_gap(
    records: Sequence[dict], case: str, reference: str, prompts: set[int], without_loops: bool = False
) -> dict | None:
    """``case``'s pooled perplexity minus ``reference``'s over ``prompts`` (those both finished), with a
    95 % interval from resampling the prompts with replacement (percentile bootstrap, fixed seed): whether
    one decoder's text is more likely to the target than another's beyond the spread of the prompts. None
    without two prompts.

    ``without_loops``: only the runs (a prompt, seed and repeat) where neither decoder's text loops
    (``Metrics.loops``): a loop is likely text because it repeats itself, so a gap that holds here is not
    the loops'. ``pairs``: the runs of each decoder where neither loops, ``of`` the runs both made."""
    mine = [r for r in records if r["case"] in (case, reference) and r["prompt_index"] in prompts]
    runs: dict[str, dict[tuple, dict]] = {case: {}, reference: {}}
    for r in mine:
        runs[r["case"]][(r["prompt_index"], r.get("seed", 0), r.get("repeat", 0))] = r
    paired = sorted(set(runs[case]) & set(runs[reference]))
    kept = [k for k in paired if not any(Metrics.from_dict(runs[c][k]).loops for c in runs)]
    if without_loops:
        mine = [runs[c][k] for c in runs for k in kept]
    totals: dict[str, dict[int, list[float]]] = {case: {}, reference: {}}
    for r in mine:
        t = totals[r["case"]].setdefault(r["prompt_index"], [0.0, 0])
        t[0] += r["nll_sum"]
        t[1] += r["new_tokens"]
    keys = sorted(set(totals[case]) & set(totals[reference]))
    if len(keys) < 2:
        return None

    def gap(sample: Sequence[int]) -> float:
        a, b = ([sum(totals[c][k][i] for k in sample) for i in (0, 1)] for c in (case, reference))
        return perplexity_of(a[0], int(a[1])) - perplexity_of(b[0], int(b[1]))

    difference, low, high = bootstrap(keys, gap)
    return {
        "reference": reference,
        "difference": difference,
        "low": low,
        "high": high,
        "prompts": len(keys),
        "pairs": len(kept),
        "of": len(paired),
    }


def bootstrap(keys: Sequence[Hashable], statistic: Callable[[Sequence[Hashable]], float]) -> tuple[float, float, float]:
    """``statistic`` over ``keys`` (prompts), and its 95 % percentile interval from :data:`DRAWS` resamples of the
    keys with replacement (fixed seed): the one resampling behind every interval of the table."""
    rng = random.Random(0)
    draws = sorted(statistic(rng.choices(keys, k=len(keys))) for _ in range(DRAWS))
    return statistic(keys), draws[int(0.025 * DRAWS)], draws[int(0.975 * DRAWS) - 1]


def pooled_mean(by_prompt: dict[Hashable, list[float]]) -> Callable[[Sequence[Hashable]], float]:
    """The mean over every value of the prompts drawn (a prompt drawn twice counts twice): a row's task score,
    pooled over its runs like its other columns, as a statistic of the prompts."""

    def mean(sample: Sequence[Hashable]) -> float:
        return sum(sum(by_prompt[k]) for k in sample) / sum(len(by_prompt[k]) for k in sample)

    return mean


def task_score(records: Sequence[dict], case: str, name: str) -> dict | None:
    """``case``'s score ``name`` (``mtad.tasks``): the mean over its runs, with a 95 % interval from resampling
    its prompts; None before a scored run."""
    by_prompt: dict[int, list[float]] = {}
    for r in records:
        if r["case"] == case and (r.get("scores") or {}).get(name) is not None:
            by_prompt.setdefault(r["prompt_index"], []).append(r["scores"][name])
    if not by_prompt:
        return None
    mean, low, high = bootstrap(sorted(by_prompt), pooled_mean(by_prompt))
    return {"mean": mean, "low": low, "high": high, "prompts": len(by_prompt)}


def task_gap(records: Sequence[dict], case: str, reference: str, name: str) -> dict | None:
    """``case``'s score ``name`` minus ``reference``'s on prompt pairs: runs pair by prompt, seed and repeat, a
    prompt's differences stay together, and the prompts are resampled (95 % interval), so what both decoders
    find hard or easy in a prompt cancels out. ``includes_zero``: the interval does not tell the two apart. None
    without two prompts with a pair."""
    runs: dict[str, dict[tuple, float]] = {case: {}, reference: {}}
    for r in records:
        value = (r.get("scores") or {}).get(name)
        if r["case"] in runs and value is not None:
            runs[r["case"]][(r["prompt_index"], r.get("seed", 0), r.get("repeat", 0))] = value
    by_prompt: dict[int, list[float]] = {}
    for key in sorted(set(runs[case]) & set(runs[reference])):
        by_prompt.setdefault(key[0], []).append(runs[case][key] - runs[reference][key])
    if len(by_prompt) < 2:
        return None
    difference, low, high = bootstrap(sorted(by_prompt), pooled_mean(by_prompt))
    return {
        "reference": reference,
        "difference": difference,
        "low": low,
        "high": high,
        "includes_zero": low <= 0 <= high,
        "prompts": len(by_prompt),
        "pairs": sum(len(v) for v in by_prompt.values()),
    }


def aggregate(
    records: Sequence[dict],
    cases: Sequence[dict] = (),
    failures: dict[str, str] | None = None,
    runs_per_prompt: int = 1,
    budget_stopped: Sequence[str] = (),
    scores: Sequence[str] = (),
) -> list[dict]:
    """One row per case (``cases`` order, then first-seen): the pooled figures, the perplexity over the
    prompts every case finished and its difference to SD's (:func:`perplexity_gap`, over every run and over
    the runs where neither text loops), a target call's seconds over the AR row's and the speed equation
    (``mtad.metrics.speed_equation``) against it (where there is one AR row),
    per-run ``<metric>_mean``/``_std``, the case's error if it failed, and each of a task's ``scores``
    (:func:`task_score`) with its difference to SD's on prompt pairs (:func:`task_gap`)."""
    failures = failures or {}
    groups: dict[str, list[dict]] = {c["case"]: [] for c in cases}
    for r in records:
        groups.setdefault(r["case"], []).append(r)
    info = {c["case"]: c for c in cases}
    common = finished_prompts(records, runs_per_prompt)
    sd = [label for label, rs in groups.items() if (rs[0] if rs else info[label])["method"] == "sd"]
    sd = sd if len(sd) == 1 else []  # one SD row to compare with (a sweep of SD has none)
    rows, pooled = [], []
    for label, rs in groups.items():
        first = rs[0] if rs else info[label]
        row = {"case": label, "method": first["method"]}
        row.update({k: first.get(k) for k in ("gamma", "beams", "tau", "draft_mode")})
        metrics = [Metrics.from_dict(r) for r in rs]
        pooled.append(pool(metrics))
        row.update(pooled[-1].to_dict())
        in_common = [m for m, r in zip(metrics, rs, strict=True) if r["prompt_index"] in common]
        row["common_prompts"] = len(common)
        row["perplexity_common"] = pool(in_common).to_dict()["perplexity"] if in_common else None
        for m in PER_RUN:
            mean, std, _ = mean_std([r[m] for r in rs])
            row[f"{m}_mean"], row[f"{m}_std"] = mean, std
        notes = sorted({r["energy_note"] for r in rs if r["energy_note"]})
        row["energy_source"] = first.get("energy_source")
        row["energy_note"] = "; ".join(notes) if notes else None
        row["acceptance_by_position"] = pooled_curve(rs)
        versus_sd = sd and label != sd[0]
        row["perplexity_vs_sd"] = perplexity_gap(records, label, sd[0], common) if versus_sd else None
        row["perplexity_vs_sd_without_loops"] = (
            perplexity_gap(records, label, sd[0], common, without_loops=True) if versus_sd else None
        )
        row["task_scores"] = {name: task_score(records, label, name) for name in scores} if scores else None
        row["task_vs_sd"] = (
            {name: task_gap(records, label, sd[0], name) for name in scores} if scores and versus_sd else None
        )
        row["budget_stopped"] = label in budget_stopped
        row["error"] = failures.get(label)
        rows.append(row)
    ar = [p for p, r in zip(pooled, rows, strict=True) if r["method"] == "ar" and p.target_call_seconds]
    for row, p in zip(rows, pooled, strict=True):  # against the one AR row: a verification over a one-token forward
        row["target_call_vs_ar"] = target_call_ratio(p, ar[0]) if len(ar) == 1 else None
        equation = speed_equation(p, ar[0]) if len(ar) == 1 else None
        row["speed_equation"] = equation.to_dict() if equation is not None else None
    return rows
