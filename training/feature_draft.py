"""Train the feature-reading draft (:mod:`mtad.models.feature_draft`) from the committed shortlist draft.

The draft adds to each token's embedding a linear map of the target's last hidden state at the previous
position, zero at the start, so training starts from exactly the committed draft and its figures. At
decoding time only the context has the target's features: a draft token reads none. :func:`levels`
scores every depth of every draft chain exactly in one forward over ``depth`` copies of each reply: the
level-1 copy reads the target's features (a chain's first draft token, read after the verified context);
the level-m copy reads none and each of its positions attends to the target-read positions up to its
chain's start and to its own chain's earlier draft tokens only (HASS's "training-time test"). The loss is
the forward KL to the target's distribution (and optionally the total variation of the warped distributions, as
``training.onpolicy``); weights are chosen by held-out acceptance per depth, on ``training.onpolicy``'s
held-out target replies (same instructions and seeds): at step 0 every depth scores the committed draft's
0.4483 there. Those held-out instructions share the training ones' templates: a gain there did not
reach the benchmark's prompts (docs/journal/2026-11-24-feature-draft.md), so export only what the
bench confirms.

Usage::

    python -m training.feature_draft --stage data --minutes 80 &   # target replies + features + labels
    python -m training.feature_draft --stage train --minutes 80 &  # resumable; held-out per depth
    python -m training.feature_draft --stage export                # <work>/best -> assets/models/smollm2-feature-draft
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from training.onpolicy import (
    DRAFT,
    SEED,
    draft_terms,
    instructions,
    label_samples,
    load_draft,
    load_target,
    loss_of,
    save_draft,
    target_replies,
)

WORK = Path(".train-feature")
OUT = Path("assets/models/smollm2-feature-draft")


# --------------------------------------------------------------------------- data


def heldout_set(work: Path, target: Any, tok: Any, n: int = 96, max_new: int = 128) -> list[dict]:
    """``training.onpolicy``'s held-out replies (same instructions and seeds), with features."""
    path = work / "heldout.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    prompts = random.Random(SEED).sample(instructions(heldout=True), n)
    held: list[dict] = []
    for i in range(0, len(prompts), 16):
        held += target_replies(target, tok, prompts[i : i + 16], SEED + i, max_new)
    label_samples(target, held, features=True)
    torch.save(held, path)
    return held


def produce(args: argparse.Namespace) -> None:
    """Target-written replies to training instructions, with features and labels, a shard a batch."""
    torch.set_num_threads(args.threads)
    target, tok = load_target()
    shards = args.data / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    heldout_set(args.data, target, tok)
    prompts = instructions(heldout=False)
    random.Random(SEED + 7).shuffle(prompts)  # not onpolicy's order: other replies than its runs saw
    n = len(list(shards.glob("*.pt")))
    t0 = time.time()
    while time.time() - t0 < args.minutes * 60:
        batch = [prompts[(n * args.gen_batch + i) % len(prompts)] for i in range(args.gen_batch)]
        samples = target_replies(target, tok, batch, SEED + 5000 + n, args.max_new)
        label_samples(target, samples, features=True)
        tmp = shards / f"{n:06d}.tmp"
        torch.save(samples, tmp)
        tmp.rename(shards / f"{n:06d}.pt")
        n += 1
        print(f"[feature data] shard {n}, {sum(len(s['idx']) for s in samples)} positions", flush=True)


# --------------------------------------------------------------------------- training


def feature_draft(path: Path = DRAFT) -> Any:
    """The committed shortlist draft (fp32, dense layers) with a zero feature map, or a saved feature
    draft, ready to train."""
    from mtad.models.feature_draft import FeatureDraftForCausalLM

    draft = load_draft(path)
    return draft if isinstance(draft, FeatureDraftForCausalLM) else FeatureDraftForCausalLM.from_draft(draft)


def chain_mask(n: int, depth: int) -> torch.Tensor:
    """Which of ``depth`` copies of n positions each copy's position attends to, ``[depth n, depth n]``:
    level 1 is causal; level m at p sees level 1 up to p - m + 1 and level l (2 <= l <= m) at p - m + l."""
    pos = torch.arange(n)
    rows = []
    for m in range(1, depth + 1):
        blocks = [pos[None, :] <= pos[:, None] - (m - 1)]
        blocks += [
            pos[None, :] == pos[:, None] - (m - lv) if lv <= m else torch.zeros(n, n, dtype=torch.bool)
            for lv in range(2, depth + 1)
        ]
        rows.append(torch.cat(blocks, dim=1))
    return torch.cat(rows, dim=0)


def levels(draft: Any, samples: list[dict], depth: int) -> list[dict[str, torch.Tensor]]:
    """Per level (draft depth) 1..``depth``: ``onpolicy.draft_terms`` at every reply position that a
    chain of that depth reaches, from one forward over ``depth`` copies of each reply."""
    from mtad.decoding.kv import additive_mask

    n = max(len(s["ids"]) for s in samples) - 1  # positions that predict a next token
    hidden = samples[0]["feats"].shape[-1]
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    feats = torch.zeros(len(samples), depth * n, hidden)
    for b, s in enumerate(samples):
        m = len(s["ids"]) - 1
        ids[b, :m] = s["ids"][:m].long()
        feats[b, 1:m] = s["feats"][: m - 1].float()  # x_p reads f_{p-1}; the copies past level 1 read none
    mask = additive_mask(chain_mask(n, depth), torch.float32)[None, None]
    pos = torch.arange(n).repeat(depth)[None].expand(len(samples), -1)
    out = draft.model(
        inputs_embeds=draft.model.embed_tokens(ids.repeat(1, depth)) + draft.feature_term(feats),
        attention_mask=mask,
        position_ids=pos,
    ).last_hidden_state
    terms = []
    for m in range(1, depth + 1):
        rows, cols, picked = [], [], {k: [] for k in ("idx", "lp", "pw")}
        for b, s in enumerate(samples):
            p = torch.arange(max(s["start"], m - 1), len(s["ids"]) - 1)  # label p - start predicts x_{p+1}
            rows.append(torch.full_like(p, b))
            cols.append(p + (m - 1) * n)
            for k in picked:
                picked[k].append(s[k][p - s["start"]])
        logits = draft.shortlist_logits(out[torch.cat(rows), torch.cat(cols)])
        cat = {k: torch.cat(v) for k, v in picked.items()}
        terms.append(draft_terms(logits, draft.model.embed_tokens.row_of, cat["idx"], cat["lp"], cat["pw"]))
    return terms


@torch.no_grad()
def evaluate(draft: Any, heldout: list[dict], depth: int, chunk: int = 4) -> list[dict[str, float]]:
    """Held-out acceptance, agreement, KL and cross-entropy per depth, pooled over positions."""
    was = draft.training
    draft.eval()
    sums = [dict.fromkeys(("accept", "agree", "kl", "ce"), 0.0) for _ in range(depth)]
    counts = [0] * depth
    for i in range(0, len(heldout), chunk):
        for m, term in enumerate(levels(draft, heldout[i : i + chunk], depth)):
            for k in sums[m]:
                sums[m][k] += term[k].sum().item()
            counts[m] += term["accept"].numel()
    draft.train(was)
    return [
        {k: round(v / max(c, 1), 5) for k, v in s.items()} | {"positions": c} for s, c in zip(sums, counts, strict=True)
    ]


def train(args: argparse.Namespace) -> None:
    """Steps on random replies of every shard so far, held-out figures per depth every few minutes, the
    best (by mean acceptance over the depths drafted) exported to ``<work>/best``. Resumes ``state.pt``;
    without one, starts from the committed feature draft (``OUT``), else from the committed shortlist draft."""
    torch.set_num_threads(args.threads)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    _, tok = load_target()
    state_path = work / "state.pt"
    saved = torch.load(state_path, weights_only=False) if state_path.exists() else None
    start = work / "last" if saved else OUT if (OUT / "model.safetensors").exists() else DRAFT
    draft = feature_draft(start).train()
    print(f"[feature] starting from {start}", flush=True)
    new = list(draft.feature_in.parameters())
    rest = [p for p in draft.parameters() if all(p is not q for q in new)]
    groups = [{"params": new, "base": args.lr}, {"params": rest, "base": args.lr_rest}]
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    step, spent, log = 0, 0.0, []
    if saved:
        opt.load_state_dict(saved["opt"])
        step, spent, log = saved["step"], saved["seconds"], saved["log"]
    heldout = torch.load(args.data / "heldout.pt", weights_only=False)
    if not log:
        held = evaluate(draft, heldout, args.depth + 1)
        log.append({"step": 0, "seconds": 0.0, "heldout": held})
        print(f"[feature] step 0 (the committed draft): {json.dumps(held)}", flush=True)
    best = max(score(e["heldout"], args.depth) for e in log)
    samples: list[dict] = []
    seen: set[str] = set()
    rng = random.Random(SEED + step)
    t0, t_eval, t_save = time.time(), time.time(), time.time()
    budget = args.minutes * 60
    while (spent + time.time() - t0) < budget:
        for path in sorted((args.data / "shards").glob("*.pt")):
            if path.name not in seen:
                seen.add(path.name)
                samples += torch.load(path, weights_only=False)
        progress = (spent + time.time() - t0) / budget
        scale = min(1.0, (step + 1) / 30) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1))))
        for g in opt.param_groups:
            g["lr"] = g["base"] * scale
        terms = levels(draft, rng.sample(samples, min(args.batch, len(samples))), args.depth)
        loss = sum(loss_of(t, args.kl_weight, args.tv_weight) for t in terms) / len(terms)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            print(
                f"[feature] step {step} replies {len(samples)} loss {loss.item():.3f} "
                + " ".join(f"d{m + 1} {t['accept'].mean().item():.3f}" for m, t in enumerate(terms)),
                flush=True,
            )
        if time.time() - t_eval > args.eval_minutes * 60:
            held = evaluate(draft, heldout, args.depth + 1)
            log.append({"step": step, "seconds": spent + time.time() - t0, "replies": len(samples), "heldout": held})
            print(f"[feature] heldout step {step}: {json.dumps(held)}", flush=True)
            if score(held, args.depth) > best:
                best = score(held, args.depth)
                save_draft(draft, tok, work / "best")
                (work / "best" / "train_log.json").write_text(json.dumps({"step": step, "log": log}, indent=1))
                print(f"[feature] new best {best:.4f} -> {work / 'best'}", flush=True)
            t_eval = time.time()
        if time.time() - t_save > 180:
            checkpoint(work, draft, tok, opt, step, spent + time.time() - t0, log)
            t_save = time.time()
    checkpoint(work, draft, tok, opt, step, spent + time.time() - t0, log)
    print("[feature] done", flush=True)


def score(held: list[dict], depth: int) -> float:
    """What chooses the weights: held-out acceptance averaged over the first ``depth`` draft positions."""
    return sum(h["accept"] for h in held[:depth]) / depth


def checkpoint(work: Path, draft: Any, tok: Any, opt: Any, step: int, seconds: float, log: list) -> None:
    """The draft's fp32 weights (``last``), the optimiser and the counters, written atomically."""
    tmp = work / "last.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    draft.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(work / "last", ignore_errors=True)
    tmp.rename(work / "last")
    torch.save({"opt": opt.state_dict(), "step": step, "seconds": seconds, "log": log}, work / "state.tmp")
    (work / "state.tmp").rename(work / "state.pt")


def export(args: argparse.Namespace) -> None:
    """Copy ``<work>/best`` to ``assets/models/smollm2-feature-draft`` with the log that chose it."""
    best = args.work / "best"
    if not (best / "model.safetensors").exists():
        sys.exit(f"nothing to export: {best} holds no weights (no evaluation beat the committed draft yet)")
    OUT.mkdir(parents=True, exist_ok=True)
    for path in best.iterdir():
        shutil.copy(path, OUT / path.name)
    print(f"exported {best} to {OUT}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.feature_draft", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=("data", "train", "export"), required=True)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--data", type=Path, default=WORK, help="where the data stage writes (shards/, heldout.pt)")
    ap.add_argument("--minutes", type=float, default=80)
    ap.add_argument("--lr", type=float, default=3e-4, help="the feature map's learning rate")
    ap.add_argument("--lr-rest", type=float, default=2e-5, help="the committed weights' learning rate")
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--tv-weight", type=float, default=0.0)
    ap.add_argument("--depth", type=int, default=3, help="draft depths trained (evaluation reports one more)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--eval-minutes", type=float, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    {"data": produce, "train": train, "export": export}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
