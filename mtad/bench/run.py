"""The bench's running: cases (a method and its settings), one run, and the loop over prompts and seeds.

Every run is one (case, prompt, seed, repeat); each gets its own energy window and its metrics come from
``mtad.metrics.summarize`` on its Steps. Cases take turns on the same prompts and seeds, so comparisons
are paired, in content and in the machine's load. A case that raises (out of memory, ...) is recorded
with its error and the others go on; ``time_budget`` stops a case after that many seconds of measured runs.
"""

from __future__ import annotations

import gc
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from mtad.decoding import decode
from mtad.decoding.spec import check, settings_for, spec_of
from mtad.energy import EnergyMeter, EnergyReading
from mtad.events import Step
from mtad.metrics import position_counts, summarize
from mtad.models.pair import ModelPair
from mtad.prompts import Prompt
from mtad.settings import Settings

PARAMS = ("gamma", "beams", "tau", "draft_mode")
"""The settings a method may depend on; each row shows the ones its spec uses (``MethodSpec.uses``)."""
SWEPT = ("gamma", "beams", "tau")
"""The settings the bench can sweep (comma lists on the command line)."""


@dataclass(frozen=True)
class Case:
    """One table row: a method (``settings.method``) and the settings it runs with."""

    settings: Settings

    @property
    def method(self) -> str:
        return self.settings.method

    @property
    def params(self) -> dict[str, object]:
        """gamma/beams/tau/draft_mode, None where the method does not use them."""
        uses = spec_of(self.method).uses
        return {k: getattr(self.settings, k) if k in uses else None for k in PARAMS}

    @property
    def label(self) -> str:
        """E.g. ``mtad γ=4 W=8 τ=0.1`` (``beam-sample`` appended when the draft is sampled); each setting by
        its symbol in the method's spec (MTJD's γ is its block length, ``mtjd K=4 W=8``)."""
        own = spec_of(self.method).param_map
        uses = own.keys()
        parts = [f"{own[k].symbol}={getattr(self.settings, k):g}" for k in SWEPT if k in uses]
        if "draft_mode" in uses and self.settings.draft_mode != Settings().draft_mode:
            parts.append(self.settings.draft_mode)
        return " ".join([self.method, *parts])


def build_cases(
    methods: Sequence[str],
    base: Settings,
    gammas: Sequence[int] | None,
    beams: Sequence[int],
    taus: Sequence[float],
) -> list[Case]:
    """The rows: each method crossed with the sweeps of only the settings it uses. Validates each.
    ``gammas`` None: each method's own paper default (``settings_for``: BiLD drafts 10)."""
    cases = []
    for method in methods:
        own = [settings_for(method).gamma] if gammas is None else list(gammas)
        values = {"gamma": own, "beams": list(beams), "tau": list(taus)}
        first = {k: v[0] for k, v in values.items()}
        swept = [k for k in SWEPT if k in spec_of(method).uses]
        for combo in itertools.product(*(values[k] for k in swept)):
            settings = check(base.with_(method=method, **{**first, **dict(zip(swept, combo, strict=True))}))
            cases.append(Case(settings))
    return cases


def run_case(
    pair: ModelPair, case: Case, prompt_ids: list[int], seed: int, meter: EnergyMeter | None = None
) -> tuple[list[Step], EnergyReading | None]:
    """Decode one prompt with one case and seed through the registry; the meter (if any) wraps exactly
    the generation."""
    settings = case.settings.with_(seed=seed)
    if meter is None:
        return list(decode(pair, prompt_ids, settings)), None
    with meter:
        steps = list(decode(pair, prompt_ids, settings))
    return steps, meter.reading


def make_record(
    case: Case,
    prompt: Prompt,
    index: int,
    prompt_ids: list[int],
    seed: int,
    repeat: int,
    steps: list[Step],
    reading: EnergyReading,
    text: str,
) -> dict:
    """One run's flat record: what ran, then every field of ``summarize`` exactly as it returned it, then
    its energy window (every measured run has one, even where energy cannot be read)."""
    metrics = summarize(steps, joules=reading.joules, energy_note=reading.note)
    reached, kept = position_counts(steps)
    s = case.settings
    return {
        "case": case.label,
        "method": case.method,
        **case.params,
        "greedy": s.is_greedy,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "seed": seed,
        "repeat": repeat,
        "prompt_index": index,
        "prompt_id": prompt.id,
        "prompt_category": prompt.category,
        "prompt_tokens": len(prompt_ids),
        **metrics.to_dict(),
        "energy_source": reading.source,
        "energy_window_seconds": reading.seconds,
        "position_reached": reached,
        "position_kept": kept,
        "text": text,
        "new_ids": [t for st in steps for t in st.appended_ids],
    }


@dataclass
class BenchResult:
    """All measured runs (records), each case's failure or budget stop, and the step traces if kept."""

    records: list[dict] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    """case label -> the error that stopped it (``OutOfMemoryError: ...``)."""
    budget_stopped: list[str] = field(default_factory=list)
    """case labels whose time budget ran out before every prompt ran."""
    steps: list[list[dict]] = field(default_factory=list)
    interrupted: bool = False


def run_bench(
    pair: ModelPair,
    cases: Sequence[Case],
    prompts: Sequence[Prompt],
    encoded: Sequence[list[int]],
    seeds: Sequence[int],
    repeats: int,
    warmup: int,
    progress: bool = True,
    keep_steps: bool = False,
    meter: EnergyMeter | None = None,
    time_budget: float | None = None,
) -> BenchResult:
    """Run every case on every prompt and seed, ``repeats`` times, after ``warmup`` uncounted runs per
    case. Cases take turns on each (prompt, seed, repeat), so a machine whose load drifts during the
    bench weighs on every row alike and the speed ratios stay paired. A case that raises is recorded in
    ``failures`` and drops out; the others go on. Ctrl-C keeps what was measured."""
    meter = meter or EnergyMeter(pair.device)
    result = BenchResult()
    spent = dict.fromkeys(range(len(cases)), 0.0)  # measured seconds of each case still running
    runs = list(itertools.product(enumerate(prompts), seeds, range(repeats)))
    with tqdm(total=len(cases) * (warmup + len(runs)), file=sys.stderr, disable=not progress, unit="run") as bar:
        try:
            for k, case in enumerate(cases):
                bar.set_description(f"warm-up {case.label}")
                for _ in range(warmup):
                    guarded(pair, case, result, spent, k, encoded[0], seeds[0])
                    bar.update()
            for (i, prompt), seed, rep in runs:
                bar.set_description(f"prompt {i + 1}/{len(prompts)} seed {seed}")
                for k in list(spent):
                    case = cases[k]
                    if time_budget is not None and spent[k] >= time_budget:
                        result.budget_stopped.append(case.label)
                        del spent[k]
                        continue
                    t0 = time.perf_counter()
                    out = guarded(pair, case, result, spent, k, encoded[i], seed, meter)
                    if out is not None:
                        spent[k] += time.perf_counter() - t0
                        steps, reading = out
                        text = pair.decode([t for st in steps for t in st.appended_ids])
                        result.records.append(make_record(case, prompt, i, encoded[i], seed, rep, steps, reading, text))
                        if keep_steps:
                            result.steps.append([st.to_dict() for st in steps])
                    bar.update()
        except KeyboardInterrupt:  # keep what was measured: the table and files say it is partial
            result.interrupted = True
    return result


def guarded(
    pair: ModelPair,
    case: Case,
    result: BenchResult,
    running: dict[int, float],
    k: int,
    prompt_ids: list[int],
    seed: int,
    meter: EnergyMeter | None = None,
) -> tuple[list[Step], EnergyReading | None] | None:
    """``run_case``, or None after recording its error: the case (index ``k``) drops out of ``running``
    and CUDA memory is released for the others. Ctrl-C is not caught."""
    if k not in running:
        return None
    try:
        return run_case(pair, case, prompt_ids, seed, meter)
    except Exception as exc:  # one failing case (out of memory, ...) must not lose the others' runs
        result.failures[case.label] = f"{type(exc).__name__}: {exc}".strip()
        del running[k]
        gc.collect()
        if pair.device.type == "cuda":
            torch.cuda.empty_cache()
        return None
