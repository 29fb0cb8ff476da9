"""Choose the draft's context n-gram bias weights (:mod:`mtad.decoding.context_bias`) by held-out acceptance.

Teacher-forced, as the on-policy trainer scores a draft: the exact 1 - TV of the warped distributions at every position
of the target's own replies to held-out instructions the target writes (``<work>/heldout.pt``, made as the
trainer makes it when missing), with the draft's logits plus the bias the engine would add there. The weights
with the highest acceptance are chosen; ``--write`` puts them in the draft's ``config.json``
(``mtad_context_bias``), which the decoders read. ``--report-prompts FILE`` scores the chosen weights on the
target's replies to FILE's prompts too, by category: a report, nothing is chosen on it.

    python -m training.context_bias --work .train-onpolicy --report-prompts assets/prompts/chat.jsonl --write
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch

from training import onpolicy as op

GRID = {1: (0.0, 0.5, 1.0), 2: (0.0, 1.0, 2.0, 3.0), 3: (0.0, 1.0, 2.0, 4.0), 4: (0.0, 2.0)}
"""Each order's candidate weights (orders 1 to 4); the grid is every combination."""


def order_masks(samples: list[dict], column_of: torch.Tensor, width: int, orders: int) -> torch.Tensor:
    """[orders, positions, width]: whether the engine's bias of order n (weight 1, the others 0) is on for a
    column at each reply position of ``samples`` (the position before each reply token, as
    :func:`training.onpolicy.reply_positions` orders them): the trainer's :func:`~training.onpolicy.reply_bias`,
    which is the engine's bias at each position's own prefix."""
    one_hot = torch.eye(orders)
    return torch.stack([op.reply_bias(samples, w, column_of, width) for w in one_hot]) > 0


@torch.inference_mode()
def shortlist_logits(draft: Any, samples: list[dict], chunk: int = 8) -> torch.Tensor:
    """The draft's shortlist logits at every reply position of ``samples``, teacher-forced, in fp32."""
    return torch.cat([op.reply_logits(draft, samples[i : i + chunk]) for i in range(0, len(samples), chunk)]).float()


def scorer(draft: Any, samples: list[dict], orders: int) -> Any:
    """A function of weights giving :func:`training.onpolicy.draft_terms`' pooled acceptance and agreement on
    ``samples`` with the bias of those weights (each position's masks and the draft's logits computed once)."""
    row_of = draft.model.embed_tokens.row_of
    logits = shortlist_logits(draft, samples)
    masks = order_masks(samples, row_of, logits.shape[-1], orders)
    labels = op.reply_labels(samples, logits.device)

    def score(weights: tuple[float, ...]) -> dict[str, float]:
        biased = logits + sum(w * masks[n] for n, w in enumerate(weights) if w)
        terms = op.draft_terms(biased, row_of, labels["idx"], labels["lp"], labels["pw"])
        return {"accept": terms["accept"].mean().item(), "agree": terms["agree"].mean().item()}

    return score


def heldout(args: argparse.Namespace) -> list[dict]:
    """The trainer's held-out set (target-written instructions): :func:`training.onpolicy.heldout_set`, which
    reads ``<work>/heldout.pt`` if its settings match and else makes it (the target loaded only then)."""
    made = (args.work / "heldout.pt").exists()
    target, tok = (None, None) if made else op.load_target(args.target, op.CPU, tokenizer=args.draft)
    args.work.mkdir(parents=True, exist_ok=True)
    return op.heldout_set(args, target, tok, op.CPU)


def choose(args: argparse.Namespace) -> dict:
    """Score every weight combination of :data:`GRID` on the held-out replies; the best, and the reports."""
    torch.set_num_threads(args.threads)
    draft = op.load_draft(args.draft).eval()
    samples = heldout(args)
    t0 = time.time()
    score = scorer(draft, samples, len(GRID))
    figures = {w: score(w) for w in itertools.product(*GRID.values())}
    best = max(figures, key=lambda w: figures[w]["accept"])
    none = tuple(0.0 for _ in GRID)
    out = {
        "weights": list(best),
        "heldout": {"none": figures[none], "chosen": figures[best], "replies": len(samples)},
        "seconds": time.time() - t0,
    }
    print(f"[context-bias] held-out, no bias {figures[none]}, {best}: {figures[best]}", flush=True)
    if args.report_prompts:
        report = op.report_set(args, op.CPU)
        score_r = scorer(draft, report, len(GRID))
        out["report"] = {"file": str(args.report_prompts), "none": score_r(none), "chosen": score_r(best)}
        print(f"[context-bias] on {args.report_prompts}: {out['report']}", flush=True)
    return out


def write_weights(draft_dir: Path, weights: list[float]) -> None:
    """Put the weights in the draft's ``config.json`` as ``mtad_context_bias`` (trailing zero orders dropped)."""
    while weights and not weights[-1]:
        weights = weights[:-1]
    path = draft_dir / "config.json"
    config = json.loads(path.read_text())
    config["mtad_context_bias"] = weights
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=op.WORK, help="where the held-out set is (or is made)")
    ap.add_argument("--draft", type=Path, default=op.DRAFT)
    ap.add_argument("--target", default=None, help="the target: a GGUF file or transformers directory (the preset's)")
    ap.add_argument("--report-prompts", default=None, help="also score on the target's replies to these prompts")
    ap.add_argument("--write", action="store_true", help="write the chosen weights into the draft's config.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heldout", type=int, default=96)
    ap.add_argument("--heldout-batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8)
    args = ap.parse_args(argv)
    args.heldout_prompts = "target"
    out = choose(args)
    (args.work / "context-bias.json").write_text(json.dumps(out, indent=2) + "\n")
    if args.write:
        write_weights(args.draft, out["weights"])
        print(f"[context-bias] wrote {out['weights']} to {args.draft / 'config.json'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
