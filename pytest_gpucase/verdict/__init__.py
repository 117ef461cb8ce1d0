"""Stage 4 (below planning, since the child computes it): outputs compared with a reference
(``compare``) and error texts read for what to check first (``triage``). Imports only ``base``.

``compare`` is the comparison's public entry and its walk; what counts as close is
``tolerance``'s, the words of a mismatch ``messages``'s, and ``_kernel`` only makes the
judging of tensor values fast, handing back a ``stats.TensorStats``.
"""
