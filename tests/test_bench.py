"""``python -m mtad.bench`` on the tiny test models: files and fields, sweeps, hf-assisted, pairing, bad input."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import mtad.bench as bench
from mtad.decoding import generate, hf_assisted
from mtad.events import json_safe
from mtad.metrics import Metrics, summarize
from mtad.prompts import PromptFileError, read_prompts
from mtad.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
METRICS = [f.name for f in fields(Metrics)]
NUMERIC = [m for m in METRICS if m != "energy_note"]
PROMPTS = [
    {"id": "p-ours", "category": "code", "prompt": "abc de fgh"},
    {"question_id": 81, "category": "writing", "turns": ["hag bed cab", "a second turn that is ignored"]},
]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "two.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return str(path)


def pair_args(tiny_dirs):
    return ["--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--device", "cpu"]


@pytest.fixture(scope="module")
def sweep_run(tiny_dirs, prompts_file, tmp_path_factory):
    """One bench run: 4 methods, a tau sweep x a beam sweep for mtad, 2 prompts, 8 tokens, with a spy on
    ``summarize`` recording the steps and metrics of every measured run."""
    out = tmp_path_factory.mktemp("bench") / "out"
    calls = []

    def spy(steps, joules=None, energy_note=None):
        m = summarize(steps, joules=joules, energy_note=energy_note)
        calls.append((list(steps), joules, energy_note, m))
        return m

    argv = [
        *pair_args(tiny_dirs),
        "--prompts", prompts_file,
        "--max-new-tokens", "8",
        "--methods", "ar,sd,mtad,hf-assisted",
        "--tau", "0,1",
        "--beams", "1,2",
        "--gamma", "3",
        "--seeds", "0",
        "--warmup", "1",
        "--no-progress",
        "--plotlyjs", "cdn",
        "--out", str(out),
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "summarize", spy)
        code = bench.main(argv)
    data = json.loads((out / "bench.json").read_text())
    return {"code": code, "out": out, "data": data, "calls": calls}


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_run_succeeds_and_writes_every_file(sweep_run):
    out = sweep_run["out"]
    assert sweep_run["code"] == 0
    for name in ("bench.json", "runs.csv", "summary.csv", "table.txt", "tau_sweep.html", "beam_sweep.html"):
        assert (out / name).is_file(), name
    assert not (out / "gamma_sweep.html").exists()  # one gamma: nothing swept, no figure
    html = (out / "tau_sweep.html").read_text()
    assert "speed (tokens\\u002fs)" in html and "perplexity" in html and "acceptance threshold" in html


def test_json_has_every_field(sweep_run):
    data = sweep_run["data"]
    env = data["environment"]
    for key in (
        "date",
        "command",
        "device",
        "device_name",
        "torch",
        "transformers",
        "python",
        "dtype",
        "energy_source",
    ):
        assert env.get(key) not in (None, ""), key
    assert env["command"].startswith("python -m mtad.bench ") and "--tau 0,1" in env["command"]
    assert env["energy_source"] == "unavailable" and "no GPU" in env["energy_unavailable_reason"]
    for r in data["runs"]:
        for key in ("case", "method", "gamma", "beams", "tau", "seed", "repeat", "prompt_id", "text", *METRICS):
            assert key in r, key
        assert r["joules"] is None and r["joules_per_token"] is None and "no GPU" in r["energy_note"]
    for a in data["aggregates"]:
        assert all(f"{m}_mean" in a and f"{m}_std" in a for m in NUMERIC)


def test_csv_has_every_field_and_every_run(sweep_run):
    data, out = sweep_run["data"], sweep_run["out"]
    header, rows = read_csv(out / "runs.csv")
    assert header == list(data["runs"][0].keys())
    assert len(rows) == len(data["runs"])
    assert set(METRICS) <= set(header)
    for row, rec in zip(rows, data["runs"], strict=True):
        assert row["case"] == rec["case"] and int(row["new_tokens"]) == rec["new_tokens"]
        assert float(row["block_efficiency"]) == pytest.approx(rec["block_efficiency"])
        assert row["joules"] == ""  # unavailable is empty, never 0
    header, rows = read_csv(out / "summary.csv")
    assert len(rows) == len(data["aggregates"])
    assert {f"{m}_{s}" for m in NUMERIC for s in ("mean", "std")} <= set(header)


def test_sweeps_give_one_row_per_value_and_only_for_mtad(sweep_run):
    aggs = sweep_run["data"]["aggregates"]
    by_method = {}
    for a in aggs:
        by_method.setdefault(a["method"], []).append(a)
    assert [a["method"] for a in aggs] == ["ar", "sd"] + ["mtad"] * 4 + ["hf-assisted"]
    assert sorted((a["beams"], a["tau"]) for a in by_method["mtad"]) == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
    for m in ("ar", "sd", "hf-assisted"):
        (row,) = by_method[m]
        assert row["tau"] is None and row["beams"] is None
    assert by_method["ar"][0]["gamma"] is None and by_method["sd"][0]["gamma"] == 3
    assert len({a["case"] for a in aggs}) == len(aggs)
    table = (sweep_run["out"] / "table.txt").read_text()
    assert sum(line.startswith("mtad ") for line in table.splitlines()) == 4


def test_every_case_runs_every_prompt_and_seed_and_warmups_are_not_counted(sweep_run):
    runs = sweep_run["data"]["runs"]
    cases = [c["case"] for c in sweep_run["data"]["config"]["cases"]]
    assert len(runs) == len(cases) * len(PROMPTS)
    assert all(a["runs"] == len(PROMPTS) for a in sweep_run["data"]["aggregates"])
    for case in cases:
        assert sorted(r["prompt_id"] for r in runs if r["case"] == case) == ["81", "p-ours"]


def test_bench_metrics_are_exactly_summarize_on_the_run_steps(sweep_run):
    runs, calls = sweep_run["data"]["runs"], sweep_run["calls"]
    assert len(calls) == len(runs)  # summarize is called once per measured run, never for warm-ups
    for rec, (steps, joules, note, metrics) in zip(runs, calls, strict=True):
        expected = json_safe(summarize(steps, joules=joules, energy_note=note).to_dict())
        got = {k: rec[k] for k in METRICS}
        timing = {
            "seconds",
            "tokens_per_second",
            "draft_seconds",
            "target_seconds",
            "other_seconds",
            "overhead_fraction",
        }
        assert {k: v for k, v in got.items() if k not in timing} == {
            k: v for k, v in expected.items() if k not in timing
        }
        assert got == json_safe(metrics.to_dict())  # the record holds what summarize returned, untouched
        assert rec["new_ids"] == [t for s in steps for t in s.appended_ids]


def test_hf_assisted_runs_and_is_summarized_from_its_steps(sweep_run):
    runs = [r for r in sweep_run["data"]["runs"] if r["method"] == "hf-assisted"]
    calls = [
        c for c, r in zip(sweep_run["calls"], sweep_run["data"]["runs"], strict=True) if r["method"] == "hf-assisted"
    ]
    assert len(runs) == len(PROMPTS)
    for rec, (steps, *_rest) in zip(runs, calls, strict=True):
        assert steps and all(s.method == "hf-assisted" for s in steps)
        assert rec["target_calls"] == len(steps) >= 1
        assert rec["draft_calls"] > 0 and rec["drafted"] == rec["draft_calls"]
        assert all(len(s.draft_ids) <= 3 for s in steps)  # gamma = 3, constant schedule
        assert rec["block_efficiency"] == pytest.approx(rec["new_tokens"] / rec["target_calls"])
        assert 1 <= rec["new_tokens"] <= 8 and math.isfinite(rec["perplexity"])
        assert all(len(s.target_logprobs) == len(s.appended_ids) for s in steps)
        assert rec["seconds"] == pytest.approx(sum(s.seconds for s in steps))


def test_table_shape_and_unavailable_energy(sweep_run):
    table = (sweep_run["out"] / "table.txt").read_text()
    header = next(line for line in table.splitlines() if line.startswith("method"))
    for col in ("speed (tok/s)", "J/token", "perplexity", "block eff.", "acceptance", "draft / target / other (s)"):
        assert col in header
    ar = next(line for line in table.splitlines() if line.startswith("ar "))
    assert ar.count("n/a") == 2  # J/token on the CPU, and acceptance (AR drafts nothing)
    assert "J/token n/a: no GPU: running on cpu" in table
    assert " ± " in table


@pytest.fixture(scope="module")
def greedy_run(tiny_dirs, prompts_file):
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        real = bench.summarize
        mp.setattr(bench, "summarize", lambda steps, **kw: calls.append(list(steps)) or real(steps, **kw))
        code = bench.main(
            [*pair_args(tiny_dirs), "--prompts", prompts_file, "--max-new-tokens", "8", "--greedy", "--tau", "1",
             "--methods", "ar,sd,hf-assisted,mtad", "--warmup", "0", "--no-progress"]
        )  # fmt: skip
    return code, calls


def test_greedy_methods_agree_token_for_token(greedy_run):
    """Greedy SD, HF assisted generation and MTAD at tau=1 are all exactly greedy AR: a paired comparison
    with the same prompts must give the same tokens and, from the target's log-probs, the same perplexity."""
    code, calls = greedy_run
    assert code == 0
    by_method = {}
    for steps in calls:
        by_method.setdefault(steps[0].method, []).append(steps)
    assert set(by_method) == {"ar", "sd", "hf-assisted", "mtad"}
    for i in range(len(PROMPTS)):
        ids = {m: [t for s in runs[i] for t in s.appended_ids] for m, runs in by_method.items()}
        assert ids["sd"] == ids["ar"] and ids["hf-assisted"] == ids["ar"] and ids["mtad"] == ids["ar"]
        ppl = {m: summarize(runs[i]).perplexity for m, runs in by_method.items()}
        assert ppl["hf-assisted"] == pytest.approx(ppl["ar"], rel=1e-4)


def test_sampled_runs_reproduce_generate_with_the_same_seed(tiny_pair, tiny_dirs, prompts_file):
    res = bench.run_bench(
        tiny_pair,
        bench.build_cases(["sd", "mtad"], Settings(max_new_tokens=8), [3], [2], [0.1]),
        read_prompts(prompts_file, limit=1),
        [tiny_pair.encode(PROMPTS[0]["prompt"])],
        seeds=[5],
        repeats=2,
        warmup=0,
        progress=False,
    )
    assert len(res.records) == 4
    for rec in res.records:
        settings = Settings(method=rec["method"], gamma=3, beams=2, tau=0.1, max_new_tokens=8, seed=5)
        assert rec["new_ids"] == generate(tiny_pair, PROMPTS[0]["prompt"], settings).new_ids


def test_hf_assisted_restores_the_draft_generation_config(tiny_pair):
    gc = tiny_pair.draft.generation_config
    before = {k: getattr(gc, k, None) for k in hf_assisted.HF_DRAFT_OPTIONS}
    case = bench.Case("hf-assisted", Settings(method="sd", gamma=2, max_new_tokens=6))
    steps, reading = bench.run_case(tiny_pair, case, tiny_pair.encode("abc"), seed=1)
    assert steps and reading is None
    assert {k: getattr(gc, k, None) for k in hf_assisted.HF_DRAFT_OPTIONS} == before


def test_hf_assisted_bridges_a_padded_vocabulary(tiny_dirs, tmp_path):
    """Qwen2.5-0.5B/7B-style pairs: one tokenizer, but the target's output layer has extra padding rows.
    transformers would take that for two tokenizers; the bench bridges it, and greedy stays exactly AR."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtad.pair import load

    wide = AutoModelForCausalLM.from_pretrained(tiny_dirs[1])
    wide.resize_token_embeddings(wide.config.vocab_size + 8, mean_resizing=False)
    wide.save_pretrained(tmp_path / "wide")
    AutoTokenizer.from_pretrained(tiny_dirs[1]).save_pretrained(tmp_path / "wide")
    pair = load(tiny_dirs[0], str(tmp_path / "wide"), device="cpu")
    sizes = (pair.draft.config.vocab_size, pair.target.config.vocab_size)
    assert sizes[0] + 8 == sizes[1] and hf_assisted.padding_ids(pair) == list(range(sizes[0], sizes[1]))
    greedy = Settings(method="sd", greedy=True, gamma=3, max_new_tokens=8)
    for prompt in ("abc de fgh", "hag bed cab"):
        ids = pair.encode(prompt)
        hf, _ = bench.run_case(pair, bench.Case("hf-assisted", greedy), ids, seed=0)
        ar, _ = bench.run_case(pair, bench.Case("ar", greedy.with_(method="ar")), ids, seed=0)
        assert [t for s in hf for t in s.appended_ids] == [t for s in ar for t in s.appended_ids]
        sampled, _ = bench.run_case(pair, bench.Case("hf-assisted", greedy.with_(greedy=False)), ids, seed=3)
        assert all(t < sizes[0] for s in sampled for t in s.appended_ids)
    assert (pair.draft.config.vocab_size, pair.target.config.vocab_size) == sizes  # restored
    assert pair.draft(input_ids=torch.tensor([[1, 2]])).logits.shape[-1] == sizes[0]  # padding hook removed


# --- bad input: a message and exit 2, never a traceback ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("this is not json\n", "line 1 is not JSON"),
        ('{"prompt": "ok"}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
        ('{"id": 1, "text": "no prompt field"}\n', 'line 1 has no prompt: expected a non-empty string field "prompt"'),
        ('{"turns": []}\n', "has no prompt"),
        ("\n\n", "has no prompts"),
    ],
    ids=["missing", "not-jsonl", "not-object", "no-prompt-field", "empty-turns", "empty-file"],
)
def test_bad_prompt_file_exits_2_with_a_message(tmp_path, tiny_dirs, capsys, content, message):
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_text(content)
    code = bench.main([*pair_args(tiny_dirs), "--prompts", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err and str(path) in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tau", "0,1.5"], "tau must be between 0 and 1"),
        (["--beams", "2,x"], "--beams: 'x' is not a valid int"),
        (["--gamma", "0"], "gamma (draft length) must be an integer from 1 to 32"),
        (["--methods", "ar,beam"], "unknown method 'beam'"),
        (["--seeds", "1,,2"], "--seeds must be a value or a comma-separated list"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--max-new-tokens", "5000"], "exceeds the model's context length"),
        (["--greedy", "--draft-mode", "beam-sample"], "stochastic beam sampling contradict"),
    ],
)
def test_bad_settings_exit_2_with_a_message(tiny_dirs, prompts_file, capsys, flags, message):
    code = bench.main([*pair_args(tiny_dirs), "--prompts", prompts_file, "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_bad_pair_and_unknown_flag_exit_2(tmp_path, prompts_file, capsys):
    assert bench.main(["--draft", str(tmp_path / "d"), "--target", str(tmp_path / "t"), "--prompts", prompts_file]) == 2
    assert "no model directory" in capsys.readouterr().err
    assert bench.main(["--prompts", prompts_file, "--frobnicate"]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_spec_bench_turns_and_limit(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(
        '{"question_id": 81, "category": "writing", "turns": ["first turn", "second"]}\n\n'
        '{"question_id": 82, "category": "math", "turns": ["another"]}\n'
        '{"question_id": 83, "category": "math", "turns": ["third"]}\n'
    )
    ps = read_prompts(path)
    assert [(p.id, p.category, p.text) for p in ps] == [
        ("81", "writing", "first turn"),
        ("82", "math", "another"),
        ("83", "math", "third"),
    ]
    assert len(read_prompts(path, limit=2)) == 2
    with pytest.raises(PromptFileError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_parse_list_and_mean_std():
    assert bench.parse_list("0, 0.1,0.1,1", float, "tau") == [0.0, 0.1, 1.0]
    assert bench.mean_std([1.0, 2.0, 3.0, None, float("nan")]) == (2.0, 1.0, 3)
    assert bench.mean_std([4.0]) == (4.0, None, 1)
    assert bench.mean_std([None]) == (None, None, 0)


def test_cli_entry_point_runs_in_a_subprocess(tiny_dirs, prompts_file, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mtad.bench", *pair_args(tiny_dirs), "--prompts", prompts_file, "--limit", "1",
         "--methods", "ar,hf-assisted", "--max-new-tokens", "4", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("method") and any(line.startswith("hf-assisted") for line in lines)
    assert "wrote" in proc.stderr and (tmp_path / "o" / "bench.json").is_file()


def test_sweep_figures_put_speed_and_perplexity_on_two_axes(sweep_run):
    from mtad.bench_plots import sweep_figure

    aggs = sweep_run["data"]["aggregates"]
    fig = sweep_figure(aggs, "tau")
    speed = [t for t in fig.data if t.name.endswith(": speed")]
    ppl = [t for t in fig.data if t.name.endswith(": perplexity")]
    assert sorted(t.name for t in speed) == ["mtad beams=1: speed", "mtad beams=2: speed"]  # one line per W
    assert all(list(t.x) == [0.0, 1.0] for t in speed + ppl)  # one point per tau value
    assert {t.yaxis for t in speed} == {"y"} and {t.yaxis for t in ppl} == {"y2"}
    mtad = [a for a in aggs if a["method"] == "mtad" and a["beams"] == 1]
    line = next(t for t in ppl if t.name.startswith("mtad beams=1"))
    assert list(line.y) == [a["perplexity_mean"] for a in sorted(mtad, key=lambda a: a["tau"])]
    assert sweep_figure(aggs, "gamma") is None  # one gamma: not a sweep
    assert len(sweep_figure(aggs, "beams").data) == 4  # beams=1,2 for tau=0 and tau=1
