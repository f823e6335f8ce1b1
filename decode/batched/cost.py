"""The verify-cost grid of batched speculative decoding (decode/batched/planner.py plans with it):
seconds of one padded (B, Q) target forward, B rows x Q tokens (the last committed token + drafts),
measured once per (target, machine) on the real round's inputs and cached as JSON under the cache
dir; a (B, Q) forward does not cost what a (1, B*Q) one does.

    cost = cost_curve(target)      # read from the cache, else measured (~2 min on 2 CPU cores)
    cost(4, 3)                     # seconds of a 4-row x 3-token forward, interpolated
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

from specdistill.decode.batched import kv_cache
from specdistill.decode.batched.exact import ExactRows
from specdistill.decode.exact import ExactVerify
from specdistill.target.prepack import is_prepacked

BATCH_NS = (1, 2, 4, 8, 16, 32)  # rows per forward measured
WIDTH_NS = (1, 2, 3, 4, 6, 8, 16, 32, 64)  # tokens per row measured (last token + drafts;
# the wide ones for trees)


def _bracket(xs: Sequence[int], x: float) -> tuple[int, int, float]:
    """The segment of ascending xs that holds x (the first or last one beyond the ends) and x's
    weight on its upper end (< 0 or > 1 when extrapolating)."""
    j = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    return j - 1, j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])


def isotonic(xs: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest to xs in least squares (pool adjacent violators: a run
    that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [mean, count] of each pooled run
    for x in xs:
        blocks.append([float(x), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


@dataclass
class CostCurve:
    """verify(B, Q): seconds of one padded batched target forward of B rows x Q tokens, from a
    measured grid, bilinear in between and linear beyond the last points; fitted non-decreasing
    along both axes by isotonic regression (a larger forward that timed faster than a smaller
    one is measurement noise: the two are pooled to their mean). Not the suffix minimum: the
    minimum of noisy timings made every narrower forward as cheap as the luckiest wider one
    (the AVX2 EPYC's B = 1 row timed 115 / 75 / 84 / 73 / 71 ms at Q = 1 / 2 / 3 / 4 / 6 under
    load and became 71 ms up to Q = 6, so the planner drafted 3 deep where 1 was faster)."""

    bs: list[int]  # rows measured, ascending, >= 2 of them
    qs: list[int]  # tokens per row measured, ascending, >= 2 of them
    seconds: list[list[float]]  # seconds[i][j]: median seconds of a (bs[i], qs[j]) forward
    key: str = ""  # "<target hash>-<machine hash>" it was measured for ("" = given by hand)

    def __post_init__(self) -> None:
        ok = (len(self.bs) >= 2 and len(self.qs) >= 2 and sorted(set(self.bs)) == list(self.bs)
              and sorted(set(self.qs)) == list(self.qs) and len(self.seconds) == len(self.bs)
              and all(len(row) == len(self.qs) for row in self.seconds))
        if not ok:
            raise ValueError(f"a cost grid needs >= 2 ascending row counts bs and >= 2 ascending "
                             f"widths qs with one time per (b, q), got bs={self.bs} qs={self.qs} "
                             f"seconds={self.seconds}")
        s = [isotonic(row) for row in self.seconds]  # along Q, then along B
        s = [list(row) for row in zip(*(isotonic(col) for col in zip(*s)))]
        for i, row in enumerate(s):  # the B pass can bend a row a little: a running maximum
            prev = s[i - 1] if i else [0.0] * len(row)  # along Q and B keeps both non-decreasing
            for j in range(len(row)):
                row[j] = max(row[j], row[j - 1] if j else 0.0, prev[j])
        self._s = s

    @classmethod
    def per_token(cls, step: float, free: int = 1, bs: Sequence[int] = BATCH_NS,
                  qs: Sequence[int] = WIDTH_NS) -> "CostCurve":
        """A grid by rule: a forward of n = B * Q tokens costs `step` seconds up to `free`
        tokens and step * n / free beyond (memory-bound up to `free` tokens, then compute-bound)."""
        return cls(list(bs), list(qs), [[step * max(1.0, b * q / free) for q in qs] for b in bs])

    def __call__(self, B: float, Q: float) -> float:
        """Seconds of a (B, Q) forward (never below the smallest measured one)."""
        a, b, wb = _bracket(self.bs, B)
        c, d, wq = _bracket(self.qs, Q)
        s = self._s
        lo = s[a][c] + wq * (s[a][d] - s[a][c])  # along Q at bs[a]
        hi = s[b][c] + wq * (s[b][d] - s[b][c])  # along Q at bs[b]
        return max(lo + wb * (hi - lo), s[0][0])


def target_hash(target: Any) -> str:
    """A short fingerprint of the target: its config, dtype, attention implementation and whether
    its linear layers are prepacked (their costs differ: target/attention.py, target/prepack.py)
    and a sample of every weight."""
    h = hashlib.sha256(target.config.to_json_string().encode())
    h.update(str(target.dtype).encode())
    h.update(str(getattr(target.config, "_attn_implementation", "")).encode())
    if is_prepacked(target.model):  # (unpacked targets keep the hashes of curves cached before)
        h.update(b"prepacked")
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
def measure_cost(target: Any, bs: Sequence[int] = BATCH_NS, qs: Sequence[int] = WIDTH_NS,
                 context: int = 96, rounds: int = 3, exact: bool = False) -> list[list[float]]:
    """seconds[i][j]: median seconds of the verification forward of decode/batched/spec.py at bs[i]
    rows x qs[j] tokens (its 4-D mask and positions, logits at every position) over a
    `context`-token KV cache per row; all (B, Q) interleaved round by round, the first round
    (warm-up) dropped. exact: the forward of exact batched decoding (decode/batched/exact.py)."""
    gen = torch.Generator().manual_seed(0)
    dev, V = target.device, target.vocab_size
    caches = {b: _context_cache(target, b, context, max(qs), gen, exact) for b in bs}  # 1.
    times: dict[tuple[int, int], list[float]] = {(b, q): [] for b in bs for q in qs}
    for r in range(rounds + 1):  # 2. every (b, q) once per round
        for b in bs:
            for q in qs:
                rows = list(torch.randint(0, V, (b, q), generator=gen).to(dev))  # b x (q,)
                t0 = time.perf_counter()
                if exact:  # each row writes its block at its own columns: nothing to crop
                    ids, mask, pos = caches[b].inputs(rows, [context] * b)
                    with caches[b].context():
                        out = target.forward(ids, cache=caches[b].cache, attention_mask=mask,
                                             position_ids=pos)
                else:
                    ids, mask, pos = kv_cache.inputs(rows, [context] * b, context,
                                                    plain_mask=b == 1)  # as batched/spec.py
                    out = target.forward(ids, cache=caches[b], attention_mask=mask,
                                         position_ids=pos)
                    caches[b].crop(-q)
                out.logits.argmax(-1).cpu()  # (b, q): waits for the device
                if r:
                    times[(b, q)].append(time.perf_counter() - t0)
    return [[statistics.median(times[(b, q)]) for q in qs] for b in bs]


def _context_cache(target: Any, b: int, context: int, width: int, gen: torch.Generator,
                   exact: bool) -> Any:
    """A KV cache of b rows x `context` random tokens: a DynamicCache, or exact rows (each
    prefilled alone, room for a `width`-token block)."""
    dev, V = target.device, target.vocab_size
    ctx = torch.randint(0, V, (b, context), generator=gen).to(dev)  # (b, context)
    if not exact:
        cache = DynamicCache()
        target.forward(ctx, cache=cache, logits_to_keep=1)
        return cache
    rows = ExactRows(target)
    for i in range(b):
        lone = ExactVerify(target, context, width)
        target.forward(ctx[i:i + 1], cache=lone.cache, logits_to_keep=1,
                       **lone.chain(0, context, dev))
        rows.add_row(lone, context)
    return rows


def cost_curve(target: Any, cache_dir: str | Path | None = None, bs: Sequence[int] = BATCH_NS,
               qs: Sequence[int] = WIDTH_NS, exact: bool = False) -> CostCurve:
    """The target's verify-cost grid on this machine: read from `cache_dir/cost_curves/<key>.json`
    (cache_dir: env SPECDISTILL_CACHE, else ~/.cache/specdistill), else measured and written.
    exact: the grid of exact batched decoding's forward (its own key)."""
    root = Path(cache_dir or os.environ.get("SPECDISTILL_CACHE") or "~/.cache/specdistill")
    m_hash, m_desc = machine_key(target.device)
    key = f"{target_hash(target)}-{m_hash}" + ("-exact" if exact else "")
    path = root.expanduser() / "cost_curves" / f"{key}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("bs") == list(bs) and saved.get("qs") == list(qs):  # else an older layout
            return CostCurve(saved["bs"], saved["qs"], saved["seconds"], key)
    seconds = measure_cost(target, bs, qs, exact=exact)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"target": target.source, "machine": m_desc, "bs": list(bs),
                               "qs": list(qs), "seconds": seconds}, indent=1))
    os.replace(tmp, path)  # atomic: a reader sees a whole grid or none
    return CostCurve(list(bs), list(qs), seconds, key)
