"""A helper module shared by cases, imported by the test process before its workers fork (as
a conftest's import would be): a global or a container a case changes reaches later cases."""

import types

import torch

VALUE = 1
CONFIG = {"scale": 1.0}
SETTINGS = types.SimpleNamespace(scale=1.0)
TABLE = torch.ones(3)
NESTED = {"opts": {"scale": 1.0}, "tables": [torch.ones(2)]}
LAYER = torch.nn.Linear(2, 2)
