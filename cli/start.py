"""The start check of every Hydra command: the composed config is checked before any work.

Each command's command line (`cli()` / `main()`) calls `check_start` with its arguments, after its
schemas are in Hydra's ConfigStore and before `@hydra.main` runs:

1. every group choice (`drafter=eagle`, `budget=...`) must name a YAML file of conf/<group>/: an
   optional group (`optional budget`) would skip a missing file in silence, and Hydra's own list of
   choices holds the schemas' internal names; the error lists the files;
2. the config is composed as Hydra will compose it, and Hydra's and OmegaConf's errors (a key that is
   no setting, a wrong type, an unknown group, a parse error) become one line naming the key;
3. a `+key=` that adds a key to a schema (a key nothing reads) and a required setting left unset
   (`???`) are refused;
4. the settings that another setting makes void (cli/settings.py) are refused or warned.

Every refusal is a UserError: `<command>: error: <line>` and exit 2 (cli/errors.py).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Optional

from specdistill.cli.errors import UserError, prog, user_errors
from specdistill.cli.paths import CONF_DIR

# command-line flags of Hydra that take a value (the value is no override)
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--experimental-rerun"}
# flags that change what is composed: the check leaves those runs to Hydra
_OTHER_COMPOSITION = {"--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp"}
_MULTIRUN = {"--multirun", "-m"}


def groups(conf_dir: str = CONF_DIR) -> dict[str, list[str]]:
    """Each config group (a folder of conf/, hydra's own excepted) -> its choices (YAML stems)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(Path(conf_dir).iterdir()) if d.is_dir() and d.name != "hydra"}


def overrides(argv: list[str]) -> Optional[list[str]]:
    """The Hydra overrides of a command line (flags and their values dropped), or None when the
    line composes another config (--config-name / --config-dir) or asks for help."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _OTHER_COMPOSITION or flag in ("--help", "-h", "--hydra-help", "--shell-completion",
                                                  "-sc", "--run", "-r"):
            return None
        if arg in _FLAGS_WITH_VALUE:
            skip = arg in ("--cfg", "-c", "--package", "-p")
            continue
        if not arg.startswith("-"):
            out.append(arg)
    return out


def _override_parts(arg: str) -> tuple[str, str, str]:
    """(prefix '+', '++', '~' or '', key without @package, value) of one override."""
    prefix = re.match(r"^(\+\+|\+|~)?", arg).group(0)
    key, _, value = arg[len(prefix):].partition("=")
    return prefix, key.split("@", 1)[0], value


def searchpath(argv_overrides: list[str]) -> list[Optional[str]]:
    """The folders of a `hydra.searchpath=[file://...]` override (None for an entry that is not a
    file:// folder)."""
    out: list[Optional[str]] = []
    for arg in argv_overrides:
        _, key, value = _override_parts(arg)
        if key == "hydra.searchpath":
            for entry in filter(None, (e.strip().strip("'\"") for e in value.strip("[]").split(","))):
                out.append(entry[len("file://"):] if entry.startswith("file://") else None)
    return out


def check_group_choices(argv_overrides: list[str], multirun: bool = False,
                        conf_dir: str = CONF_DIR) -> None:
    """Refuse a group choice that names no file of conf/<group>/ (the choices listed)."""
    known = groups(conf_dir)
    for folder in searchpath(argv_overrides):  # a plugin's conf folders add their choices
        if folder is None:  # not a file:// folder (pkg://): left to the composition's own check
            return
        for group, choices in groups(folder).items():
            known[group] = sorted({*known.get(group, []), *choices})
    for arg in argv_overrides:
        prefix, key, value = _override_parts(arg)
        if prefix == "~" or key not in known or "${" in value:
            continue
        values = value.split(",") if multirun else [value]
        for v in values:
            v = v.strip()
            if v in ("null", "") or v in known[key]:
                continue
            raise UserError(f"{key}={v} names no file conf/{key}/{v}.yaml; the choices of {key}: "
                            f"{', '.join(known[key])}" + (" (or ~budget for none)" if key == "budget"
                                                          else ""))


def compose(config_name: str, argv_overrides: list[str], conf_dir: str = CONF_DIR) -> Any:
    """The config Hydra will compose for these overrides (its `hydra.` ones left to Hydra), with
    Hydra's and OmegaConf's errors turned into one UserError line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    mine = [a for a in argv_overrides if not _override_parts(a)[1].startswith("hydra")
            or _override_parts(a)[1] == "hydra.searchpath"]  # a plugin's conf folders compose too
    was = GlobalHydra.instance().is_initialized()
    if was:  # a caller inside Hydra already (tests): compose in a fresh one, then leave it cleared
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            return hydra_compose(config_name, overrides=mine)
    except Exception as e:  # noqa: BLE001 - every composition error is the user's config
        if _is_config_error(e):
            raise UserError(hydra_message(e)) from e
        if isinstance(e, (AssertionError, AttributeError)):  # OmegaConf on a key under a null node
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"the settings could not be composed ({first}): a key under a setting "
                            f"that is null (off) cannot be set alone; pick the group choice that "
                            f"turns it on (e.g. data=sharegpt_regen, data=sharegpt_selfgen)") from e
        raise


def _is_config_error(e: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(e, (HydraException, OmegaConfBaseException))


def _chain(e: BaseException) -> list[BaseException]:
    out = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def hydra_message(e: BaseException) -> str:
    """One line for a Hydra / OmegaConf composition error: the key, what is wrong, the fix."""
    chain = _chain(e)
    head = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    keyed = next((c for c in chain if getattr(c, "full_key", None)), None)
    where = re.match(r"In '([^']+)'", head)
    source = f" (set by conf/{where.group(1)}.yaml)" if where and "/" in where.group(1) else ""
    if keyed is None:
        if "Could not find" in str(e):
            return (head.split(": ", 1)[-1] + ": pick a file of the group's folder in conf/").rstrip()
        detail = [str(c).strip().splitlines()[0] for c in chain[1:] if str(c).strip()]
        return head + (f": {detail[0]}" if detail else "") + " (Hydra's override syntax: key=value)"
    key, first = keyed.full_key, str(keyed).strip().splitlines()[0]
    missing = re.match(r"Key '([^']+)' not in '?(\w+)'?", first)
    if missing:
        return (f"{key} is not a setting of {missing.group(2)}{source}: check its spelling "
                f"(`--cfg job` prints every setting), or pick a group choice that has it")
    value = re.search(r"Value '([^']*)'", first)
    return f"{key}{'=' + value.group(1) if value else ''}: {first}{source}: give it a value of its type"


def check_added_keys(cfg: Any, argv_overrides: list[str]) -> None:
    """Refuse `+a.b=v` where a is a schema (a dataclass): the key is no setting, nothing reads it
    (a free-form dict, like deepspeed.extra, takes any key)."""
    from omegaconf import OmegaConf

    for arg in argv_overrides:
        prefix, key, _ = _override_parts(arg)
        if prefix != "+" or key.startswith("hydra"):
            continue
        parent_key, _, name = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if OmegaConf.is_dict(parent) and OmegaConf.get_type(parent) not in (dict, None):
            raise UserError(f"+{key} adds a key that is no setting of "
                            f"{OmegaConf.get_type(parent).__name__}: nothing reads it; check its "
                            f"spelling (`--cfg job` prints every setting)")


def check_required(cfg: Any) -> None:
    """Refuse a config with required settings left unset (`???`), naming each."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"required setting{'s' if len(missing) > 1 else ''} not given: "
                        f"{', '.join(k + '=' for k in missing)}: give {'each' if len(missing) > 1 else 'it'} "
                        f"on the command line")


def start_check(command: str, config_name: str, argv: list[str], schema: Optional[type] = None,
                conf_dir: str = CONF_DIR) -> Any:
    """Steps 1-4 of the module docstring, and every numeric setting inside its range (`schema`:
    the command's dataclass, cli/ranges.py); returns the composed config (None: left to Hydra:
    another config, help, or a sweep, whose choices are still checked)."""
    from specdistill.cli.ranges import check_ranges
    from specdistill.cli.settings import check_void

    args = overrides(argv)
    if args is None:
        return None
    multirun = any(a in _MULTIRUN for a in argv)
    check_group_choices(args, multirun, conf_dir)
    if multirun:
        return None
    cfg = compose(config_name, args, conf_dir)
    check_added_keys(cfg, args)
    if not any(a in ("--cfg", "-c", "--info", "-i") for a in argv):  # a printed config may show ???
        check_required(cfg)
    if schema is not None:
        check_ranges(cfg, schema)
    for line in check_void(cfg, args):
        print(f"{prog(command)}: warning: {line}", file=sys.stderr, flush=True)
    return cfg


def check_start(command: str, config_name: str, argv: list[str], schema: Optional[type] = None) -> None:
    """start_check under the one-line error path: exit 2 with one line on a refusal."""
    with user_errors(command):
        start_check(command, config_name, argv, schema)
