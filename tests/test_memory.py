"""train/memory.py: the C heap's free pages go back to the OS, and the trainer asks for it every
trainer.log_every steps (a CPU job's resident memory otherwise climbs ~20 MB a step)."""
import subprocess
import sys

import pytest

from test_train import chat_file, make_cfg, run  # noqa: F401 (chat_file: a fixture)

HOLES = """
from specdistill.train.memory import _glibc, release_free_memory
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
big, small = [], []
for _ in range(3000):  # 64 KB blocks (under glibc's mmap threshold) between kept 1 KB ones
    big.append(bytearray(64 * 1024))
    small.append(bytearray(1024))
del big  # ~190 MB of holes inside the heap: free, but not at its top, so still resident
before = anon()
print(_glibc() is not None, release_free_memory(), before - anon())
"""


def test_freed_holes_in_the_heap_go_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, check=True)
    glibc, released, dropped_kb = out.stdout.split()
    if glibc != "True":
        pytest.skip("not glibc: release_free_memory does nothing here")
    assert released == "True"
    assert int(dropped_kb) > 150_000  # most of the 190 MB of holes left the process


def test_the_trainer_releases_free_memory_every_log_every_steps(tmp_path, chat_file, monkeypatch):
    from specdistill.train import recipe

    calls = []
    monkeypatch.setattr(recipe, "release_free_memory", lambda: calls.append(1) or True)
    r = run(make_cfg(tmp_path, chat_file, "trainer.max_steps=5", "trainer.log_every=2",
                     "trainer.eval_every=0", "trainer.save_every=0"))
    assert r.step == 5 and len(calls) == 3  # steps 2, 4 and the last
