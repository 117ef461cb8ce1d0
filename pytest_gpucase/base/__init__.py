"""Layer 0, the foundation: errors, the backends table, atomic files, tensor walks, safe text.

Imports nothing else of the package. Nothing here imports torch at module level.
"""
