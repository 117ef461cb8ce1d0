"""Stage 2, planning: requirements against the environment, and a case expanded into the runs
(``RunSpec``) that become pytest items. Pure: nothing here starts a process.
"""
