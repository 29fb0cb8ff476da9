"""``python -m mtad.audit OUT``: does each decoder emit tokens by the target's sampling distribution?

A perplexity gap between two decoders has two parts: the *contexts* the runs happened to write
(some texts are easier than others) and a *per-token* shift, tokens chosen more (or less) likely than
the target's distribution at that position would choose them. Only the second is a property of the method;
an exact decoder (SD, Spectr, SpecInfer, transformers' assisted generation) has none.

The audit re-scores a bench's runs with one full target forward per run (no KV cache, no drafts:
independent of the decoders' own arithmetic) and sums, over every emitted token x_t,

    log p_t(x_t) - E_{x ~ π_t}[log p_t(x)],     π_t = warp(p_t), the distribution sampled from.

Under the target's distribution each term has mean 0 given the past, so the sum over N tokens is a
martingale: divided by the square root of its summed conditional variances it is about N(0, 1)
(the z-score). The same holds for the indicator "x_t is the target's top token". Exact decoders
should show |z| within noise; MTAD and BiLD show their shift and its sign. Greedy runs are checked
against the argmax instead (the share of tokens that are the target's top one).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

import torch

from mtad.bench.report import text_table
from mtad.flags import add_pair_args, load_pair_from_args
from mtad.models.pair import ModelPair
from mtad.sampling import log_probs, probs
from mtad.settings import Settings

Z_LIMIT = 4.0
"""|z| above this is reported as a deviation from the target's distribution (two-sided p < 1e-4 under it)."""


@dataclass
class Calibration:
    """Summed per-token statistics of some runs against the target's distribution at each position."""

    tokens: int = 0
    log_likelihood: float = 0.0  # Σ log p(x_t): minus the runs' NLL, recomputed without a cache
    excess: float = 0.0  # Σ log p(x_t) − E_π[log p] (nats); > 0: likelier tokens than the distribution gives
    variance: float = 0.0  # Σ Var_π[log p]
    top1_hits: float = 0.0  # tokens that were the target's top token
    top1_expected: float = 0.0  # Σ distribution(top token)
    top1_variance: float = 0.0  # Σ distribution(top)(1 − distribution(top))

    def __add__(self, other: Calibration) -> Calibration:
        return Calibration(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def mean_excess(self) -> float:
        """Nats per token by which the emitted tokens beat (> 0) or trail the distribution's expectation."""
        return self.excess / self.tokens if self.tokens else math.nan

    @property
    def z(self) -> float:
        """``excess`` in standard deviations of its distribution (about N(0, 1) for an exact decoder)."""
        return self.excess / math.sqrt(self.variance) if self.variance > 0 else math.nan

    @property
    def top1_rate(self) -> float:
        return self.top1_hits / self.tokens if self.tokens else math.nan

    @property
    def top1_z(self) -> float:
        gap = self.top1_hits - self.top1_expected
        return gap / math.sqrt(self.top1_variance) if self.top1_variance > 0 else math.nan


@torch.inference_mode()
def score_run(target: torch.nn.Module, prompt_ids: list[int], new_ids: list[int], settings: Settings) -> Calibration:
    """One run's tokens against the distribution ``settings`` sample from, re-scored by one full forward."""
    if not new_ids:
        return Calibration()
    device = next(target.parameters()).device
    ids = torch.tensor([prompt_ids + new_ids], device=device)
    n = len(new_ids)
    rows = target(input_ids=ids, logits_to_keep=n + 1).logits[0, :n].float()  # row t predicts new_ids[t]
    raw = torch.log_softmax(rows, dim=-1)
    top = raw.argmax(dim=-1)
    if settings.is_greedy:
        dist = torch.nn.functional.one_hot(top, raw.shape[-1]).to(raw.dtype)
    else:
        dist = probs(log_probs(rows, settings))
    x = torch.tensor(new_ids, device=device)
    lp_x = raw.gather(1, x[:, None])[:, 0]
    mean = (dist * raw).sum(-1)
    var = ((dist * raw.square()).sum(-1) - mean.square()).clamp_min(0)
    p_top = dist.gather(1, top[:, None])[:, 0]
    return Calibration(
        tokens=n,
        log_likelihood=lp_x.sum().item(),
        excess=(lp_x - mean).sum().item(),
        variance=var.sum().item(),
        top1_hits=(x == top).sum().item(),
        top1_expected=p_top.sum().item(),
        top1_variance=(p_top * (1 - p_top)).sum().item(),
    )


def run_settings(record: dict) -> Settings:
    """The sampling settings a bench record ran with (what its tokens were drawn from)."""
    return Settings(
        method=record["method"],
        greedy=bool(record["greedy"]),
        temperature=float(record["temperature"]),
        top_k=int(record["top_k"]),
        top_p=float(record["top_p"]),
        max_new_tokens=int(record["max_new_tokens"]),
    )


def audit_bench(bench: dict, pair: ModelPair, prompt_ids: list[list[int]]) -> dict[str, Calibration]:
    """Per bench case: the calibration of all its runs (``prompt_ids`` by the runs' prompt index)."""
    out: dict[str, Calibration] = {}
    for record in bench["runs"]:
        if "new_ids" not in record:
            raise ValueError("bench.json holds no token ids for its runs; rerun the bench with this version")
        cal = score_run(pair.target, prompt_ids[record["prompt_index"]], record["new_ids"], run_settings(record))
        out[record["case"]] = out.get(record["case"], Calibration()) + cal
    return out


def verdict(method: str, greedy: bool, cal: Calibration) -> str:
    """What the figures say: consistent with the target's distribution, or how the method departs from it."""
    from mtad.decoding.spec import spec_of

    if greedy:
        return "all target argmax" if cal.top1_hits == cal.tokens else f"{cal.tokens - cal.top1_hits:.0f} not argmax"
    far = abs(cal.z) > Z_LIMIT or abs(cal.top1_z) > Z_LIMIT
    if spec_of(method).exact:
        return "DEVIATES from the target's distribution" if far else "consistent with the target's distribution"
    if not far:
        return "no shift detected"
    return "likelier tokens than the distribution" if cal.z > 0 else "less likely tokens than the distribution"


def signed(z: float) -> str:
    """A z-score to two places, or n/a (a greedy row's one-hot distribution has no variance)."""
    return "n/a" if math.isnan(z) else f"{z:+.2f}"


def render(cases: dict[str, Calibration], verdicts: dict[str, str]) -> str:
    """A plain-text table, one line per bench case."""
    header = ("case", "tokens", "excess (nats/token)", "z", "top-1 rate", "top-1 z", "verdict")
    body = [
        (
            case,
            str(cal.tokens),
            f"{cal.mean_excess:+.4f}",
            signed(cal.z),
            f"{cal.top1_rate:.3f}",
            signed(cal.top1_z),
            verdicts[case],
        )
        for case, cal in cases.items()
    ]
    return text_table(header, body, left=1, right=6)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mtad audit",
        description="Check, token by token, whether each method of a bench run sampled by the target's distribution.",
    )
    ap.add_argument("out", help="a bench --out directory (reads its bench.json, writes audit.json there)")
    add_pair_args(ap)
    ap.epilog = "Without pair flags the audit loads the preset and dtype the bench ran (a --draft/--target bench needs them again)."
    return ap


def main(argv: list[str] | None = None) -> int:
    from mtad.decoding import encode_prompt
    from mtad.models.errors import PairError
    from mtad.prompts import PromptFileError, read_prompts

    args = parser().parse_args(argv)
    out = Path(args.out)
    try:
        bench = json.loads((out / "bench.json").read_text(encoding="utf-8"))
        env, config = bench["environment"], bench["config"]
        if not (args.pair or args.draft or args.target):
            if env.get("pair") in (None, "custom"):
                raise ValueError("the bench ran a --draft/--target pair: give the same --draft and --target")
            args.pair = env["pair"]
        if args.dtype == "auto":
            args.dtype = env["dtype"]
        pair = load_pair_from_args(args)
        raw = env.get("prompt_format") == "raw text"
        prompts = read_prompts(config["prompts_file"], limit=len(config["prompts"]))
        longest = Settings(max_new_tokens=max(c["max_new_tokens"] for c in config["cases"]))
        prompt_ids = [encode_prompt(pair, p.text, longest, raw=raw) for p in prompts]
        cases = audit_bench(bench, pair, prompt_ids)
    except (OSError, KeyError, ValueError, PairError, PromptFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    methods = {r["case"]: (r["method"], bool(r["greedy"])) for r in bench["runs"]}
    verdicts = {case: verdict(*methods[case], cal) for case, cal in cases.items()}
    print(f"mtad audit {args.out}: pair {env['pair']}, {env['dtype']}, {sum(c.tokens for c in cases.values())} tokens")
    print(render(cases, verdicts))
    print(
        "excess: mean of log p(x) - E_π[log p] under the target's unwarped log-probabilities, π = the "
        "warped distribution the run sampled from (greedy rows: the argmax); z: the summed excess in standard "
        f"deviations (about N(0,1) for an exact decoder); |z| > {Z_LIMIT:g} is a deviation (docs/metrics.md)."
    )
    report = {
        "bench": str(out / "bench.json"),
        "z_limit": Z_LIMIT,
        "cases": {
            case: {
                **asdict(cal),
                "mean_excess": cal.mean_excess,
                "z": cal.z,
                "top1_rate": cal.top1_rate,
                "top1_z": cal.top1_z,
                "verdict": verdicts[case],
            }
            for case, cal in cases.items()
        },
    }
    (out / "audit.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
