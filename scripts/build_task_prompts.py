"""Write the downstream tasks' prompt files from the installed standard library: ``python scripts/build_task_prompts.py``.

Two tasks (``mtad.tasks``), each a JSONL of ``id``, ``category``, ``prompt`` and ``reference`` under
``assets/prompts/tasks/``, with a sidecar JSON recording the Python version, the rule and the file's sha256:

* ``code-summary`` (the chat pair): a public function or method of a public standard-library module, its code
  without its docstring, and "say in one sentence what it does"; the reference is the docstring's first sentence.
* ``line-completion`` (the embedded pair): a function of a file the embedded pair held out of its training
  (``assets/models/heldout_files.txt``), up to a line; the reference is that line. No item's last context lines
  and target line occur verbatim in a training file, and no item contains a benchmark prompt (``code.jsonl``).

Every choice is a fixed rule: candidates in order of the sha256 of their id, at most a few per file, so the
same standard library gives the same files. The tests rebuild them and compare.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.embedded_pair import is_heldout, list_corpus, read_text, stdlib_root  # noqa: E402

OUT = ROOT / "assets" / "prompts" / "tasks"
PYTHON = "3.11.7"
"""The CPython whose standard library the files come from (the embedded pair's corpus too)."""

SUMMARY_ITEMS = 240
SUMMARY_PER_FILE = 3
SUMMARY_INSTRUCTION = "Say in one sentence what this Python function does."
LINE_ITEMS = 240
LINE_PER_FILE = 6
LINE_CONTEXT_LINES = 30
LINE_CHECK_LINES = 3
"""A line-completion item is dropped when its last this-many context lines and its target line occur together
in a training file."""

SUMMARY_RULE = (
    "every *.py under the stdlib, sorted, outside site-packages, no path part starting with '_' or 'test' and "
    "none named 'tests' or 'idle_test'; each top-level function and each method of a top-level class whose name "
    "does not start with '_', with a docstring of its own line(s) whose first sentence (first paragraph, one "
    "line, cut after the first '. ' or at its final '.') has 4-30 words and no '>>>'; the code is the source "
    "without its docstring, dedented, 3-25 lines and at most 1200 characters; duplicate codes or references "
    f"dropped; candidates in order of sha256(id), at most {SUMMARY_PER_FILE} per file, the first {SUMMARY_ITEMS}"
)
LINE_RULE = (
    "the held-out files of assets/models/heldout_files.txt (checked against the corpus rule), sorted; each "
    "function (any depth) whose id is no code.jsonl prompt's; a target line at index k >= 2 of the function "
    f"(k < {LINE_CONTEXT_LINES}), not blank, not a comment, not inside a docstring, 8-60 characters stripped; the "
    "prompt is the function's lines before it and the target line's indentation but its last space (where a "
    "byte-level BPE splits: the space belongs to the line's first word); the candidate line with the smallest "
    "sha256(id:k) per function; dropped when the prompt holds a code.jsonl prompt or one holds it, or the last "
    f"{LINE_CHECK_LINES} context lines with the target line occur in a training file; candidates in order of "
    f"sha256(id), at most {LINE_PER_FILE} per file, the first {LINE_ITEMS}"
)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def first_sentence(doc: str) -> str | None:
    """The docstring's first sentence on one line: its first paragraph, cut after the first '. ' or at its end."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    cut = re.search(r"\.\s", paragraph)
    sentence = paragraph[: cut.start() + 1] if cut else paragraph
    return sentence if sentence.endswith(".") else None


def public_module(rel: str) -> bool:
    parts = Path(rel).parts
    return not any(p.startswith(("_", "test")) or p in ("tests", "idle_test") for p in parts)


def summary_candidates(rel: str, text: str) -> list[dict]:
    """The public functions and methods of one module with a docstring, as code-summary items."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")):
        nodes += [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node)
        first = node.body[0]
        if node.name.startswith("_") or doc is None or len(node.body) < 2 or first.lineno == node.lineno:
            continue
        sentence = first_sentence(doc)
        if sentence is None or ">>>" in sentence or not 4 <= len(sentence.split()) <= 30:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        kept = lines[start : first.lineno - 1] + lines[first.end_lineno : node.end_lineno]
        code = textwrap.dedent("".join(kept)).rstrip()
        if not 3 <= len(code.splitlines()) <= 25 or len(code) > 1200:
            continue
        qualname = node.name if node in tree.body else f"{parent_name(tree, node)}.{node.name}"
        out.append({"id": f"{rel}:{qualname}", "category": "function", "code": code, "reference": sentence})
    return out


def parent_name(tree: ast.Module, node: ast.AST) -> str:
    return next(c.name for c in tree.body if isinstance(c, ast.ClassDef) and node in c.body)


def pick(candidates: list[dict], per_file: int, n: int) -> list[dict]:
    """The first ``n`` candidates in order of sha256(id), at most ``per_file`` from any one file."""
    chosen, per = [], {}
    for c in sorted(candidates, key=lambda c: digest(c["id"])):
        rel = c["id"].split(":")[0]
        if per.get(rel, 0) < per_file:
            per[rel] = per.get(rel, 0) + 1
            chosen.append(c)
        if len(chosen) == n:
            break
    return chosen


def code_summary(root: Path) -> list[dict]:
    train, heldout, _ = list_corpus(root)
    candidates, codes, refs = [], set(), set()
    for rel in sorted(train + heldout):
        if not public_module(rel):
            continue
        for c in summary_candidates(rel, read_text(rel, root)):
            if c["code"] in codes or c["reference"] in refs:
                continue
            codes.add(c["code"])
            refs.add(c["reference"])
            candidates.append(c)
    return [
        {
            "id": c["id"],
            "category": c["category"],
            "prompt": f"{SUMMARY_INSTRUCTION}\n\n```python\n{c['code']}\n```",
            "reference": c["reference"],
        }
        for c in pick(candidates, SUMMARY_PER_FILE, SUMMARY_ITEMS)
    ]


def docstring_lines(node: ast.AST) -> set[int]:
    """1-based line numbers inside any string-constant statement (a docstring) under ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            out |= set(range(n.lineno, n.end_lineno + 1))
    return out


def line_candidates(rel: str, text: str, benchmark_ids: set[str]) -> list[dict]:
    """One line-completion item per function of a held-out file (the line chosen by hash), before the checks."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        fid = f"{rel}:{node.lineno}"
        if fid in benchmark_ids:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        inside = docstring_lines(node)
        choices = []
        for k in range(2, min(LINE_CONTEXT_LINES, node.end_lineno - start)):
            line = lines[start + k]
            stripped = line.strip()
            if not 8 <= len(stripped) <= 60 or stripped.startswith("#") or start + k + 1 in inside:
                continue
            choices.append(k)
        if not choices:
            continue
        k = min(choices, key=lambda k: digest(f"{fid}:{k}"))
        out.append(
            {
                "id": f"{fid}+{k}",
                "category": "line",
                "context": lines[start : start + k],
                "line": lines[start + k],
            }
        )
    return out


def line_completion(root: Path) -> list[dict]:
    train, heldout, _ = list_corpus(root)
    listed = (ROOT / "assets" / "models" / "heldout_files.txt").read_text().split()
    if listed != heldout or not all(is_heldout(r) for r in listed):
        sys.exit("the held-out files here differ from assets/models/heldout_files.txt: not the corpus the pair saw")
    bench = [json.loads(x) for x in (ROOT / "assets" / "prompts" / "code.jsonl").read_text().splitlines() if x]
    bench_ids = {p["id"] for p in bench}
    training = "\0".join(read_text(r, root) for r in train)
    candidates = []
    for rel in heldout:
        for c in line_candidates(rel, read_text(rel, root), bench_ids):
            indent = c["line"][: len(c["line"]) - len(c["line"].lstrip())]
            prompt = "".join(c["context"]) + indent[:-1]  # the last space starts the line's first token
            window = "".join(c["context"][-LINE_CHECK_LINES:]) + c["line"]
            if any(p["prompt"] in prompt or prompt in p["prompt"] for p in bench) or window in training:
                continue
            candidates.append(
                {"id": c["id"], "category": c["category"], "prompt": prompt, "reference": c["line"].strip()}
            )
    return pick(candidates, LINE_PER_FILE, LINE_ITEMS)


TASKS = {"code-summary": (code_summary, SUMMARY_RULE), "line-completion": (line_completion, LINE_RULE)}


def jsonl(items: list[dict]) -> str:
    return "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items)


def build(name: str, root: Path | None = None) -> tuple[str, dict]:
    """A task's JSONL text and its sidecar record."""
    make, rule = TASKS[name]
    text = jsonl(make(root or stdlib_root()))
    sidecar = {
        "task": name,
        "python": platform.python_version(),
        "built_by": "scripts/build_task_prompts.py",
        "rule": rule,
        "items": text.count("\n"),
        "sha256": digest(text),
    }
    return text, sidecar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma list of " + ", ".join(TASKS))
    args = ap.parse_args()
    if platform.python_version() != PYTHON:
        sys.exit(f"build with CPython {PYTHON} (the embedded pair's corpus); this is {platform.python_version()}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.tasks.split(","):
        text, sidecar = build(name)
        (args.out / f"{name}.jsonl").write_text(text, encoding="utf-8")
        (args.out / f"{name}.json").write_text(json.dumps(sidecar, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {sidecar['items']} {name} items to {args.out / name}.jsonl")


if __name__ == "__main__":
    main()
