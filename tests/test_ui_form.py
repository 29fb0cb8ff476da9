"""The page's run inputs are matched by name, never by position: app.py's widgets, the page's Run, the
``/run`` API's parameters and a link's fields all follow :class:`mtad.ui.form.RunForm`."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from mtad.ui import link
from mtad.ui import run as runs
from mtad.ui.form import FIELDS, RunForm, widgets


def test_the_api_run_takes_the_forms_fields_in_order():
    names = list(inspect.signature(runs.run).parameters)
    assert names[:-1] == list(FIELDS) and names[-1] == "request"


def test_widgets_are_ordered_by_the_form_and_every_field_is_named_once():
    given = {name: object() for name in reversed(FIELDS)}
    assert list(widgets(**given)) == list(FIELDS)
    with pytest.raises(TypeError, match="missing \\['seed'\\]"):
        widgets(**{k: v for k, v in given.items() if k != "seed"})
    with pytest.raises(TypeError, match="unknown \\['max_new'\\]"):
        widgets(**given, max_new=object())


def test_settings_values_leave_out_the_prompt_pair_lanes_and_ar():
    form = RunForm(**{name: name for name in FIELDS})
    values = form.settings_values()
    assert "prompt" not in values and "pair_name" not in values and "left" not in values and "with_ar" not in values
    assert values["max_new_tokens"] == "max_new_tokens" and values["num_drafts"] == "num_drafts"


def test_a_link_fills_the_form_fields_by_name(monkeypatch):
    monkeypatch.setattr(link, "pair_choices", lambda: [("tiny", "tiny")])
    query = {"prompt": "abc", "pair": "tiny", "max_new": "9", "m": "3", "ar": "1", "left": "spectr", "it": "2"}
    *fields, wanted, _ = link.from_query(None, SimpleNamespace(query_params=query))
    by_name = dict(zip(FIELDS, fields, strict=True))
    assert by_name["prompt"]["value"] == "abc" and by_name["pair_name"]["value"] == "tiny"
    assert by_name["max_new_tokens"]["value"] == 9.0 and by_name["num_drafts"]["value"] == 3.0
    assert by_name["with_ar"]["value"] is True and by_name["left"]["value"] == "spectr"
    assert wanted == {"lane": None, "it": 2}
