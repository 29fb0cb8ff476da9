"""Choosing γ and W per machine (``mtad.tuning``): the prediction's arithmetic, the acceptance table's
figures against the decoders', the timing and its disk cache, and the CLI, bench and generate flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mtad.bench.cli as bench
import mtad.cli as cli
import mtad.tuning.timing as timing
from mtad.decoding import decode
from mtad.metrics import summarize
from mtad.prompts import Prompt, read_prompts
from mtad.settings import Settings
from mtad.tuning import AcceptanceTable, Candidate, candidates, fastest, known_fastest, predict, warp_of
from mtad.tuning.choose import Tuning
from mtad.tuning.cli import main as tuning_main
from mtad.tuning.table import GAMMAS, Row, measure, shipped_table, table_path

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["abc de fgh", "hag bed cab", "a bad fad"]


def row(method: str, gamma: int, beams: int | None, be: float) -> Row:
    return Row(method, gamma, beams, be, new_tokens=0, target_calls=0)


def test_prediction_is_block_efficiency_over_iteration_seconds_against_ar():
    rows = [row("sd", 1, None, 1.5), row("mtad", 1, 2, 1.7), row("mtad", 4, 8, 2.6), row("sd", 4, None, 1.8)]
    seconds = {
        Candidate("sd", 1): 0.018,
        Candidate("mtad", 1, 2): 0.019,
        Candidate("mtad", 4, 8): 0.045,
        Candidate("sd", 4): 0.040,
    }
    preds = predict(rows, seconds, ar_seconds=0.016)
    assert [p.candidate.label for p in preds] == ["mtad γ=1 W=2", "sd γ=1", "mtad γ=4 W=8", "sd γ=4"]
    top = preds[0]
    assert top.tokens_per_second == pytest.approx(1.7 / 0.019)
    assert top.speedup == pytest.approx(1.7 / 0.019 * 0.016)
    tuning = Tuning(preds, 0.016, from_disk=False)
    assert tuning.best("sd").candidate == Candidate("sd", 1)
    chosen = tuning.settings(Settings(tau=0.3), "mtad")
    assert (chosen.method, chosen.gamma, chosen.beams, chosen.tau) == ("mtad", 1, 2, 0.3)
    assert predict(rows, {Candidate("sd", 4): 0.04}, 0.016)[0].candidate == Candidate("sd", 4)  # untimed: left out


def test_the_warp_is_what_a_block_efficiency_depends_on():
    assert warp_of(Settings(greedy=True)) == warp_of(Settings(greedy=True, top_p=0.5))  # greedy needs no warp
    assert warp_of(Settings(temperature=0)) == warp_of(Settings(greedy=True))
    assert warp_of(Settings()) != warp_of(Settings(top_k=10))
    assert warp_of(Settings()) != warp_of(Settings(tau=0.2))
    assert warp_of(Settings()) != warp_of(Settings(draft_mode="beam-sample"))
    assert len(candidates()) == len(GAMMAS) * 5  # SD per γ, MTAD per γ and four beam counts


@pytest.fixture(scope="module")
def tiny_table(tiny_pair) -> AcceptanceTable:
    prompts = [Prompt(f"p{i}", "", t) for i, t in enumerate(TEXTS)]
    encoded = [tiny_pair.encode(t, raw=True) for t in TEXTS]
    warps = [Settings(max_new_tokens=12), Settings(max_new_tokens=12, tau=1.0, greedy=True)]
    return measure(tiny_pair, prompts, encoded, warps, seeds=[0, 1], progress=False, prompts_name="tiny")


def test_a_table_holds_each_candidates_tokens_per_target_call(tiny_pair, tiny_table):
    sampled = tiny_table.rows(Settings())
    assert [r.candidate for r in sampled] == candidates()
    for r in sampled:
        assert 1 <= r.block_efficiency <= r.gamma + 1
    # the figure is the decoders' own: tokens over target calls of the same runs
    sd2 = next(r for r in sampled if r.candidate == Candidate("sd", 2))
    runs = [
        summarize(
            list(
                decode(
                    tiny_pair, tiny_pair.encode(t, raw=True), Settings(method="sd", gamma=2, max_new_tokens=12, seed=s)
                )
            )
        )
        for t in TEXTS
        for s in (0, 1)
    ]
    tokens, calls = sum(m.new_tokens for m in runs), sum(m.target_calls for m in runs)
    assert (sd2.new_tokens, sd2.target_calls) == (tokens, calls)
    assert sd2.block_efficiency == round(tokens / calls, 4)


def test_tables_of_two_seeds_pool_into_the_table_of_both(tiny_pair, tiny_table):
    prompts = [Prompt(f"p{i}", "", t) for i, t in enumerate(TEXTS)]
    encoded = [tiny_pair.encode(t, raw=True) for t in TEXTS]
    warps = [Settings(max_new_tokens=12), Settings(max_new_tokens=12, tau=1.0, greedy=True)]
    one, two = (measure(tiny_pair, prompts, encoded, warps, [s], progress=False, prompts_name="tiny") for s in (0, 1))
    both = one.merged(two)
    assert both.seeds == [0, 1] and both.prompt_ids == ["p0", "p1", "p2"][: len(TEXTS)]
    assert both.warps == tiny_table.warps  # the same counts, so the same block efficiencies, as one run of both
    with pytest.raises(ValueError, match=r"both tables hold seed\(s\) \[0\]"):
        one.merged(one)
    fewer = measure(tiny_pair, prompts[:1], encoded[:1], warps, [1], progress=False, prompts_name="tiny")
    with pytest.raises(ValueError, match="different prompt_ids"):
        one.merged(fewer)
    one_warp = measure(tiny_pair, prompts, encoded, warps[:1], [1], progress=False, prompts_name="tiny")
    with pytest.raises(ValueError, match="no figures for greedy, τ 1"):
        one.merged(one_warp)


def test_tau_one_accepts_nothing_so_every_mtad_row_keeps_one_token_a_call(tiny_table):
    greedy = tiny_table.rows(Settings(greedy=True, tau=1.0))
    assert {r.block_efficiency for r in greedy if r.method == "mtad"} == {1.0}
    assert tiny_table.rows(Settings(greedy=True)) is None  # τ 0.1 was not measured greedy


def test_fastest_times_here_and_keeps_the_seconds_on_disk(tiny_pair, tiny_table, tmp_path, monkeypatch):
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path))
    timed = []
    real = timing.time_iterations
    monkeypatch.setattr(
        timing, "time_iterations", lambda p, runs, *a, **k: timed.append(len(runs)) or real(p, runs, *a, **k)
    )
    ids = tiny_pair.encode("abc de", raw=True)
    first = fastest(tiny_pair, Settings(), ids, table=tiny_table)
    assert not first.from_disk and timed == [len(candidates()) + 1]  # every candidate and AR
    assert first.ar_seconds > 0 and all(p.iteration_seconds > 0 for p in first.predictions)
    speeds = [p.tokens_per_second for p in first.predictions]
    assert speeds == sorted(speeds, reverse=True)
    again = fastest(tiny_pair, Settings(), ids, table=tiny_table)
    assert again.from_disk and timed == [21] and again.predictions == first.predictions
    only_sd = fastest(tiny_pair, Settings(greedy=True, tau=1.0), ids, table=tiny_table, methods=("sd",))
    assert timed == [21, 5]  # another warp's runs are timed apart: AR and four SD rows
    assert {p.candidate.method for p in only_sd.predictions} == {"sd"}
    fastest(tiny_pair, Settings(), ids, table=tiny_table, refresh=True)
    assert timed == [21, 5, 21]
    files = list((tmp_path / "tuning").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["threads"] >= 1


def test_what_was_timed_before_is_known_without_timing_and_each_timing_is_announced(
    tiny_pair, tiny_table, tmp_path, monkeypatch
):
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path))
    assert known_fastest(tiny_pair, Settings(), table=tiny_table) is None  # nothing timed here yet
    told = []
    ids = tiny_pair.encode("abc de", raw=True)
    timed = fastest(tiny_pair, Settings(), ids, table=tiny_table, progress=lambda *a: told.append(a))
    runs = len(candidates()) + 1
    assert [(done, total) for done, total, _ in told] == [(i, 4 * runs) for i in range(4 * runs)]  # 3 rounds + 1
    assert told[0][2].method == "ar" and {s.method for _, _, s in told} == {"ar", "sd", "mtad"}
    known = known_fastest(tiny_pair, Settings(), table=tiny_table)
    assert known is not None and known.from_disk and known.predictions == timed.predictions
    assert known_fastest(tiny_pair, Settings(top_k=10), table=tiny_table) is None  # a warp the table lacks
    assert known_fastest(tiny_pair, Settings(greedy=True, tau=1.0), table=tiny_table) is None  # never timed


def test_a_warp_the_table_lacks_is_refused_by_name(tiny_pair, tiny_table):
    with pytest.raises(ValueError, match=r"no figures for T 1, top-k 10, top-p 0.9, τ 0.1, beam; it has T 1"):
        fastest(tiny_pair, Settings(top_k=10), [1, 2], table=tiny_table)
    with pytest.raises(ValueError, match="no acceptance table for the pair 'custom'"):
        fastest(tiny_pair, Settings(), [1, 2])
    with pytest.raises(ValueError, match="cannot read the acceptance table"):
        AcceptanceTable.load(Path("/nonexistent/table.json"))


def test_bench_and_generate_run_the_tuned_settings(tiny_dirs, tiny_table, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path / "cache"))
    table = tmp_path / "table.json"
    tiny_table.save(table)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc de fgh"}) + "\n")
    pair = ["--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--device", "cpu", "--engine", "eager"]
    out = tmp_path / "out"
    argv = [*pair, "--prompts", str(prompts), "--methods", "ar,sd,mtad", "--gamma", "1,4", "--max-new-tokens", "8"]
    code = bench.main(
        [*argv, "--tuned", "--acceptance", str(table), "--no-progress", "--warmup", "0", "--out", str(out)]
    )
    assert code == 0
    err = capsys.readouterr().err
    tuned = json.loads((out / "bench.json").read_text())["environment"]["tuned"]
    labels = [c["case"] for c in json.loads((out / "bench.json").read_text())["config"]["cases"]]
    assert labels[0] == "ar" and len(labels) == 3  # the γ sweep collapsed to one choice a method
    assert set(tuned) == set(labels[1:]) and all(f"tuned: {label}" in err for label in labels[1:])
    assert all(v["predicted_speedup"] > 0 for v in tuned.values())
    assert (
        cli.main(
            [
                "generate",
                *pair,
                "--prompt",
                "abc",
                "--method",
                "mtad",
                "--tuned",
                "--acceptance",
                str(table),
                "--max-new-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    steps = json.loads(captured.out)["steps"]
    label = captured.err.split("tuned: ")[1].split(" (")[0]
    gamma = int(label.split("γ=")[1].split()[0])
    # the first draft has the chosen length (later ones shrink as the 8 new tokens run out)
    assert any(c.startswith(label) for c in labels) and len(steps[0]["draft_ids"]) == gamma
    assert cli.main(["generate", *pair, "--prompt", "abc", "--method", "ar", "--tuned"]) == 2
    assert "--tuned chooses the draft settings of sd and mtad, not of ar" in capsys.readouterr().err


def test_the_cli_refuses_the_benchmarks_prompts_and_an_unknown_warp(tmp_path, capsys):
    code = tuning_main(["measure", "--pair", "embedded", "--prompts", str(ROOT / "assets/prompts/code.jsonl")])
    assert code == 2 and "are the benchmark's" in capsys.readouterr().err


def test_the_shipped_smollm2_table_covers_the_defaults_and_was_not_measured_on_the_benchmark():
    table = shipped_table("smollm2")
    assert table is not None
    for warp in (Settings(), Settings(greedy=True)):
        rows = table.rows(warp)
        assert rows is not None and [r.candidate for r in rows] == candidates()
        assert all(1 <= r.block_efficiency <= r.gamma + 1 and r.target_calls > 100 for r in rows)
    bench = {p.text for p in read_prompts(ROOT / "assets/prompts/chat.jsonl")}
    tuned_on = read_prompts(ROOT / table.prompts)
    assert tuned_on and not bench & {p.text for p in tuned_on}
    assert table.prompt_ids and table.prompt_ids == [p.id for p in tuned_on][: len(table.prompt_ids)]
    assert table.max_new_tokens == Settings().max_new_tokens


def test_the_cli_measures_a_table_and_ranks_the_candidates_with_it(tiny_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    pair = ["--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--device", "cpu", "--engine", "eager"]
    table = tmp_path / "t.json"
    measure_argv = ["measure", *pair, "--prompts", str(prompts), "--max-new-tokens", "8", "--no-progress"]
    assert tuning_main(measure_argv) == 2  # a pair given by paths names no table: where to write it?
    assert "say where to write it with --out" in capsys.readouterr().err
    assert tuning_main([*measure_argv, "--greedy-too", "--out", str(table)]) == 0
    warps = AcceptanceTable.load(table).warps
    assert [e["warp"]["greedy"] for e in warps] == [False, True] and len(warps[0]["rows"]) == len(candidates())
    assert tuning_main([*measure_argv, "--greedy-too", "--out", str(table), "--seeds", "1", "--extend"]) == 0
    pooled = AcceptanceTable.load(table)
    assert pooled.seeds == [0, 1] and pooled.warps[0]["rows"][0]["new_tokens"] > warps[0]["rows"][0]["new_tokens"]
    assert tuning_main([*measure_argv, "--greedy-too", "--out", str(table), "--seeds", "1", "--extend"]) == 2
    assert "already holds seed(s) [1]" in capsys.readouterr().err
    capsys.readouterr()
    assert tuning_main(["show", *pair, "--acceptance", str(table)]) == 0
    out = capsys.readouterr().out
    assert "torch threads, float32, eager engine (timed now)" in out
    assert all(f"\n{c.label} " in out for c in candidates())
    assert "fastest mtad: mtad γ=" in out and "fastest sd: sd γ=" in out
    assert tuning_main(["show", *pair, "--acceptance", str(table), "--top-k", "5"]) == 2
    assert "has no figures for T 1, top-k 5" in capsys.readouterr().err


def test_a_table_written_before_the_renaming_still_loads(tmp_path):
    """Tables written before 0.2.0 named each sampling warp a "law"; they load with the same rows."""
    shipped = json.loads(table_path("smollm2").read_text())
    old = {("laws" if k == "warps" else k): v for k, v in shipped.items()}
    old["laws"] = [{"law": e["warp"], "rows": e["rows"]} for e in shipped["warps"]]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert AcceptanceTable.load(path) == shipped_table("smollm2") and shipped_table("smollm2").warps


def test_extend_refuses_a_mismatched_table_before_measuring(tiny_dirs, tmp_path, monkeypatch, capsys):
    import mtad.tuning.table as tables

    monkeypatch.setenv("MTAD_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    pair = ["--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--device", "cpu", "--engine", "eager"]
    table = tmp_path / "t.json"
    argv = ["measure", *pair, "--prompts", str(prompts), "--max-new-tokens", "8", "--no-progress", "--out", str(table)]
    assert tuning_main([*argv, "--greedy-too"]) == 0
    measured = []
    monkeypatch.setattr(tables, "measure", lambda *a, **k: measured.append(a) or pytest.fail("measured"))
    for other in (["--seeds", "1"], ["--seeds", "1", "--greedy-too", "--max-new-tokens", "9"]):
        assert tuning_main([*argv, "--extend", *other]) == 2  # one warp of two; another budget
    err = capsys.readouterr().err
    assert "the other table has no figures for greedy" in err and "different max_new_tokens: 8, 9" in err
    assert not measured


def test_a_table_that_fails_to_save_leaves_the_old_one_whole(tmp_path, monkeypatch):
    import mtad.tuning.table as tables

    path = tmp_path / "acceptance.json"
    old = AcceptanceTable("tiny", "p.jsonl", 8, [0], "float32", "2026-12-01", None)
    old.save(path)
    before = path.read_text()

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tables.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        AcceptanceTable("tiny", "p.jsonl", 8, [0, 1], "float32", "2026-12-02", None).save(path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["acceptance.json"]
