"""Write the prompts the smollm2 pair's acceptance table is measured on: ``python scripts/tuning_prompts.py``.

User turns the target writes itself (``training.onpolicy.target_prompts``, Magpie), from the seed of the
trainer's held-out set, which no training round draws from, and never one of the benchmark's prompts
(``assets/prompts/chat.jsonl``), compared by text. Settings fastest on a machine (``mtad.tuning``) are chosen
on these, so the benchmark's prompts stay a check, not something tuned on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.onpolicy import HELDOUT_SEED, eval_prompts, load_target, target_prompts  # noqa: E402

OUT = ROOT / "assets" / "prompts" / "tuning.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=32, help="how many prompts (default 32)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(0)
    target, tok = load_target(tokenizer=ROOT / "assets" / "models" / "smollm2-draft")
    texts = target_prompts(target, tok, args.n, HELDOUT_SEED, exclude=eval_prompts())
    if len(texts) < args.n:
        sys.exit(f"the target wrote {len(texts)} usable prompts of the {args.n} asked for")
    lines = [json.dumps({"id": f"t{i}", "category": "target-written", "prompt": t}) for i, t in enumerate(texts)]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(texts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
