"""Stage 1, a case on disk: ``case.toml`` (model, load), the payload, golden files, variants,
the binding of inputs to parameters, the vocabulary of generated calls, directories
written whole. Imports only ``base``; only ``payload`` touches torch, when it reads tensors.
"""
