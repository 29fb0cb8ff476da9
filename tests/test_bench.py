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

import mtad.bench.cli as bench
import mtad.bench.report as bench_report
import mtad.bench.run as bench_run
from mtad.bench.aggregate import mean_std
from mtad.bench.run import Case
from mtad.decoding import decode, generate, hf_assisted
from mtad.energy import EnergyReading
from mtad.events import json_safe
from mtad.metrics import Metrics, pool, summarize
from mtad.prompts import Prompt, PromptFileError, read_prompts
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
        mp.setattr(bench_run, "summarize", spy)
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
    for col in ("speed (tok/s)", "J/token", "perplexity", "ppl common", "block eff.", "acceptance", "draft / target"):
        assert col in header
    ar = next(line for line in table.splitlines() if line.startswith("ar "))
    assert ar.count("n/a") == 2  # J/token on the CPU, and acceptance (AR drafts nothing)
    assert "J/token n/a: no GPU: running on cpu" in table
    assert "pooled over the row's runs" in table and "docs/metrics.md" in table


@pytest.fixture(scope="module")
def greedy_run(tiny_dirs, prompts_file):
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        real = bench_run.summarize
        mp.setattr(bench_run, "summarize", lambda steps, **kw: calls.append(list(steps)) or real(steps, **kw))
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
    res = bench_run.run_bench(
        tiny_pair,
        bench_run.build_cases(["sd", "mtad"], Settings(max_new_tokens=8), [3], [2], [0.1]),
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


def test_cases_take_turns_on_each_prompt_and_seed(tiny_pair, prompts_file):
    """Interleaved, not case after case: a load that drifts during the bench weighs on every row alike."""
    res = bench_run.run_bench(
        tiny_pair,
        bench_run.build_cases(["ar", "sd", "mtad"], Settings(max_new_tokens=4), [2], [2], [0.1]),
        read_prompts(prompts_file, limit=2),
        [tiny_pair.encode("abc de fgh"), tiny_pair.encode("hag bed cab")],
        seeds=[0, 1],
        repeats=1,
        warmup=1,
        progress=False,
    )
    order = [(r["prompt_index"], r["seed"], r["method"]) for r in res.records]
    assert order == [(i, seed, m) for i in (0, 1) for seed in (0, 1) for m in ("ar", "sd", "mtad")]


@pytest.mark.parametrize("gamma", [2, 3])
def test_hf_assisted_drafts_gamma_tokens_a_round_and_records_its_rounds(tiny_pair, gamma):
    """transformers' default schedule changes the draft length from round to round (it started at 2 and
    went up to 8 here when the draft's config was left alone); the draft's config fixes it at gamma,
    as SD drafts. Each round's Step: its index, which tokens the target gave, EOS only at the end."""
    s = Settings(method="hf-assisted", gamma=gamma, max_new_tokens=24, seed=0)
    steps = list(decode(tiny_pair, tiny_pair.encode("abc"), s))
    done, full = 0, []
    for step in steps:
        if done + gamma + 1 <= s.max_new_tokens and not set(step.draft_ids) & tiny_pair.eos_ids:
            full.append(len(step.draft_ids))  # a round with room for gamma drafts and no EOS among them
        done += len(step.appended_ids)
    assert len(full) >= 3 and set(full) == {gamma}
    assert [st.index for st in steps] == list(range(len(steps)))
    for st in steps:
        n = len(st.appended_ids)
        assert st.from_target == [False] * st.accepted + [True] * (n - st.accepted)
    assert not any(st.eos for st in steps[:-1])


def test_hf_assisted_with_room_for_one_token_is_one_round_without_drafts(tiny_pair):
    """No room to draft: one target call, one Step, no drafts (not the verification input's tail)."""
    steps = list(decode(tiny_pair, tiny_pair.encode("abc"), Settings(method="hf-assisted", max_new_tokens=1)))
    assert len(steps) == 1 and steps[0].draft_ids == [] and len(steps[0].appended_ids) == 1
    assert steps[0].target_calls == 1 and steps[0].from_target == [True]


def test_hf_assisted_restores_both_generation_configs(tiny_pair):
    configs = (tiny_pair.target.generation_config, tiny_pair.draft.generation_config)
    before = [c.to_dict() for c in configs]
    steps, reading = bench_run.run_case(tiny_pair, Case(Settings(method="hf-assisted", gamma=2, max_new_tokens=6)),
                                        tiny_pair.encode("abc"), seed=1)  # fmt: skip
    assert steps and reading is None
    assert (tiny_pair.target.generation_config, tiny_pair.draft.generation_config) == configs
    assert [c.to_dict() for c in configs] == before


def test_hf_assisted_bridges_a_padded_vocabulary(tiny_dirs, tmp_path):
    """Qwen2.5-0.5B/7B-style pairs: one tokenizer, but the target's output layer has extra padding rows.
    transformers would take that for two tokenizers; the bench bridges it, and greedy stays exactly AR."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtad.models.pair import load

    wide = AutoModelForCausalLM.from_pretrained(tiny_dirs[1])
    wide.resize_token_embeddings(wide.config.vocab_size + 8, mean_resizing=False)
    wide.save_pretrained(tmp_path / "wide")
    AutoTokenizer.from_pretrained(tiny_dirs[1]).save_pretrained(tmp_path / "wide")
    pair = load(tiny_dirs[0], str(tmp_path / "wide"), device="cpu")
    sizes = (pair.draft.config.vocab_size, pair.target.config.vocab_size)
    assert sizes[0] + 8 == sizes[1] and hf_assisted.padding_ids(pair) == list(range(sizes[0], sizes[1]))
    greedy = Settings(method="hf-assisted", greedy=True, gamma=3, max_new_tokens=8)
    for prompt in ("abc de fgh", "hag bed cab"):
        ids = pair.encode(prompt)
        hf, _ = bench_run.run_case(pair, Case(greedy), ids, seed=0)
        ar, _ = bench_run.run_case(pair, Case(greedy.with_(method="ar")), ids, seed=0)
        assert [t for s in hf for t in s.appended_ids] == [t for s in ar for t in s.appended_ids]
        sampled, _ = bench_run.run_case(pair, Case(greedy.with_(greedy=False)), ids, seed=3)
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
    assert mean_std([1.0, 2.0, 3.0, None, float("nan")]) == (2.0, 1.0, 3)
    assert mean_std([4.0]) == (4.0, None, 1)
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2.0)), 2)  # two runs have a spread
    assert mean_std([None]) == (None, None, 0)


def test_cli_entry_point_runs_in_a_subprocess(tiny_dirs, prompts_file, tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep a caller's packages
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
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
    from mtad.bench.plots import sweep_figure

    aggs = sweep_run["data"]["aggregates"]
    fig = sweep_figure(aggs, "tau")
    speed = [t for t in fig.data if t.name.endswith(": speed")]
    ppl = [t for t in fig.data if t.name.endswith(": perplexity")]
    assert sorted(t.name for t in speed) == ["mtad beams=1: speed", "mtad beams=2: speed"]  # one line per W
    assert all(list(t.x) == [0.0, 1.0] for t in speed + ppl)  # one point per tau value
    assert {t.yaxis for t in speed} == {"y"} and {t.yaxis for t in ppl} == {"y2"}
    mtad = [a for a in aggs if a["method"] == "mtad" and a["beams"] == 1]
    line = next(t for t in ppl if t.name.startswith("mtad beams=1"))
    assert list(line.y) == [a["perplexity"] for a in sorted(mtad, key=lambda a: a["tau"])]
    assert sweep_figure(aggs, "gamma") is None  # one gamma: not a sweep
    assert len(sweep_figure(aggs, "beams").data) == 4  # beams=1,2 for tau=0 and tau=1


# --- the registry --------------------------------------------------------------------------------------------------


def test_one_registry_names_every_method_once():
    from mtad.decoding import DECODERS
    from mtad.decoding.spec import registry

    METHODS = tuple(registry())

    assert tuple(DECODERS) == METHODS  # the CLI, the bench and Settings.validate all read METHODS
    assert bench.parser().get_default("methods") is None  # every method the pair can run
    assert bench.parse_methods(",".join(METHODS)) == list(METHODS)
    assert [c.method for c in bench_run.build_cases(METHODS, Settings(), [2], [2], [0.5])] == list(METHODS)


# --- EOS inside the accepted drafts ----------------------------------------------------------------------------------


def test_eos_inside_accepted_drafts_counts_only_the_kept_ones(tiny_pair):
    """On the tiny pair the draft proposes EOS (id 0) inside a prefix the target accepts: the cut keeps fewer
    tokens than were accepted, and ``accepted`` (so acceptance) counts only the kept drafts. Greedy SD and
    transformers' assisted generation keep the same tokens per round, so hf-assisted's counts match SD's."""
    runs = {}
    for method, prompt, extra in (
        ("mtad", "abc def gh", {"tau": 0.0}),  # tau = 0 accepts every prefix the target gives mass to
        ("sd", "bg gacdhdc", {}),  # greedy: the target's argmax after this prompt is EOS too
        ("hf-assisted", "bg gacdhdc", {}),
    ):
        s = Settings(method=method, greedy=True, gamma=4, max_new_tokens=30, **extra)
        runs[method] = list(decode(tiny_pair, tiny_pair.encode(prompt), s))
    for method, steps in runs.items():
        last = steps[-1]
        assert last.eos and last.appended_ids[-1] in tiny_pair.eos_ids, method
        if method != "hf-assisted":  # transformers' draft stops at EOS; ours drafts on and the cut runs
            assert len(last.appended_ids) < len(last.draft_ids), method  # the rare path ran
        assert last.appended_ids == last.draft_ids[: len(last.appended_ids)], method
        assert last.accepted == len(last.appended_ids) and not any(last.from_target), method
        m = summarize(steps)
        assert m.accepted == sum(s.accepted for s in steps) <= m.new_tokens
    sd = [(s.appended_ids, s.accepted) for s in runs["sd"]]
    assert [(s.appended_ids, s.accepted) for s in runs["hf-assisted"]] == sd


# --- hf-assisted ignores the models' own generation settings (issue 11.3) --------------------------------------------


def test_hf_assisted_ignores_the_models_generation_config(tiny_dirs, tmp_path):
    """A target that ships repetition_penalty, no_repeat_ngram_size, min_new_tokens and bad words: greedy
    hf-assisted must still equal greedy AR (our decoders never read them). Negative control: transformers
    with the model's own config does decode something else, so the test can fail."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtad.models.pair import load

    prompt = "abc de fgh"
    plain = load(*tiny_dirs, device="cpu")
    ar_ids = generate(plain, prompt, Settings(method="ar", greedy=True, max_new_tokens=12)).new_ids
    dirs = []
    for name, src in (("draft", tiny_dirs[0]), ("target", tiny_dirs[1])):
        model = AutoModelForCausalLM.from_pretrained(src)
        gc = model.generation_config
        gc.repetition_penalty, gc.no_repeat_ngram_size, gc.min_new_tokens = 5.0, 2, 12
        gc.bad_words_ids = [[ar_ids[0]]]
        model.save_pretrained(tmp_path / name)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / name)
        dirs.append(str(tmp_path / name))
    pair = load(*dirs, device="cpu")
    assert pair.target.generation_config.repetition_penalty == 5.0
    ids = torch.tensor([pair.encode(prompt)])
    inherited = pair.target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                     assistant_model=pair.draft)[0, ids.shape[1]:].tolist()  # fmt: skip
    assert inherited != ar_ids  # the negative control: the model's settings change the output
    for gamma in (1, 3):
        hf = generate(pair, prompt, Settings(method="hf-assisted", greedy=True, gamma=gamma, max_new_tokens=12))
        assert hf.new_ids == ar_ids, gamma
    assert pair.target.generation_config.repetition_penalty == 5.0  # restored after the run


# --- pooled figures, energy, failures and the time budget ------------------------------------------------------------


class FakeMeter:
    """An energy meter that reads 0.5 J, 0.75 J, 1.0 J ... for successive windows (a GPU's counter stand-in)."""

    available, source, reason = True, "fake-counter", None

    def __init__(self, device=None):
        self.windows, self.reading = 0, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reading = EnergyReading(0.5 + 0.25 * self.windows, 0.01, self.source, None)
        self.windows += 1


@pytest.fixture(scope="module")
def fault_run(tiny_dirs, prompts_file, tmp_path_factory):
    """ar, sd, mtad W=1,2, hf-assisted on 2 prompts x 2 seeds with a fake energy meter and every step saved;
    the draft raises a real ``torch.OutOfMemoryError`` from a forward hook whenever its batch exceeds 1,
    so only mtad W=2 (beam batch of 2) fails."""
    out = tmp_path_factory.mktemp("fault") / "out"
    real_load = bench.load_pair_from_args
    oom_calls = []

    def load_with_oom(args):
        pair = real_load(args)

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and ids.shape[0] > 1:
                oom_calls.append(ids.shape)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test hook)")

        pair.draft.register_forward_pre_hook(hook, with_kwargs=True)
        return pair

    argv = [*pair_args(tiny_dirs), "--prompts", prompts_file, "--max-new-tokens", "8", "--seeds", "0,1",
            "--methods", "ar,sd,mtad,hf-assisted", "--beams", "1,2", "--gamma", "3", "--warmup", "0",
            "--save-steps", "--no-progress", "--plotlyjs", "cdn", "--out", str(out)]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "load_pair_from_args", load_with_oom)
        mp.setattr(bench, "EnergyMeter", FakeMeter)
        code = bench.main(argv)
    data = json.loads((out / "bench.json").read_text())
    return {"code": code, "out": out, "data": data, "oom_calls": oom_calls}


def test_a_failing_case_is_recorded_and_the_others_are_kept(fault_run):
    data, out = fault_run["data"], fault_run["out"]
    assert fault_run["oom_calls"] and fault_run["code"] == 1  # the hook fired; exit 1 says a case failed
    failed = "mtad γ=3 W=2 τ=0.1"
    assert data["failures"] == [{"case": failed, "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                 "2.00 GiB (test hook)"}]  # fmt: skip
    rows = {a["case"]: a for a in data["aggregates"]}
    assert list(rows) == ["ar", "sd γ=3", "mtad γ=3 W=1 τ=0.1", failed, "hf-assisted γ=3"]
    assert rows[failed]["runs"] == 0 and rows[failed]["error"].startswith("OutOfMemoryError")
    for case, row in rows.items():
        if case != failed:
            assert row["runs"] == 4 and row["error"] is None and row["tokens_per_second"] > 0
    assert {r["case"] for r in data["runs"]} == set(rows) - {failed}
    table = (out / "table.txt").read_text()
    assert f"{failed} failed after 0 run(s): OutOfMemoryError: CUDA out of memory" in table
    summary = read_csv(out / "summary.csv")[1]
    assert next(r for r in summary if r["case"] == failed)["error"].startswith("OutOfMemoryError")


def test_pooled_perplexity_is_exp_mean_nll_over_the_saved_steps(fault_run):
    """The row's perplexity is exp(mean NLL over all new tokens of its runs), recomputed here from the saved
    Step traces; it differs from the mean of per-run perplexities (the token-weighted mean is never lower)."""
    data = fault_run["data"]
    assert len(data["steps"]) == len(data["runs"])
    by_case = {}
    for rec, steps in zip(data["runs"], data["steps"], strict=True):
        assert [t for s in steps for t in s["appended_ids"]] == rec["new_ids"]
        by_case.setdefault(rec["case"], []).append((rec, steps))
    differs = 0
    for row in data["aggregates"]:
        runs = by_case.get(row["case"], [])
        if not runs:
            continue
        lps = [lp for _, steps in runs for s in steps for lp in s["target_logprobs"]]
        assert row["perplexity"] == pytest.approx(math.exp(-sum(lps) / len(lps)), rel=1e-12)
        assert row["perplexity_common"] == pytest.approx(row["perplexity"], rel=1e-12)  # every row finished all
        tokens = sum(len(lp) for lp in ([lp for s in steps for lp in s["target_logprobs"]] for _, steps in runs))
        seconds = sum(s["seconds"] for _, steps in runs for s in steps)
        assert row["tokens_per_second"] == pytest.approx(tokens / seconds, rel=1e-9)
        mean_ppl = sum(r["perplexity"] for r, _ in runs) / len(runs)
        assert row["perplexity_mean"] == pytest.approx(mean_ppl)
        weighted = sum(r["perplexity"] * r["new_tokens"] for r, _ in runs) / tokens
        assert weighted >= row["perplexity"] * (1 - 1e-12)  # Jensen: exp of a mean <= the mean of exps
        differs += abs(mean_ppl - row["perplexity"]) > 1e-6 * row["perplexity"]
    assert differs  # pooled and per-run means are really different figures here


def test_fake_meter_joules_reach_records_csv_and_table(fault_run):
    data, out = fault_run["data"], fault_run["out"]
    runs = data["runs"]
    # every measured run (no warm-ups here) opened one window, in order; the failed case's first run too
    joules = [r["joules"] for r in runs]
    assert joules == sorted(joules) and len(set(joules)) == len(joules)
    for rec in runs:
        assert rec["energy_source"] == "fake-counter"
        assert rec["joules_per_token"] == pytest.approx(rec["joules"] / rec["new_tokens"])
    _, csv_rows = read_csv(out / "runs.csv")
    assert [float(r["joules"]) for r in csv_rows] == joules
    table = (out / "table.txt").read_text().splitlines()
    for row in data["aggregates"]:
        rs = [r for r in runs if r["case"] == row["case"]]
        if not rs:
            assert row["joules_per_token"] is None
            continue
        pooled = sum(r["joules"] for r in rs) / sum(r["new_tokens"] for r in rs)
        assert row["joules_per_token"] == pytest.approx(pooled, rel=1e-12)
        line = next(line for line in table if line.startswith(row["method"] + " ") and f" {row['runs']}" in line)
        assert bench_report.fmt(pooled) in line.split()
    assert "J/token n/a" not in "\n".join(table)


def test_time_budget_stops_each_row_and_compares_perplexity_over_common_prompts(tiny_dirs, tmp_path):
    prompts = tmp_path / "three.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc de", "fgh a", "bad cafe")))
    out = tmp_path / "out"
    code = bench.main([*pair_args(tiny_dirs), "--prompts", str(prompts), "--max-new-tokens", "6", "--methods",
                       "ar,sd", "--warmup", "0", "--time-budget", "1e-9", "--no-progress", "--out", str(out)])  # fmt: skip
    data = json.loads((out / "bench.json").read_text())
    assert code == 0 and data["config"]["time_budget_seconds"] == 1e-9
    assert [(r["case"], r["prompt_index"]) for r in data["runs"]] == [("ar", 0), ("sd γ=4", 0)]  # then out of time
    for row in data["aggregates"]:
        assert row["budget_stopped"] and row["runs"] == 1 and row["common_prompts"] == 1
        (rec,) = [r for r in data["runs"] if r["case"] == row["case"]]
        assert row["perplexity_common"] == pytest.approx(rec["perplexity"])
    assert "ran out of its time budget after 1 run(s)" in (out / "table.txt").read_text()


def _record(case: str, index: int, nll: float = 1.0, tokens: int = 2, **extra) -> dict:
    m = dict.fromkeys(Metrics.__dataclass_fields__, 0.0)
    m.update(new_tokens=tokens, nll_sum=nll, seconds=1.0, target_calls=tokens, acceptance=None,
             joules=None, joules_per_token=None, energy_note=None, perplexity=math.exp(nll / tokens))  # fmt: skip
    return {"case": case, "method": case, "prompt_index": index, "energy_source": "rapl-counter", **m, **extra}


def test_common_prompts_leave_out_a_prompt_one_row_did_not_finish():
    from mtad.bench.aggregate import aggregate

    records = [_record("a", 0, 1.0, 2), _record("a", 1, 8.0, 2), _record("b", 0, 3.0, 3)]
    rows = {r["case"]: r for r in aggregate(records)}
    assert rows["a"]["common_prompts"] == 1 and rows["b"]["common_prompts"] == 1
    assert rows["a"]["perplexity"] == pytest.approx(math.exp(9.0 / 4))
    assert rows["a"]["perplexity_common"] == pytest.approx(math.exp(1.0 / 2))
    assert rows["b"]["perplexity_common"] == pytest.approx(math.exp(3.0 / 3))


def test_the_table_prints_each_figure_to_its_digits():
    """The printed table, cell by cell: 0 decimals from 1000 up, 1 from 10, 2 from 0.1 (and for 0), else 3
    (chosen before rounding: 999.96 prints 1000.0); n/a for a figure not measured; ``-`` for a setting a
    method has no use for; the time split to the millisecond; failures, budget stops and the energy note."""
    from mtad.bench.report import render_table

    def row(**kw) -> dict:
        base = dict.fromkeys(("gamma", "beams", "tau", "draft_mode", "joules_per_token", "perplexity_common"))
        base.update(case="ar", method="ar", draft_seconds_mean=0.0, target_seconds_mean=1.5, other_seconds_mean=0.01234,
                    runs=2, common_prompts=3, error=None, budget_stopped=False)  # fmt: skip
        return {**base, **kw}

    rows = [
        row(
            tokens_per_second=1000.0,
            joules_per_token=12.345,
            perplexity=2.3456,
            perplexity_common=0.1,
            repetition=0.0312,
            block_efficiency=1.0,
            acceptance=0.0,
        ),
        row(
            case="mtad γ=4",
            method="mtad",
            gamma=4,
            beams=8,
            tau=0.1,
            draft_mode="beam",
            tokens_per_second=999.96,
            joules_per_token=float("nan"),
            perplexity=10.0,
            perplexity_common=0.09996,
            repetition=0.5,
            block_efficiency=2.5,
            acceptance=0.012345,
            draft_seconds_mean=0.25,
            runs=1,
            error="the GPU ran out of memory",
            budget_stopped=True,
            common_prompts=0,
        ),
    ]
    assert render_table(rows, energy_note="no GPU").splitlines() == [
        "method  γ  W  τ    draft  speed (tok/s)  J/token  perplexity  ppl common  rep. 4-grams  block eff.  "
        "acceptance  draft / target / other (s/run)  runs",
        "------  -  -  ---  -----  -------------  -------  ----------  ----------  ------------  ----------  "
        "----------  ------------------------------  ----",
        "ar      -  -  -    -               1000     12.3        2.35        0.10         0.031        1.00  "
        "      0.00           0.000 / 1.500 / 0.012     2",
        "mtad    4  8  0.1  beam          1000.0      n/a        10.0       0.100          0.50        2.50  "
        "     0.012           0.250 / 1.500 / 0.012     1",
        "speed, J/token, perplexity, block eff. and acceptance are pooled over the row's runs (total over total,",
        "see docs/metrics.md); 'ppl common' pools only the 3 prompt(s) every row finished; 'rep. 4-grams'",
        "is the share of repeated 4-grams (a looping text has a low perplexity); the time split is the mean per run.",
        "Per-run means and standard deviations are in summary.csv and bench.json.",
        "mtad γ=4 failed after 1 run(s): the GPU ran out of memory",
        "mtad γ=4 ran out of its time budget after 1 run(s)",
        "J/token n/a: no GPU",
    ]


def test_a_table_with_no_rows_still_prints_its_header_and_legend():
    from mtad.bench.report import render_table

    lines = render_table([]).splitlines()
    assert lines[0].startswith("method  γ  W  τ") and set(lines[1]) == {"-", " "}
    assert "pools only the 0 prompt(s) every row finished" in lines[3] and len(lines) == 6


def test_csv_columns_are_the_union_of_the_rows_keys_in_first_seen_order(tmp_path):
    from mtad.bench.report import write_csv

    path = tmp_path / "rows.csv"
    write_csv(path, [{"a": 1, "b": None}, {"b": [1, 2], "c": {"k": "v"}, "a": 2.5}])
    assert path.read_text(encoding="utf-8").splitlines() == ["a,b,c", "1,,", '2.5,"[1, 2]","{""k"": ""v""}"']


def test_the_environment_names_the_run_as_it_ran(tiny_pair, tiny_dirs):
    import platform

    import transformers

    from mtad.bench.report import environment
    from mtad.models.devices import device_model

    env = environment(tiny_pair, ["--pair", "a b", "--seeds", "0"], "no GPU", "rapl-counter", "abc123")
    assert env["command"] == "python -m mtad.bench --pair 'a b' --seeds 0"
    assert env["device"] == "cpu" and env["device_name"] == device_model(torch.device("cpu"))
    assert env["dtype"] == str(tiny_pair.dtype).removeprefix("torch.") and env["pair"] == tiny_pair.name
    assert (env["draft_parameters"], env["target_parameters"]) == tiny_pair.parameters()
    assert (env["draft_source"], env["target_source"]) == tiny_dirs  # the directories the pair was loaded from
    assert env["cpu_count"] == os.cpu_count() and env["torch_threads"] == torch.get_num_threads()
    assert (env["python"], env["platform"]) == (platform.python_version(), platform.platform())
    assert (env["torch"], env["transformers"], env["cuda"]) == (
        torch.__version__,
        transformers.__version__,
        torch.version.cuda,
    )
    assert (env["energy_source"], env["energy_unavailable_reason"], env["git_commit"]) == (
        "rapl-counter",
        "no GPU",
        "abc123",
    )
    assert env["date"].endswith("+00:00") and len(env["date"]) == len("2026-11-22T16:49:51+00:00")
    assert env["linear_kernels"] == tiny_pair.kernels and set(env["linear_kernels"]) == {"draft", "target"}
    assert env["cpu_flags"][-1] == f"aten:{torch.backends.cpu.get_cpu_capability()}" or any(
        f.startswith("ATEN_CPU_CAPABILITY=") for f in env["cpu_flags"]
    )


def test_the_environment_names_forwards_that_ran_uncompiled(tiny_pair, monkeypatch):
    from mtad.bench.report import environment
    from mtad.models import static_llama

    monkeypatch.setattr(static_llama, "UNCOMPILED", {})
    assert environment(tiny_pair, [], None, "none", None)["uncompiled_shapes"] == []
    static_llama.UNCOMPILED["Llama, 1 row, 5 tokens (gemv form)"] = "past dynamo's limit of 8 graphs"
    assert environment(tiny_pair, [], None, "none", None)["uncompiled_shapes"] == [
        "Llama, 1 row, 5 tokens (gemv form) (past dynamo's limit of 8 graphs)"
    ]


def test_the_environment_names_emulated_instruction_sets(tiny_pair, monkeypatch):
    from mtad.bench.report import environment

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # this process may run capped already
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    env = environment(tiny_pair, [], None, "none", None)
    assert env["cpu_flags"][-1] == "ONEDNN_MAX_CPU_ISA=AVX2"
    flags = set(open("/proc/cpuinfo").read().split())
    assert ("avx2" in env["cpu_flags"]) == ("avx2" in flags)
    assert ("avx512_f" in env["cpu_flags"]) == ("avx512f" in flags)  # PyTorch's spelling, whoever read it


def test_a_prompt_is_finished_only_when_every_seed_of_every_case_ran():
    from mtad.bench.aggregate import aggregate, finished_prompts

    records = [_record("a", 0), _record("a", 0), _record("a", 1), _record("b", 0), _record("b", 0), _record("b", 1)]
    assert finished_prompts(records, runs_per_prompt=2) == {0}  # prompt 1 ran one seed of two
    assert finished_prompts(records, runs_per_prompt=1) == {0, 1}
    assert finished_prompts(records, runs_per_prompt=3) == set() and finished_prompts([], 2) == set()
    # a case with no finished prompt has no common perplexity (not the pool of nothing)
    rows = {r["case"]: r for r in aggregate([_record("a", 0), _record("b", 1)], runs_per_prompt=1)}
    assert rows["a"]["common_prompts"] == 0 and rows["a"]["perplexity_common"] is None


def test_a_row_carries_its_energy_source_and_every_distinct_note():
    from mtad.bench.aggregate import aggregate

    records = [_record("a", 0, energy_note="sub-second run"), _record("a", 1, energy_note="counter wrapped"),
               _record("a", 2, energy_note="sub-second run"), _record("b", 0)]  # fmt: skip
    rows = {r["case"]: r for r in aggregate(records)}
    assert rows["a"]["energy_source"] == "rapl-counter"
    assert rows["a"]["energy_note"] == "counter wrapped; sub-second run"
    assert rows["b"]["energy_note"] is None


# --- one home: prompt files and greedy SD are read and run by the library ------------------------------------------


def test_the_pages_examples_read_spec_bench_turns(tmp_path):
    from mtad.models.presets import Preset
    from mtad.ui.inputs import example_prompts

    f = tmp_path / "question.jsonl"
    f.write_text('{"question_id": 81, "category": "writing", "turns": ["Compose a blog post", "Rewrite it"]}\n')
    assert example_prompts(Preset("x", "d", "t", "desc", prompts=str(f))) == [
        ("[writing] Compose a blog post", "Compose a blog post")
    ]


def test_train_pair_greedy_sd_figure_is_the_engines(tiny_dirs, tmp_path):
    """``simulate_greedy_sd`` runs the engine; checked here against the teacher-forced count: greedy SD's
    output is the target's greedy continuation g, and each target call keeps the draft's run of argmax
    matches along g (at most gamma) plus one token of its own. The tiny draft rarely agrees with its
    target, so a second pair drafts with a copy of the target, which agrees everywhere (long runs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.embedded_pair import simulate_greedy_sd

    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("abc def gh", "bg gacdhdc", "bggca c cb"))
    )
    same = tmp_path / "same"
    for name in ("draft", "target"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs[1]).save_pretrained(same / name)
        AutoTokenizer.from_pretrained(tiny_dirs[1]).save_pretrained(same / name)
    for out, draft_dir in ((Path(tiny_dirs[0]).parent, tiny_dirs[0]), (same, tiny_dirs[1])):
        res = simulate_greedy_sd(out, prompts_file, gamma=3, max_new_tokens=40, log=lambda _: None)
        tokens, calls = teacher_forced_greedy_sd(draft_dir, tiny_dirs[1], prompts_file, gamma=3, max_new_tokens=40)
        assert res["prompts"] == 3 and res["generated_tokens"] == tokens
        assert res["aggregate_tokens_per_target_call"] == pytest.approx(tokens / calls)
    assert calls < tokens / 2  # with the twin draft, runs of accepted drafts did happen


def teacher_forced_greedy_sd(draft_dir, target_dir, prompts_file, gamma, max_new_tokens):
    """(tokens, target calls) of greedy SD from one teacher-forced draft pass over the target's greedy output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    draft, target = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (draft_dir, target_dir))
    tokens = calls = 0
    for text in read_prompts(prompts_file):
        ids = torch.tensor([tok.encode(text.text)])
        with torch.inference_mode():
            full = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=0)
            g = full[0, ids.shape[1] :]
            match = (draft(input_ids=full[:, :-1]).logits[0, ids.shape[1] - 1 :].argmax(-1) == g).tolist()
        pos = 0
        while pos < len(g):
            run = 0
            while run < gamma and pos + run < len(g) - 1 and match[pos + run]:
                run += 1
            pos += run + 1
            calls += 1
        tokens += len(g)
    return tokens, calls


# --- run_bench itself: records, turns, budgets, warm-ups, failures, interruption, progress ----------


def _bench(pair, methods, prompts, **kwargs):
    """``run_bench`` over ``prompts`` (texts) with small defaults that a test overrides."""
    base = kwargs.pop("settings", Settings(max_new_tokens=4))
    args = dict(seeds=[0], repeats=1, warmup=0, progress=False)
    args.update(kwargs)
    cases = bench_run.build_cases(methods, base, [2], [2], [0.1])
    items = [Prompt(id=f"q{i}", category=f"c{i}", text=t) for i, t in enumerate(prompts)]
    return bench_run.run_bench(pair, cases, items, [pair.encode(t) for t in prompts], **args)


def test_a_run_record_holds_what_ran_its_metrics_and_its_energy_window(tiny_pair):
    settings = Settings(max_new_tokens=5, temperature=0.8, top_k=7, top_p=0.95)
    meter = FakeMeter()
    res = _bench(tiny_pair, ["sd"], ["fgh a"], settings=settings, seeds=[3], repeats=2, warmup=1,
                 meter=meter, keep_steps=True)  # fmt: skip
    assert not res.failures and not res.interrupted and meter.windows == 2  # the warm-up opens no window
    ids = tiny_pair.encode("fgh a")
    for repeat, (rec, steps) in enumerate(zip(res.records, res.steps, strict=True)):
        replay = list(decode(tiny_pair, ids, settings.with_(method="sd", gamma=2, beams=2, tau=0.1, seed=3)))
        from mtad.metrics import position_counts

        assert [s["appended_ids"] for s in steps] == [s.appended_ids for s in replay]  # the kept trace is the run's
        assert rec["new_ids"] == [t for s in steps for t in s["appended_ids"]]
        metrics = {k: rec[k] for k in Metrics.__dataclass_fields__}
        assert metrics["new_tokens"] == len(rec["new_ids"]) and metrics["joules"] == 0.5 + 0.25 * repeat
        assert metrics["joules_per_token"] == pytest.approx(metrics["joules"] / metrics["new_tokens"])
        assert metrics["energy_note"] is None
        what_ran = {k: v for k, v in rec.items() if k not in metrics}
        assert what_ran == {
            "case": "sd γ=2", "method": "sd", "gamma": 2, "beams": None, "tau": None, "draft_mode": None,
            "greedy": False, "temperature": 0.8, "top_k": 7, "top_p": 0.95, "max_new_tokens": 5,
            "seed": 3, "repeat": repeat, "prompt_index": 0, "prompt_id": "q0", "prompt_category": "c0",
            "prompt_tokens": len(ids), "energy_source": "fake-counter", "energy_window_seconds": 0.01,
            "position_reached": list(position_counts(replay)[0]), "position_kept": list(position_counts(replay)[1]),
            "text": tiny_pair.decode(rec["new_ids"]), "new_ids": rec["new_ids"],
        }  # fmt: skip
        assert list(rec)[: list(rec).index("prompt_tokens") + 1] == list(what_ran)[:17]  # what ran comes first
    assert res.records[0]["text"]  # a real reply, not an empty string


def test_without_a_meter_each_run_reads_the_device_s_own(tiny_pair):
    (rec,) = _bench(tiny_pair, ["ar"], ["abc de"]).records
    assert rec["energy_source"] == "unavailable" and rec["joules"] is None and rec["energy_window_seconds"] > 0
    assert rec["energy_note"] == "no GPU: running on cpu, and no readable RAPL energy counter"


def test_each_method_drafts_its_own_paper_gamma_unless_one_is_given():
    cases = bench_run.build_cases(["sd", "bild", "ar"], Settings(), None, [8], [0.1])
    assert [c.label for c in cases] == ["sd γ=4", "bild γ=10", "ar"]
    assert [c.label for c in bench_run.build_cases(["bild"], Settings(), [3, 5], [8], [0.1])] == [
        "bild γ=3",
        "bild γ=5",
    ]


class FakeClock:
    """``perf_counter`` for run_bench alone: each measured run of case k takes ``costs[k]`` seconds."""

    def __init__(self, costs):
        self.costs, self.now = costs, 0.0

    def perf_counter(self):
        return self.now


def test_a_case_stops_once_its_budget_is_spent_and_the_others_go_on(tiny_pair, monkeypatch):
    # ar's runs "take" 5 s and sd's 1 s, with a 3 s budget: ar stops after one prompt, sd after three
    clock = FakeClock([5.0, 1.0])
    real_guarded = bench_run.guarded

    def timed(pair, case, result, running, k, *args):
        out = real_guarded(pair, case, result, running, k, *args)
        clock.now += clock.costs[k]
        return out

    monkeypatch.setattr(bench_run, "time", clock)
    monkeypatch.setattr(bench_run, "guarded", timed)
    res = _bench(tiny_pair, ["ar", "sd"], ["abc", "de", "fgh", "a b", "c d"], time_budget=3.0)
    assert [(r["method"], r["prompt_index"]) for r in res.records] == [("ar", 0), ("sd", 0), ("sd", 1), ("sd", 2)]
    assert res.budget_stopped == ["ar", "sd γ=2"]


def test_a_case_that_fails_in_its_warm_up_is_recorded_and_never_measured(tiny_pair, monkeypatch):
    real_decode, runs = bench_run.decode, []

    def decode_or_fail(pair, ids, settings):
        runs.append(settings.method)
        if settings.method == "sd":
            raise RuntimeError("the draft model is broken (test)")
        return real_decode(pair, ids, settings)

    monkeypatch.setattr(bench_run, "decode", decode_or_fail)
    res = _bench(tiny_pair, ["ar", "sd", "mtad"], ["abc"], warmup=2, seeds=[0, 1])
    assert res.failures == {"sd γ=2": "RuntimeError: the draft model is broken (test)"}
    assert runs == ["ar", "ar", "sd", "mtad", "mtad"] + ["ar", "mtad"] * 2  # two warm-ups each, then 2 seeds
    assert [r["method"] for r in res.records] == ["ar", "mtad", "ar", "mtad"]


def test_ctrl_c_keeps_the_runs_measured_so_far(tiny_pair, monkeypatch):
    real_decode, calls = bench_run.decode, []

    def decode_then_interrupt(pair, ids, settings):
        calls.append(settings.method)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_decode(pair, ids, settings)

    monkeypatch.setattr(bench_run, "decode", decode_then_interrupt)
    res = _bench(tiny_pair, ["ar", "sd"], ["abc", "de"])
    assert res.interrupted is True and not res.failures
    assert [(r["method"], r["prompt_index"]) for r in res.records] == [("ar", 0), ("sd", 0), ("ar", 1)]


def test_the_progress_bar_counts_every_run_on_stderr(tiny_pair, capsys):
    _bench(tiny_pair, ["ar", "sd"], ["abc", "de"], seeds=[0, 1], warmup=1, progress=True)
    err = capsys.readouterr().err
    assert "10/10" in err and ("run/s" in err or "s/run" in err)  # 2 cases x (1 warm-up + 2 x 2 runs), in runs
    assert "warm-up sd γ=2" in err and "prompt 1/2 seed 0" in err and "prompt 2/2 seed 1" in err
    assert "prompt 0/" not in err and "prompt 3/" not in err
    assert capsys.readouterr().out == ""
    _bench(tiny_pair, ["ar"], ["abc"], progress=False)
    assert capsys.readouterr() == ("", "")  # no bar at all


def test_run_bench_by_default_shows_progress_and_keeps_no_steps(tiny_pair, capsys):
    cases = bench_run.build_cases(["ar"], Settings(max_new_tokens=2), [2], [2], [0.1])
    res = bench_run.run_bench(tiny_pair, cases, [Prompt("q", "", "abc")], [tiny_pair.encode("abc")], [0], 1, 0)
    assert len(res.records) == 1 and res.steps == []
    assert "1/1" in capsys.readouterr().err


def test_a_row_pools_its_runs_acceptance_curve_and_the_table_prints_it():
    from mtad.bench.aggregate import aggregate
    from mtad.bench.report import render_table

    records = [
        _record("sd", 0, position_reached=[4, 2], position_kept=[2, 1]),
        _record("sd", 1, position_reached=[2, 1, 1], position_kept=[1, 1, 0]),
        _record("ar", 0),
    ]
    rows = {r["case"]: r for r in aggregate(records)}
    assert rows["sd"]["acceptance_by_position"] == [3 / 6, 2 / 3, 0.0]  # counts added, then divided
    assert rows["ar"]["acceptance_by_position"] == []
    for r in rows.values():
        r.update(error=None, budget_stopped=False)
    lines = render_table(list(rows.values())).splitlines()
    i = lines.index("acceptance by draft position (token i kept, given tokens 1..i-1 were):")
    assert lines[i + 1] == "  sd  0.50  0.67  0.00" and len(lines) == i + 2


def test_a_rows_target_call_pools_its_runs_calls_and_is_set_against_ars():
    """A row's target call: its runs' target-forward seconds after their first step over their target calls
    there (runs of different lengths weigh by their calls); against the one AR row's, what a verification costs
    over a one-token forward; none against AR where there are two AR rows. The table prints both under the
    curves."""
    from mtad.bench.aggregate import aggregate
    from mtad.bench.report import render_table

    def run(case: str, method: str, prompt: int, seconds: float, calls: int) -> dict:
        return _record(
            case, prompt, tokens=calls, method=method, later_target_seconds=seconds, later_target_calls=calls
        )

    records = [run("ar", "ar", 0, 0.10, 10), run("ar", "ar", 1, 0.30, 30)]  # 10 ms a call
    records += [run("sd", "sd", 0, 0.16, 10), run("sd", "sd", 1, 0.04, 1)]  # 0.20 s over 11 calls
    rows = {r["case"]: r for r in aggregate(records)}
    assert rows["ar"]["target_call_seconds"] == pytest.approx(0.01)
    assert rows["sd"]["target_call_seconds"] == pytest.approx(0.20 / 11)  # not the mean of 16 and 40 ms
    assert rows["sd"]["target_call_vs_ar"] == pytest.approx(0.20 / 11 / 0.01)
    assert rows["ar"]["target_call_vs_ar"] == pytest.approx(1.0)
    for r in rows.values():
        r.update(error=None, budget_stopped=False)
    lines = render_table(list(rows.values())).splitlines()
    i = lines.index("a target call, ms, and against AR's (a verification's cost over a one-token forward's):")
    assert lines[i + 1 : i + 3] == ["  ar  10.0", "  sd  18.2  1.82×"]
    twice = aggregate([*records, {**run("ar", "ar", 2, 0.1, 5), "case": "ar again"}])
    assert all(r["target_call_vs_ar"] is None for r in twice)
    no_call = Metrics.from_dict(_record("ar", 0, tokens=1, later_target_calls=0))
    assert pool([no_call]).target_call_seconds is None


def test_perplexity_against_sd_where_neither_text_loops():
    """The same difference over the runs where neither decoder's text loops: a decoder whose lower perplexity
    comes from its loops shows it there. Runs pair by prompt, seed and repeat; a loop of either leaves the
    pair out; the table prints the difference and how many runs it kept."""
    from mtad.bench.aggregate import aggregate
    from mtad.bench.report import render_table

    def run(case: str, prompt: int, seed: int, nll: float, repetition: float = 0.0) -> dict:
        return {**_record(case, prompt, nll, 4), "case": case, "seed": seed, "repeat": 0, "repetition": repetition}

    records = []
    for p in range(5):
        for seed in (0, 1):
            records.append(run("sd", p, seed, 4.0, repetition=0.5 if (p, seed) == (4, 1) else 0.02))
            loops = seed == 0  # MTAD loops in half its runs, and there its text is very likely
            records.append(run("mtad", p, seed, 0.4 if loops else 4.4, 0.4 if loops else 0.03))
    rows = {r["case"]: r for r in aggregate(records)}
    everything, clean = rows["mtad"]["perplexity_vs_sd"], rows["mtad"]["perplexity_vs_sd_without_loops"]
    assert everything["difference"] < 0 < clean["difference"]
    assert clean["difference"] == pytest.approx(math.exp(4.4 / 4) - math.exp(4.0 / 4))
    assert 0 < clean["low"] and (clean["pairs"], clean["of"], clean["prompts"]) == (4, 10, 4)  # (4, 1): SD loops
    assert rows["sd"]["perplexity_vs_sd_without_loops"] is None
    for r in rows.values():
        r.update(error=None, budget_stopped=False)
    table = render_table(list(rows.values()))
    assert (
        "the same over the runs where neither text loops (>= 15 % repeated 4-grams), and how many those are:" in table
    )
    assert f"  mtad  {clean['difference']:+.3f}  [{clean['low']:+.3f}, {clean['high']:+.3f}]  4 of 10" in table


def test_perplexity_against_sd_has_an_interval_from_resampling_prompts():
    """Each row's pooled perplexity minus SD's over the common prompts, with a 95 % interval from resampling
    the prompts: it excludes 0 when every prompt agrees on the sign, and spans 0 when one prompt outweighs
    the rest the other way; a prompt a row did not finish is left out; the table prints it."""
    from mtad.bench.aggregate import aggregate
    from mtad.bench.report import render_table

    def rows_of(mtad_nll: list[float]) -> dict:
        records = [_record("sd", i, 2.0, 2) for i in range(6)]
        records += [{**_record("mtad", i, nll, 2), "case": "mtad W=8"} for i, nll in enumerate(mtad_nll)]
        return {r["case"]: r for r in aggregate(records)}

    rows = rows_of([1.0, 1.2, 0.8, 1.0, 1.1, 0.9])  # every prompt below SD's
    gap = rows["mtad W=8"]["perplexity_vs_sd"]
    assert gap["reference"] == "sd" and gap["prompts"] == 6
    assert gap["difference"] == pytest.approx(math.exp(6.0 / 12) - math.exp(12.0 / 12))
    assert gap["low"] <= gap["difference"] <= gap["high"] < 0
    assert rows["sd"]["perplexity_vs_sd"] is None
    mixed = rows_of([0.5, 0.5, 0.5, 0.5, 0.5, 12.0])["mtad W=8"]["perplexity_vs_sd"]
    assert mixed["difference"] > 0 and mixed["low"] < 0 < mixed["high"]
    assert rows_of([1.0] * 5)["mtad W=8"]["perplexity_vs_sd"]["prompts"] == 5  # prompt 5 unfinished
    for r in rows.values():
        r.update(error=None, budget_stopped=False)
    table = render_table(list(rows.values()))
    assert "perplexity minus SD's over the common prompts (95 % interval, prompts resampled):" in table
    assert f"  mtad W=8  {gap['difference']:+.3f}  [{gap['low']:+.3f}, {gap['high']:+.3f}]" in table


def test_out_into_an_earlier_bench_s_folder_leaves_no_stale_figure(tiny_dirs, prompts_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("tau_sweep.html", "tau_sweep.png", "figure1_mtjd.html", "runs.csv", "notes.md"):
        (out / name).write_text("from an earlier bench")
    argv = [*pair_args(tiny_dirs), "--prompts", prompts_file, "--max-new-tokens", "4", "--methods", "sd"]
    argv += ["--gamma", "2,3", "--warmup", "0", "--no-progress", "--plotlyjs", "cdn", "--out", str(out)]
    assert bench.main(argv) == 0
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert "tau_sweep.html" not in names and "tau_sweep.png" not in names and "figure1_mtjd.html" not in names
    assert "gamma_sweep.html" in names and (out / "notes.md").read_text() == "from an earlier bench"
    assert (out / "runs.csv").read_text() != "from an earlier bench"


def test_each_row_s_speed_equation_is_its_measured_speed_over_ar_s(sweep_run):
    """The bench's equation per row, from the pooled runs: its product is the row's tokens/s over the AR row's
    within 5 % (it is an identity over the same Steps), and the table writes it out."""
    rows = sweep_run["data"]["aggregates"]
    (ar,) = [r for r in rows if r["method"] == "ar"]
    table = (sweep_run["out"] / "table.txt").read_text()
    for r in rows:
        eq = r["speed_equation"]
        assert eq["product"] == pytest.approx(r["tokens_per_second"] / ar["tokens_per_second"], rel=0.05)
        assert eq["tokens_per_call"] == pytest.approx(r["block_efficiency"])
        assert eq["verification"] == pytest.approx(
            r["target_seconds"] / r["target_calls"] * ar["new_tokens"] / ar["seconds"]
        )
        assert f"  {eq['text']}" in table
    assert "× AR = tokens a target call ÷ (verification + drafting + rest)" in table


def test_the_environment_and_table_put_ar_against_the_weight_read_bound(sweep_run, tiny_pair):
    from mtad.models.bandwidth import weight_bytes

    bound = sweep_run["data"]["environment"]["weight_read_bound"]
    (ar,) = [r for r in sweep_run["data"]["aggregates"] if r["method"] == "ar"]
    assert bound["target_weight_bytes"] == weight_bytes(tiny_pair.target) > 0
    assert bound["read_bytes_per_second"] > 1e8
    assert bound["seconds_per_token"] == pytest.approx(bound["target_weight_bytes"] / bound["read_bytes_per_second"])
    assert bound["ar_times_bound"] == pytest.approx(ar["seconds"] / ar["new_tokens"] / bound["seconds_per_token"])
    assert bound["text"].startswith(f"AR at {bound['ar_times_bound']:.1f}× the weight-read bound")
    assert bound["text"] in (sweep_run["out"] / "table.txt").read_text()
