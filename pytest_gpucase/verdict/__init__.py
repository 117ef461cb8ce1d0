"""Stage 4 (below planning, since the child computes it): outputs compared with a reference
(``compare``) and error texts read for what to check first (``triage``). Imports only ``base``.
"""
