"""Downstream tasks (mtad.tasks): the prompt files, the scores, and the bench's per-row score with its intervals."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import sys
from pathlib import Path

import pytest

import mtad.bench.cli as bench
from mtad.bench.aggregate import aggregate, task_gap, task_score
from mtad.bench.report import render_table
from mtad.metrics import Metrics
from mtad.prompts import PromptFileError, read_prompts
from mtad.tasks import TASKS, edit_similarity, exact_match, first_sentence, next_line, rouge_l

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "assets" / "prompts" / "tasks"
BENCHMARK_PROMPTS = [ROOT / "assets" / "prompts" / f for f in ("chat.jsonl", "code.jsonl", "tuning.jsonl")]


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def build_script():
    spec = importlib.util.spec_from_file_location("build_task_prompts", ROOT / "scripts" / "build_task_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the scores against hand-computed values ---------------------------------------------------------------


def test_rouge_l_is_the_f1_of_the_longest_common_word_subsequence():
    # LCS "the cat sat" = 3 words: precision 3/3, recall 3/6, F1 = 2·1·0.5 / 1.5
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(200 / 3)
    # order counts: a bag of words (ROUGE-1) would give 100 here, the LCS is one word long
    assert rouge_l("b a", "a b") == pytest.approx(50.0)
    assert rouge_l("Returns the list.", "Return the list") == pytest.approx(100.0)  # stemmed, punctuation dropped
    assert rouge_l("nothing alike", "Return the list") == 0.0


def test_edit_similarity_is_codexglue_indel_ratio():
    # indel distance (a substitution costs 2): 100 · (1 − d / (|a| + |b|))
    assert edit_similarity("ab", "ba") == pytest.approx(50.0)  # a Levenshtein ratio would give 0
    assert edit_similarity("kitten", "sitting") == pytest.approx(100 * (1 - 5 / 13))
    assert edit_similarity("return x", "return x") == 100.0
    assert exact_match("return x", "return x") == 100.0 and exact_match("return  x", "return x") == 0.0


def test_predictions_taken_out_of_replies():
    assert next_line(" return g\n\n    def h(self):") == "return g"
    assert next_line("") == ""
    assert first_sentence("Returns the sum.  Then\nmore.") == "Returns the sum."
    assert first_sentence("Returns 3.5 times x") == "Returns 3.5 times x"  # a decimal point ends nothing
    task = TASKS["line-completion"]
    assert task.score(" self.x = 1\n  junk", "self.x = 1") == {"exact match": 100.0, "edit similarity": 100.0}


# --- the prompt files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_files_have_references_a_sidecar_and_no_benchmark_prompt(name):
    task = TASKS[name]
    items = load(task.prompts)
    sidecar = json.loads(task.prompts.with_suffix(".json").read_text())
    assert len(items) >= 200 and sidecar["items"] == len(items)
    assert sidecar["python"] == build_script().PYTHON and sidecar["built_by"] == "scripts/build_task_prompts.py"
    assert sidecar["sha256"] == hashlib.sha256(task.prompts.read_bytes()).hexdigest()
    assert len({i["id"] for i in items}) == len(items)
    assert all(i["prompt"].strip() and i["reference"].strip() for i in items)
    assert [p.reference for p in read_prompts(task.prompts)] == [i["reference"] for i in items]
    benchmark = [p["prompt"] for f in BENCHMARK_PROMPTS for p in load(f)]
    for i in items:
        assert not any(b in i["prompt"] or i["prompt"] in b for b in benchmark), i["id"]


def test_code_summary_is_none_of_the_chat_draft_s_training_prompts():
    from training.chat_draft import chat_prompts

    trained = chat_prompts(set())
    assert len(trained) > 1000
    items = load(TASKS["code-summary"].prompts)
    assert not any(i["prompt"] in trained or i["prompt"].split("\n")[0] in trained for i in items)
    assert not any("```python" in t and "def " in t for t in trained)  # no function's code was a training prompt


def test_line_completion_comes_only_from_files_the_embedded_pair_held_out():
    heldout = set((ROOT / "assets" / "models" / "heldout_files.txt").read_text().split())
    items = load(TASKS["line-completion"].prompts)
    assert all(i["id"].split(":")[0] in heldout for i in items)
    assert all(not i["reference"].startswith("#") and 8 <= len(i["reference"]) <= 60 for i in items)


def test_the_script_rebuilds_the_committed_files():
    """The files are what the fixed rule gives on the recorded Python's standard library (which also checks
    that no line-completion item's last lines and target line occur in a training file)."""
    script = build_script()
    if platform.python_version() != script.PYTHON:
        pytest.skip(f"needs CPython {script.PYTHON}'s standard library (the files' source); this is {sys.version}")
    for name in TASKS:
        text, sidecar = script.build(name)
        assert text == (TASK_DIR / f"{name}.jsonl").read_text(encoding="utf-8"), name
        assert sidecar == json.loads((TASK_DIR / f"{name}.json").read_text()), name


def test_a_reference_must_be_a_string(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x", "reference": 3}\n')
    with pytest.raises(PromptFileError, match='"reference" must be a string'):
        read_prompts(path)


# --- the bench: a score per row, an interval from resampling prompts, a paired difference --------------------


def rec(case: str, prompt: int, score: float, seed: int = 0) -> dict:
    return {"case": case, "prompt_index": prompt, "seed": seed, "repeat": 0, "scores": {"s": score}}


def test_the_difference_to_sd_is_paired_by_prompt():
    """B scores A's score + 10 on every prompt while the prompts range from 0 to 90: paired, the difference is
    exactly 10 with no spread; comparing the two pooled rows would give an interval wider than 50."""
    records = [rec("A", p, 10.0 * p) for p in range(10)] + [rec("B", p, 10.0 * p + 10) for p in range(10)]
    records.append(rec("B", 10, 100.0))  # a prompt A did not run pairs with nothing
    gap = task_gap(records, "B", "A", "s")
    assert gap["difference"] == gap["low"] == gap["high"] == pytest.approx(10.0)
    assert not gap["includes_zero"] and gap["prompts"] == 10 and gap["pairs"] == 10
    b = task_score(records, "B", "s")
    assert b["mean"] == pytest.approx(650 / 11)  # every run of B: 10 + 20 + … + 100, and 100
    assert b["high"] - b["low"] > 30 and b["prompts"] == 11


def test_the_interval_includes_zero_when_the_decoders_do_not_differ():
    records = [rec("A", p, s) for p, s in enumerate([0, 100, 0, 100, 50, 0])]
    records += [rec("B", p, s) for p, s in enumerate([100, 0, 0, 100, 50, 0])]
    gap = task_gap(records, "B", "A", "s")
    assert gap["difference"] == 0.0 and gap["low"] < 0 < gap["high"] and gap["includes_zero"]


def test_runs_pair_by_seed_and_a_prompts_runs_stay_together():
    records = [rec("A", p, 0.0, seed) for p in range(4) for seed in (0, 1)]
    records += [rec("B", p, 50.0 * seed, seed) for p in range(4) for seed in (0, 1)]
    gap = task_gap(records, "B", "A", "s")
    assert gap["pairs"] == 8 and gap["prompts"] == 4
    assert gap["difference"] == gap["low"] == gap["high"] == pytest.approx(25.0)  # each prompt's mean is 25


def test_rows_carry_scores_and_the_table_says_when_the_interval_includes_zero():
    base = dict.fromkeys(Metrics.__dataclass_fields__, 0.0)
    base.update(new_tokens=2, nll_sum=1.0, seconds=1.0, target_calls=2, acceptance=None, joules=None,
                joules_per_token=None, energy_note=None, energy_source=None)  # fmt: skip
    records = []
    for case in ("sd", "mtad"):
        for p in range(6):
            records.append({**base, **rec(case, p, 40.0 + (p % 2) * 20), "method": case})
    rows = aggregate(records, scores=("s",))
    mtad = next(r for r in rows if r["case"] == "mtad")
    assert mtad["task_scores"]["s"]["mean"] == pytest.approx(50.0)
    assert mtad["task_vs_sd"]["s"]["difference"] == 0.0 and mtad["task_vs_sd"]["s"]["includes_zero"]
    table = render_table(rows)
    assert "includes 0: no difference measured" in table
    assert "under 10 prompts, resampling them understates the spread" in table  # 6 prompts here
    many = [{**r, "prompt_index": p} for p in range(12) for r in records[:1]]  # 12 prompts a row
    many += [{**r, "prompt_index": p, "case": "mtad", "method": "mtad"} for p in range(12) for r in records[:1]]
    assert "understates" not in render_table(aggregate(many, scores=("s",)))
    assert table.splitlines()[0].split().count("s") == 1  # the score's column


def test_bench_task_scores_every_run_against_its_reference(tiny_dirs, tmp_path, capsys):
    prompts = tmp_path / "task.jsonl"
    rows = [{"id": "a", "prompt": "abc de", "reference": "fgh"}, {"id": "b", "prompt": "bad", "reference": "cab"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--device", "cpu", "--prompts", str(prompts),
            "--task", "line-completion", "--methods", "ar,sd", "--warmup", "0", "--no-progress", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["config"]["task"] == "line-completion"
    assert {c["max_new_tokens"] for c in data["config"]["cases"]} == {32}  # the task's default
    task = TASKS["line-completion"]
    for r in data["runs"]:
        assert r["scores"] == task.score(r["text"], rows[r["prompt_index"]]["reference"])
    sd = next(a for a in data["aggregates"] if a["method"] == "sd")
    assert set(sd["task_scores"]) == {"exact match", "edit similarity"} and sd["task_vs_sd"] is None
    assert "edit similarity minus SD's" in (out / "table.txt").read_text()

    prompts.write_text('{"id": "bare", "prompt": "abc"}\n')
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert "--task line-completion" in err and "'bare'" in err and '"reference"' in err and "Traceback" not in err


def test_help_lists_the_task_names(capsys):
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in TASKS)
