"""The benchmark behind the paper's tables and sweeps (``python -m mtad.bench``).

``cli`` is the command line, ``run`` decodes the cases, ``aggregate`` pools their rows, ``report`` writes
the table and files, ``plots`` draws the sweeps.
"""
