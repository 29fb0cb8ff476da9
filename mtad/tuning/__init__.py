"""Draft settings fastest on this machine: SD's γ, MTAD's γ and W, chosen by a cost model.

Tokens per target call (block efficiency) are the pair's, not the machine's: an acceptance table holds them,
measured once on held-out prompts for each candidate (:mod:`.table`). An iteration's seconds are the
machine's: they are timed where the pair runs, with the decoders themselves (:mod:`.timing`). The predicted
speed of a candidate is its block efficiency over its iteration's seconds, against AR's one token a forward
(:mod:`.choose`).
"""

from mtad.tuning.choose import Prediction, fastest, known_fastest, predict, tuned
from mtad.tuning.table import METHODS, AcceptanceTable, Candidate, candidates, warp_of
from mtad.tuning.timing import TIMING_PROMPT

__all__ = [
    "TIMING_PROMPT",
    "METHODS",
    "AcceptanceTable",
    "Candidate",
    "Prediction",
    "candidates",
    "fastest",
    "known_fastest",
    "warp_of",
    "predict",
    "tuned",
]
