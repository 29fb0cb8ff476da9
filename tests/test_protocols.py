"""Both engines answer the calls the decoders make (``mtad.decoding.protocols``), with the same parameters, and
the decoders are typed against those protocols only, never against one engine's classes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from test_feature_draft import feature_pair  # noqa: F401  (a fixture, used by name)

from mtad.decoding.kv import CachedLM
from mtad.decoding.protocols import Cache, LanguageModel, TreeLanguageModel
from mtad.decoding.state import DecodeState
from mtad.decoding.static_lm import StaticLM
from mtad.settings import Settings

DECODING = Path(__file__).resolve().parents[1] / "mtad" / "decoding"
ENGINE_CLASSES = {"CachedLM", "KVCache", "StaticLM", "StaticKV", "FeatureLM"}
ENGINE_MODULES = {"kv.py", "static_lm.py", "features.py", "graphs.py", "protocols.py"}


def protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    """The methods and properties a protocol declares (its own and inherited), by name."""
    out = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        for name, member in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                out[name] = None
            elif inspect.isfunction(member):
                out[name] = inspect.signature(member)
    return out


def assert_conforms(obj: object, protocol: type) -> None:
    """``obj`` has every member of ``protocol``, its methods taking the same parameters in the same order
    with the same defaults."""
    assert isinstance(obj, protocol), (type(obj).__name__, protocol.__name__)
    for name, wanted in protocol_methods(protocol).items():
        if wanted is None:
            assert not callable(getattr(obj, name)), name  # a property or an attribute, not a method
            continue
        got = inspect.signature(getattr(type(obj), name))
        shape = [(p.name, p.default) for p in wanted.parameters.values()]
        assert [(p.name, p.default) for p in got.parameters.values()] == shape, (type(obj).__name__, name)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_each_engine_s_models_and_caches_conform(tiny_pair, engine: str) -> None:
    lm = (
        CachedLM(tiny_pair.target, tiny_pair.vocab_size)
        if engine == "eager"
        else StaticLM(tiny_pair.target, tiny_pair.vocab_size)
    )
    assert_conforms(lm, TreeLanguageModel)
    assert_conforms(lm.cache, Cache)
    lm.feed(torch.tensor([tiny_pair.encode("abc")]))  # and after a forward, with positions held
    assert_conforms(lm.cache, Cache) and lm.cache.length == lm.length > 0


def test_a_feature_reading_draft_is_a_language_model(feature_pair) -> None:  # noqa: F811
    st = DecodeState.start(feature_pair, feature_pair.encode("ab"), Settings(method="sd"))
    assert type(st.draft).__name__ == "FeatureLM"
    assert_conforms(st.draft, LanguageModel)
    assert_conforms(st.draft.cache, Cache)


def test_the_conformance_check_catches_a_missing_or_renamed_parameter(tiny_pair) -> None:
    class Renamed(CachedLM):
        def rollback(self, keep: int) -> None:  # the protocol's parameter is length
            super().rollback(keep)

    with pytest.raises(AssertionError):
        assert_conforms(Renamed(tiny_pair.target, tiny_pair.vocab_size), TreeLanguageModel)


def annotation_names(tree: ast.AST) -> set[str]:
    """Every name used inside a type annotation (arguments, returns, annotated fields and variables)."""
    notes = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]
            notes += [a.annotation for a in args if a is not None and a.annotation is not None]
            notes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
    names = set()
    for note in filter(None, notes):
        text = ast.unparse(note)
        names |= {n.id for n in ast.walk(ast.parse(text.strip("'\""), mode="eval")) if isinstance(n, ast.Name)}
    return names


def test_the_decoders_are_typed_against_the_protocols_only() -> None:
    decoders = [p for p in sorted(DECODING.glob("*.py")) if p.name not in ENGINE_MODULES]
    assert len(decoders) > 15
    for path in decoders:
        named = annotation_names(ast.parse(path.read_text(encoding="utf-8"))) & ENGINE_CLASSES
        assert not named, (path.name, named)
    state = annotation_names(ast.parse((DECODING / "state.py").read_text(encoding="utf-8")))
    assert {"LanguageModel", "TreeLanguageModel"} <= state
