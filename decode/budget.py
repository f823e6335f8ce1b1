"""The verification budget of batched speculative decoding: how many draft positions one batched
target forward should verify, from the drafts' own confidences and the measured cost curve.

Verifying draft tokens is free only while the forward is memory-bound; past that, every rejected
draft costs compute. `CostCurve` is cost(n) = seconds of one target forward of n new tokens,
measured once per (target, machine) and cached as JSON under the cache dir. `choose_widths` turns
the drafts' survival scores (`survival`) and the curve into per-row draft lengths.

Why a width: the batched forward is a padded (B, Q) tensor, so its cost is cost(B * Q) whatever
the rows hold. Given Q, filling a row up to Q costs nothing more, so the decision is the verify
width w = Q - 1: depth i of every row is verified only when the whole batch's expected gain at
that depth (the sum of the rows' survival scores there) pays for B more tokens in the forward.
Low-confidence tails (depths past w) are cut in every row; at large B, where cost grows with every
token, w falls to 0 and the batch decodes plainly by itself.

Lossless under sampling: whether draft i of a row is verified must not depend on that draft's own
value (nor on anything after it), or the kept drafts would no longer be distributed as q. So the
score of depth i uses the drafted tokens' probabilities before it and only the top probability of
q_i (not q_i(d_i)), and the width grows depth by depth, stopping at the first depth that lowers
the expected committed tokens per unit of cost (a stopping rule that never looks ahead). Greedy
drafts are deterministic, so greedy takes the best width over all depths.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from drafters.base import ChainProposal

CURVE_NS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # forward sizes measured (tokens)


@dataclass
class CostCurve:
    """cost(n): seconds of one target forward of n new tokens, from measured points, linear in
    between and beyond the last two; made non-decreasing (a larger forward that timed faster
    than a smaller one says the smaller one costs at most that)."""

    ns: list[int]  # measured forward sizes, ascending
    seconds: list[float]  # median seconds per forward, same order
    key: str = ""  # "<target hash>-<machine hash>" it was measured for ("" = given by hand)

    def __post_init__(self) -> None:
        if len(self.ns) < 2 or len(self.ns) != len(self.seconds) or sorted(self.ns) != list(self.ns):
            raise ValueError(f"a cost curve needs >= 2 ascending sizes with one time each, got "
                             f"ns={self.ns} seconds={self.seconds}")
        fixed = list(self.seconds)
        for i in range(len(fixed) - 2, -1, -1):  # suffix minimum: non-decreasing in n
            fixed[i] = min(fixed[i], fixed[i + 1])
        self._s = fixed

    def __call__(self, n: float) -> float:
        ns, s = self.ns, self._s
        j = next((i for i in range(1, len(ns)) if n <= ns[i]), len(ns) - 1)
        a, b = j - 1, j
        slope = (s[b] - s[a]) / (ns[b] - ns[a])
        return max(s[a] + slope * (n - ns[a]), s[0])


def target_hash(target: Any) -> str:
    """A short fingerprint of the target: its config, dtype and a sample of every weight."""
    h = hashlib.sha256(target.config.to_json_string().encode())
    h.update(str(target.dtype).encode())
    for name, p in target.model.named_parameters():
        flat = p.detach().reshape(-1)
        h.update(f"{name}{tuple(p.shape)}{float(flat.double().sum()):.9e}".encode())
        h.update(flat[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def machine_key(device: torch.device) -> tuple[str, str]:
    """(hash, description) of the hardware the curve holds for: CPU model, cores, torch threads,
    and the GPU's name on a CUDA device."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu} | {os.cpu_count()} cores | {torch.get_num_threads()} threads | {device}"
    if device.type == "cuda":
        desc += f" | {torch.cuda.get_device_name(device)}"
    return hashlib.sha256(desc.encode()).hexdigest()[:12], desc


@torch.inference_mode()
def measure_cost(target: Any, ns: Sequence[int] = CURVE_NS, context: int = 64,
                 rounds: int = 5) -> list[float]:
    """Median seconds of a forward of n new tokens (logits at each, as verification reads them)
    over a `context`-token KV cache, for each n; sizes interleaved round by round, the first
    round (warm-up) dropped."""
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    ctx = torch.randint(0, target.vocab_size, (1, context), generator=gen).to(target.device)
    target.forward(ctx, cache=cache, logits_to_keep=1)
    times: dict[int, list[float]] = {n: [] for n in ns}
    for r in range(rounds + 1):
        for n in ns:
            ids = torch.randint(0, target.vocab_size, (1, n), generator=gen).to(target.device)
            t0 = time.perf_counter()
            target.forward(ids, cache=cache).logits.argmax(-1).cpu()  # waits for the device
            if r:
                times[n].append(time.perf_counter() - t0)
            cache.crop(-n)
    return [statistics.median(times[n]) for n in ns]


def cost_curve(target: Any, cache_dir: str | Path | None = None, ns: Sequence[int] = CURVE_NS
               ) -> CostCurve:
    """The target's cost curve on this machine: read from `cache_dir/cost_curves/<key>.json`
    (cache_dir: env SPECDISTILL_CACHE, else ~/.cache/specdistill), else measured and written."""
    root = Path(cache_dir or os.environ.get("SPECDISTILL_CACHE") or "~/.cache/specdistill")
    m_hash, m_desc = machine_key(target.device)
    key = f"{target_hash(target)}-{m_hash}"
    path = root.expanduser() / "cost_curves" / f"{key}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if list(saved["ns"]) == list(ns):
            return CostCurve(saved["ns"], saved["seconds"], key)
    seconds = measure_cost(target, ns)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"target": target.source, "machine": m_desc, "ns": list(ns),
                               "seconds": seconds}, indent=1))
    os.replace(tmp, path)  # atomic: a reader sees a whole curve or none
    return CostCurve(list(ns), seconds, key)


def survival(prop: ChainProposal, m: int) -> torch.Tensor:
    """(m,) score of each of the first m drafts: the drafter's probability that the chain survives
    to it, prod_{j<i} q_j(d_j) * max q_i (greedy: prod_{j<=i} q_j(d_j), the drafted tokens being
    the argmaxes). Never reads draft i's own value at depth i (see the module docstring). A
    deterministic drafter (no probs, no confidence) scores 1 everywhere."""
    tokens = prop.tokens[:m]
    if prop.probs is not None:
        q = prop.probs[:m].float()  # (m, V)
        own = q.gather(-1, tokens[:, None].to(q.device)).squeeze(-1)  # (m,) q_i(d_i)
        top = q.max(-1).values  # (m,)
    elif prop.confidence is not None:  # greedy: the drafted token is the argmax
        own = top = prop.confidence[:m].float()
    else:
        return torch.ones(m)
    before = torch.cat([own.new_ones(1), own[:-1]]).cumprod(0)  # (m,) prod_{j<i} own_j
    return (before * top).cpu()


def choose_widths(scores: list[torch.Tensor], cost: CostCurve, greedy: bool) -> list[int]:
    """Per-row verify lengths for one batched forward. scores[r] (m_r,) from `survival`.

    1. The forward has B rows and width w + 1 (last token + w drafts): cost(B * (w + 1)).
    2. Expected committed tokens at width w: B (each row's correction / bonus token) plus every
       row's scores at depths <= w.
    3. Greedy: the w with the most expected tokens per second. Sampling: w grows while each depth
       raises that ratio (decided depth by depth, see the module docstring).
    4. Row r verifies min(w, m_r) drafts.
    """
    B = len(scores)
    k = max((len(s) for s in scores), default=0)
    gain, best_w, best = float(B), 0, B / cost(B)  # 1.-2. width 0: plain decoding
    for w in range(1, k + 1):
        gain += sum(float(s[w - 1]) for s in scores if len(s) >= w)
        ratio = gain / cost(B * (w + 1))
        if ratio > best:
            best_w, best = w, ratio
        elif not greedy:
            break  # 3. sampling stops at the first depth that does not pay
    return [min(best_w, len(s)) for s in scores]  # 4.
