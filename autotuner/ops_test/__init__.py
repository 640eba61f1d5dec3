"""The ops, one decorated function each (autotuner.ops_test.base.register_op), in the ``*_ops`` modules.

Importing the package imports every ``*_ops`` module in it, by name, so an op in a new module is found
without a list to edit; autotuner.ops_test.places derives model order and the tables from what they
registered.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name.endswith("_ops"):
        importlib.import_module(f"{__name__}.{_module.name}")
