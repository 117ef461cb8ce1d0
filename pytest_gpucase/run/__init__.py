"""Stage 3, running: one ``RunSpec`` in a fresh child. ``isolation`` is the process mechanics
(it knows nothing of cases); ``parent`` is the pytest side of a run, ``child`` what the child
does, ``replay`` the generated calls of recorded cases, ``reference_cache`` the reference kept
between runs.
"""
