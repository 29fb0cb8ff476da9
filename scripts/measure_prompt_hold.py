"""How long a visitor's prompt of N tokens holds the device, per lane, before its first new token.

``python scripts/measure_prompt_hold.py`` on the smollm2 pair: an AR lane (target only) and an SD lane
(draft and target) each read the whole prompt, then write one or two tokens; the seconds are the lane's.
The page's default cap on prompt tokens (``MTAD_MAX_PROMPT_TOKENS``) was chosen from these figures
(docs/journal/2026-11-24-prompt-hold.md; how to run it: docs/bench.md, (f)).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtad.decoding import decode  # noqa: E402
from mtad.models.pair import load_pair  # noqa: E402
from mtad.settings import Settings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    args = parser.parse_args()
    pair = load_pair(args.pair)
    print(f"pair {args.pair}, {torch.get_num_threads()} thread(s), {pair.dtype}")
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text() * 20
    ids = pair.encode(text, raw=True)
    for n in (int(x) for x in args.lengths.split(",")):
        for method in ("ar", "sd"):
            settings = Settings(method=method, max_new_tokens=1 if method == "ar" else 2, gamma=1, greedy=True)
            t0 = time.perf_counter()
            list(decode(pair, ids[:n], settings))
            print(f"{n:5d} prompt tokens, {method}: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
