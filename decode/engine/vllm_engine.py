"""vLLM as the judge of an export: load it as vLLM's speculative decoder does, decode greedily with
and without it, and read vLLM's own acceptance counters.

Two engine processes run side by side (decode/engine/vllm_worker.py, each in the vLLM virtualenv
of decode/engine/envs.py): one plain, one speculative. Prompts go to them in turn, plain then
speculative, so the load of a shared machine hits both alike and their speeds compare (the brief's
A B A B rule). Each process keeps one sequence at a time (max_num_seqs=1), eager mode, no prefix
cache, the target at the asked dtype.

Which speculative method an export is loaded with is vLLM's choice of reader, so it is named here
from the export's own config.json and its layout's `serving["vllm"]` (the drafter module's): vLLM
would otherwise guess from the folder's name and fall back to `draft_model`.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from specdistill.decode.engine import served_entry
from specdistill.decode.engine.envs import EngineUnavailable, damaged_install

WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclass
class Generation:
    """One prompt's greedy output from the engine, with its speculative counts (0 when plain)."""

    ids: list[int]
    seconds: float
    finish_reason: Optional[str] = None
    drafts: int = 0  # speculative rounds (vLLM's num_drafts)
    draft_tokens: int = 0  # drafts proposed (num_drafts x k)
    accepted: int = 0  # drafts accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i


def speculative_config(export_dir: Path, k: int, serving: Optional[dict] = None) -> dict[str, Any]:
    """vLLM's speculative_config for an export folder written by export/folder.py; ValueError
    naming the formats vLLM serves when this one is not among them. serving: vLLM's entry for a
    folder written by another trainer (a peer's, benchmarks/peers), e.g. {"method": "eagle3"}."""
    method = serving or served_entry(export_dir, "vllm", "which vLLM does not serve; vLLM serves")
    return {**method, "model": str(Path(export_dir).resolve()), "num_speculative_tokens": int(k)}


class Worker:
    """One vllm_worker.py process: start() waits until its engine is loaded (or failed)."""

    def __init__(self, python: Path, settings: dict, log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        spath = log_path.with_suffix(".settings.json")
        spath.write_text(json.dumps(settings, indent=1))
        read_fd, write_fd = os.pipe()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(python), "-P", str(WORKER), str(spath), "--reply-fd", str(write_fd)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True,
            pass_fds=(write_fd,), env=env, start_new_session=True)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")

    def reply(self, timeout: float) -> dict:
        """The worker's next JSON reply; an error dict if it died or stayed silent past timeout."""
        ready, _, _ = select.select([self.replies], [], [], timeout)
        line = self.replies.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            why = (f"exited with code {code}" if code is not None
                   else f"sent nothing for {timeout:.0f} s")
            return {"error": f"the vLLM process {why}; its log: {self.log_path}",
                    "log_tail": self.log_tail()}
        return json.loads(line)

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def generate(self, ids: list[int], max_tokens: int, stop_ids: list[int],
                 timeout: float) -> Generation:
        self.proc.stdin.write(json.dumps({"op": "generate", "prompt_ids": ids,
                                          "max_tokens": max_tokens, "stop_token_ids": stop_ids}) + "\n")
        self.proc.stdin.flush()
        r = self.reply(timeout)
        if "error" in r:
            raise EngineUnavailable(f"vLLM failed while decoding: {r['error']}")
        return Generation(ids=r["ids"], seconds=r["seconds"], finish_reason=r.get("finish_reason"),
                          **r["spec"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)  # its engine-core child too
                self.proc.wait()
        self.replies.close()
        self.log.close()


def worker_env(threads: int | None, timeout: float = 1800) -> dict[str, str]:
    """The environment of a vLLM process: offline, no usage stats, its engine core in the same
    process, the compute threads bound to the cores this process may use, and one
    engine step allowed the check's own timeout (vLLM's default of 300 s kills the engine on a
    machine loaded many times over)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
               VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=str(int(timeout)))
    cores = sorted(os.sched_getaffinity(0))
    if threads:
        cores = cores[:threads]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # the engine core inside our worker, not a process of its own: one process an engine, not three,
    # 2.6 GB instead of 4.0 (with a 1 GiB KV cache), faster on 2 cores, the same outputs and
    # acceptance (BENCHMARKS.md "vLLM's engine core in-process")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def kv_cache_bytes(target_dir: Path, export_dir: Path, dtype: str, max_model_len: int) -> int:
    """The KV cache an engine is given: twice what one sequence of max_model_len (+ a block of
    slack) takes in the target's and the drafter's attention layers at `dtype`, at least 64 MiB;
    1 GiB when the target's config.json does not give its sizes. vLLM's CPU backend allocates and
    zeroes all it is given; VLLM_CPU_KVCACHE_SPACE counts whole GiB, ~16x what SmolLM2's check
    needs (BENCHMARKS.md "The whole default job under 8 GB"). A
    VLLM_CPU_KVCACHE_SPACE in the environment still wins (vLLM reads it last)."""
    try:
        target = json.loads((Path(target_dir) / "config.json").read_text())
        target = target.get("text_config", target)  # a multimodal target's language model
        heads = target.get("num_key_value_heads") or target["num_attention_heads"]
        head_dim = target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"]
        draft = json.loads((Path(export_dir) / "config.json").read_text())
        layers = target["num_hidden_layers"] + int(draft.get("num_hidden_layers") or 1)
    except (OSError, KeyError, TypeError, ValueError):
        return 1 << 30
    per_token = 2 * layers * heads * head_dim * getattr(torch, dtype).itemsize  # K and V
    return max(64 << 20, 2 * per_token * (max_model_len + 256))


def run_vllm(python: Path, target_dir: Path, export_dir: Path, k: int, prompts: list[list[int]],
             max_new_tokens: list[int], stop_ids: list[int], dtype: str, max_model_len: int,
             logs: Path, plain: bool = True, threads: int | None = None,
             timeout: float = 1800, serving: Optional[dict] = None) -> dict[str, Any]:
    """Decode `prompts` (token ids) greedily in vLLM with the export, and plainly (plain=True),
    interleaved prompt by prompt. Returns {"loaded", "error", "version", "load_s", "plain",
    "spec"}; a failed load is a result ("loaded": False with vLLM's own error), not an exception,
    and so is an engine that loads and then fails while decoding ("loaded": True, "error")."""
    spec_cfg = speculative_config(export_dir, k, serving)
    env = worker_env(threads, timeout)
    base = {"model": str(target_dir), "dtype": dtype, "max_model_len": max_model_len, "seed": 0,
            "kv_cache_memory_bytes": kv_cache_bytes(target_dir, export_dir, dtype, max_model_len)}
    settings = {"plain": {**base, "speculative_config": None},
                "spec": {**base, "speculative_config": spec_cfg}}
    out: dict[str, Any] = {"engine": "vllm", "speculative_config": spec_cfg, "loaded": False,
                           "error": None, "version": None, "load_s": {}, "plain": [], "spec": []}
    workers: dict[str, Worker] = {}
    try:
        for name in ("plain", "spec") if plain else ("spec",):  # both load at once
            if not Path(python).is_file():  # an install marked complete whose interpreter is gone
                raise EngineUnavailable(damaged_install(python, f"{python} is missing"))
            workers[name] = Worker(python, settings[name], logs / f"vllm-{name}.log", env)
        for name, w in workers.items():
            r = w.reply(timeout)
            if r.get("damaged"):  # vllm does not import: the install, not the export
                raise EngineUnavailable(damaged_install(python, r["error"]))
            if "error" in r:
                out["error"] = r["error"]
                out["error_detail"] = r.get("traceback") or r.get("log_tail")
                out["failed_engine"] = name
                return out
            out["version"], out["load_s"][name] = r["vllm"], r["load_s"]
        out["loaded"] = True
        _decode(workers, prompts, max_new_tokens, stop_ids, timeout, out)
        return out
    finally:
        for w in workers.values():
            w.close()


def _decode(workers: dict[str, Worker], prompts: list[list[int]], max_new_tokens: list[int],
            stop_ids: list[int], timeout: float, out: dict[str, Any]) -> None:
    """Every prompt through every loaded engine, in turn, into out[name]; an engine that fails
    while decoding leaves its words and log tail in out (error, error_detail, failed_engine)."""
    name = None
    try:
        # a first short request per process: one-time costs stay out of the measured prompts
        for name, w in workers.items():
            w.generate(prompts[0][:16], 4, stop_ids, timeout)
        t0 = time.perf_counter()
        for ids, n in zip(prompts, max_new_tokens):
            for name, w in workers.items():  # plain, then speculative: A B A B ...
                out[name].append(w.generate(ids, n, stop_ids, timeout))
        out["wall_s"] = time.perf_counter() - t0
    except EngineUnavailable as e:
        out.update(error=str(e), error_detail=workers[name].log_tail(), failed_engine=name)
