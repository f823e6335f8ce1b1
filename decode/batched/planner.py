"""The verification budget of batched speculative decoding: whether and how deep the batch drafts
this round, and how many draft positions its one batched target forward verifies.

A round costs drafting (per row, one row after another) plus ONE padded (B, Q) target forward
(Q = last committed token + w drafts). Verifying draft tokens is free only while that forward is
memory-bound; past that, every rejected draft costs compute, and the drafting alone may cost more
than the drafts bring. So a round is planned in two steps, each maximising the expected committed
tokens per second:

1. Before drafting (`RoundPlanner.depth`): the depth d every row drafts, 0 = a plain round (no
   drafter call at all). Expected tokens B * (1 + S_1 + .. + S_d), S_i the running estimate of a
   row's chance to commit its i-th draft (from the last rounds' outcomes); seconds = verify(B, d+1)
   + B * (drafting seconds per row at depth d, measured online) + B * (the round's other work per
   row, measured online). Where the estimates say no depth pays, the batch drafts only to probe:
   when an optimistic estimate of the S_i (each depth's acceptance counted with one more accepted
   draft) says some depth would pay. The counts fade a little each plain round, so the optimistic
   estimate climbs back and the probes come often where drafting nearly pays and rarely where it
   is far off; where no depth would pay even if every draft were accepted, never. A caller that
   decodes call after call keeps one planner (`generate_batch(planner=...)`), so each call starts
   from what the last ones learnt instead of drafting blind.
2. After drafting (`choose_widths`): the drafting is paid; the verify width w <= d is cut from the
   drafts' own confidences (`survival`) against verify(B, w+1): low-confidence tails are cut.

verify(B, Q) is `CostCurve`, a grid of measured padded batched forwards (the real round's inputs:
B rows over a KV cache, a 4-D mask, logits at every position), measured once per (target, machine)
and cached as JSON under the cache dir; a (B, Q) forward does not cost what a (1, B*Q) one does.

Lossless under sampling: step 1 reads only past rounds. In step 2 whether draft i of a row is
verified must not depend on that draft's own value (nor on anything after it), or the kept drafts
would no longer be distributed as q. So the score of depth i uses the drafted tokens'
probabilities before it and only the top probability of q_i (not q_i(d_i)), and the width grows
depth by depth, stopping at the first depth that lowers the expected committed tokens per second
(a stopping rule that never looks ahead). Greedy drafts are deterministic, so greedy takes the
best width over all depths.
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
from specdistill.drafters.base import ChainProposal
from specdistill.drafters.prepack import is_prepacked

BATCH_NS = (1, 2, 4, 8, 16, 32)  # rows per forward measured
WIDTH_NS = (1, 2, 3, 4, 6, 8, 16, 32, 64)  # tokens per row measured (last token + drafts;
# the wide ones for trees)


def _bracket(xs: Sequence[int], x: float) -> tuple[int, int, float]:
    """The segment of ascending xs that holds x (the first or last one beyond the ends) and x's
    weight on its upper end (< 0 or > 1 when extrapolating)."""
    j = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    return j - 1, j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])


@dataclass
class CostCurve:
    """verify(B, Q): seconds of one padded batched target forward of B rows x Q tokens, from a
    measured grid, bilinear in between and linear beyond the last points; made non-decreasing
    along both axes (a larger forward that timed faster than a smaller one says the smaller one
    costs at most that)."""

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
        s = [list(row) for row in self.seconds]
        for row in s:  # suffix minimum along Q, then along B: non-decreasing in both
            for j in range(len(row) - 2, -1, -1):
                row[j] = min(row[j], row[j + 1])
        for i in range(len(s) - 2, -1, -1):
            s[i] = [min(a, b) for a, b in zip(s[i], s[i + 1])]
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
    its linear layers are prepacked (their costs differ: drafters/attention.py, drafters/prepack.py)
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


class RoundPlanner:
    """Budgeted mode, step 1 (module docstring): how deep every row drafts this round, decided
    before any draft exists, from past rounds only. Keep one per (target, drafter, k) across
    `generate_batch` calls (its `planner` argument): what it learns holds for every batch size.

    What it learns online (acceptance per row, so one estimate serves every batch size):
      * S_i, a row's chance to commit its i-th draft: per depth, decayed counts of rows that
        reached depth i (drafted it, every earlier draft accepted) and of those that committed it;
        a draft cut by step 2 counts as not committed (it brought nothing). Prior: half a reached
        and accepted draft per depth, so depths never tried look worth a try. The counts decay by
        `decay` per drafting round and by `idle_decay` per plain round (old evidence fades, so a
        probe eventually comes back to check it);
      * the drafting phase's seconds at each asked depth and number of drafting rows (an EMA per
        (depth, rows): rows drafting together (Drafter.propose_rows) cost less than rows x one
        row; an unseen pair is scaled from the nearest seen one (rows first), linear in depth and
        in rows; nothing seen yet = free);
      * the round's other seconds per row (accept, cache compaction: an EMA).
    """

    def __init__(self, cost: CostCurve, k: int, decay: float = 0.9, idle_decay: float = 0.998,
                 optimism: float = 1.0, ema: float = 0.3, tree_width: float | None = None) -> None:
        self.cost, self.k, self.decay, self.ema = cost, k, decay, ema
        # trees: the round is plain (0) or the drafter's whole tree (k = its depth), whose
        # forward is tree_width tokens per row (first guessed, then an EMA of the measured ones)
        self.tree_width = tree_width
        self.idle_decay, self.optimism = idle_decay, optimism
        self.reach, self.acc = [0.0] * k, [0.0] * k  # decayed counts per depth 1..k
        self.draft_s: dict[tuple[int, int], float] = {}  # (depth, rows drafting) -> phase seconds
        self.other_row = 0.0  # seconds per row per round outside the drafters and the forward
        self.probes = 0  # rounds drafted only because the optimistic estimate might pay

    @property
    def tree(self) -> bool:
        """Planning trees (plain or the whole tree) rather than chain depths."""
        return self.tree_width is not None

    def survival(self, extra: float = 0.0) -> list[float]:
        """S_1 .. S_k: the running chance that a row commits its i-th draft; with extra > 0 each
        depth's acceptance counts `extra` more accepted drafts (the optimistic estimate)."""
        out, s = [], 1.0
        for r, a in zip(self.reach, self.acc):
            s *= (a + 0.5 + extra) / (r + 0.5 + extra)
            out.append(s)
        return out

    def draft_seconds(self, d: int, B: int) -> float:
        """Estimated seconds of a round's drafting phase: B rows drafting d each."""
        if d == 0 or B == 0 or not self.draft_s:
            return 0.0
        nd, nb = min(self.draft_s, key=lambda x: (abs(x[1] - B), abs(x[0] - d), -x[1], -x[0]))
        return self.draft_s[(nd, nb)] * (d / nd) * (B / nb)

    def rate(self, B: int, d: int, S: Sequence[float]) -> float:
        """Expected committed tokens per second of a round of B rows drafting d each."""
        tokens = B * (1.0 + sum(S[:d]))
        width = self.tree_width if self.tree and d else d + 1
        seconds = self.cost(B, width) + self.draft_seconds(d, B) + B * self.other_row
        return tokens / seconds

    def _best(self, B: int, S: Sequence[float]) -> int:
        """The depth >= 1 with the best rate under S, or 0 where none beats a plain round."""
        plain = self.rate(B, 0, S) * (1 + 1e-9)  # a tie is no gain
        rates = {d: self.rate(B, d, S) for d in ([self.k] if self.tree else range(1, self.k + 1))}
        best = max(rates, key=rates.get)
        return best if rates[best] > plain else 0

    def depth(self, B: int) -> int:
        """This round's draft depth for B rows: 1. the best by the estimates; 2. if that is 0
        (plain), a probe at the best depth by the optimistic estimate, where that one pays; else
        0, and the counts fade by idle_decay."""
        if self.k == 0:
            return 0
        d = self._best(B, self.survival())  # 1.
        if d:
            return d
        d = self._best(B, self.survival(self.optimism))  # 2.
        if d:
            self.probes += 1
            return d
        self.reach = [x * self.idle_decay for x in self.reach]
        self.acc = [x * self.idle_decay for x in self.acc]
        return 0

    def observe(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """One round's outcome per row: drafts made (before any cut) and drafts committed."""
        if not any(drafted):
            return
        self.reach = [x * self.decay for x in self.reach]
        self.acc = [x * self.decay for x in self.acc]
        for m, n in zip(drafted, accepted):
            for i in range(min(m, n + 1, self.k)):  # depths 1..min(m, n+1) reached
                self.reach[i] += 1.0
                self.acc[i] += float(i < n)

    def observe_width(self, width: int) -> None:
        """Trees: a tree round's forward width (tokens per row)."""
        if self.tree:
            self.tree_width += self.ema * (width - self.tree_width)

    def observe_times(self, depth: int, rows_drafted: int, draft_s: float, rows: int,
                      other_s: float) -> None:
        """One round's seconds: its drafting phase over rows_drafted rows at depth `depth`, and
        its work outside the drafters and the forward over all `rows`."""
        if depth and rows_drafted:
            key, old = (depth, rows_drafted), self.draft_s.get((depth, rows_drafted))
            self.draft_s[key] = draft_s if old is None else old + self.ema * (draft_s - old)
        if rows:
            self.other_row += self.ema * (other_s / rows - self.other_row)


def new_planner(cost: CostCurve, k: int, drafter: Any = None, tree: bool = False) -> RoundPlanner:
    """A batch's planner: chains choose a depth in 0..k; trees choose between a plain round and
    the drafter's whole tree, of depth `tree_depth` and first guessed `tree_total_tokens` nodes
    (its config's EAGLE-2 tree settings; k otherwise), then measured."""
    if not tree:
        return RoundPlanner(cost, k)
    cfg = getattr(drafter, "cfg", None)
    depth = int(getattr(cfg, "tree_depth", k))
    return RoundPlanner(cost, depth, tree_width=float(getattr(cfg, "tree_total_tokens", depth)) + 1)


def batch_planner(target: Any, drafter: Any, k: int, tree: bool, planner: RoundPlanner | None,
                  cost: CostCurve | None, cache_dir: str | None, exact: bool = False
                  ) -> RoundPlanner:
    """A budgeted `generate_batch`'s planner: the caller's kept planner (checked against this
    call's settings), else a new one over `cost` (None = the target's measured grid, cached under
    cache_dir; exact: the grid of exact batched decoding)."""
    if planner is None:
        return new_planner(cost if cost is not None else cost_curve(target, cache_dir, exact=exact),
                           k, drafter, tree)
    if planner.tree != tree or (not tree and planner.k != k):
        made = "trees" if planner.tree else f"chains of k={planner.k}"
        asked = "trees" if tree else f"chains of k={k}"
        raise ValueError(f"the planner was made for {made}, this call drafts {asked}; keep one "
                         f"planner per k and tree setting")
    if cost is not None and cost is not planner.cost:
        raise ValueError("cost and planner.cost differ; pass the cost only through the planner")
    return planner


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
    """Budgeted mode, step 2: per-row verify lengths for one batched forward, the drafting being
    paid. scores[r] (m_r,) from `survival`.

    1. The forward has B rows and width w + 1 (last token + w drafts): cost(B, w + 1).
    2. Expected committed tokens at width w: B (each row's correction / bonus token) plus every
       row's scores at depths <= w.
    3. Greedy: the w with the most expected tokens per second. Sampling: w grows while each depth
       raises that ratio (decided depth by depth, see the module docstring).
    4. Row r verifies min(w, m_r) drafts.
    """
    B = len(scores)
    k = max((len(s) for s in scores), default=0)
    gain, best_w, best = float(B), 0, B / cost(B, 1)  # 1.-2. width 0: plain decoding
    for w in range(1, k + 1):
        gain += sum(float(s[w - 1]) for s in scores if len(s) >= w)
        ratio = gain / cost(B, w + 1)
        if ratio > best:
            best_w, best = w, ratio
        elif not greedy:
            break  # 3. sampling stops at the first depth that does not pay
    return [min(best_w, len(s)) for s in scores]  # 4.
