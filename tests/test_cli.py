"""`specdistill <verb>`: the one command dispatches every verb to its entry point, names unknown
verbs and benchmarks in one line with exit 2, and its messages name the command as typed."""
import importlib
import os
import shutil
import subprocess
import sys

import pytest

from procs import ROOT
from specdistill.cli.errors import PROG_ENV
from specdistill.cli.main import VERBS, bench_names, benchmarks_folder, main


@pytest.fixture(autouse=True)
def own_prog_name():
    """main() names the command for the process it runs in (SPECDISTILL_PROG): give it back."""
    before = os.environ.get(PROG_ENV)
    yield
    if before is None:
        os.environ.pop(PROG_ENV, None)
    else:
        os.environ[PROG_ENV] = before


def test_every_verb_names_an_entry_point_that_exists():
    for verb, (entry, what) in VERBS.items():
        module, _, function = entry.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), verb
        assert what


def test_help_lists_the_verbs(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {verb} " in out for verb in VERBS)


def test_an_unknown_verb_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["trian"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "unknown verb 'trian'" in err and "train" in err


def test_bench_lists_the_checkouts_benchmarks_and_refuses_an_unknown_one(capsys, monkeypatch):
    folder = benchmarks_folder()
    assert folder == ROOT / "benchmarks"
    names = bench_names(folder)
    assert {"decode_speed", "throughput", "recipe_study", "peers"} <= set(names)  # peers: a package
    assert all(names.values()), "every benchmark's docstring says what it measures"
    monkeypatch.setattr(sys, "argv", ["specdistill", "bench"])
    main(["bench"])
    assert "decode_speed" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["specdistill", "bench", "nope"])
    with pytest.raises(SystemExit) as e:
        main(["bench", "nope"])
    assert e.value.code == 2 and "no benchmark 'nope'" in capsys.readouterr().err


def test_the_console_script_runs_a_verb_and_names_it_in_its_errors(tmp_path):
    exe = shutil.which("specdistill")
    assert exe, "pip install -e . installs the `specdistill` console script"
    out = subprocess.run([exe, "train", "--cfg", "job", "target=tiny"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "drafter:" in out.stdout, out.stderr[-2000:]
    bad = subprocess.run([exe, "decode", "ckpt=/nonexistent/run", "target=tiny"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    err = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and err[-1].startswith("specdistill decode: error:"), bad.stderr
