"""A token tree: several draft sequences with their shared prefixes stored once, verified in ONE
target row with a tree attention mask (each node sees the context and exactly its ancestors, at
the position its depth gives it), then the cache compacted to the kept path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad.decoding.protocols import LanguageModel
from mtad.decoding.state import DecodeState


@dataclass
class TokenTree:
    """Nodes in first-seen order; ``parents[i]`` is -1 for a child of the context; ``paths[w]``
    lists candidate w's node per position."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    paths: list[list[int]]

    @classmethod
    def from_sequences(cls, seqs: list[list[int]]) -> TokenTree:
        """Merge sequences: two that agree on their first j tokens share those j nodes."""
        tokens, parents, depths, paths = [], [], [], []
        index: dict[tuple[int, int], int] = {}
        for seq in seqs:
            node, path = -1, []
            for depth, tok in enumerate(seq):
                key = (node, tok)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    depths.append(depth)
                node = index[key]
                path.append(node)
            paths.append(path)
        return cls(tokens, parents, depths, paths)

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or one of i's ancestors."""
        n = len(self)
        seen = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):  # parents come before children
            if parent >= 0:
                seen[i] |= seen[parent]
        return seen


def tree_allow(tree: TokenTree, past: int, pending: int) -> torch.Tensor:
    """Which positions each query of one tree forward attends, [pending + N, past + pending + N] (True =
    attend): cached context visible to all, the pending context tokens causal, each node its ancestors."""
    n = len(tree)
    q = pending + n
    allow = torch.zeros(q, past + q, dtype=torch.bool)
    allow[:, :past] = True
    allow[:, past : past + pending] = torch.ones(q, pending, dtype=torch.bool).tril(diagonal=0)
    allow[pending:, past : past + pending] = True
    allow[pending:, past + pending :] = tree.ancestors()
    return allow


def verify_tree(st: DecodeState, tree: TokenTree) -> torch.Tensor:
    """One target forward over the unseen context then every tree node, in one row.

    Returns logits [pending + N, V]: row ``pending - 1`` predicts the first tokens, row
    ``pending + i`` the children of node i. The cache then holds every node: :func:`keep_path`."""
    lm = st.target
    pending = st.pending(lm)
    past, k = lm.length, pending.shape[1]
    nodes = torch.tensor([tree.tokens], dtype=torch.long, device=st.device)
    positions = list(range(past, past + k)) + [past + k + d for d in tree.depths]
    t0 = st.timer.mark()
    logits = lm.feed_masked(torch.cat([pending, nodes], dim=1), positions, tree_allow(tree, past, k))[0]
    st.spans["target"].append((t0, st.timer.mark()))
    return logits


def keep_path(lm: LanguageModel, context: int, nodes: list[int]) -> None:
    """Drop every cached tree node but ``nodes`` (the kept path), so the cache is the context
    (its first ``context`` positions) followed by the kept tokens in order."""
    lm.cache.keep_positions(list(range(context)) + [context + i for i in nodes])
