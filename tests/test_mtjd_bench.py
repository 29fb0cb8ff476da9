"""MTJD in the CLI, the bench's K sweep (the paper's Figure 1: table and figure) and the MTAD-vs-MTJD command."""

from __future__ import annotations

import itertools
import json

import pytest
from test_bench import pair_args, prompts_file  # noqa: F401  (a fixture)

import mtad.bench.cli as bench
import mtad.bench.plots as bench_plots
from mtad import mtjd_agreement
from mtad.bench.plots import figure1, save_sweep_figures
from mtad.bench.report import figure1_table, render_table
from mtad.cli import main as cli_main


def test_the_cli_decodes_with_mtjd_and_refuses_a_bad_k(tiny_dirs, capsys) -> None:  # noqa: ANN001
    argv = ["generate", "--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--prompt", "abc de", "--method", "mtjd"]
    assert cli_main([*argv, "--gamma", "3", "--beams", "2", "--max-new-tokens", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["method"] == "mtjd" and len(out["new_ids"]) == 7
    assert [len(s["appended_ids"]) for s in out["steps"]] == [3, 3, 1]  # the last block: one token, AR's own
    assert [s["target_calls"] for s in out["steps"]] == [3, 3, 1] and out["metrics"]["target_calls"] == 7
    assert all(len(s["beams"]) == 2 for s in out["steps"][:2]) and out["steps"][2]["beams"] is None
    assert out["metrics"]["acceptance"] is None and out["metrics"]["block_efficiency"] == 1.0
    assert cli_main([*argv, "--gamma", "0"]) == 2
    assert "K (MTJD block length, gamma) must be an integer from 1 to 32" in capsys.readouterr().err


@pytest.fixture(scope="module")
def k_sweep(tiny_dirs, prompts_file, tmp_path_factory):  # noqa: ANN001, ANN201, F811
    out = tmp_path_factory.mktemp("k-sweep")
    argv = [*pair_args(tiny_dirs), "--prompts", prompts_file, "--max-new-tokens", "12", "--methods", "ar,mtjd",
            "--gamma", "1,2,3", "--beams", "2", "--seeds", "0,1", "--warmup", "0", "--no-progress",
            "--plotlyjs", "cdn", "--out", str(out)]  # fmt: skip
    code = bench.main(argv)
    return code, out, json.loads((out / "bench.json").read_text())


def test_the_k_sweep_writes_figure1_as_a_table_and_a_figure(k_sweep) -> None:  # noqa: ANN001
    code, out, data = k_sweep
    assert code == 0
    rows = {r["case"]: r for r in data["aggregates"]}
    assert list(rows) == ["ar", "mtjd K=1 W=2", "mtjd K=2 W=2", "mtjd K=3 W=2"]
    # K = 1 is AR draw for draw: the same texts, so the same pooled perplexity and repetition
    assert rows["mtjd K=1 W=2"]["perplexity"] == rows["ar"]["perplexity"]
    assert rows["mtjd K=1 W=2"]["repetition"] == rows["ar"]["repetition"]
    assert all(rows[c]["block_efficiency"] <= 1 for c in rows)
    table = (out / "table.txt").read_text()
    assert "MTJD against K (the paper's Figure 1)" in table and "mtjd: γ is its block length K" in table
    lines = table.split("MTJD against K")[1].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("K "))
    body = [line.split() for line in itertools.takewhile(str.strip, lines[header + 2 :])]  # the table, to its end
    assert [b[0] for b in body] == ["AR", "1", "2", "3"]
    assert body[2][3] == f"{rows['mtjd K=2 W=2']['perplexity']:.2f}"
    html = (out / "figure1_mtjd.html").read_text()
    assert "the paper's Figure 1" in html and (out / "gamma_sweep.html").exists()


ROWS = [
    {"method": "ar", "gamma": None, "beams": None, "draft_mode": None, "perplexity": 3.0, "repetition": 0.02,
     "tokens_per_second": 50.0, "block_efficiency": 1.0, "runs": 4, "error": None},
    *({"method": "mtjd", "gamma": k, "beams": 4, "draft_mode": "beam", "perplexity": 3.0 - 0.4 * k,
       "repetition": 0.05 * k, "tokens_per_second": 30.0, "block_efficiency": 1.0, "runs": 4, "error": None,
       "perplexity_std": 0.1, "repetition_std": None} for k in (1, 2, 3)),
    {"method": "mtjd", "gamma": 4, "beams": 4, "draft_mode": "beam-sample", "perplexity": 2.0, "repetition": 0.1,
     "tokens_per_second": 30.0, "block_efficiency": 1.0, "runs": 4, "error": None},
]  # fmt: skip


def test_figure1_draws_perplexity_left_and_repetition_right_against_k() -> None:
    fig = figure1(ROWS, subtitle="tiny")
    assert [t.name for t in fig.data] == ["MTJD W=4 beam: perplexity", "MTJD W=4 beam: repeated 4-grams"]
    ppl, rep = fig.data
    assert list(ppl.x) == [1, 2, 3] and list(ppl.y) == pytest.approx([2.6, 2.2, 1.8]) and ppl.yaxis == "y"
    assert list(rep.y) == pytest.approx([0.05, 0.1, 0.15]) and rep.yaxis == "y2" and rep.line.dash == "dash"
    assert ppl.line.color == rep.line.color and ppl.line.dash == "solid"  # one colour per beam width and search
    assert tuple(fig.layout.yaxis2.range) == (0, 1)  # repetition is a share
    assert list(ppl.error_y.array) == [0.1] * 3 and rep.error_y.array is None
    assert [(s.y0, s.yref) for s in fig.layout.shapes] == [(3.0, "y"), (0.02, "y2")]
    assert fig.layout.meta == {"figure": "figure1_mtjd"}
    assert figure1(ROWS[:2] + ROWS[4:]) is None  # one K per line: no sweep


def test_figure1_table_and_files(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    table = figure1_table(ROWS)
    body = [line.split() for line in table.splitlines()[4:]]
    assert [b[:3] for b in body] == [["AR", "-", "-"], ["1", "4", "beam"], ["2", "4", "beam"], ["3", "4", "beam"]]
    assert body[1][3:] == ["2.60", "0.050", "30.0", "1.00", "4"]
    assert figure1_table(ROWS[:1]) is None and "Figure 1" not in render_table(ROWS[:1] and [])
    monkeypatch.setattr(bench_plots, "kaleido_available", lambda: False)
    paths = save_sweep_figures(ROWS, tmp_path, plotlyjs="cdn")
    assert [p.name for p in paths] == ["gamma_sweep.html", "figure1_mtjd.html"]


def test_the_agreement_command_compares_mtad_with_mtjd(tiny_dirs, prompts_file, tmp_path, capsys) -> None:  # noqa: ANN001, F811
    argv = [*pair_args(tiny_dirs), "--prompts", prompts_file, "--max-new-tokens", "10", "--gamma", "3",
            "--beams", "2", "--seeds", "0,1", "--out", str(tmp_path)]  # fmt: skip
    assert mtjd_agreement.main(argv) == 0
    printed = capsys.readouterr().out
    assert "accepted prefix = MTJD's first η tokens" in printed and printed.splitlines()[2].startswith("ar ")
    doc = json.loads((tmp_path / "agreement.json").read_text())
    assert len(doc["runs"]) == 4 and doc["settings"]["gamma"] == 3 and doc["settings"]["beams"] == 2
    total = doc["agreement"]
    assert total["iterations"] == sum(r["agreement"]["iterations"] for r in doc["runs"]) > 0
    assert all(set(r) == {"prompt_id", "seed", "ar", "mtad", "mtjd", "agreement"} for r in doc["runs"])
    assert doc["environment"]["command"].startswith("python -m mtad.mtjd_agreement --draft")
    assert (tmp_path / "agreement.txt").read_text().count("MTAD iterations compared") == 1
    assert mtjd_agreement.main([*argv[:-2], "--beams", "0"]) == 2
