"""Beside the pipeline, each starting from a case or a training run: the Recorder
(``record``), ``minimize``, ``ablate``, ``show`` (``gpucase show`` / ``request``, secrets
removed by ``scrub``), ``validate`` (the dry run), and the helpers users call in their own
code (``checks``, ``checkpoint``).
"""
