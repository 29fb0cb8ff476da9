"""Where the draft proposes tokens the warped target rules out: ``python scripts/first_token_misses.py``.

First checks that the draft and the target are fed the same token ids for the pair's example prompts (the
ids each model's embedding receives on its first call, read with forward hooks: a chat template, a BOS or a
prompt's ids applied to one model only would show here). Then runs each drafting decoder on those prompts
with the page's default settings and prints, per decoder and draft position, the share of iterations that
reached the position (every earlier token allowed) whose token the warped target gives probability 0
(``mtad.metrics.excluded_by_position``): a share no τ can accept.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtad.decoding import decode, encode_prompt  # noqa: E402
from mtad.metrics import excluded_by_position  # noqa: E402
from mtad.models.pair import load_pair  # noqa: E402
from mtad.models.presets import presets  # noqa: E402
from mtad.ui.inputs import DEFAULTS, example_prompts  # noqa: E402


def fed_ids(pair: object, prompt_ids: list[int]) -> tuple[list[int], list[int]]:
    """The ids the draft's and the target's embeddings receive on their first call of an SD iteration."""
    seen: dict[str, list[int]] = {}

    def hook(name: str):
        def record(_module: object, args: tuple) -> None:
            seen.setdefault(name, args[0][0].tolist())

        return record

    handles = [
        model.get_input_embeddings().register_forward_pre_hook(hook(name))
        for name, model in (("draft", pair.draft), ("target", pair.target))
    ]
    try:
        steps = decode(pair, prompt_ids, DEFAULTS.with_(method="sd", max_new_tokens=2, seed=0))
        next(iter(steps))
    finally:
        for h in handles:
            h.remove()
    return seen["draft"], seen["target"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--methods", default="sd,mtad,spectr,specinfer,bild")
    parser.add_argument("--limit", type=int, default=8, help="example prompts (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--top-k", type=int, default=DEFAULTS.top_k, help=f"default {DEFAULTS.top_k}, the page's")
    parser.add_argument("--top-p", type=float, default=DEFAULTS.top_p, help=f"default {DEFAULTS.top_p}, the page's")
    args = parser.parse_args()
    warp = {"top_k": args.top_k, "top_p": args.top_p}
    pair = load_pair(args.pair)
    prompts = [text for _, text in example_prompts(presets()[args.pair])][: args.limit]
    print(f"pair {args.pair}: {len(prompts)} example prompts, engine {pair.engine}, dtype {pair.dtype}, {warp}")
    same = 0
    for text in prompts:
        ids = encode_prompt(pair, text, DEFAULTS)
        draft, target = fed_ids(pair, ids)
        ok = draft[: len(ids)] == ids and target[: len(ids)] == ids
        same += ok
        if not ok:
            print(f"  DIFFER on {text[:40]!r}: prompt {ids[:8]}…, draft {draft[:8]}…, target {target[:8]}…")
    print(f"ids fed to the draft and the target equal the prompt's: {same} of {len(prompts)} prompts")
    with torch.inference_mode():
        for method in args.methods.split(","):
            reached: list[int] = []
            excluded: list[int] = []
            iterations = 0
            first_p: list[float] = []  # the warped target's probability of each first draft token
            for seed, text in enumerate(prompts):
                settings = DEFAULTS.with_(method=method, max_new_tokens=args.max_new_tokens, seed=seed, **warp)
                steps = list(decode(pair, encode_prompt(pair, text, settings), settings))
                iterations += len(steps)
                first_p += [math.exp(st.log_p[0]) for st in steps if st.log_p]
                r, e = excluded_by_position(steps)
                for i in range(len(r)):
                    if i == len(reached):
                        reached.append(0)
                        excluded.append(0)
                    reached[i] += r[i]
                    excluded[i] += e[i]
            shares = " · ".join(
                f"{i + 1}: {e}/{r} ({e / r:.0%})" for i, (r, e) in enumerate(zip(reached, excluded, strict=True)) if r
            )
            mean = sum(first_p) / len(first_p) if first_p else float("nan")
            print(f"{method}: {iterations} iterations; excluded by position: {shares}; mean p of the first: {mean:.2f}")


if __name__ == "__main__":
    main()
