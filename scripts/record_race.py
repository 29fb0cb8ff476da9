"""Record the race the page shows a first visitor before anyone presses Run: ``python scripts/record_race.py``.

Runs the page's own lanes (``mtad.ui.runner.run_lanes``: SD, MTAD and AR one after another, each on its
own clock) on the smollm2 pair with the page's default settings and the pair's first example prompt, and
writes each lane's clock and token counts, with the device it ran on, to ``assets/race.json`` (a few kB).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtad.decoding import encode_prompt  # noqa: E402
from mtad.metrics import target_call_ratio  # noqa: E402
from mtad.models.presets import presets  # noqa: E402
from mtad.models.static_llama import uncompiled_shapes  # noqa: E402
from mtad.ui.inputs import DEFAULTS, example_prompts  # noqa: E402
from mtad.ui.race import RACE_FILE, race_record  # noqa: E402
from mtad.ui.record import LaneRecord, RunRecord  # noqa: E402
from mtad.ui.runner import run_lanes  # noqa: E402
from mtad.ui.state import PAGE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--out", type=Path, default=RACE_FILE)
    args = parser.parse_args()
    PAGE.pairs.preload(args.pair).join()  # as the page's start-up loads and compiles it, in a thread of its own
    pair = PAGE.pairs.get(args.pair)
    prompt = example_prompts(presets()[args.pair])[0][1]
    settings = DEFAULTS
    ids = encode_prompt(pair, prompt, settings)
    methods = ["sd", "mtad", "ar"]
    record = RunRecord(pair=args.pair, device="", prompt=prompt, settings=settings.to_dict())
    record.lanes = {m: LaneRecord(method=m, prompt_ids=ids) for m in methods}
    for _ in run_lanes(pair, record, settings, threading.Event()):
        pass
    data = race_record(record, pair)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    ar = record.lanes["ar"].metrics()
    for lane, curve in zip(record.lanes.values(), data["lanes"], strict=True):
        m = lane.metrics()
        call = target_call_ratio(m, ar)
        versus = f", {curve['times_ar']:.2f}× AR" if curve["times_ar"] is not None else ""
        cost = f", one target call {call:.2f}× AR's" if call is not None and lane.method != "ar" else ""
        print(f"{curve['label']}: {m.new_tokens} tokens in {m.seconds:.2f} s{versus}{cost}")
    if uncompiled_shapes():
        print(f"uncompiled forwards: {'; '.join(uncompiled_shapes())}")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
