"""Token ids to display pieces: each token's exact share of the decoded text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def token_pieces(tokenizer: PreTrainedTokenizerBase, context_ids: list[int], ids: list[int]) -> list[str]:
    """The text each of ``ids`` adds after ``context_ids``, by differences of cumulative decodes.

    Decoding tokens one by one breaks multi-byte characters and leading-space rules; the
    differences always join back to exactly the decoded text.
    """
    tail = list(context_ids[-8:])
    prev = tokenizer.decode(tail, skip_special_tokens=True)
    pieces = []
    for t in ids:
        tail.append(t)
        cur = tokenizer.decode(tail, skip_special_tokens=True)
        pieces.append(cur[len(prev) :] if cur.startswith(prev) else cur)
        prev = cur
    return pieces
