"""The page's run inputs, by name: one dataclass that app.py's widgets, the page's Run, the ``/run`` API
and a link's query all agree on, so no handler depends on the order of a list of widgets."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class RunForm:
    """What a run receives, unchecked (the API can send anything; :func:`mtad.ui.run.check_run` checks it by
    name). The fields' order is the ``/run`` API's parameter order."""

    prompt: object
    pair_name: object
    tau: object
    beams: object
    gamma: object
    max_new_tokens: object
    greedy: object
    temperature: object
    top_k: object
    top_p: object
    seed: object
    with_ar: object
    left: object
    right: object
    num_drafts: object
    tau1: object
    tau2: object

    def settings_values(self) -> dict[str, object]:
        """The values that become :class:`mtad.settings.Settings` (all but the prompt, pair, lanes and AR)."""
        values = asdict(self)
        for key in ("prompt", "pair_name", "with_ar", "left", "right"):
            values.pop(key)
        return values


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RunForm))


def widgets(**by_field: object) -> dict[str, object]:
    """Each form field's widget, in the form's order: app.py's ``inputs_kwargs`` for the run events (and the
    outputs a link fills). A field left out or unknown fails when the page is built, not at a visitor's run."""
    missing = [f for f in FIELDS if f not in by_field]
    unknown = [f for f in by_field if f not in FIELDS]
    if missing or unknown:
        raise TypeError(f"run form widgets: missing {missing}, unknown {unknown}")
    return {f: by_field[f] for f in FIELDS}
