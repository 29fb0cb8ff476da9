"""The method spec (issue 23): a decoder added from one new file plus one ``register`` call reaches the CLI,
the bench and the page, its settings checked against its own spec; and the built-in registry is the one
list every consumer reads (no method named anywhere else)."""

from __future__ import annotations

import importlib
import json
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

import mtad.bench.cli as bench
from mtad import cli
from mtad.decoding import DECODERS, decode, encode_prompt, spec
from mtad.decoding.spec import PANELS, MethodSpec, check, register, registry, settings_for, unregister, uses_draft
from mtad.settings import PARAMS, Settings
from mtad.ui import outputs, pickers, state
from mtad.ui import run as runs
from mtad.ui.figures import COLOURS
from mtad.ui.record import LABELS

ROOT = Path(__file__).resolve().parent.parent
TOY = "toy-sd"
TOY_FILE = '''
"""A toy decoder: speculative decoding allowed at most 3 draft tokens (its own range for gamma)."""

from mtad.decoding.iteration import Iteration, iid_draft, verify_row
from mtad.decoding.spec import MethodSpec
from mtad.decoding.speculative import sd_accept
from mtad.settings import PARAMS

TOY_SD = Iteration(propose=iid_draft, verify=verify_row, accept=sd_accept)


def toy_step(st):
    """One SD iteration under the toy's name: SD's drafter, verifier and rule in the shared iteration."""
    return TOY_SD(st)


SPEC = MethodSpec(
    name="toy-sd",
    label="Toy SD (test)",
    short="Toy",
    colour="#123456",
    params=(PARAMS["gamma"].own(name="toy draft length", hi=3, default=2),),
    step=toy_step,
    exact=True,
    panel="sd",
)
'''
PAGE = dict(
    prompt="abc def abc",
    pair="tiny",
    tau=0.1,
    beams=3,
    gamma=3,
    max_new=10,
    greedy=False,
    temperature=1.0,
    top_k=20,
    top_p=0.9,
    seed=7,
    with_ar=False,
    left=TOY,
    right="mtad",
    num_drafts=4,
    tau1=0.9,
    tau2=2.0,
)


@pytest.fixture
def toy(tmp_path: Path):  # noqa: ANN201
    """The toy decoder's module, written to a temporary package directory, imported and registered for
    one test (then unregistered, so that the other tests see the built-in registry alone)."""
    root = tmp_path / "toy_pkg"
    root.mkdir()
    (root / "toy_decoder.py").write_text(textwrap.dedent(TOY_FILE))
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("toy_decoder")
        register(module.SPEC)
        yield module.SPEC
    finally:
        unregister(TOY)
        sys.modules.pop("toy_decoder", None)
        sys.path.remove(str(root))


def pair_args(tiny_dirs: tuple[str, str]) -> list[str]:
    return ["--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--device", "cpu"]


def method_choices() -> list[str]:
    generate = next(a for a in cli.parser()._actions if a.dest == "command").choices["generate"]
    return list(next(a for a in generate._actions if a.dest == "method").choices)


def test_its_settings_are_checked_against_its_own_spec(toy: MethodSpec) -> None:
    assert check(Settings(method=TOY, gamma=3)).gamma == 3
    with pytest.raises(ValueError, match=r"toy draft length must be an integer from 1 to 3; got 4"):
        check(Settings(method=TOY, gamma=4))
    check(Settings(method="sd", gamma=4))  # the shared range is untouched: 4 is fine for SD
    with pytest.raises(ValueError, match="tau must be between 0 and 1"):  # the settings it does not use too
        check(Settings(method=TOY, gamma=2, tau=2.0))
    assert settings_for(TOY).gamma == 2 and settings_for(TOY, gamma=3).gamma == 3
    assert uses_draft(TOY) and DECODERS[TOY] is toy and toy.uses == ("gamma",)


def test_a_name_is_registered_once(toy: MethodSpec) -> None:
    other = MethodSpec(name=TOY, label="x", short="x", colour="#000000", step=toy.step)
    with pytest.raises(ValueError, match="already registered"):
        register(other)
    assert register(toy) is toy  # the same spec again changes nothing
    with pytest.raises(ValueError, match="exactly one of step and decoder"):
        MethodSpec(name="none", label="x", short="x", colour="#000000")
    with pytest.raises(ValueError, match=r"its default: toy draft length must be an integer from 1 to 3; got 4"):
        MethodSpec(
            name="bad", label="x", short="x", colour="#0", step=toy.step, params=(toy.params[0].own(default=None),)
        )
    with pytest.raises(ValueError, match="wider than the engine's"):
        MethodSpec(name="bad", label="x", short="x", colour="#0", step=toy.step, params=(PARAMS["gamma"].own(hi=99),))
    with pytest.raises(ValueError, match="not a setting"):
        MethodSpec(name="bad", label="x", short="x", colour="#0", step=toy.step, params=(PARAMS["tau"].own(field="x"),))


def test_the_cli_offers_and_runs_it(toy: MethodSpec, tiny_dirs, capsys) -> None:  # noqa: ANN001
    assert TOY in method_choices()
    argv = ["generate", *pair_args(tiny_dirs), "--prompt", "abc def", "--max-new-tokens", "8", "--json", "--raw"]
    assert cli.main([*argv, "--method", TOY, "--gamma", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == TOY and out["settings"]["gamma"] == 2
    # the toy is SD under another name: SD's tokens for the same settings and seed
    assert cli.main([*argv, "--method", "sd", "--gamma", "2"]) == 0
    assert out["new_ids"] == json.loads(capsys.readouterr().out)["new_ids"] and out["new_ids"]
    assert cli.main([*argv, "--method", TOY, "--gamma", "4"]) == 2
    assert "toy draft length must be an integer from 1 to 3; got 4" in capsys.readouterr().err


def test_the_bench_runs_it_in_its_own_rows(toy: MethodSpec, tiny_dirs, tmp_path) -> None:  # noqa: ANN001
    assert TOY in " ".join(bench.parser().format_help().split())  # offered, and run by default
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "abc de"}) + "\n")
    out = tmp_path / "out"
    argv = [*pair_args(tiny_dirs), "--prompts", str(prompts), "--max-new-tokens", "6", "--methods", f"sd,{TOY}"]
    argv += ["--gamma", "2,3", "--warmup", "0", "--no-progress", "--plotlyjs", "cdn", "--out", str(out)]
    assert bench.main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    cases = [r["case"] for r in data["aggregates"]]
    assert f"{TOY} γ=2" in cases and f"{TOY} γ=3" in cases and "sd γ=2" in cases
    assert data["config"]["methods"] == ["sd", TOY]
    table = (out / "table.txt").read_text()
    assert re.search(rf"^{re.escape(TOY)} +3 +- +- +- ", table, re.M), table
    assert bench.main([*argv[:-2], "--gamma", "4", "--out", str(tmp_path / "bad")]) == 2


def test_the_page_races_it(toy: MethodSpec, tiny_presets) -> None:  # noqa: ANN001
    assert ("Toy SD (test)", TOY) in pickers.racer_choices()
    assert TOY in pickers.RACERS and LABELS[TOY] == "Toy SD (test)" and COLOURS[TOY] == "#123456"
    state.PAGE.cancels.arm("toy-test")
    *_, last = runs.run(*PAGE.values(), SimpleNamespace(session_hash="toy-test"))
    data = last[-1]
    assert list(data["lanes"]) == [TOY, "mtad"] and data["lanes"][TOY]["label"] == "Toy SD (test)"
    assert 'data-method="toy-sd"' in last[2] and "γ = 3" in last[2]
    assert outputs.lane_note(TOY, {"gamma": 3}) == "γ = 3"
    # its lane holds SD's tokens for the same settings (the page ran the registered step, nothing else)
    pair = state.PAGE.pairs.get("tiny")
    s = Settings(method="sd", gamma=3, beams=3, max_new_tokens=10, seed=7)
    ids = encode_prompt(pair, PAGE["prompt"], s)
    assert data["lanes"][TOY]["new_ids"] == [t for st in decode(pair, ids, s) for t in st.appended_ids]
    # the page's γ box allows 4; the toy's spec does not, and the run is refused by that spec's words
    with pytest.raises(gr.Error, match="toy draft length must be an integer from 1 to 3; got 4"):
        state.PAGE.cancels.arm("toy-test")
        list(runs.run(*{**PAGE, "gamma": 4}.values(), SimpleNamespace(session_hash="toy-test")))


def test_unregistered_it_is_gone_everywhere(tmp_path: Path) -> None:
    name = "toy-gone"
    step = registry()["sd"].step
    register(MethodSpec(name=name, label="Gone", short="Gone", colour="#000000", step=step))
    assert name in method_choices() and name in pickers.RACERS
    unregister(name)
    assert name not in method_choices() and name not in pickers.RACERS and name not in LABELS
    with pytest.raises(ValueError, match="method must be one of"):
        check(Settings(method=name))


def test_every_consumer_reads_the_registry() -> None:
    names = tuple(registry())
    assert names == ("ar", "sd", "mtad", "mtad-tree", "bild", "spectr", "specinfer", "hf-assisted", "mtjd")
    assert tuple(method_choices()) == names
    assert f"comma list of {', '.join(names)}" in " ".join(bench.parser().format_help().split())
    assert set(pickers.RACERS) == {"sd", "mtad", "mtad-tree", "bild", "spectr", "specinfer", "mtjd"}
    assert dict(LABELS) == {n: s.label for n, s in registry().items()} and set(COLOURS) == set(names)
    for name, s in registry().items():
        assert s.name == name and s.panel in PANELS and re.fullmatch(r"#[0-9a-f]{6}", s.colour)
        assert uses_draft(name) == s.drafts == (s.panel not in ("none", "target-beams"))
        assert check(settings_for(name)).method == name
        for p in s.params:  # a method's own range never reaches past what the engine allows for the field
            assert PARAMS[p.field].lo <= p.lo and p.hi <= PARAMS[p.field].hi
    assert settings_for("bild").gamma == 10 and settings_for("sd").gamma == Settings().gamma
    for p in PARAMS.values():  # the page's range for a setting lies inside the engine's
        lo, hi = p.widget_range
        assert p.lo <= lo <= hi <= p.hi and (p.choices or p.page_name)


def test_no_method_is_named_outside_its_own_module() -> None:
    """Each built-in method's name, quoted, appears only in its decoder module (its spec); the roles the
    page and the bench give AR, SD and MTAD (baseline lane, default race) are the exceptions."""
    sources = {p: p.read_text() for p in [*(ROOT / "mtad").rglob("*.py"), ROOT / "app.py"]}
    for name, s in registry().items():
        if name in ("ar", "sd", "mtad"):
            continue
        own = next(Path(m.__file__) for m in list(sys.modules.values()) if getattr(m, "SPEC", None) is s)
        allowed = {own.resolve(), (ROOT / "mtad" / f"{name.replace('-', '_')}_agreement.py").resolve()}
        found = [p for p, text in sources.items() if f'"{name}"' in text and p.resolve() not in allowed]
        assert not found, f"{name!r} is named in {found}: read it from its spec instead"
    assert spec.__name__ == "mtad.decoding.spec"
