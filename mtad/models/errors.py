"""The one error of the model side: a pair that cannot be named, loaded or used, said for the user."""

from __future__ import annotations


class PairError(ValueError):
    """A pair that cannot be loaded or used, with a message meant for the user."""
