"""The bench's sweep figures, from hand-made rows: which lines, which values, which axis, which files."""

from __future__ import annotations

import mtad.bench.plots as bench_plots
from mtad.bench.plots import save_sweep_figures, sweep_figure, sweep_series, swept_values


def row(method, gamma=None, beams=None, tau=None, speed=10.0, ppl=3.0, speed_std=None, ppl_std=None):
    return {"method": method, "gamma": gamma, "beams": beams, "tau": tau, "tokens_per_second": speed,
            "perplexity": ppl, "tokens_per_second_std": speed_std, "perplexity_std": ppl_std}  # fmt: skip


ROWS = [
    row("ar", speed=20.0, ppl=2.5),
    row("sd", gamma=4, speed=22.0, ppl=2.6),
    row("mtad", 4, 8, 0.5, speed=30.0, ppl=2.9, speed_std=1.5, ppl_std=None),
    row("mtad", 4, 8, 0.1, speed=28.0, ppl=2.7, speed_std=1.0, ppl_std=0.2),
    row("mtad", 4, 4, 0.1, speed=26.0, ppl=2.8),
    row("mtad", 4, 4, 0.5, speed=27.0, ppl=3.0),
]


def test_swept_values_and_one_series_per_method_and_other_swept_setting():
    assert swept_values(ROWS, "tau") == [0.1, 0.5] and swept_values(ROWS, "gamma") == [4]
    series = sweep_series(ROWS, "tau")
    assert list(series) == ["mtad beams=8", "mtad beams=4"]  # gamma is not swept, so it does not split lines
    assert [r["tau"] for r in series["mtad beams=8"]] == [0.1, 0.5]  # sorted by the swept setting
    assert list(sweep_series(ROWS, "gamma")) == ["sd", "mtad beams=8 tau=0.5", "mtad beams=8 tau=0.1",
                                                 "mtad beams=4 tau=0.1", "mtad beams=4 tau=0.5"]  # fmt: skip


def test_a_sweep_figure_draws_speed_left_and_perplexity_right_with_ar_for_reference():
    fig = sweep_figure(ROWS, "tau", subtitle="smollm2 · 2 prompts")
    names = [t.name for t in fig.data]
    assert names == [
        "mtad beams=8: speed",
        "mtad beams=8: perplexity",
        "mtad beams=4: speed",
        "mtad beams=4: perplexity",
    ]
    speed, ppl = fig.data[0], fig.data[1]
    assert list(speed.x) == [0.1, 0.5] and list(speed.y) == [28.0, 30.0] and speed.yaxis == "y"
    assert list(ppl.y) == [2.7, 2.9] and ppl.yaxis == "y2" and ppl.line.dash == "dash"
    assert speed.mode == ppl.mode == "lines+markers"
    # error bars: the per-run standard deviation, 0 where a row has none, none at all where no row has one
    assert speed.error_y.type == "data" and list(speed.error_y.array) == [1.0, 1.5] and speed.error_y.visible
    assert list(ppl.error_y.array) == [0.2, 0]
    assert fig.data[2].error_y.array is None and fig.data[3].error_y.array is None
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert [(s.y0, s.yref, s.line.dash) for s in lines] == [(20.0, "y", "dot"), (2.5, "y2", "dot")]
    assert [a.text for a in fig.layout.annotations] == ["AR speed", "AR perplexity"]
    assert (
        fig.layout.title.text
        == "Effect of the acceptance threshold τ on speed and perplexity<br><sub>smollm2 · 2 prompts</sub>"
    )
    assert fig.layout.xaxis.title.text == "acceptance threshold τ"
    assert fig.layout.yaxis.title.text == "speed (tokens/s)" and fig.layout.yaxis2.title.text == "perplexity"
    assert fig.layout.meta == {"figure": "tau_sweep"}
    assert fig.layout.legend.orientation == "h"


def test_a_sweep_without_ar_or_its_perplexity_draws_only_what_there_is():
    no_ar = [r for r in ROWS if r["method"] != "ar"]
    fig = sweep_figure(no_ar, "beams")
    assert not fig.layout.shapes and fig.layout.title.text == "Effect of the number of beams W on speed and perplexity"
    assert fig.layout.meta == {"figure": "beam_sweep"}
    assert [t.name for t in fig.data][:2] == ["mtad tau=0.5: speed", "mtad tau=0.5: perplexity"]
    assert list(fig.data[0].x) == [4, 8] and list(fig.data[0].y) == [27.0, 30.0]
    ar_no_ppl = [row("ar", speed=20.0, ppl=None), row("ar", speed=99.0), *no_ar]
    fig = sweep_figure(ar_no_ppl, "tau")
    assert [s.y0 for s in fig.layout.shapes] == [20.0]  # the first AR row only, and no perplexity line
    assert sweep_figure(ROWS, "gamma") is None and sweep_figure(ROWS[:3], "tau") is None  # one value: no sweep


def test_save_writes_one_html_per_swept_setting(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_plots, "kaleido_available", lambda: False)
    paths = save_sweep_figures(ROWS, tmp_path, subtitle="two prompts", plotlyjs="cdn")
    assert paths == [tmp_path / "tau_sweep.html", tmp_path / "beam_sweep.html"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beam_sweep.html", "tau_sweep.html"]
    cdn = (tmp_path / "tau_sweep.html").read_text()
    assert 'src="https://cdn.plot.ly' in cdn and "two prompts" in cdn and "acceptance threshold" in cdn
    (tmp_path / "inline").mkdir()
    inline = save_sweep_figures(ROWS, tmp_path / "inline", plotlyjs="inline")[0].read_text()
    assert 'src="https://cdn.plot.ly' not in inline and len(inline) > 1_000_000  # plotly.js itself, for offline viewing


def test_save_adds_a_png_where_kaleido_can_write_one_and_goes_on_where_it_cannot(tmp_path, monkeypatch):
    written = []

    def write_image(self, path, width, height, scale):
        written.append((path.name, width, height, scale))
        if "beam" in path.name:
            raise RuntimeError("kaleido found no browser")
        path.write_bytes(b"png")

    monkeypatch.setattr(bench_plots, "kaleido_available", lambda: True)
    monkeypatch.setattr(bench_plots.go.Figure, "write_image", write_image)
    paths = save_sweep_figures(ROWS, tmp_path, plotlyjs="cdn")
    assert [p.name for p in paths] == ["tau_sweep.html", "tau_sweep.png", "beam_sweep.html"]
    assert written == [("tau_sweep.png", 900, 520, 2), ("beam_sweep.png", 900, 520, 2)]


def test_kaleido_available_asks_the_import_system(monkeypatch):
    monkeypatch.setattr(bench_plots.importlib.util, "find_spec", lambda name: object() if name == "kaleido" else None)
    assert bench_plots.kaleido_available() is True
    monkeypatch.setattr(bench_plots.importlib.util, "find_spec", lambda name: None)
    assert bench_plots.kaleido_available() is False


def test_save_by_default_embeds_plotly_and_names_no_subtitle(tmp_path):
    (path,) = save_sweep_figures([r for r in ROWS if r["beams"] in (None, 8)], tmp_path)  # only τ is swept
    html = path.read_text()
    assert path.name == "tau_sweep.html" and 'src="https://cdn.plot.ly' not in html
    assert 'on speed and perplexity"' in html  # the title ends there: no subtitle


def test_save_skips_a_setting_that_is_not_swept_and_goes_on_to_the_next(tmp_path):
    rows = [row("mtad", 4, 8, 0.1), row("mtad", 4, 4, 0.1), row("mtad", 2, 8, 0.1)]  # W and γ swept, τ not
    paths = save_sweep_figures(rows, tmp_path, plotlyjs="cdn")
    assert [p.name for p in paths if p.suffix == ".html"] == ["beam_sweep.html", "gamma_sweep.html"]
