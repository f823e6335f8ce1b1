"""`specdistill <verb> [settings...]`: the one command.

    specdistill train drafter=eagle3 target=smollm2     # = python -m train ...
    specdistill decode ckpt=runs/train/<run> eval=mtbench
    specdistill export run=runs/train/<run> format=vllm out=exports/e3
    specdistill capture out=/data/feats/smollm2          # the target's features, once
    specdistill regenerate out=runs/regen/sharegpt.jsonl # the target answers the prompts
    specdistill engine export=exports/e3                 # serve an export in vLLM / llama.cpp
    specdistill bench <name> [--args]                    # a benchmark of the checkout (benchmarks/)

Each verb runs its command's own entry point with the rest of the arguments; `specdistill` alone
or `--help` lists the verbs. The verbs name their entry points as strings, as console scripts do,
so this table is the one place that knows every command (tests/test_layout.py allows it).
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
from pathlib import Path

from specdistill.cli.errors import PROG_ENV, USAGE_EXIT

# verb -> (entry point "module:function", what it does)
VERBS = {
    "train": ("specdistill.train.__main__:cli", "distil a drafter from a frozen target (Hydra)"),
    "decode": ("specdistill.decode.__main__:cli", "decode an eval set with a drafter, losslessly"),
    "export": ("specdistill.train.export:main", "write a trained drafter in an engine's layout"),
    "capture": ("specdistill.data.capture:main", "capture the target's features of a data set"),
    "regenerate": ("specdistill.data.regenerate:main", "let the target answer a data set's prompts"),
    "engine": ("specdistill.decode.engine.__main__:cli", "serve an export in vLLM or llama.cpp"),
    "bench": ("specdistill.cli.main:bench", "run a benchmark of the checkout (benchmarks/<name>)"),
}


def usage() -> str:
    lines = ["usage: specdistill <verb> [settings...]   (specdistill <verb> --help for its own)", ""]
    lines += [f"  {verb:<11} {what}" for verb, (_, what) in VERBS.items()]
    return "\n".join(lines)


def benchmarks_folder() -> Path | None:
    """The checkout's benchmarks/ (beside cli/ in a source checkout; not part of a wheel)."""
    here = Path(__file__).resolve().parents[1] / "benchmarks"
    return here if (here / "__init__.py").is_file() else None


def bench_names(folder: Path) -> dict[str, str]:
    """Each benchmark's name -> the first line of its docstring: a module, or a package that runs
    as one (its __main__.py's docstring)."""
    import ast

    out = {}
    files = [*folder.glob("*.py"), *folder.glob("*/__main__.py")]
    for p in sorted(files):
        name = p.parent.name if p.name == "__main__.py" else p.stem
        if name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        out[name] = doc.strip().splitlines()[0] if doc.strip() else ""
    return dict(sorted(out.items()))


def bench() -> None:
    """`specdistill bench <name> [--args]`: python -m benchmarks.<name> from the checkout."""
    folder = benchmarks_folder()
    if folder is None:
        sys.exit(f"specdistill bench: error: the benchmarks ship with the source checkout, not the "
                 f"installed package; clone the repository and run `specdistill bench` (or "
                 f"`python -m benchmarks.<name>`) from its root")
    names = bench_names(folder)
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print("usage: specdistill bench <name> [--help | options]\n")
        print("\n".join(f"  {n:<16} {doc}" for n, doc in names.items()))
        return
    if args[0] not in names:
        print(f"specdistill bench: error: no benchmark {args[0]!r}; the benchmarks: "
              f"{', '.join(names)}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    sys.argv = [f"python -m benchmarks.{args[0]}", *args[1:]]
    runpy.run_module(f"benchmarks.{args[0]}", run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"specdistill: error: unknown verb {verb!r}; the verbs: {', '.join(VERBS)} "
              f"(specdistill --help)", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    module, _, function = VERBS[verb][0].partition(":")
    os.environ[PROG_ENV] = f"specdistill {verb}"  # the name its messages give the command
    sys.argv = [f"specdistill {verb}", *rest]
    getattr(importlib.import_module(module), function)()


if __name__ == "__main__":
    main()
