"""A committed folder's MANIFEST.json: the size and sha256 of every file in it, written before the
folder is committed (store/atomic.py) and checked by every reader (store/rundir.py): training
checkpoints and best/ (train/checkpoint.py) and exports (export/folder.py). A truncated, deleted
or overwritten file is then named instead of failing deep inside safetensors or torch.load.
"""
from __future__ import annotations

import json
from pathlib import Path

COMPLETE = "COMPLETE"  # written last into a committed folder (store/atomic.py commit_folder)
MANIFEST = "MANIFEST.json"  # every file's size and sha256, written before COMPLETE


def _files(folder: Path) -> list[Path]:
    """Every file under `folder` except the manifest and the COMPLETE marker, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def write_manifest(folder: Path) -> None:
    """Record size and sha256 of every file in `folder` (called on a staging folder)."""
    from specdistill.target.model import file_sha256

    entries = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
               for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


def verify(folder: Path, required: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with a committed folder (checkpoint, best/, export): [] when every file the
    manifest vouches for is there with its size and hash, and every `required` file exists. A folder
    written before manifests existed is checked for `required` files only."""
    from specdistill.target.model import file_sha256

    folder = Path(folder)
    problems = [f"{folder / f}: missing" for f in required if not (folder / f).is_file()]
    if not (folder / MANIFEST).is_file():
        return problems
    try:
        entries = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return problems + [f"{folder / MANIFEST}: unreadable ({e})"]
    for rel, want in sorted(entries.items()):
        f = folder / rel
        if not f.is_file():
            if f"{f}: missing" not in problems:
                problems.append(f"{f}: missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, the manifest says {want['size']} "
                            f"(truncated or overwritten)")
        elif file_sha256(f) != want["sha256"]:
            problems.append(f"{f}: content differs from the manifest's sha256 (corrupted)")
    return problems
