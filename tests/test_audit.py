"""``mtad.audit``: whole runs re-scored by one full target forward, against the distribution they sampled from."""

from __future__ import annotations

import json
import math

import pytest

import mtad.audit as audit
import mtad.bench.cli as bench
from mtad.audit import Calibration, score_run
from mtad.decoding import DECODERS, generate
from mtad.settings import Settings

PROMPTS = ("abc de", "hag bed", "fed cab a")
SEEDS = range(10)


def calibrate(pair, method: str, **kw) -> Calibration:  # noqa: ANN001
    """All of one method's runs over PROMPTS x SEEDS, 48 new tokens each, audited."""
    total = Calibration()
    for prompt in PROMPTS:
        for seed in SEEDS:
            s = Settings(method=method, max_new_tokens=48, seed=seed, **kw)
            run = generate(pair, prompt, s)
            total = total + score_run(pair.target, run.prompt_ids, run.new_ids, s)
    return total


@pytest.fixture(scope="module")
def audited(close_pair):
    return {m: calibrate(close_pair, m) for m in ("ar", "sd", "spectr", "specinfer", "hf-assisted", "mtad")}


def test_recompute_equals_what_the_run_reported(close_pair):
    """The full forward scores each token as the decoder's cached forwards did (fp32)."""
    s = Settings(method="sd", max_new_tokens=48, seed=3)
    run = generate(close_pair, "abc de", s)
    reported = sum(lp for step in run.steps for lp in step.target_logprobs)
    cal = score_run(close_pair.target, run.prompt_ids, run.new_ids, s)
    assert cal.tokens == len(run.new_ids) > 20
    assert cal.log_likelihood == pytest.approx(reported, abs=1e-3)


@pytest.mark.parametrize("method", ["ar", "sd", "spectr", "specinfer", "hf-assisted"])
def test_exact_decoders_follow_the_target_distribution_over_whole_runs(audited, method):
    """Every position of every run, not only the first tokens: no shift beyond noise."""
    cal = audited[method]
    assert DECODERS[method].exact
    assert cal.tokens > 500
    assert abs(cal.z) < audit.Z_LIMIT and abs(cal.top1_z) < audit.Z_LIMIT, (cal.z, cal.top1_z)
    assert audit.verdict(method, False, cal) == "consistent with the target's distribution"


def test_the_audit_detects_mtads_shift(audited):
    """The negative control: MTAD keeps beam prefixes the target finds likely, a shift the audit sees."""
    cal = audited["mtad"]
    assert not DECODERS["mtad"].exact
    assert cal.z > audit.Z_LIMIT and cal.mean_excess > 0
    assert audit.verdict("mtad", False, cal) == "likelier tokens than the distribution"


def test_a_biased_sampler_fails_the_audit(close_pair):
    """Tokens drawn from the raw distribution while the audit is told the run used top-k 2: flagged."""
    wide = Settings(method="ar", max_new_tokens=48, top_k=0, top_p=1.0)
    narrow = Settings(method="ar", max_new_tokens=48, top_k=2, top_p=1.0)
    total = Calibration()
    for prompt in PROMPTS:
        for seed in SEEDS:
            run = generate(close_pair, prompt, Settings(**{**wide.to_dict(), "seed": seed}))
            total = total + score_run(close_pair.target, run.prompt_ids, run.new_ids, narrow)
    assert total.z < -audit.Z_LIMIT
    assert audit.verdict("ar", False, total) == "DEVIATES from the target's distribution"


def test_greedy_runs_are_checked_against_the_argmax(close_pair):
    s = Settings(method="sd", greedy=True, max_new_tokens=32)
    run = generate(close_pair, "abc de", s)
    cal = score_run(close_pair.target, run.prompt_ids, run.new_ids, s)
    assert cal.top1_hits == cal.tokens == len(run.new_ids)
    assert audit.verdict("sd", True, cal) == "all target argmax"
    ar = generate(close_pair, "abc de", Settings(method="ar", max_new_tokens=32, seed=1))
    sampled = score_run(close_pair.target, ar.prompt_ids, ar.new_ids, s)
    assert sampled.top1_hits < sampled.tokens  # sampled text is not all argmax
    assert math.isnan(sampled.z)  # a one-hot distribution has no variance


def test_cli_audits_a_bench_directory(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    pair = ["--draft", tiny_dirs[0], "--target", tiny_dirs[1], "--device", "cpu"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    argv = [*pair, "--prompts", str(prompts), "--methods", "ar,mtad", "--max-new-tokens", "16"]
    assert bench.main([*argv, "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    assert audit.main([str(out)]) == 2  # a --draft/--target bench: the audit needs the pair again
    assert "give the same --draft and --target" in capsys.readouterr().err
    assert audit.main([str(out), *pair]) == 0
    text = capsys.readouterr().out
    assert "ar " in text and "mtad γ=4 W=8 τ=0.1" in text and "verdict" in text
    report = json.loads((out / "audit.json").read_text())
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert sum(c["tokens"] for c in report["cases"].values()) == sum(len(r["new_ids"]) for r in runs)
    assert -sum(r["nll_sum"] for r in runs if r["method"] == "ar") == pytest.approx(
        report["cases"]["ar"]["log_likelihood"], abs=1e-3
    )


def test_cli_reports_a_missing_bench(tmp_path, capsys):
    assert audit.main([str(tmp_path / "nowhere")]) == 2
    assert "error:" in capsys.readouterr().err
