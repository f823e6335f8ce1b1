"""llama.cpp as the judge of an export: convert it with llama.cpp's own converter, serve it with
llama-server beside the plain target, decode greedily and read llama-server's own counters.

    build = llamacpp_build(cache)                                  # decode/engine/llamacpp_build.py
    target = gguf_target(build, target_dir, cache)                 # the target, f32 GGUF (cached)
    draft = gguf_draft(build, export_dir, target_dir, out / "draft.gguf")
    run = run_llamacpp(build, target, draft, spec_type, k, prompts, max_new_tokens, ...)

The route to GGUF (`gguf_draft`): llama.cpp b11434's `convert_hf_to_gguf.py` reads our `vllm`
(LlamaForCausalLMEagle3, `midlayer.*`) and `speculators` (Eagle3Speculator, `layers.0.*`) EAGLE-3
exports with `--target-model-dir` (the target's HF folder: tokenizer, layer count); it writes
`eagle_aux_hidden_state_layer_ids` as the GGUF's target layers, whose *inputs* llama.cpp captures
(llama_set_embeddings_layer_inp), exactly our hidden-state indices. A `causal_lm` export (small_lm)
converts as a plain Llama and serves as a `-md` draft model (draft-simple). The target goes to an
f32 GGUF from the same HF folder our decoder loads, so llama.cpp's plain output can be compared
with ours; the KV caches are f32 too (llama.cpp's default is f16).

Bookkeeping (tools/server/server-context.cpp, common/speculative.cpp at b11434), so numbers compare
like for like with our decoder:
- drafts per round: the draft chain runs to `--spec-draft-n-max` = k, except that `--spec-draft-
  p-min` stops it early when the draft's top probability falls below it: set to 0, so every round
  drafts k, as our chains do. The server caps a draft at n_remaining - 1 = max_new_tokens -
  generated - 1 (get_n_draft_max): our decoder's cap exactly; a round left with no room drafts
  nothing and is a plain step, not a verification step.
- rounds: `spec_decode_num_drafts_total` counts verification steps, i.e. rounds with a non-empty
  draft (a plain step is not one); accepted drafts `spec_decode_num_accepted_tokens_total`, the
  bonus token NOT included; per position `..._per_pos_total{position=i}` = rounds whose first i+1
  drafts were accepted. tau = 1 + accepted / rounds, our definition (decode/metrics.py).
- at an EOS: the round's accepted drafts are counted before the output is cut at the EOS, so a
  draft past an EOS that the target's greedy continuation agrees with counts as accepted.
The replay (decode/replay.py replay_greedy with past_eos=True, rounds that drafted) follows these
rules; the counters come from llama-server's /metrics (`--metrics`), differenced around each
request, and are cross-checked with the response's own `timings.draft_n` / `draft_n_accepted`.

Two servers run side by side, one plain and one speculative, each with one slot (`-np 1`) and no
prompt cache; prompts go to them in turn (A B A B), so a shared machine's load hits both alike.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from specdistill.decode.engine import served_entry
from specdistill.decode.engine.envs import EngineUnavailable, engines_root
from specdistill.decode.engine.llamacpp_build import LlamaCpp
from specdistill.decode.engine.vllm_engine import Generation

OUTTYPE = "f32"  # GGUF weights: f32 keeps llama.cpp's numbers next to our fp32 decoder's
COUNTERS = {"llamacpp:spec_decode_num_drafts_total": "drafts",
            "llamacpp:spec_decode_num_draft_tokens_total": "draft_tokens",
            "llamacpp:spec_decode_num_accepted_tokens_total": "accepted"}
PER_POS = re.compile(r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}\s+(\S+)')
ERROR_WORDS = ("error", "failed", "what():", "exception", "abort", "invalid", "unknown")


def _entry(export_dir: Path) -> dict[str, Any]:
    return served_entry(export_dir, "llamacpp", "which this check does not serve in llama.cpp; "
                                                "it serves")


def spec_type(export_dir: Path, entry: Optional[dict] = None) -> tuple[str, bool]:
    """(llama-server's --spec-type, converter needs the target folder: --target-model-dir) for an
    export folder, from its layout's `serving` entry (or `entry`, llama.cpp's entry for another
    trainer's export: its layout's, e.g. drafters/dspark.py LLAMACPP); ValueError naming what
    llama.cpp serves when this one is not among it."""
    entry = entry or _entry(export_dir)
    return entry["spec_type"], bool(entry["needs_target"])


def refusal(export_dir: Path, entry: Optional[dict] = None) -> Optional[str]:
    """Why llama.cpp would not serve the export folder as trained, in one line, from its layout's
    `serving` entry `check` (or `entry`'s) on the folder's config.json and tensors; None when it
    would, or when the layout has no check."""
    from specdistill.export.folder import read_export

    check = (entry or _entry(export_dir)).get("check")
    return None if check is None else check(*read_export(export_dir))


def _last_error(text: str) -> str:
    """The engine's own error line from a log: the last line naming an error, else the last."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hit = next((ln for ln in reversed(lines) if any(w in ln.lower() for w in ERROR_WORDS)), None)
    return hit or (lines[-1] if lines else "no output")


def _convert(build: LlamaCpp, source: Path, out: Path, extra: list[str], log: Path,
             timeout: float) -> Optional[str]:
    """convert_hf_to_gguf.py source -> out (written under a temporary name, renamed at the end).
    None when it worked, else the converter's own error line."""
    tmp = out.with_name(out.name + ".tmp")
    cmd = [str(build.python), str(build.converter), str(source), "--outtype", OUTTYPE,
           "--outfile", str(tmp), *extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        res = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"convert_hf_to_gguf.py did not finish in {timeout:.0f} s"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
    if res.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        return _last_error(res.stderr + res.stdout)
    tmp.rename(out)
    return None


def _folder_key(folder: Path) -> str:
    """A content key of an HF folder: its config and the bytes of its weights."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:24]


def gguf_target(build: LlamaCpp, target_dir: Path, cache: Path, timeout: float = 1800) -> Path:
    """The target's HF folder as an f32 GGUF, converted once per content and cached under
    <cache>/engines/llamacpp-gguf/. EngineUnavailable with the converter's reason if it fails."""
    target_dir = Path(target_dir)
    out = engines_root(cache) / "llamacpp-gguf" / f"target-{_folder_key(target_dir)}-{OUTTYPE}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    why = _convert(build, target_dir, out, [], out.with_suffix(".log"), timeout)
    if why:
        raise EngineUnavailable(f"llama.cpp's converter refused the target {target_dir}: {why}")
    return out


def gguf_draft(build: LlamaCpp, export_dir: Path, target_dir: Path, out: Path,
               timeout: float = 1800, entry: Optional[dict] = None) -> Optional[str]:
    """An export as a GGUF draft at `out` through llama.cpp's own converter. None when it
    converted, else the converter's error line verbatim (the engine's refusal)."""
    _, needs_target = spec_type(export_dir, entry)
    extra = ["--target-model-dir", str(target_dir)] if needs_target else []
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    return _convert(build, Path(export_dir), out, extra, out.with_suffix(".convert.log"), timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server process on a local port; start() waits until it serves (or died)."""

    def __init__(self, build: LlamaCpp, args: list[str], log_path: Path, threads: int) -> None:
        self.port = _free_port()
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.cmd = [str(build.server), *args, "--host", "127.0.0.1", "--port", str(self.port),
                    "-np", "1", "-t", str(threads), "-tb", str(threads), "--metrics",
                    "--no-webui", "--no-cache-prompt", "-ctk", "f32", "-ctv", "f32", "-s", "0"]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.t0 = time.perf_counter()

    def _request(self, path: str, body: Optional[dict], timeout: float) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def wait_ready(self, timeout: float) -> dict:
        """{"load_s"} once /health answers 200, or {"error", "log_tail"} when the server exits
        (its own error line) or stays unready past timeout."""
        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                return {"error": _last_error(tail), "log_tail": tail}
            try:
                self._request("/health", None, 5)
                return {"load_s": time.perf_counter() - self.t0}
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.25)  # 503 while loading, refused before listening
        return {"error": f"llama-server was not ready in {timeout:.0f} s; its log: {self.log_path}",
                "log_tail": self.log_tail()}

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def counters(self) -> dict:
        """The speculative counters of /metrics now (all 0 on a plain server)."""
        text = self._request("/metrics", None, 60).decode()
        out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in COUNTERS:
                out[COUNTERS[name]] = int(float(value))
            elif m := PER_POS.match(line):
                i = int(m.group(1))
                pos = out["accepted_per_pos"]
                pos.extend([0] * (i + 1 - len(pos)))
                pos[i] = int(float(m.group(2)))
        return out

    def generate(self, ids: list[int], max_tokens: int, timeout: float) -> Generation:
        """Greedy decode of prompt ids; the request's own speculative counts (counter difference)."""
        before = self.counters()
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, "stream": False, "id_slot": 0}
        t = time.perf_counter()
        try:
            r = json.loads(self._request("/completion", body, timeout))
        except (urllib.error.URLError, OSError) as e:
            raise EngineUnavailable(f"llama-server failed while decoding: {e}; its log: "
                                    f"{self.log_path}") from None
        seconds = time.perf_counter() - t
        after = self.counters()
        pos_b = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
        spec = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
        spec["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos_b)]
        timings = r.get("timings") or {}
        if (timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)) != (
                spec["draft_tokens"], spec["accepted"]):  # the two accounts of one request
            raise EngineUnavailable(f"llama-server's /metrics ({spec}) and its response timings "
                                    f"({timings}) disagree on one request")
        return Generation(ids=list(r["tokens"]), seconds=seconds, finish_reason=r.get("stop_type"),
                          **spec)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def server_args(target_gguf: Path, draft_gguf: Optional[Path], spec: Optional[str], k: int,
                n_ctx: int) -> list[str]:
    """llama-server's model arguments: the target, and the draft with a fixed k (module docstring)."""
    args = ["-m", str(target_gguf), "-c", str(n_ctx)]
    if draft_gguf is not None:
        args += ["-md", str(draft_gguf), "--spec-type", spec, "--spec-draft-n-max", str(k),
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-ctkd", "f32", "-ctvd", "f32"]
    return args


def run_llamacpp(build: LlamaCpp, target_gguf: Path, draft_gguf: Path, spec: str, k: int,
                 prompts: list[list[int]], max_new_tokens: list[int], n_ctx: int, logs: Path,
                 plain: bool = True, threads: Optional[int] = None,
                 timeout: float = 1800) -> dict[str, Any]:
    """Decode `prompts` greedily in llama-server with the draft, and plainly (plain=True),
    interleaved prompt by prompt. Returns run_vllm's dict: {"loaded", "error", "version",
    "load_s", "plain", "spec", "speculative_config"}; a refused load is a result, not a raise.

    threads=None: the cores the load average leaves idle (target/precision.py idle_cores):
    ggml's threads spin at a barrier after every op, so one descheduled thread stalls the rest;
    on the shared 2-core machine at load ~12, SmolLM2 f32 decoded at 0.06-0.2 tokens/s with 2
    threads and 3.7 with 1."""
    from specdistill.target.precision import idle_cores

    threads = threads or idle_cores()
    spec_args = server_args(target_gguf, draft_gguf, spec, k, n_ctx)
    out: dict[str, Any] = {"engine": "llamacpp", "loaded": False, "error": None,
                           "version": build.version, "load_s": {}, "plain": [], "spec": [],
                           "speculative_config": " ".join(spec_args[4:]), "threads": threads}
    servers: dict[str, Server] = {}
    try:
        if plain:
            servers["plain"] = Server(build, server_args(target_gguf, None, None, k, n_ctx),
                                      logs / "llamacpp-plain.log", threads)
        servers["spec"] = Server(build, spec_args, logs / "llamacpp-spec.log", threads)
        for name, s in servers.items():
            r = s.wait_ready(timeout)
            if "error" in r:
                out.update(error=r["error"], error_detail=r["log_tail"], failed_engine=name)
                return out
            out["load_s"][name] = r["load_s"]
        out["loaded"] = True
        for s in servers.values():  # one-time costs stay out of the measured prompts
            s.generate(prompts[0][:16], 4, timeout)
        t0 = time.perf_counter()
        for ids, n in zip(prompts, max_new_tokens):
            for name, s in servers.items():  # plain, then speculative: A B A B ...
                out[name].append(s.generate(ids, n, timeout))
        out["wall_s"] = time.perf_counter() - t0
        return out
    finally:
        for s in servers.values():
            s.close()


def run_export(export_dir: Path, target_dir: Path, cache: Path, k: int, prompts: list[list[int]],
               max_new_tokens: list[int], n_ctx: int, out_dir: Path, plain: bool = True,
               threads: Optional[int] = None, timeout: float = 1800,
               entry: Optional[dict] = None) -> dict[str, Any]:
    """The whole llama.cpp side of the engine check: the layout's own check of what llama.cpp
    reads (`refusal`), build (or reuse) llama.cpp, convert the target and the export to GGUF
    (out_dir/gguf/draft.gguf), serve and decode (run_llamacpp). A draft refused by the check or
    the converter is a result ("loaded": False, one line; the converter's own error line)."""
    from specdistill.decode.engine.llamacpp_build import llamacpp_build

    spec, _ = spec_type(export_dir, entry)
    why = refusal(export_dir, entry)  # before building or converting anything
    if why:
        return {"engine": "llamacpp", "loaded": False, "version": None, "load_s": {},
                "error": why, "failed_engine": "check", "speculative_config": f"--spec-type {spec}"}
    build = llamacpp_build(cache)
    target_gguf = gguf_target(build, target_dir, cache, timeout)
    draft = Path(out_dir) / "gguf" / "draft.gguf"
    why = gguf_draft(build, export_dir, target_dir, draft, timeout, entry)
    log = draft.with_suffix(".convert.log")
    if why:
        return {"engine": "llamacpp", "loaded": False, "version": build.version, "load_s": {},
                "error": f"convert_hf_to_gguf.py: {why}", "failed_engine": "converter",
                "error_detail": (log.read_text()[-4000:] if log.is_file() else None),
                "speculative_config": f"--spec-type {spec}"}
    return run_llamacpp(build, target_gguf, draft, spec, k, prompts, max_new_tokens, n_ctx,
                        Path(out_dir), plain=plain, threads=threads, timeout=timeout)
