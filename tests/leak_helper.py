"""A helper module shared by cases, imported by the test process before its workers fork (as
a conftest's import would be): a global or a container a case changes reaches later cases."""

VALUE = 1
CONFIG = {"scale": 1.0}
