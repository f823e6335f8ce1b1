"""A stand-in for vLLM's offline API (tests/test_engine.py): the worker protocol, counters and
interleaving are tested without an engine. Greedy "output": token t+1 = (last token + 1) mod 97.
A speculative engine counts one round per 2 new tokens with the first of its k drafts accepted.
A folder holding REFUSE is refused with that file's text, as vLLM refuses a checkpoint; one
holding DIE loads and then fails every request with that file's text."""
import json
import os
from dataclasses import dataclass
from pathlib import Path

__version__ = "fake"


@dataclass
class _Metric:
    name: str
    value: int = 0
    values: list = None


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Out:
    def __init__(self, ids):
        self.outputs = [type("C", (), {"token_ids": ids, "finish_reason": "length"})()]


class LLM:
    def __init__(self, model, speculative_config=None, **kw):
        self.spec = speculative_config
        if self.spec:
            refuse = Path(self.spec["model"]) / "REFUSE"
            if refuse.is_file():
                raise ValueError(refuse.read_text())
        self.k = self.spec["num_speculative_tokens"] if self.spec else 0
        self.kv = kw.get("kv_cache_memory_bytes")
        self.drafts = self.accepted = 0

    def generate(self, prompts, params, use_tqdm=False):
        if self.spec and (Path(self.spec["model"]) / "DIE").is_file():
            raise RuntimeError((Path(self.spec["model"]) / "DIE").read_text())
        ids = prompts[0]["prompt_token_ids"]
        out = [(ids[-1] + i + 1) % 97 for i in range(params.max_tokens)]
        if self.spec:
            rounds = len(out) // 2
            self.drafts += rounds
            self.accepted += rounds
        order = Path(os.environ["FAKE_VLLM_LOGS"]) / "order.jsonl"
        with open(order, "a") as f:
            f.write(json.dumps({"engine": "spec" if self.spec else "plain", "n": len(ids),
                                "kv": self.kv}) + "\n")
        return [_Out(out)]

    def get_metrics(self):
        if not self.spec:
            return []
        return [_Metric("vllm:spec_decode_num_drafts", self.drafts),
                _Metric("vllm:spec_decode_num_draft_tokens", self.drafts * self.k),
                _Metric("vllm:spec_decode_num_accepted_tokens", self.accepted),
                _Metric("vllm:spec_decode_num_accepted_tokens_per_pos",
                        values=[self.accepted] + [0] * (self.k - 1))]
