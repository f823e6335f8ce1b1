"""Shared fixtures: tiny random-init targets and an isolated cache."""
import os

import pytest

from drafters.target import TargetConfig

TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


@pytest.fixture
def tiny_target_cfg() -> TargetConfig:
    """The `target=tiny` config: random-init 2-layer Llama with the (cached) SmolLM2 tokenizer."""
    return TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                        model_config=dict(TINY_MODEL), seed=0)


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a hub
