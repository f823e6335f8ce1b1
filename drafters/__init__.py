"""Drafters: the models that propose tokens for the frozen target to verify.

Importing the package imports every module of it, so each drafter registers itself
(base.register) with no list to edit: a new drafter is one module in drafters/ plus
conf/drafter/<name>.yaml. A drafter may also live outside this checkout: the folders named in
$SPECDISTILL_DRAFTERS (os.pathsep-separated) are searched too, with their YAML found through
`hydra.searchpath` (tests/test_extension.py writes one to a temporary folder).
"""
import importlib
import os
import pkgutil

PATH_ENV = "SPECDISTILL_DRAFTERS"  # extra folders of drafter modules, os.pathsep-separated

__path__ += [p for p in os.environ.get(PATH_ENV, "").split(os.pathsep)  # noqa: F821
             if p and os.path.isdir(p) and p not in __path__]  # noqa: F821

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")  # registration side effects
