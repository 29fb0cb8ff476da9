"""The token tree: shared prefixes stored once, each node attends to exactly its ancestors, the tree
forward's logits equal full recomputes, and the compacted cache equals a recompute (Llama, OPT, Qwen2)."""

from __future__ import annotations

import pytest
import torch
from conftest import cached_next_logits, full_logits
from test_architectures import arch_pair  # noqa: F401  (the OPT/Qwen2 pair fixture)

from mtad.decoding.kv import additive_mask
from mtad.decoding.multidraft import layout, multi_step
from mtad.decoding.specinfer import mss
from mtad.decoding.state import DecodeState
from mtad.decoding.tree import TokenTree, keep_path, tree_allow, verify_tree
from mtad.settings import Settings

SEQS = [[1, 2, 3], [1, 2, 4], [5, 2, 3], [1, 2, 3], [1, 6, 3]]


def test_shared_prefixes_are_stored_once() -> None:
    tree = TokenTree.from_sequences(SEQS)
    # distinct prefixes: (1) (1,2) (1,2,3) (1,2,4) (5) (5,2) (5,2,3) (1,6) (1,6,3)
    distinct = {tuple(s[: j + 1]) for s in SEQS for j in range(len(s))}
    assert len(tree) == len(distinct) == 9
    assert tree.paths[0] == tree.paths[3] and tree.paths[0][:2] == tree.paths[1][:2]
    for seq, path in zip(SEQS, tree.paths, strict=True):
        assert [tree.tokens[i] for i in path] == seq
        assert [tree.depths[i] for i in path] == [0, 1, 2]
        assert [tree.parents[i] for i in path] == [-1, *path[:-1]]  # -1: a child of the context


def test_each_node_sees_exactly_its_ancestors() -> None:
    tree = TokenTree.from_sequences(SEQS)
    prefix_of = {}  # node -> the token prefix it stands for, read off the sequences
    for seq, path in zip(SEQS, tree.paths, strict=True):
        for j, node in enumerate(path):
            prefix_of[node] = tuple(seq[: j + 1])
    seen = tree.ancestors()
    for i in range(len(tree)):
        for j in range(len(tree)):
            expected = prefix_of[i][: len(prefix_of[j])] == prefix_of[j]
            assert bool(seen[i, j]) == expected, (i, j)


def test_tree_mask_is_in_the_models_dtype() -> None:
    """The additive mask joins the attention scores: it must come in the model's dtype (bf16 on CPUs)."""
    tree = TokenTree.from_sequences([[7, 8], [7, 9]])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        mask = additive_mask(tree_allow(tree, past=3, pending=2), dtype)
        assert mask.dtype == dtype and mask.min() == torch.finfo(dtype).min and mask.max() == 0


def test_tree_mask_layout() -> None:
    tree = TokenTree.from_sequences([[7, 8], [7, 9]])  # nodes 7, 8, 9; 8 and 9 children of 7
    mask = additive_mask(tree_allow(tree, past=3, pending=2), torch.float32)
    allow = (mask == 0).int().tolist()
    assert allow == [
        [1, 1, 1, 1, 0, 0, 0, 0],  # pending token 1: the past and itself
        [1, 1, 1, 1, 1, 0, 0, 0],  # pending token 2
        [1, 1, 1, 1, 1, 1, 0, 0],  # node 7
        [1, 1, 1, 1, 1, 1, 1, 0],  # node 8: 7 and itself, not its sibling 9
        [1, 1, 1, 1, 1, 1, 0, 1],  # node 9
    ]


def check_tree_forward(pair) -> None:  # noqa: ANN001
    """Prefill part of the context, then one tree forward: every node's logits equal a full recompute."""
    ids = pair.encode("abc de fgh bad cafe")
    assert len(ids) > 3
    st = DecodeState.start(pair, ids, Settings(method="specinfer"))
    st.target.feed(torch.tensor([ids[:-2]], dtype=torch.long))  # two context tokens still pending
    seqs = [[5, 6, 7], [5, 6, 8], [9, 6, 7], [5, 10, 7]]
    tree = TokenTree.from_sequences(seqs)
    logits = verify_tree(st, tree)
    torch.testing.assert_close(logits[1], full_logits(pair.target, ids), rtol=1e-4, atol=1e-4)
    for seq, path in zip(seqs, tree.paths, strict=True):
        for j, node in enumerate(path):
            want = full_logits(pair.target, ids + seq[: j + 1])
            torch.testing.assert_close(logits[2 + node], want, rtol=1e-4, atol=1e-4)
    keep_path(st.target, len(ids), tree.paths[2][:2])  # keep 9, 6
    assert st.target.length == len(ids) + 2
    kept = ids + seqs[2][:2] + [3]  # one token past the cache, so the cached check runs a forward
    torch.testing.assert_close(
        cached_next_logits(st.target, kept), full_logits(pair.target, kept), rtol=1e-4, atol=1e-4
    )


def test_tree_forward_equals_recompute_llama(tiny_pair) -> None:  # noqa: ANN001
    check_tree_forward(tiny_pair)


def test_tree_forward_equals_recompute_other_architectures(arch_pair) -> None:  # noqa: ANN001, F811
    check_tree_forward(arch_pair)


def test_layout_falls_back_to_rows(tiny_pair, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    st = DecodeState.start(tiny_pair, tiny_pair.encode("abc"), Settings(method="specinfer"))
    assert layout(st, 4) == "tree" and layout(st, 1) == "rows"
    monkeypatch.setattr(tiny_pair.target.config, "_attn_implementation", "flash_attention_2")
    assert layout(st, 4) == "rows"


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_and_tree_agree(tiny_pair, greedy: bool) -> None:  # noqa: ANN001
    """Same seed, same draws: the two layouts produce the same tokens and keep correct caches."""
    s = Settings(method="specinfer", greedy=greedy, gamma=4, num_drafts=4, max_new_tokens=30, seed=5)
    out = {}
    for how in ("rows", "tree"):
        st = DecodeState.start(tiny_pair, tiny_pair.encode("abc de"), s)
        while st.remaining > 0 and not multi_step(st, mss, how).eos:
            for lm, model in ((st.target, tiny_pair.target), (st.draft, tiny_pair.draft)):
                torch.testing.assert_close(
                    cached_next_logits(lm, st.ids), full_logits(model, st.ids), rtol=1e-4, atol=1e-4
                )
        out[how] = st.ids
    assert out["rows"] == out["tree"]


@pytest.mark.parametrize("how", ["tree", "rows"])
def test_mtad_tree_never_accepts_a_padded_beam(tiny_pair, monkeypatch: pytest.MonkeyPatch, how: str) -> None:  # noqa: ANN001
    """top-p 0.05 leaves one token a step, so 3 of W = 4 beams are padding of joint q = 0. At tau = 0 the
    old rule passed their p/0 = inf prefixes; now no accepted token has q = 0, the tree leaves the padding
    out of the target's forward, and the caches stay equal to a recompute."""
    import math

    from mtad.decoding import DECODERS, mtad_tree, multidraft

    trees: list[TokenTree] = []
    real = multidraft.verify_tree
    monkeypatch.setattr(multidraft, "verify_tree", lambda st, tree: trees.append(tree) or real(st, tree))
    if how == "rows":  # as under an attention kernel without 4-D masks (flash attention)
        monkeypatch.setattr(mtad_tree, "layout", lambda st, n: "rows")
    s = Settings(method="mtad-tree", top_p=0.05, beams=4, gamma=3, tau=0.0, max_new_tokens=24, seed=3)
    st = DecodeState.start(tiny_pair, tiny_pair.encode("abc de"), s)
    padded = accepted = 0
    while st.remaining > 0:
        step = DECODERS["mtad-tree"].step(st)
        if step.beam_scores is None:  # the last token of the budget: a plain target step
            break
        dead = [not math.isfinite(x) for x in step.beam_scores]
        padded += sum(dead)
        assert not dead[step.chosen]
        assert all(math.isfinite(x) for x in step.log_q[: step.accepted])
        accepted += step.accepted
        if how == "tree":
            assert len(trees[-1].paths) == dead.count(False)
        for lm, model in ((st.target, tiny_pair.target), (st.draft, tiny_pair.draft)):
            torch.testing.assert_close(cached_next_logits(lm, st.ids), full_logits(model, st.ids), rtol=1e-4, atol=1e-4)
        if step.eos:
            break
    assert padded > 0 and accepted > 0  # the padding was there, and drafts were still accepted
    assert (len(trees) > 0) == (how == "tree")
