"""The web app's helpers: token spans, the verification panel, plotly figures, cards and the run
orchestration that turns decoder ``Step``s into page updates.

This is the only package of ``mtad`` that may import Gradio (``mtad.ui.handlers`` does); the
rendering modules are pure functions of recorded runs, so they are tested without a server.
"""
