"""The drafters' config schemas in Hydra's ConfigStore (group `drafter`, as `schema_<name>`).

Each conf/drafter/<name>.yaml starts from `schema_<name>`, so a misspelt key or a wrong type in a
drafter's YAML fails at start with Hydra's message. The schemas live with the drafters that own
them: every entry point (`python -m train`, `python -m decode`, export) stores them from here
before Hydra composes, and none has to reach into another entry point's config module for it.
"""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

import specdistill.drafters  # noqa: F401  (importing the package registers every drafter and its schema)
from specdistill.drafters.base import CONFIGS


def store_drafter_schemas() -> list[str]:
    """Store every registered drafter's schema; returns the names stored, sorted."""
    cs = ConfigStore.instance()
    for name, schema in CONFIGS.items():
        cs.store(group="drafter", name=f"schema_{name}", node=schema)
    return sorted(CONFIGS)
