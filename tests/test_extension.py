"""The extension rule as a test: a new drafter is ONE module in a `drafters/` folder + ONE YAML in
a `drafter/` config folder, and nothing else is edited.

The throwaway drafter below lives only in a temporary folder (tmp/drafters/toy.py and
tmp/conf/drafter/toy.yaml). It is written against the public interface alone (drafters/base.py
Drafter and register, the shared draft head and chain loop; no underscore name of the project,
checked below) and registers its config schema and one export layout of its own. The test checks
that it registers, trains a few steps through the real recipe (`python -m train` with the temporary
folder in $SPECDISTILL_DRAFTERS and on Hydra's search path), decodes losslessly (greedy output == the
plain target's), saves / loads, and exports in every layout it registered (its own and `hf`)."""
from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import write_chats

ROOT = Path(__file__).resolve().parents[1]

TOY = '''
"""Toy drafter: the next token from the last one alone (a bigram model): embed -> Linear -> head."""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from specdistill.drafters.base import DraftPrediction, Drafter, DrafterConfig, register
from specdistill.drafters.parts.head import head_logits, init_draft_head
from specdistill.drafters.parts.layouts import ExportLayout


@dataclass
class ToyConfig(DrafterConfig):
    name: str = "toy"  # registry key
    draft_vocab_size: Optional[int] = None  # pruned head size (None = the target's head, frozen)


def _write(drafter, state, ctx):  # our state dict under the names a made-up engine reads
    return ({"architectures": ["ToyDrafter"], **ctx.common()},
            {"toy.safetensors": {"bigram." + k: v for k, v in state.items()}})


def _read(files, dcfg, vocab_size):
    return {k[len("bigram."):]: v for k, v in files["toy.safetensors"].items()}


FLAT = ExportLayout(format="toy_flat", summary="a made-up engine's bigram layout.",
                    usage="toy-serve {base} --draft {path} --k {k}", write=_write, read=_read)


@register("toy", config=ToyConfig, layouts=(FLAT,))
class Toy(Drafter):
    def __init__(self, cfg: ToyConfig, target) -> None:
        super().__init__(target.vocab_size, cfg, target)  # target: a plain attribute, never saved
        self.proj = nn.Linear(target.hidden_size, target.hidden_size)
        init_draft_head(self, target.lm_head(), cfg.draft_vocab_size, target.vocab_size)
        self.to(target.device)

    def logits(self, ids):  # (..., ) target ids -> (..., Vd)
        h = self.proj(self.target.embed_tokens()(ids).float())
        return head_logits(self, h)

    def forward_train(self, batch):
        return [DraftPrediction(logits=self.logits(batch.input_ids))]  # shift 0: token t+1 from t

    @torch.no_grad()
    def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
        first = self.logits(state.tokens[-1]).float()
        return self.draft_chain(first, lambda i, tok: self.logits(tok).float(), k, sampling,
                                generator, min_confidence)
'''

YAML = """\
# Toy bigram drafter (tests/test_extension.py). Schema: drafters/toy.py ToyConfig.
defaults:
  - schema_toy
  - _self_

draft_vocab_size: 256  # a pruned head: exercises the draft vocab maps in training and export
"""


def private_names(source: str) -> list[str]:
    """The underscore names (dunders aside) a module's source imports or reads off an object."""
    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            found.append(f".{node.attr} (line {node.lineno})")
    return found


def test_the_toy_uses_only_the_public_interface():
    assert private_names(TOY) == []
    assert private_names("from a import _b\nx._y\nx.__class__") == ["import _b", "._y (line 2)"]


@pytest.fixture
def toy_folder(tmp_path):
    """tmp/drafters/toy.py + tmp/conf/drafter/toy.yaml, importable in this process too; the
    registration is undone afterwards."""
    (tmp_path / "drafters").mkdir()
    (tmp_path / "drafters" / "toy.py").write_text(textwrap.dedent(TOY))
    (tmp_path / "conf" / "drafter").mkdir(parents=True)
    (tmp_path / "conf" / "drafter" / "toy.yaml").write_text(YAML)
    import specdistill.drafters as drafters
    from specdistill.drafters import base

    path = list(drafters.__path__)
    os.environ[drafters.PATH_ENV] = str(tmp_path / "drafters")
    try:
        yield tmp_path
    finally:
        del os.environ[drafters.PATH_ENV]
        drafters.__path__[:] = path
        base.DRAFTERS.pop("toy", None)
        base.CONFIGS.pop("toy", None)
        sys.modules.pop("specdistill.drafters.toy", None)


def test_a_drafter_in_one_module_and_one_yaml(toy_folder, tiny_target_cfg):
    from specdistill.decode.spec import generate
    from specdistill.drafters.base import DRAFTERS
    from specdistill.export.folder import export_drafter, load_export
    from specdistill.store.drafter import load_drafter
    from specdistill.store.rundir import resolve_drafter
    from specdistill.target.model import load_target

    # 1. trains through the real recipe: `python -m specdistill.train drafter=toy`, nothing else edited
    run = toy_folder / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # SPECDISTILL_DRAFTERS: the fixture's
    cmd = [sys.executable, "-m", "specdistill.train", f"hydra.searchpath=[file://{toy_folder / 'conf'}]",
           "drafter=toy", "target=tiny", "data=jsonl",
           f"data.path={write_chats(toy_folder / 'c.jsonl', 16, 10)}",
           "data.max_length=64", "data.eval_fraction=0.25", f"data.cache_dir={toy_folder / 'cache'}",
           "trainer=smoke", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.save_every=2",
           "trainer.eval_conversations=1", "trainer.final_eval=null", "logger.kinds=[jsonl]",
           f"run_dir={run}"]
    done = subprocess.run(cmd, cwd=toy_folder, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = resolve_drafter(run).folder
    assert json.loads((saved / "drafter.json").read_text())["draft_vocab_size"] == 256  # the YAML's

    # 2. registers in this process too: importing the package finds every drafters/ folder
    import specdistill.drafters as drafters

    importlib.reload(drafters)
    assert "toy" in DRAFTERS and set(DRAFTERS["toy"].layouts) == {"hf", "toy_flat"}

    # 3. saves / loads, decodes losslessly
    target = load_target(tiny_target_cfg)
    toy = load_drafter(saved, target).eval()
    prompt = target.tokenizer("Continue from gamma.", return_tensors="pt")["input_ids"][0]
    plain = generate(target, None, prompt, max_new_tokens=12)
    spec = generate(target, toy, prompt, max_new_tokens=12, k=3)
    assert torch.equal(spec.tokens, plain.tokens) and sum(spec.drafted) > 0

    # 4. exports in every layout it registered, and reads each back
    ids = prompt[None]
    for fmt in sorted(DRAFTERS["toy"].layouts):
        out = export_drafter(toy, json.loads((saved / "drafter.json").read_text()), target, fmt,
                             toy_folder / f"export-{fmt}")["path"]
        back = load_export(out, target)
        with torch.no_grad():
            assert torch.equal(back.logits(ids), toy.logits(ids))
    assert (toy_folder / "export-toy_flat" / "toy.safetensors").is_file()
