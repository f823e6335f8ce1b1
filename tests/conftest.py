"""Shared fixtures: tiny random-init targets, an isolated cache, and one tiny trained run."""
import json
import os
from pathlib import Path

import pytest
import torch

from specdistill.target.model import TargetConfig

TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


@pytest.fixture
def tiny_target_cfg() -> TargetConfig:
    """The `target=tiny` config: random-init 2-layer Llama with the (cached) SmolLM2 tokenizer."""
    return TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                        model_config=dict(TINY_MODEL), seed=0,
                        dtype="float32")  # pinned like conf/target/tiny.yaml: auto is bf16 on some CPUs


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_chats(path: Path, n: int, length: int) -> Path:
    """n small ShareGPT conversations with learnable structure: each answer continues a cyclic
    word list for `length` words from where the question starts."""
    with open(path, "w") as f:
        for i in range(n):
            seq = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(length))
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": f"Continue from {WORDS[i % len(WORDS)]}."},
                {"from": "gpt", "value": seq}]}) + "\n")
    return path


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N workers share the cores, one thread
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # each (subprocesses included), as a
        torch.set_num_threads(1)  # second spinning OpenMP thread per worker only adds contention
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a hub
    os.environ.setdefault("WANDB_MODE", "offline")  # W&B never reaches its servers from tests
    os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A finished training run on the tiny target, logged to every logger kind, with a final
    decoder eval: EAGLE in the layout serving engines load (full vocab, no layer-0 input norm).
    Shared by the report and export tests (about 10 s on 2 cores)."""
    from hydra import compose, initialize_config_dir

    import specdistill.train.__main__  # noqa: F401  (stores the schemas)
    from specdistill.train.recipe import DistillRecipe

    root = tmp_path_factory.mktemp("tiny_run")
    chats = write_chats(root / "chats.jsonl", 24, 10)
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=96",
            "data.eval_fraction=0.2", f"data.cache_dir={root / 'cache'}", "trainer=smoke",
            "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=2",
            "trainer.eval_conversations=1",
            "trainer.final_eval=mtbench", "trainer.final_eval_limit=2",
            "trainer.final_eval_max_new_tokens=12", "trainer.eval_k=3",
            f"run_dir={root / 'run'}", "logger.kinds=[console,jsonl,wandb,tensorboard]",
            "drafter=eagle", "drafter.draft_vocab_size=null", "drafter.input_norm=false"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second OpenMP thread only adds contention
    try:
        recipe = DistillRecipe(cfg)
        recipe.setup()
        recipe.train()
        recipe.final_eval()
        recipe.cleanup()
    finally:
        torch.set_num_threads(threads)
    return Path(cfg.run_dir)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and spinning threads crawl when the cores are busy
    (use with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
