"""The CLI runs the baselines (bild, spectr, specinfer, mtad-tree) and refuses their bad settings with exit 2."""

from __future__ import annotations

import json

import pytest

from mtad.cli import main, parser, settings_from_args


@pytest.mark.parametrize("method", ["bild", "spectr", "specinfer", "mtad-tree"])
def test_json_output_records_candidates(tiny_dirs: tuple[str, str], capsys: pytest.CaptureFixture, method: str) -> None:
    draft, target = tiny_dirs
    argv = ["generate", "--draft", draft, "--target", target, "--prompt", "abc de", "--method", method]
    code = main([*argv, "--max-new-tokens", "12", "--json", "-m", "3", "--beams", "3", "--tau1", "0.1"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["new_ids"] == [t for s in out["steps"] for t in s["appended_ids"]]
    assert out["settings"]["method"] == method and out["settings"]["num_drafts"] == 3
    drafting = [s for s in out["steps"] if s["candidates"]]
    if method == "bild":
        assert all(s["candidates"] is None for s in out["steps"])
        return
    assert drafting and all(len(s["candidates"]) == 3 for s in drafting)
    for s in drafting:
        assert s["draft_ids"] == s["candidates"][s["chosen"]]
        assert s["candidate_kept"][s["chosen"]] == s["accepted"]


def test_gamma_defaults_to_the_methods_paper_value() -> None:
    def gamma(*flags: str) -> int:
        return settings_from_args(parser().parse_args(["generate", "--prompt", "x", *flags]), flags[1]).gamma

    assert gamma("--method", "bild") == 10
    assert gamma("--method", "spectr") == 4
    assert gamma("--method", "bild", "--gamma", "3") == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-m", "0"], "num drafts (m) must be an integer from 1 to 16"),
        (["--num-drafts", "17"], "from 1 to 16"),
        (["--tau1", "-0.1"], "tau1 (BiLD fallback threshold) must be between 0 and 1"),
        (["--tau1", "1.5"], "tau1 (BiLD fallback threshold) must be between 0 and 1"),
        (["--tau2", "-1"], "tau2 (BiLD rollback threshold, in nats) must be a finite number >= 0"),
        (["--tau2", "nan"], "tau2 (BiLD rollback threshold, in nats) must be a finite number >= 0"),
        (["--method", "bild", "--gamma", "0"], "gamma (draft length) must be an integer from 1 to 32"),
    ],
)
def test_bad_baseline_settings_exit_2(
    tiny_dirs: tuple[str, str], capsys: pytest.CaptureFixture, flags: list[str], message: str
) -> None:
    draft, target = tiny_dirs
    assert (
        main(["generate", "--draft", draft, "--target", target, "--prompt", "abc", "--method", "spectr", *flags]) == 2
    )
    assert message in capsys.readouterr().err


def test_unknown_method_exits_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "abc", "--method", "medusa"])
    assert exc.value.code == 2
    assert "invalid choice: 'medusa'" in capsys.readouterr().err
