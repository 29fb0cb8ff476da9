"""Prompt sets for the benchmark: our JSONL (``prompt``) and Spec-Bench's ``question.jsonl`` (``turns``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class PromptFileError(ValueError):
    """A prompt file that cannot be read, with a message naming the file and line."""


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: an id, a category (may be empty) and the text; a task's prompt also has the
    reference its reply is scored against (``mtad.tasks``)."""

    id: str
    category: str
    text: str
    reference: str | None = None


def read_prompts(path: str | Path, limit: int | None = None, skip_invalid: bool = False) -> list[Prompt]:
    """Read a JSONL prompt file: one object per line with ``prompt`` (ours) or ``turns`` (Spec-Bench:
    the first turn is used). Blank lines are skipped; ``limit`` keeps the first N prompts.

    Raises ``PromptFileError`` for a missing or unreadable file, a line that is not a JSON object,
    a line with neither field (unless ``skip_invalid``: the page's examples skip such lines), or a file
    with no prompts.
    """
    if limit is not None and limit < 1:
        raise PromptFileError(f"--limit must be at least 1; got {limit}")
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptFileError(f"prompt file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompt file {path}: {exc}") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompts.append(_parse_line(path, number, line))
        except PromptFileError:
            if not skip_invalid:
                raise
            continue
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise PromptFileError(f"prompt file {path} has no prompts (expected one JSON object per line)")
    return prompts


def _parse_line(path: Path, number: int, line: str) -> Prompt:
    """One JSONL line as a Prompt, or a PromptFileError naming the line."""
    where = f"{path}, line {number}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where} is not JSON ({exc.msg}); expected JSONL: one JSON object per line") from None
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where} is a JSON {type(obj).__name__}, not an object; expected JSONL objects")
    text = _prompt_text(obj)
    if text is None:
        raise PromptFileError(
            f'{where} has no prompt: expected a non-empty string field "prompt" or a Spec-Bench "turns" list of strings'
        )
    pid = obj.get("id", obj.get("question_id", number))
    reference = obj.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise PromptFileError(f'{where}: "reference" must be a string; got a JSON {type(reference).__name__}')
    return Prompt(id=str(pid), category=str(obj.get("category") or ""), text=text, reference=reference)


def _prompt_text(obj: dict) -> str | None:
    """The prompt of an object: ``prompt``, else the first of ``turns``; None when neither is usable."""
    text = obj.get("prompt")
    if text is None:
        turns = obj.get("turns")
        if isinstance(turns, list) and turns:
            text = turns[0]
    if isinstance(text, str) and text.strip():
        return text
    return None
