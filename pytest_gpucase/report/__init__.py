"""Stage 5, reporting: the JSON report file, the compatibility matrix across reports and its
renderers, the GitHub step summary. Plain data in, text out: no torch, no pytest.
"""
