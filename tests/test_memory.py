"""train/memory.py: the C heap's free pages go back to the OS, and the trainer asks for it every
trainer.log_every steps (a CPU job's resident memory otherwise climbs ~20 MB a step); large
tensors come from the heap, not from a fresh mmap (and page faults) each."""
import os
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


REUSE = """
import resource, sys, torch
from specdistill.train.memory import _glibc, large_tensors_from_the_heap
said = large_tensors_from_the_heap() if sys.argv[1] == "heap" else "glibc's defaults"
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(20 << 20); del x  # 80 MB (a step's largest): over glibc's largest mmap threshold
before = faults()
for i in range(10):  # ~64 MB, written and freed again, as the logits of steps of other lengths are
    x = torch.ones((16 << 20) - 1000 * i); del x
print(_glibc() is not None, faults() - before, said)
"""


def test_large_tensors_reuse_the_heaps_pages_instead_of_faulting_in_new_ones():
    def faults(mode: str, **env) -> tuple[bool, int, str]:
        out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True,
                             check=True, env={**os.environ, **env})
        glibc, n, said = out.stdout.split(maxsplit=2)
        return glibc == "True", int(n), said.strip()

    glibc, default, _ = faults("default")
    if not glibc:
        pytest.skip("not glibc: large_tensors_from_the_heap does nothing here")
    _, heap, said = faults("heap")
    assert said.startswith("glibc: large tensors from the heap")
    assert default > 0 and heap * 10 < default, (default, heap)  # 16 k faults a tensor at 4 KB pages
    _, _, said = faults("heap", MALLOC_MMAP_MAX_="65536")  # the user's tunables win
    assert "set in the environment, kept" in said
