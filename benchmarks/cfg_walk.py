"""How the main job's config travels through the floors: every read of the composed `cfg` on a
short tiny-target train job, by the module that reads it.

    python -m benchmarks.cfg_walk                      # eagle3 on the tiny target, 2 steps
    python -m benchmarks.cfg_walk drafter=dflash       # any train overrides after the flags

A read is a DictConfig attribute / item / `get` access made from one of our modules (the frame
that called OmegaConf). Consecutive reads by the same module are one stop; a climb is a stop on a
higher floor (tests/test_layout.py FLOORS) right after a stop on a lower one: the config went down
a floor and came back up. An upward read is a module on a lower floor reading a config section
owned by a higher floor (`trainer.*` read outside train/, `data.*` read in target/); the range
check (cli/ranges.py) reads every key by design and is left out of that count.

Writes <out>/cfg_walk.json and prints the stops and the totals.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from omegaconf import DictConfig

FLOORS = ("cli", "target", "drafters", "store", "export", "data", "decode", "train")
# the floor that owns each top-level section of the train config
OWNER = {"target": "target", "drafter": "drafters", "data": "data", "trainer": "train", "logger": "train",
         "deepspeed": "train", "budget": "train"}
VALIDATORS = ("specdistill.cli.ranges",)  # read every key by design (the range check at job start)


def reader(depth: int = 2) -> str | None:
    """The first of our modules up the stack (skipping OmegaConf and this file), or None."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("specdistill.") and not name.startswith("specdistill.cli.errors"):
            return name
        if name.startswith(("omegaconf", "benchmarks.cfg_walk", "__main__")) or name == __name__:
            frame = frame.f_back
            continue
        return None
    return None


def trace(reads: list[tuple[str, str]]):
    """Patch DictConfig's read paths to append (module, full key) to `reads`; returns the undo."""
    orig_getattr, orig_getitem, orig_get = DictConfig.__getattr__, DictConfig.__getitem__, DictConfig.get

    def log(node: DictConfig, key) -> None:
        module = reader(3)
        if module is not None and isinstance(key, str) and not key.startswith("_"):
            try:
                full = node._get_full_key(key)
            except Exception:  # noqa: BLE001 - a node mid-construction has no full key yet
                full = str(key)
            reads.append((module, full))

    def getattr_(self, key):
        log(self, key)
        return orig_getattr(self, key)

    def getitem_(self, key):
        log(self, key)
        return orig_getitem(self, key)

    def get_(self, key, default_value=None):
        log(self, key)
        return orig_get(self, key, default_value)

    DictConfig.__getattr__, DictConfig.__getitem__, DictConfig.get = getattr_, getitem_, get_

    def undo() -> None:
        DictConfig.__getattr__, DictConfig.__getitem__, DictConfig.get = orig_getattr, orig_getitem, orig_get
    return undo


def floor(module: str) -> str:
    return module.split(".")[1]


def summarise(reads: list[tuple[str, str]]) -> dict:
    stops: list[dict] = []
    for module, key in reads:
        if stops and stops[-1]["module"] == module:
            stops[-1]["reads"] += 1
            continue
        stops.append({"module": module, "floor": floor(module), "reads": 1, "first": key})
    rank = {f: i for i, f in enumerate(FLOORS)}
    climbs = [f"{a['module']} -> {b['module']}" for a, b in zip(stops, stops[1:])
              if rank[b["floor"]] > rank[a["floor"]]]
    upward = sorted({f"{m} reads {k}" for m, k in reads if m not in VALIDATORS
                     and OWNER.get(k.split(".")[0]) and rank[floor(m)] < rank[OWNER[k.split(".")[0]]]})
    return {"reads": len(reads), "stops": len(stops), "climbs": len(climbs), "climb_list": climbs,
            "upward_reads": upward, "stop_list": stops,
            "reads_list": [list(r) for r in reads]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out/cfg_walk")
    args, overrides = ap.parse_known_args(argv)
    reads: list[tuple[str, str]] = []
    run_dir = tempfile.mkdtemp(prefix="cfg_walk_")
    sys.argv = ["train", "target=tiny", "trainer=smoke", "drafter=eagle3", "trainer.max_steps=2",
                "trainer.final_eval=null", "logger=jsonl", f"run_dir={run_dir}", *overrides]
    from specdistill.train.__main__ import cli

    trace(reads)
    try:
        cli()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    result = summarise(reads)
    for s in result["stop_list"]:
        print(f"{s['floor']:9s} {s['module']:45s} {s['reads']:4d}  {s['first']}")
    print(f"\n{result['reads']} reads, {result['stops']} stops, {result['climbs']} climbs up a floor, "
          f"{len(result['upward_reads'])} upward reads")
    for c in result["climb_list"]:
        print("  climb:", c)
    for u in result["upward_reads"]:
        print("  upward:", u)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cfg_walk.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
