"""Runs at the start of every Python process that has this directory on PYTHONPATH (the `site` module).

It arms relaytrain_faults when a RELAYTRAIN_FAULT_* variable asks for a fault, and does nothing else.
A sitecustomize found later on sys.path (a distribution's or a virtual environment's) would be shadowed
by this one, so it is run afterwards, as if this file were not here.
"""

import importlib.machinery
import importlib.util
import os
import sys

import relaytrain_faults

relaytrain_faults.install()

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec(__name__, _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module
    _spec.loader.exec_module(_module)
