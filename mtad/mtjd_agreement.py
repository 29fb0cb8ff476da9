"""``python -m mtad.mtjd_agreement``: MTAD against the MTJD it approximates, at the same K = γ, W and search.

For every prompt and seed it runs AR, MTAD and MTJD (perplexity and repetition from ``mtad.metrics``), and at
each MTAD iteration's context it runs MTJD's beam search over the target (:func:`mtad.decoding.mtjd.target_beams`,
K = the tokens MTAD drafted there) and compares MTJD's choice with what MTAD did from that same context:

* ``prefix_equal``: of the iterations that accepted η ≥ 1 draft tokens, those whose η accepted tokens are
  MTJD's first η tokens (MTAD kept what exact-as-we-can MTJD would have written);
* ``block_equal``: iterations whose whole drafted block (the draft's best beam) is MTJD's K tokens (the
  draft found the target's own best beam);
* ``step_equal``: iterations whose appended tokens (η drafts and the target's token) agree with MTJD's block
  as far as both go (MTAD's token after a whole accepted block lies past MTJD's K and is not compared);
* ``common_prefix``: the tokens MTAD appended that agree with MTJD's block before the first difference.

MTJD's choice is a beam search, deterministic unless ``--draft-mode beam-sample``: in sampling runs MTAD's
tokens are draws and agreement measures how often a draw lands on the beam search's mode. Definitions:
docs/methods.md; how to run it: docs/bench.md, experiment (g).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mtad.decoding.mtjd import cut_at_eos, target_beams
from mtad.decoding.spec import check
from mtad.decoding.state import DecodeState, to_host
from mtad.events import Step, json_safe
from mtad.models.pair import ModelPair
from mtad.sampling import sample_logp
from mtad.settings import Settings


@dataclass
class Agreement:
    """Counts over MTAD iterations that drafted (``iterations``); rates are their ratios."""

    iterations: int = 0
    with_accepted: int = 0
    prefix_equal: int = 0
    block_equal: int = 0
    step_equal: int = 0
    common_prefix: int = 0
    appended: int = 0

    def __add__(self, other: Agreement) -> Agreement:
        return Agreement(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    @property
    def prefix_equal_rate(self) -> float | None:
        """Of the iterations that accepted drafts, the share whose accepted prefix is MTJD's."""
        return self.prefix_equal / self.with_accepted if self.with_accepted else None

    @property
    def block_equal_rate(self) -> float | None:
        return self.block_equal / self.iterations if self.iterations else None

    @property
    def step_equal_rate(self) -> float | None:
        return self.step_equal / self.iterations if self.iterations else None

    @property
    def common_prefix_share(self) -> float | None:
        """The share of MTAD's appended tokens that lie inside the agreement with MTJD's block."""
        return self.common_prefix / self.appended if self.appended else None

    def to_dict(self) -> dict:
        rates = ("prefix_equal_rate", "block_equal_rate", "step_equal_rate", "common_prefix_share")
        return json_safe({**asdict(self), **{k: getattr(self, k) for k in rates}})


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def mtjd_choices(pair: ModelPair, prompt_ids: list[int], steps: Sequence[Step], settings: Settings) -> list:
    """MTJD's block at the context of each step of a run (None where the step drafted nothing): the best of
    W beams of K = ``len(step.draft_ids)`` tokens over the target (a one-token block is the target's own
    draw, as in :func:`mtad.decoding.mtjd.mtjd_step`), under ``settings``' distribution, W and search. One target
    cache serves the whole run: it is cut back to the context after each search."""
    st = DecodeState.start(pair, prompt_ids, settings.with_(method="mtjd"))
    context = list(prompt_ids)
    out: list[list[int] | None] = []
    for step in steps:
        k = len(step.draft_ids)
        if k:
            st.begin()
            st.ids = list(context)
            if k == 1:
                tok = sample_logp(
                    st.judged(st.run_next(st.target, st.pending(st.target)))[0], st.settings, generator=st.generator
                )
                block = [to_host(tok)[0]]
            else:
                beams = target_beams(st, k)
                block = to_host(beams.tokens.index_select(0, beams.best.view(1))[0])[0]
            out.append(cut_at_eos(block, pair.eos_ids))
            st.target.rollback(len(context))
        else:
            out.append(None)
        context.extend(step.appended_ids)
    return out


def agreement(steps: Sequence[Step], choices: Sequence[list[int] | None], eos_ids: frozenset[int]) -> Agreement:
    """Compare each MTAD step that drafted with MTJD's block from the same context (see the module); a
    drafted block is compared up to its first EOS, as MTJD's block ends there."""
    a = Agreement()
    for step, block in zip(steps, choices, strict=True):
        if block is None:
            continue
        eta, kept = step.accepted, step.appended_ids
        a.iterations += 1
        a.with_accepted += eta > 0
        a.prefix_equal += eta > 0 and block[:eta] == step.draft_ids[:eta]
        a.block_equal += block == cut_at_eos(step.draft_ids, eos_ids)
        a.step_equal += common_prefix(kept, block) == min(len(kept), len(block))
        a.common_prefix += common_prefix(kept, block)
        a.appended += len(kept)
    return a


def run_agreement(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> tuple[list[Step], Agreement]:
    """One MTAD run (``settings`` with method mtad) and its agreement with MTJD at every iteration."""
    from mtad.decoding import decode

    steps = list(decode(pair, prompt_ids, settings.with_(method="mtad")))
    return steps, agreement(steps, mtjd_choices(pair, prompt_ids, steps, settings), pair.eos_ids)


# ---------------------------------------------------------------- the command


def parser() -> argparse.ArgumentParser:
    from mtad.flags import add_pair_args, add_sampling_args

    d = Settings()
    ap = argparse.ArgumentParser(
        prog="mtad mtjd-agreement",
        description="MTAD against MTJD (beam search over the target) at the same K = gamma, W and search: "
        "perplexity, repetition, and how often MTAD's accepted prefix is MTJD's choice from the same context.",
    )
    add_pair_args(ap)
    ap.add_argument("--prompts", help="JSONL prompt file (default: the --pair preset's prompt set)")
    ap.add_argument("--limit", type=int, help="use the first N prompts")
    add_sampling_args(ap)
    ap.add_argument("--gamma", type=int, default=d.gamma, help="MTAD's draft length = MTJD's K")
    ap.add_argument("--beams", type=int, default=d.beams, help="W, for MTAD's draft and MTJD's search alike")
    ap.add_argument("--tau", type=float, default=d.tau, help="MTAD's threshold")
    ap.add_argument("--seeds", default=str(d.seed), help="comma list of seeds")
    ap.add_argument("--raw", action="store_true", help="prompts as plain text, without a chat pair's template")
    ap.add_argument("--out", help="directory for agreement.json and agreement.txt")
    return ap


def report(rows: dict[str, list], total: Agreement) -> str:
    """The comparison as text: AR, MTAD and MTJD pooled, then MTAD's agreement with MTJD."""
    from mtad.bench.report import fmt, text_table
    from mtad.metrics import pool

    header = ["method", "perplexity", "rep. 4-grams", "speed (tok/s)", "block eff.", "acceptance", "runs"]
    body = []
    for method, metrics in rows.items():
        p = pool(metrics)
        body.append(
            [
                method,
                fmt(p.perplexity),
                fmt(p.repetition),
                fmt(p.tokens_per_second),
                fmt(p.block_efficiency),
                fmt(p.acceptance),
                str(p.runs),
            ]
        )
    lines = [text_table(header, body, 1), ""]
    lines += [
        f"MTAD iterations compared with MTJD's choice from the same context: {total.iterations}",
        f"  accepted prefix = MTJD's first η tokens: {pct(total.prefix_equal_rate)} "
        f"({total.prefix_equal} of {total.with_accepted} iterations with η ≥ 1)",
        f"  drafted block = MTJD's K tokens:         {pct(total.block_equal_rate)} ({total.block_equal})",
        f"  appended tokens start MTJD's block:      {pct(total.step_equal_rate)} ({total.step_equal})",
        f"  appended tokens inside the agreement:    {pct(total.common_prefix_share)} "
        f"({total.common_prefix} of {total.appended})",
    ]
    return "\n".join(lines)


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def main(argv: Sequence[str] | None = None) -> int:
    from mtad.bench.cli import default_prompts, output_dir, parse_list
    from mtad.bench.report import environment, git_commit
    from mtad.decoding import decode, encode_prompt
    from mtad.flags import load_pair_from_args, sampling_settings
    from mtad.metrics import summarize
    from mtad.prompts import read_prompts

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        base = sampling_settings(args).with_(gamma=args.gamma, beams=args.beams, tau=args.tau)
        for method in ("mtad", "mtjd"):
            check(base.with_(method=method))
        seeds = parse_list(args.seeds, int, "seeds")
        prompts = read_prompts(default_prompts(args), args.limit)
        out = output_dir(args.out)
        commit = git_commit()
        pair = load_pair_from_args(args)
        encoded = [encode_prompt(pair, p.text, base, raw=args.raw) for p in prompts]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows: dict[str, list] = {"ar": [], "mtad": [], "mtjd": []}
    runs, total = [], Agreement()
    for prompt, ids in zip(prompts, encoded, strict=True):
        for seed in seeds:
            s = base.with_(seed=seed)
            record = {"prompt_id": prompt.id, "seed": seed}
            for method in ("ar", "mtjd"):
                steps = list(decode(pair, ids, s.with_(method=method)))
                rows[method].append(summarize(steps))
                record[method] = rows[method][-1].to_dict()
            steps, agree = run_agreement(pair, ids, s)
            rows["mtad"].append(summarize(steps))
            record["mtad"] = rows["mtad"][-1].to_dict()
            record["agreement"] = agree.to_dict()
            total = total + agree
            runs.append(record)
            print(f"{prompt.id} seed {seed}: {agree.to_dict()}", file=sys.stderr)
    text = report(rows, total)
    print(text)
    if out is not None:
        env = environment(pair, argv, None, "none", commit)
        env["command"] = "python -m mtad.mtjd_agreement " + shlex.join(argv)
        doc = {"environment": env, "settings": base.to_dict(), "agreement": total.to_dict(), "runs": runs}
        (out / "agreement.json").write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
        (out / "agreement.txt").write_text(f"{env['command']}\n{env['date']} on {env['device_name']}\n\n{text}\n")
        print(f"wrote {out / 'agreement.json'} and {out / 'agreement.txt'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
