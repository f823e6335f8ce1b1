"""Settings that another setting makes void, as data: each is refused or warned at job start.

A rule names the setting that decides (`key`), the one it makes void (`void`), when, and why. Two
levels:

- REFUSE: the job would run and do something other than what the command line asked (an on-policy
  phase that never starts, a features folder nobody reads, a regeneration that self-generation
  replaces): the start check (cli/start.py) ends the command with one line naming both keys and the
  fix. When neither key was typed (a shipped YAML's value: a budget's phase start under a short
  max_steps) it is warned instead;
- WARN: a setting the user typed on the command line is void under the other (a sampling seed of
  greedy decoding, the limit of a final eval that is off): one WARNING line naming both keys.

A WARN rule fires only for a key the user set on the command line (`key=` / `+key=`), never for a
value a shipped YAML holds. The rules read the composed config by dotted key; a config without the
key (another command) never matches, so one table serves every command.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

REFUSE, WARN = "refuse", "warn"


def get(cfg: Any, key: str) -> Any:
    """The value at dotted `key` (None: absent, null or ???)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - an interpolation that resolves only at run time
        return None


def _no_heads_step(c: Any) -> bool:
    start, steps = get(c, "trainer.on_policy_heads_start"), get(c, "trainer.max_steps")
    return start is not None and steps is not None and math.ceil(start * steps) >= steps


def _selfgen_only(c: Any) -> bool:  # every row self-generated: no capture of the file's rows
    return get(c, "data.selfgen") is not None and not get(c, "data.selfgen.mix")


def _greedy(prefix: str) -> Callable[[Any], bool]:
    return lambda c: get(c, f"{prefix}temperature") == 0 and get(c, f"{prefix}temperature") is not None


@dataclass(frozen=True)
class Void:
    """`void` does nothing when `when(cfg)` holds; `key` is the setting that decides it."""

    key: str
    void: str
    when: Callable[[Any], bool]
    why: str  # what happens instead, and the fix
    level: str = WARN
    # a REFUSE rule refuses when the user typed either key ("either") or `key` itself ("key"); a
    # shipped YAML's value that fires it (a budget's phase start under a short max_steps) is warned
    typed: str = "either"


RULES: tuple[Void, ...] = (
    Void("trainer.on_policy_heads_start", "trainer.max_steps", _no_heads_step,
         "the on-policy heads phase starts at or after the last step, so no on-policy step runs: "
         "set trainer.on_policy_heads_start below 1 (0.9: the last tenth), or null for none",
         REFUSE, typed="key"),
    Void("trainer.on_policy_fraction", "trainer.on_policy_start_step",
         lambda c: (get(c, "trainer.on_policy_fraction") or 0) > 0
         and (get(c, "trainer.on_policy_start_step") or 0) >= (get(c, "trainer.max_steps") or 1),
         "on-policy batches start at or after trainer.max_steps, so none is ever trained on: set "
         "trainer.on_policy_start_step below trainer.max_steps", REFUSE),
    Void("data.selfgen", "trainer.features_dir", lambda c: _selfgen_only(c)
         and get(c, "trainer.features_dir") is not None,
         "self-generation writes the features with its rows and no capture is read: drop "
         "trainer.features_dir (or set data.selfgen.mix=true to train on the file's rows too)", REFUSE),
    Void("trainer.features", "trainer.features_dir",
         lambda c: get(c, "trainer.features") == "online" and get(c, "trainer.features_dir") is not None,
         "online features are computed every step and never read from a folder: add "
         "trainer.features=offline to train on that capture, or drop trainer.features_dir", REFUSE),
    Void("data.selfgen", "data.regenerate",
         lambda c: get(c, "data.selfgen") is not None and get(c, "data.regenerate") is not None,
         "self-generation answers the prompts itself and the regenerated answers are never made: "
         "keep one (data=sharegpt_selfgen or data=sharegpt_regen)", REFUSE),
    Void("data.selfgen", "trainer.capture_features_dtype",
         lambda c: _selfgen_only(c) and get(c, "trainer.features") == "offline",
         "the features are those self-generation stored (data.selfgen.features_dtype); no capture runs"),
    Void("trainer.features", "trainer.capture_features_dtype",
         lambda c: get(c, "trainer.features") == "online",
         "online features are never stored: set trainer.features=offline to store a capture"),
    *(Void("trainer.on_policy_fraction", f"trainer.on_policy_{k}",
           lambda c: (get(c, "trainer.on_policy_fraction") or 0) == 0,
           "on-policy batches are off (0): set trainer.on_policy_fraction > 0 to use them")
      for k in ("max_new_tokens", "temperature", "start_step")),
    *(Void("trainer.on_policy_heads_start", f"trainer.on_policy_heads_{k}",
           lambda c: get(c, "trainer.on_policy_heads_start") is None,
           "the on-policy heads phase is off (null): set trainer.on_policy_heads_start to use it")
      for k in ("depth", "anchors", "rows")),
    *(Void("trainer.final_eval", f"trainer.final_eval_{k}",
           lambda c: get(c, "trainer.final_eval") is None and get(c, "trainer") is not None,
           "the final eval is off (null): set trainer.final_eval=mtbench to run it")
      for k in ("limit", "max_new_tokens")),
    Void("trainer.engine_check", "trainer.engine_check_limit",
         lambda c: get(c, "trainer") is not None and get(c, "trainer.engine_check") is None,
         "the engine check is off (null): set trainer.engine_check=vllm to run it"),
    Void("trainer.backend", "deepspeed",
         lambda c: get(c, "trainer.backend") not in (None, "deepspeed"),
         "the DeepSpeed settings are read by trainer.backend=deepspeed only"),
    *(Void("logger.kinds", f"logger.wandb_{k}",
           lambda c: get(c, "logger.kinds") is not None and "wandb" not in get(c, "logger.kinds"),
           "W&B is not among the loggers: add wandb to logger.kinds (or logger=default)")
      for k in ("mode", "project", "entity", "run_name", "tags")),
    Void("logger.kinds", "logger.tensorboard_dir",
         lambda c: get(c, "logger.kinds") is not None and "tensorboard" not in get(c, "logger.kinds"),
         "TensorBoard is not among the loggers: add tensorboard to logger.kinds (logger=tensorboard)"),
    *(Void(f"{p}temperature", f"{p}seed", _greedy(p),
           "greedy answers (temperature 0) draw no samples: set a temperature > 0 to sample")
      for p in ("", "data.selfgen.", "data.regenerate.")),
    *(Void("temperature", k, _greedy(""),
           "greedy decoding (temperature 0) takes the most likely token: set a temperature > 0")
      for k in ("top_k", "top_p")),
    *(Void("k", k, lambda c: get(c, "k") == 0 and get(c, "drafter") is not None,
           "k=0 decodes plainly with the target, nothing is drafted: set k >= 1")
      for k in ("tree", "min_confidence")),
)


def user_keys(argv_overrides: list[str]) -> set[str]:
    """The dotted keys (and groups) the command line sets."""
    out = set()
    for arg in argv_overrides:
        key, sep, _ = arg.lstrip("+~").partition("=")
        if sep:
            out.add(key.split("@", 1)[0])
    return out


def _typed(key: str, typed: set[str], group: bool = False) -> bool:
    """Did the command line set `key` or a key under it (group: or the group holding it, data=)?"""
    return any(t == key or t.startswith(key + ".") or (group and key.startswith(t + "."))
               for t in typed)


def _level(rule: Void, typed: set[str]) -> str | None:
    """REFUSE, WARN or None (silent) for a rule that fires, by what the user typed."""
    if rule.level == WARN:
        return WARN if _typed(rule.void, typed) else None
    either = rule.typed == "either"
    asked = _typed(rule.key, typed, group=either) or (either and _typed(rule.void, typed, group=True))
    return REFUSE if asked else WARN


def void_settings(cfg: Any, argv_overrides: list[str]) -> list[tuple[str, str]]:
    """(REFUSE or WARN, one-line message) of every rule that fires on this config and command
    line, naming both keys and their values."""
    typed = user_keys(argv_overrides)
    out = []
    for rule in RULES:
        level = _level(rule, typed)
        if level is None or (rule.level == REFUSE and get(cfg, rule.key) is None) or not rule.when(cfg):
            continue
        shown = f"{rule.key}={_show(get(cfg, rule.key))}"
        void = f"{rule.void}={_show(get(cfg, rule.void))}"
        say = f"{shown} with {void}" if rule.level == REFUSE else f"{void} does nothing with {shown}"
        out.append((level, f"{say}: {rule.why}"))
    return out


def _show(v: Any) -> str:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(v):
        return "(set)"
    return "null" if v is None else str(v)


def check_void(cfg: Any, argv_overrides: list[str]) -> list[str]:
    """Refuse the first REFUSE rule that fires (UserError naming both keys); else return the
    warnings (one line each) for the caller to print."""
    from specdistill.cli.errors import UserError

    fired = void_settings(cfg, argv_overrides)
    refused = [msg for level, msg in fired if level == REFUSE]
    if refused:
        raise UserError(refused[0])
    return [msg for level, msg in fired if level == WARN]
