"""Each browser or API session's copy of the page's components stays the size of the page.

Gradio 6 answers a property update (``gr.update(…)``, ``gr.skip()``) by building a new component and keeping it
in the session under the updated component's id, but the new component takes a fresh id of its own. A plain
value sent to that component afterwards is then kept under the fresh id, as one more component with its
value: the page's run stream skips unchanged lanes and plots, so every run left about a dozen of them, and the
session's record of the component's value went stale under its own id (docs/journal has the soak's figures).
"""

from __future__ import annotations

from gradio.blocks import Block
from gradio.state_holder import SessionState

_MARK = "_mtad_keeps_ids"


def keep_component_ids() -> None:
    """Make a session keep each updated component under the id it replaces (idempotent; one place, for every
    handler's updates). The updated component is never rendered, so its own id names nothing else."""
    setitem = SessionState.__setitem__
    if getattr(setitem, _MARK, False):
        return

    def __setitem__(self: SessionState, key: int, value: object) -> None:
        if isinstance(value, Block) and value._id != key and key in self.blocks_config.blocks:
            value._id = key
        setitem(self, key, value)

    setattr(__setitem__, _MARK, True)
    SessionState.__setitem__ = __setitem__
