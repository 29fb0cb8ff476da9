"""The web app's side of mtad: the page's event handlers, their shared state, and the rendering and
streaming that turn decoder ``Step``s into page updates.

Handlers, one job each: ``pickers`` (pairs, examples, the raced decoders), ``line`` (Run pressed, the
waiting line, Stop), ``run`` (a run, the page's and the ``/run`` API's), ``replay``, ``panel`` (the
verification panel's events) and ``link`` (links to a run); ``form`` names the run's inputs, ``outputs``
builds what run and replay show, ``state`` holds what every visitor shares (``PAGE``). Rendering:
``tokens``, ``cards``, ``figures``, ``verify``, ``race``: pure functions of recorded runs, tested without a
server. ``runner`` decodes the lanes on the device.

This is the only package of ``mtad`` that may import Gradio.
"""
