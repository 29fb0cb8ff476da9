"""``python -m mtad generate``: JSON output fields and a clear exit 2 on every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mtad.cli import main
from mtad.metrics import summarize

STEP_FIELDS = {"draft_ids", "log_p", "log_q", "accepted", "appended_ids", "seconds"}
METRIC_FIELDS = {"new_tokens", "target_calls", "draft_calls", "block_efficiency", "acceptance", "perplexity", "seconds"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mtad", "generate", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
def test_json_output(tiny_dirs: tuple[str, str], capsys: pytest.CaptureFixture, method: str) -> None:
    draft, target = tiny_dirs
    code = main(
        [
            "generate",
            "--draft",
            draft,
            "--target",
            target,
            "--device",
            "cpu",
            "--prompt",
            "abc de",
            "--method",
            method,
            "--max-new-tokens",
            "12",
            "--json",
            "--seed",
            "4",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"text", "prompt_ids", "new_ids", "steps", "metrics"} <= set(out)
    assert len(out["new_ids"]) == out["metrics"]["new_tokens"] <= 12
    for step in out["steps"]:
        assert STEP_FIELDS <= set(step)
        assert len(step["log_p"]) == len(step["log_q"]) == len(step["draft_ids"])
    assert METRIC_FIELDS <= set(out["metrics"])
    assert out["new_ids"] == [t for s in out["steps"] for t in s["appended_ids"]]


def test_end_to_end_subprocess(tiny_dirs: tuple[str, str]) -> None:
    draft, target = tiny_dirs
    ok = run_cli(
        "--draft",
        draft,
        "--target",
        target,
        "--prompt",
        "abc",
        "--method",
        "mtad",
        "--greedy",
        "--max-new-tokens",
        "10",
        "--json",
    )
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["metrics"]["new_tokens"] == len(out["new_ids"])
    bad = run_cli("--draft", draft, "--target", target, "--prompt", "abc", "--tau", "2")
    assert bad.returncode == 2
    assert "tau must be between 0 and 1" in bad.stderr and "Traceback" not in bad.stderr


def test_text_output_marks_tokens(tiny_dirs: tuple[str, str], capsys: pytest.CaptureFixture) -> None:
    draft, target = tiny_dirs
    os.environ["FORCE_COLOR"] = "1"
    try:
        assert (
            main(
                [
                    "generate",
                    "--draft",
                    draft,
                    "--target",
                    target,
                    "--prompt",
                    "abc",
                    "--greedy",
                    "--max-new-tokens",
                    "12",
                ]
            )
            == 0
        )
    finally:
        del os.environ["FORCE_COLOR"]
    cap = capsys.readouterr()
    assert cap.out.startswith("abc") and "\033[33m" in cap.out
    assert "block efficiency" in cap.err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt", "   "], "prompt is empty"),
        (["--gamma", "0"], "gamma (draft length) must be an integer from 1 to 32"),
        (["--gamma", "33"], "from 1 to 32"),
        (["--beams", "0"], "beams must be an integer from 1 to 64"),
        (["--beams", "65"], "from 1 to 64"),
        (["--tau", "-0.5"], "tau must be between 0 and 1"),
        (["--tau", "1.01"], "tau must be between 0 and 1"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--top-k", "-3"], "top-k must be an integer >= 0"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--max-new-tokens", "0"], "max new tokens must be an integer >= 1"),
        (["--max-new-tokens", "250", "--prompt", "abc " * 30], "exceeds the model's context length of 256"),
        (["--greedy", "--draft-mode", "beam-sample"], "contradict"),
        (["--pair", "no-such-pair"], "either --pair or --draft/--target"),
    ],
)
def test_bad_input_exits_2(
    tiny_dirs: tuple[str, str], capsys: pytest.CaptureFixture, flags: list[str], message: str
) -> None:
    draft, target = tiny_dirs
    argv = ["generate", "--draft", draft, "--target", target, "--prompt", "abc", *flags]
    if "--prompt" in flags:
        argv = ["generate", "--draft", draft, "--target", target, *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err


def test_mismatched_tokenizers_refused(
    tiny_dirs: tuple[str, str],
    micro_pair,
    capsys: pytest.CaptureFixture,  # noqa: ANN001
    tmp_path,
) -> None:  # noqa: ANN001
    micro_dir = tmp_path / "micro"
    micro_pair.target.save_pretrained(micro_dir)
    micro_pair.tokenizer.save_pretrained(micro_dir)
    assert main(["generate", "--draft", str(micro_dir), "--target", tiny_dirs[1], "--prompt", "abc"]) == 2
    err = capsys.readouterr().err
    assert "tokenizers differ" in err and "10 tokens" in err and "64" in err


def test_missing_directory(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--draft", "./nope/draft", "--target", "./nope/target", "--prompt", "x"]) == 2
    assert "no model directory" in capsys.readouterr().err


def test_metrics_json_equals_summarize(tiny_pair, capsys: pytest.CaptureFixture, tiny_dirs) -> None:  # noqa: ANN001
    from mtad.decoding import generate
    from mtad.settings import Settings

    draft, target = tiny_dirs
    main(
        [
            "generate",
            "--draft",
            draft,
            "--target",
            target,
            "--prompt",
            "abc",
            "--greedy",
            "--json",
            "--max-new-tokens",
            "9",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    run = generate(tiny_pair, "abc", Settings(greedy=True, max_new_tokens=9))
    m = summarize(run.steps)
    assert out["new_ids"] == run.new_ids
    assert out["metrics"]["block_efficiency"] == pytest.approx(m.block_efficiency)
    assert out["metrics"]["perplexity"] == pytest.approx(m.perplexity, rel=1e-6)


def test_a_prompt_that_is_not_utf8_is_a_sentence_not_a_traceback(tiny_dirs: tuple[str, str]) -> None:
    """``--prompt $'\\xff'``: the byte reaches Python as a lone surrogate, which the tokenizer cannot take."""
    draft, target = tiny_dirs
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "mtad", "generate", "--draft", draft, "--target", target, "--prompt"]
    bad = subprocess.run([os.fsencode(a) for a in argv] + [b"abc \xff"], capture_output=True, env=env, timeout=300)
    stderr = bad.stderr.decode("utf-8", "replace")
    assert bad.returncode == 2 and "Traceback" not in stderr, stderr
    assert "the prompt holds a character that is not text (U+DCFF, a lone surrogate, at character 5" in stderr
