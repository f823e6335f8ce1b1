"""train/memory.py: the C heap's free pages go back to the OS, and the trainer asks for it after
every step (a CPU job's resident memory otherwise climbs ~20 MB a step)."""
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


AFTER_A_LARGE_FREE = """
import sys
from specdistill.train.memory import mmap_large_blocks
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
setting = mmap_large_blocks(int(sys.argv[1])) if sys.argv[1] != "none" else None
big = bytearray(b"1") * (20 << 20)  # mmapped; freeing it lifts glibc's dynamic threshold to 20 MB
del big
blocks, kept = [], []
for _ in range(30):  # 120 MB of 4 MB blocks, each written, with a kept 1 KB block after each
    blocks.append(bytearray(b"1") * (4 << 20))
    kept.append(bytearray(1024))
before = anon()
del blocks
print(setting, before - anon())
"""


def test_a_fixed_mmap_threshold_hands_freed_blocks_back_to_the_os():
    """trainer.mmap_threshold_mb: with glibc's own threshold, 4 MB blocks allocated after a 20 MB
    block was freed come from the heap and stay resident when freed; at 1 MB they are mmapped
    and leave the process when freed."""
    def freed_kb(arg):
        out = subprocess.run([sys.executable, "-c", AFTER_A_LARGE_FREE, arg], capture_output=True,
                             text=True, check=True).stdout.split()
        return out[0], int(out[1])

    setting, with_it = freed_kb("1")
    if setting != "True":
        pytest.skip("not glibc: mallopt is not there")
    _, without = freed_kb("none")
    assert with_it > 100_000  # most of the 120 MB left the process at once
    assert with_it > without + 60_000  # glibc's own threshold kept them in the heap


def test_the_mmap_threshold_setting_is_applied_or_said(tmp_path, chat_file, monkeypatch, caplog):
    from specdistill.train import recipe

    got = []
    monkeypatch.setattr(recipe, "mmap_large_blocks", lambda mb: got.append(mb) or False)
    run(make_cfg(tmp_path, chat_file, "trainer.max_steps=1", "trainer.mmap_threshold_mb=2",
                 "trainer.eval_every=0", "trainer.save_every=0"))
    assert got == [2]
    assert "trainer.mmap_threshold_mb=2 is ignored: no glibc" in caplog.text


def test_the_trainer_releases_free_memory_after_every_step(tmp_path, chat_file, monkeypatch):
    from specdistill.train import recipe

    calls = []
    monkeypatch.setattr(recipe, "release_free_memory", lambda *mapped: calls.append(1) or True)
    r = run(make_cfg(tmp_path, chat_file, "trainer.max_steps=5", "trainer.log_every=2",
                     "trainer.eval_every=0", "trainer.save_every=0"))
    assert r.step == 5 and len(calls) == 5  # whatever trainer.log_every says


def test_the_trainer_unmaps_the_capture_after_every_batch_it_reads(tmp_path, chat_file, monkeypatch):
    """The capture's memory-mapped pages count as the job's resident memory until unmapped: the
    trainer drops its shard handles after each batch it reads from them, and reads after that are
    the same (the shards reopen)."""
    import torch

    from specdistill.data.capture import OfflineFeatures

    calls, release = [], OfflineFeatures.release
    monkeypatch.setattr(OfflineFeatures, "release", lambda self: calls.append(len(self._open))
                        or release(self))
    r = run(make_cfg(tmp_path, chat_file, "trainer.max_steps=5", "trainer.log_every=2",
                     "trainer.features=offline", "trainer.eval_every=0", "trainer.save_every=0"))
    assert r.step == 5 and len(calls) == 5 * r.tcfg.grad_accum  # each micro-batch read
    assert all(n > 0 for n in calls)  # with the shards it had opened
    assert not r.offline._open  # the last step unmapped them
    rows = [r.train_ds[i] for i in range(3)]
    T = max(len(x["input_ids"]) for x in rows)
    before = r.offline.batch([0, 1, 2], rows, T)
    assert r.offline._open
    r.offline.release()
    assert not r.offline._open
    for a, b in zip(before, r.offline.batch([0, 1, 2], rows, T)):
        assert torch.equal(a, b)


HUGE = """
import os, resource, sys
from specdistill.train.memory import large_tensors_in_huge_pages
turned_on = large_tensors_in_huge_pages()
import torch
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(64 << 20, dtype=torch.uint8)  # 64 MB written: 16 k faults in 4 KB pages, 32 in 2 MB ones
print(turned_on, os.environ.get("THP_MEM_ALLOC_ENABLE"),
      resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def test_large_tensors_take_huge_pages_and_the_users_setting_stands():
    """The job (train/__main__.py) backs tensors >= 2 MB with transparent huge pages: a 64 MB tensor
    costs a few dozen page faults instead of 16 k; the variable is gone from the environment
    afterwards (subprocesses keep their defaults), and a user's own THP_MEM_ALLOC_ENABLE stands."""
    import os
    from pathlib import Path

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not mode.is_file() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this machine")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    assert out[:2] == ["True", "None"] and int(out[2]) < 2_000, out
    out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, check=True,
                         env={**env, "THP_MEM_ALLOC_ENABLE": "0"}).stdout.split()
    assert out[:2] == ["False", "0"], out
    if "[madvise]" in mode.read_text():  # huge pages only where asked for: the user's 0 is 4 KB pages
        assert int(out[2]) > 10_000, out


def test_the_engine_check_starts_after_the_training_and_the_decoders_copies_are_freed(
        tmp_path, chat_file, monkeypatch):
    """vLLM's engines start beside the job (~1.6 GiB each): by then the optimizer's moments are
    gone (the gradients already are), and so are the decoder's bf16 copies of the target and the
    best drafter (nothing still refers to them); the check gets the training copies, as before."""
    import weakref

    from specdistill.target.model import load_target
    from specdistill.train import final_eval as fe
    from specdistill.train.recipe import DistillRecipe

    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=3", "trainer.eval_every=3",
                   "trainer.save_every=3", "trainer.final_eval=mtbench", "trainer.final_eval_limit=1",
                   "trainer.final_eval_max_new_tokens=4", "trainer.engine_check=vllm")
    r = DistillRecipe(cfg)
    r.setup()
    r.train()
    assert r.optimizer.state  # Adam's moments: twice the drafter's size
    copies, cast = [], fe.cast_drafter
    monkeypatch.setattr(fe, "decode_target", lambda cfg, trained: copies.append(
        weakref.ref(t := load_target(cfg.target))) or t)  # a copy, as on a bf16 machine
    monkeypatch.setattr(fe, "cast_drafter", lambda *a: copies.append(weakref.ref(d := cast(*a))) or d)
    seen = {}

    def engine_eval(cfg, run_dir, target, drafter, ours, loggers, step, ours_dtype):
        seen.update(alive=[ref() is not None for ref in copies], state=dict(r.optimizer.state),
                    grads=[p.grad for p in r.params if p.grad is not None],
                    training_copies=(target is r.target, drafter is r.drafter), rows=len(ours),
                    ours_dtype=ours_dtype)
        return None

    monkeypatch.setattr(fe, "engine_eval", engine_eval)
    r.final_eval()
    r.cleanup()
    assert seen == {"alive": [False, False], "state": {}, "grads": [], "training_copies": (True, True),
                    "rows": 1, "ours_dtype": str(r.target.dtype).removeprefix("torch.")}
