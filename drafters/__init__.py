"""Drafters: the models that propose tokens for the frozen target to verify.

Importing the package imports every module of it, so each drafter registers itself
(base.register) with no list to edit: a new drafter is one module in a `drafters/` folder plus
conf/drafter/<name>.yaml. `__path__` is extended over every `drafters/` folder on sys.path, so
a drafter may also live outside this checkout (tests/test_extension.py writes one to a temporary
folder).
"""
import importlib
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")  # registration side effects
