"""Bad input as a new user meets it, beyond tests/test_faults.py: every command answers in one line
(exit 2, no traceback), refuses before any heavy work, reads no drafter folder unverified, and names
the target a checkpoint was trained for. In-process where the behaviour is the library's (through
the same `user_errors` the commands use); real processes, started together, where it is a
process's (exit code, one line, nothing written)."""
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from procs import pythonpath
from safetensors.torch import load_file, save_file
from test_train import chat_file, make_cfg  # noqa: F401  (fixture + config helper)

import specdistill.decode.engine.__main__ as engine_main
import specdistill.train.__main__  # noqa: F401  (stores the train schemas)
from specdistill.cli.errors import user_errors
from specdistill.data import capture, regenerate
from specdistill.data.prompts import PromptFormatError, load_prompts
from specdistill.data.sharegpt import DataFormatError, first_invalid_utf8
from specdistill.drafters.parts.layouts import ExportError
from specdistill.export.folder import load_resolved
from specdistill.store.drafter import TargetMismatch, check_trained_target
from specdistill.store.rundir import resolve_drafter
from specdistill.target.model import load_target
from specdistill.train import export

ROOT = Path(__file__).resolve().parents[1]
for _module in (capture, regenerate, export):
    _module.store_schema()


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _one_line(capsys, fn, *args) -> str:
    """fn(*args) inside the commands' `user_errors`: exit 2 and one line, no traceback."""
    with pytest.raises(SystemExit) as e:
        with user_errors("cmd"):
            fn(*args)
    err = capsys.readouterr().err.splitlines()  # (a library's progress bar may come first)
    lines = [ln for ln in err if "cmd: error: " in ln]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("cmd: error: "), err
    assert not any("Traceback" in ln for ln in err)
    return lines[0]


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A copy of the tiny trained run (best/, checkpoints step-2 and step-4, final eval) to damage."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


def _truncate(path: Path, size: int = 100) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


# -- data commands ----------------------------------------------------------------------------------
def test_capture_refuses_layers_the_target_lacks_and_a_missing_file(  # noqa: F811
        tmp_path, chat_file, capsys):
    out = tmp_path / "out"
    base = ["target=tiny", "data=jsonl", f"data.cache_dir={tmp_path / 'cache'}", f"out={out}"]
    cfg = _compose("capture", [*base, f"data.path={chat_file}", "layers=[99]"])
    err = _one_line(capsys, capture.run, cfg)
    assert "layers=[99]: [99] are not hidden states of target random-init Llama" in err
    assert "(0 = embeddings .. 2 = layer 2, or -1 = the final-normed state)" in err
    cfg = _compose("capture", [*base, f"data.path={tmp_path / 'none.jsonl'}"])
    assert f"data file {tmp_path / 'none.jsonl'} does not exist" in _one_line(capsys, capture.run, cfg)
    cfg = _compose("regenerate", [*base, f"data.path={tmp_path / 'none.jsonl'}"])
    assert "does not exist" in _one_line(capsys, regenerate.run, cfg)
    assert not out.exists()


def _bad_utf8_jsonl(path: Path) -> int:
    """Two good records, then one with a latin-1 byte; returns the bad byte's offset."""
    good = [json.dumps({"id": str(i), "conversations": [{"from": "human", "value": "hi"},
                                                        {"from": "gpt", "value": "ho"}]}) + "\n"
            for i in range(2)]
    bad = '{"id": "2", "conversations": [{"from": "human", "value": "caf'.encode() + b"\xe9" + \
        b'"}, {"from": "gpt", "value": "x"}]}\n'
    path.write_bytes("".join(good).encode() + bad)
    return len("".join(good)) + bad.index(b"\xe9")


def test_non_utf8_data_is_named_with_file_line_and_byte(tmp_path, tiny_target_cfg, capsys):
    from specdistill.data.dataset import DataConfig, load_chat_dataset

    f = tmp_path / "chats.jsonl"
    offset = _bad_utf8_jsonl(f)
    want = f"{f}:3: not UTF-8 text at line 3, byte offset {offset} (b'\\xe9"
    tok = load_target(tiny_target_cfg).tokenizer
    cfg = DataConfig(kind="file", path=str(f), cache_dir=str(tmp_path / "cache"))
    assert want in _one_line(capsys, load_chat_dataset, cfg, tok)  # train: inside `datasets`
    g = tmp_path / "chats.json"  # a JSON array, read in chunks
    g.write_bytes(b"[" + f.read_bytes().replace(b"}\n{", b"},\n{").rstrip(b"\n") + b"]")
    with pytest.raises(DataFormatError, match=r"chats\.json:3: not UTF-8 text at line 3"):
        load_chat_dataset(DataConfig(kind="file", path=str(g), cache_dir=str(tmp_path / "c2")), tok)
    p = tmp_path / "prompts.jsonl"  # decode's eval.kind=jsonl
    p.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptFormatError, match=r"prompts\.jsonl:2: not UTF-8 text at line 2, byte "
                                                r"offset 31"):
        load_prompts("jsonl", path=str(p))


def test_the_first_bad_byte_is_found_across_chunks(monkeypatch):
    import io

    from specdistill.data import sharegpt

    monkeypatch.setattr(sharegpt, "CHUNK_CHARS", 2)  # 'é' (2 bytes) split over two chunks: fine
    assert first_invalid_utf8(io.BytesIO("ab\né\nc".encode() + b"\xff")) == (3, 7, b"\xff")
    assert first_invalid_utf8(io.BytesIO("ab\né".encode())) == (0, -1, b"")


def test_an_unwritable_out_is_refused_before_hydra_and_the_probe_leaves_nothing(tmp_path, capsys):
    from specdistill.cli.paths import check_out_dir_arg

    for key, file, value in (("out", False, "/proc/specdistill-capture"),  # data.capture
                             ("out", True, "/proc/specdistill/regen.jsonl"),  # data.regenerate
                             ("out", True, str(tmp_path))):  # a folder where a file goes
        with pytest.raises(SystemExit) as e:
            check_out_dir_arg("cmd", ["target=tiny", f"{key}={value}"], key=key, file=file)
        assert e.value.code == 2 and f"cmd: error: cannot " in capsys.readouterr().err
    check_out_dir_arg("cmd", [f"out={tmp_path / 'a' / 'b' / 'r.jsonl'}"], key="out", file=True)
    check_out_dir_arg("cmd", [f"run_dir={tmp_path / 'c' / 'd'}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # writable: nothing created


# -- full disk, busy run dir ----------------------------------------------------------------------
def test_a_full_disk_is_one_line_and_other_os_errors_are_not_hidden(tmp_path, chat_file, capsys,  # noqa: F811
                                                                     monkeypatch):
    from specdistill.train import recipe, rundir

    def full():
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/step-2")

    err = _one_line(capsys, full)
    assert "no space left on the disk of /runs/x/checkpoints/step-2" in err and "run_dir=" in err
    with pytest.raises(ConnectionRefusedError):  # a bug or an outage, not the user's: traceback
        with user_errors("cmd"):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: SimpleNamespace(free=2**20))
    r = recipe.DistillRecipe(make_cfg(tmp_path, chat_file, "trainer.max_steps=2"))
    try:
        err = _one_line(capsys, r.setup)
    finally:
        r.release_lock()
    assert "only 1 MiB free under" in err and "set run_dir= to another disk" in err


# -- no drafter folder read unverified ------------------------------------------------------------
def test_a_damaged_drafter_is_named_and_a_run_dir_falls_back_loudly(run_copy, caplog, capsys):
    import benchmarks.decode_speed as bench

    best = run_copy / "best" / "drafter.safetensors"
    _truncate(best)
    for setting, fn in (("ckpt", lambda: resolve_drafter(run_copy / "best")),
                        ("--ckpt", lambda: bench.load_drafters(None, [str(run_copy / "best")], ["target"]))):
        err = _one_line(capsys, fn)
        assert f"{best}: 100 bytes, the manifest says" in err and f"={run_copy}, which falls back" in err
    with caplog.at_level(logging.WARNING):
        source = resolve_drafter(run_copy)  # decode ckpt=<run dir>, train.export run=<run dir>
    assert source.folder == run_copy / "checkpoints" / "step-0000004"
    assert "USING AN OLDER DRAFTER" in caplog.text
    assert "NOT the drafter the run's final eval" in source.fallback
    for step in (2, 4):
        (run_copy / "checkpoints" / f"step-{step:07d}" / "drafter.json").unlink()
    err = _one_line(capsys, resolve_drafter, run_copy)
    assert f"no drafter in {run_copy} verifies" in err and "step-0000002/drafter.json: missing" in err


def test_export_of_a_run_with_a_damaged_best_says_so_in_its_card(run_copy, tmp_path):
    _truncate(run_copy / "best" / "drafter.safetensors")
    cfg = OmegaConf.merge(OmegaConf.structured(export.ExportConfig),
                          {"run": str(run_copy), "out": str(tmp_path / "e"), "format": "hf"})
    export.run_export(cfg)
    card = (tmp_path / "e" / "README.md").read_text()
    assert "Warning: this export is not the drafter measured below" in card
    assert "checkpoints/step-0000004 is used" in card
    cfg.parity, cfg.out = True, str(tmp_path / "p")  # parity would compare with another drafter
    with pytest.raises(ExportError, match="parity compares with the drafter the final eval measured"):
        export.run_export(cfg)
    assert not (tmp_path / "p").exists()


def test_a_damaged_export_is_refused_by_every_reader(run_copy, tmp_path, tiny_target_cfg, capsys):
    from specdistill.export.folder import export_drafter, load_export

    target = load_target(tiny_target_cfg)
    source = resolve_drafter(run_copy)
    out = export_drafter(load_resolved(source, target), json.loads(
        (source.folder / "drafter.json").read_text()), target, "hf", tmp_path / "e")["path"]
    weights = next(out.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in a weight: the shapes still validate
    weights.write_bytes(bytes(raw))
    err = _one_line(capsys, resolve_drafter, out)  # decode ckpt=<export>
    assert f"{weights}: content differs from the manifest's sha256" in err
    with pytest.raises(ExportError, match="is damaged"):
        load_export(out, target)
    cfg = _compose("engine", ["target=tiny", f"export={out}", f"out={tmp_path / 'check'}"])
    assert "sha256" in _one_line(capsys, engine_main.run, cfg)  # before any engine starts
    assert not (tmp_path / "check").exists()


def test_bench_resolves_a_run_dir_like_decode(tiny_run, tiny_target_cfg):
    import benchmarks.decode_speed as bench

    target = load_target(tiny_target_cfg)
    [(label, drafter)] = bench.load_drafters(target, [str(tiny_run)], ["target"])
    assert label == "eagle (drafter float32)" and drafter.name == "eagle"


# -- a checkpoint for another target --------------------------------------------------------------
def test_a_drafter_for_another_target_names_both(run_copy, tmp_path, tiny_target_cfg, capsys):
    wide = tiny_target_cfg
    wide.model_config = {**wide.model_config, "hidden_size": 128}
    target = load_target(wide)
    err = _one_line(capsys, load_resolved, resolve_drafter(run_copy), target)
    assert "was trained for target random-init Llama" in err and "hidden 64, vocab" in err
    assert "the given target is random-init Llama" in err and "hidden 128, vocab" in err
    cfg = OmegaConf.merge(OmegaConf.structured(export.ExportConfig), {
        "run": str(run_copy), "out": str(tmp_path / "e"), "target": OmegaConf.structured(wide)})
    assert "hidden 128" in _one_line(capsys, export.run_export, cfg)  # train.export target=...
    # a folder saved before drafters recorded their target: its weights' shapes, and the run's
    old = run_copy / "checkpoints" / "step-0000004"
    save_file(load_file(old / "drafter.safetensors"), old / "drafter.safetensors",
              metadata={"name": "eagle"})
    (old / "MANIFEST.json").unlink()
    (run_copy / "best" / "COMPLETE").unlink()  # so the run dir resolves to step-4
    err = _one_line(capsys, load_resolved, resolve_drafter(run_copy), target)
    assert "does not fit target random-init Llama" in err and "size mismatch" in err
    assert "trained it for target tiny" in err
    assert not (tmp_path / "e").exists()


def test_a_tiny_checkpoint_on_the_default_target_names_both(tiny_run):
    smollm2 = SimpleNamespace(source="/pkgs/SmolLM2-135M-Instruct.Q4_1.gguf (from cache /c)",
                              hidden_size=576, vocab_size=49152, num_layers=30)
    with pytest.raises(TargetMismatch, match=r"trained for target random-init Llama .*hidden 64.*; "
                       r"the given target is /pkgs/SmolLM2-135M-Instruct\.Q4_1\.gguf \(hidden 576"):
        check_trained_target(tiny_run / "best", smollm2)


def test_ttt_length_past_the_batch_is_said_once(tiny_target_cfg, caplog):
    from specdistill.drafters.base import TrainBatch, build_drafter

    target = load_target(tiny_target_cfg)
    d = build_drafter({"name": "eagle3", "ttt_length": 7}, target)
    B, T = 1, 6
    batch = TrainBatch(input_ids=torch.randint(0, 100, (B, T)), attention_mask=torch.ones(B, T),
                       loss_mask=torch.ones(B, T), target_logits=torch.zeros(B, T, target.vocab_size),
                       features=torch.randn(B, T, 3 * target.hidden_size))
    with caplog.at_level(logging.WARNING):
        assert len(d.forward_train(batch)) == 4 and len(d.forward_train(batch)) == 4
    assert caplog.text.count("drafter.ttt_length=7 is longer than a batch of 6 tokens") == 1


# -- real processes -------------------------------------------------------------------------------
def test_every_command_refuses_bad_input_in_one_line(run_copy, tmp_path):
    """Four commands started together, each with a mistake a new user makes; each ends within
    seconds with exit 2, one `<command>: error:` line, no traceback, nothing of its own written."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    busy = tmp_path / "busy"
    busy.mkdir()
    lock = json.dumps({"pid": holder.pid, "host": os.uname().nodename, "started": time.time()})
    (busy / "run.lock").write_text(lock)
    _truncate(run_copy / "best" / "drafter.safetensors")
    cases = {  # command line -> what its one line must say
        ("specdistill.data.regenerate", "target=tiny", "batch_size=0", "max_new_tokens=-1",
         f"data.path={tmp_path / 'none.jsonl'}", f"out={tmp_path / 'r' / 'regen.jsonl'}"):
            "invalid settings: batch_size=0 is outside [1, 4096]; max_new_tokens=-1 is outside [1, 1048576]",
        ("benchmarks.decode_speed", "--limit", "0", "--k", "-1", "--batch", "--batch-sizes", "0",
         "--out", str(tmp_path / "b")):
            "invalid settings: limit=0 is outside [1, 1000000000]; k=-1 is outside [1, 64]; "
            "batch_sizes[0]=0 is outside [1, 4096]",
        ("decode", "target=tiny", f"ckpt={run_copy / 'best'}", f"run_dir={tmp_path / 'd'}"):
            f"ckpt={run_copy / 'best'} is damaged: {run_copy / 'best' / 'drafter.safetensors'}: 100",
        ("train", "target=tiny", "trainer=smoke", f"run_dir={busy}"):
            f"pid {holder.pid}",
    }
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("SPECDISTILL_DEBUG", None)
    try:
        t0 = time.time()
        procs = {args: subprocess.Popen([sys.executable, "-m", *args], cwd=tmp_path, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for args in cases}
        done = {args: (p.communicate(timeout=240), p.returncode) for args, p in procs.items()}
        seconds = time.time() - t0
    finally:
        holder.kill()
        holder.wait()
    for args, ((_, err), code) in done.items():
        assert code == 2 and cases[args] in err and "Traceback" not in err, (args, err[-2000:])
        assert len([ln for ln in err.splitlines() if ": error: " in ln]) == 1
    assert not (tmp_path / "r").exists() and not (tmp_path / "b").exists()
    assert not (tmp_path / "d" / "result.json").exists()
    assert (busy / "run.lock").read_text() == lock and not (busy / "config.yaml").exists()
    assert seconds < 120, seconds  # all four together, on two shared cores: refused at start
