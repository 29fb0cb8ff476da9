"""Downstream tasks: prompts with a reference each, and the score of a reply against its reference.

The paper's third claim is a task score beside speed and perplexity (its Table 6). Two tasks run offline, from
files ``scripts/build_task_prompts.py`` writes from the standard library (``assets/prompts/tasks/``). Scores are
on a 0-100 scale; the bench pools them per row and compares rows on prompt pairs (docs/metrics.md).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtad.models.presets import ASSETS


@functools.cache
def _rouge_scorer():  # noqa: ANN202
    from rouge_score import rouge_scorer  # imported on first use: it loads nltk's stemmer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 × 100 (``rouge-score``, Porter stemming): the longest common subsequence of words."""
    return 100 * _rouge_scorer().score(reference, prediction)["rougeL"].fmeasure


def exact_match(prediction: str, reference: str) -> float:
    """100 when the two are the same text, else 0 (CodeXGLUE's line-level exact match)."""
    return 100.0 if prediction == reference else 0.0


def edit_similarity(prediction: str, reference: str) -> float:
    """CodeXGLUE's line-level edit similarity: ``fuzz.ratio``, 100 × (1 − indel distance / total length)."""
    from rapidfuzz import fuzz

    return fuzz.ratio(prediction, reference)


def first_sentence(reply: str) -> str:
    """The reply's first sentence on one line (the task asks for one): up to the first '.', '!' or '?' followed
    by whitespace, or all of it."""
    text = " ".join(reply.split())
    end = re.search(r"[.!?](\s|$)", text)
    return text[: end.start() + 1] if end else text


def next_line(continuation: str) -> str:
    """The line a continuation writes: its text up to the first newline, without surrounding whitespace (the
    prompt ends inside the line's indentation, so the reply starts on the line to predict)."""
    return continuation.split("\n", 1)[0].strip()


@dataclass(frozen=True)
class Task:
    """A downstream task: its prompt file, the pair it is meant for, and how a reply is scored."""

    name: str
    description: str
    pair: str
    prompts: Path
    max_new_tokens: int
    prediction: Callable[[str], str]
    scores: tuple[tuple[str, Callable[[str, str], float]], ...]
    """(name, function) of each score; the first is the task's headline."""

    @property
    def score_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.scores)

    def score(self, reply: str, reference: str) -> dict[str, float]:
        """Every score of one reply (the prediction taken out of it first) against its reference."""
        prediction = self.prediction(reply)
        return {name: float(f(prediction, reference)) for name, f in self.scores}


TASKS = {
    t.name: t
    for t in (
        Task(
            name="code-summary",
            description="a standard-library function without its docstring: say in one sentence what it does; "
            "ROUGE-L against the docstring's first sentence (the chat pair)",
            pair="smollm2",
            prompts=ASSETS / "prompts" / "tasks" / "code-summary.jsonl",
            max_new_tokens=48,
            prediction=first_sentence,
            scores=(("ROUGE-L", rouge_l),),
        ),
        Task(
            name="line-completion",
            description="a held-out function up to a line: write the next line; exact match and edit similarity "
            "(the embedded code pair)",
            pair="embedded",
            prompts=ASSETS / "prompts" / "tasks" / "line-completion.jsonl",
            max_new_tokens=32,
            prediction=next_line,
            scores=(("exact match", exact_match), ("edit similarity", edit_similarity)),
        ),
    )
}
"""The tasks by name (``mtad bench --task NAME``)."""
