"""On-policy distillation data (DistillSpec): the drafter writes the answers, the target scores them.

On fixed data the drafter learns the target's distribution along text someone else wrote, but at
decode time it continues its OWN drafts. DistillSpec (Zhou et al., 2024) mixes in the drafter's own
continuations, scored by the target at every position, and reports better acceptance. Here, with
probability `trainer.on_policy_fraction`, a training micro-batch is replaced row by row by

    prompt        the conversation up to the start of one of its assistant turns (picked at random;
                  cut from the left to fit data.max_length with the continuation),
    continuation  up to trainer.on_policy_max_new_tokens tokens sampled from the CURRENT drafter at
                  trainer.on_policy_temperature, cut after its first end-of-turn token,

with loss_mask = 1 on the continuation only. The recipe runs the target on it like on any batch
(online: an on-policy batch has no captured features), so the loss compares drafter and target at
every continuation position: the target's logits on prompt + continuation ARE the score.
`trainer.on_policy_start_step` keeps the first optimizer steps on fixed data only: an untrained
drafter's samples are not text yet (measured: BENCHMARKS.md, small_lm grid).

Every draw is seeded by (seed, step, micro-batch, rank): a run and its resume see the same batches.
Generation goes through the Drafter interface (`propose`, with the drafter's own KV cache), so any
drafter that drafts without target features works (small_lm); others are refused at setup.
"""
from __future__ import annotations

import hashlib

import torch
from tqdm import tqdm

from specdistill.data import quiet
from specdistill.data.dataset import pad_batch
from specdistill.drafters.base import DecodeState, Drafter
from specdistill.drafters.parts.sampling import SamplingParams


def _device(drafter: Drafter) -> torch.device:
    return next(drafter.parameters(), torch.empty(0)).device


def assistant_starts(loss_mask: torch.Tensor) -> list[int]:
    """loss_mask (T,) -> positions t >= 1 where an assistant span begins (mask turns 0 -> 1)."""
    m = loss_mask.long()
    prev = torch.cat([m.new_zeros(1), m[:-1]])  # (T,)
    return [int(t) for t in ((m == 1) & (prev == 0)).nonzero().flatten().tolist() if t >= 1]


@torch.no_grad()
def sample_continuation(drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                        sampling: SamplingParams, generator: torch.Generator | None,
                        eos_ids: torch.Tensor) -> torch.Tensor:
    """prompt (P,) -> the drafter's continuation (n,), n <= max_new_tokens, cut after an EOS."""
    drafter.reset()
    toks = drafter.propose(DecodeState(tokens=prompt), max_new_tokens, sampling, generator).tokens
    eos = torch.isin(toks, eos_ids.to(toks.device))  # (n,)
    return toks[: int(eos.long().argmax()) + 1] if bool(eos.any()) else toks


def on_policy_batch(drafter: Drafter, raw: dict[str, torch.Tensor], *, max_new_tokens: int,
                    sampling: SamplingParams, choice: torch.Generator, generator: torch.Generator,
                    eos_ids, pad_id: int, max_length: int, progress: bool = False
                    ) -> dict[str, torch.Tensor]:
    """A raw batch (input_ids, attention_mask, loss_mask: (B, T)) -> an on-policy raw batch of
    prompt + drafter continuation rows (B, T'), loss_mask on the continuations. `choice` (CPU)
    picks the assistant turn of each row, `generator` (on the drafter's device) samples."""
    dev = _device(drafter)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
    rows = []
    for b in tqdm(range(raw["input_ids"].shape[0]), desc="on-policy", leave=False,
                  disable=not progress):
        n = int(raw["attention_mask"][b].sum())
        ids = raw["input_ids"][b, :n]  # (n,)
        starts = assistant_starts(raw["loss_mask"][b, :n]) or [max(n, 1)]
        start = starts[int(torch.randint(len(starts), (), generator=choice))]
        prompt = ids[:start][-max(1, max_length - max_new_tokens):]  # (P,)
        cont = sample_continuation(drafter, prompt.to(dev), max_new_tokens, sampling, generator,
                                   eos).cpu()  # (c,)
        rows.append({"input_ids": torch.cat([prompt, cont]).tolist(),
                     "loss_mask": [0] * len(prompt) + [1] * len(cont)})
    return pad_batch(rows, pad_id)


class OnPolicyMixer:
    """The recipe's hook: `mixer(raw, step, micro)` returns the micro-batch itself or, with
    probability `fraction`, an on-policy batch made from its prompts (`last` says which)."""

    def __init__(self, drafter: Drafter, *, fraction: float, max_new_tokens: int,
                 temperature: float, seed: int, rank: int, pad_id: int, eos_ids, max_length: int,
                 start_step: int = 0, progress: bool | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"trainer.on_policy_fraction must be in [0, 1], got {fraction}")
        if start_step < 0:
            raise ValueError(f"trainer.on_policy_start_step must be >= 0, got {start_step}")
        if max_new_tokens < 1 or max_new_tokens >= max_length:
            raise ValueError(f"trainer.on_policy_max_new_tokens ({max_new_tokens}) must be in "
                             f"[1, data.max_length={max_length})")
        if drafter.feature_layers:
            raise ValueError(f"trainer.on_policy_fraction > 0 needs a drafter that writes text on "
                             f"its own (small_lm); {drafter.name!r} reads target features "
                             f"(feature_layers {tuple(drafter.feature_layers)}), so it cannot "
                             f"generate without the target. Set trainer.on_policy_fraction=0")
        if not eos_ids:
            raise ValueError("on-policy data needs the target's end-of-turn ids (none found)")
        self.drafter, self.fraction, self.max_new_tokens = drafter, fraction, max_new_tokens
        self.sampling = SamplingParams(temperature=temperature)
        self.seed, self.rank, self.pad_id = seed, rank, pad_id
        self.eos_ids, self.max_length = set(eos_ids), max_length
        self.start_step = start_step  # fixed data only before this optimizer step (a warm-up)
        self.progress = not quiet() if progress is None else progress
        self.last = False  # whether the latest call replaced its batch

    @classmethod
    def from_config(cls, drafter: Drafter, cfg, rank: int, pad_id: int, eos_ids) -> "OnPolicyMixer":
        """From the train config (trainer.on_policy_*, seed, data.max_length); refuses ZeRO-3,
        whose partitioned parameters cannot run the drafter outside its engine."""
        t = cfg.trainer
        if t.backend == "deepspeed" and int(cfg.get("deepspeed", {}).get("zero_stage", 2)) == 3:
            raise ValueError("on-policy data (trainer.on_policy_fraction > 0) does not run under "
                             "ZeRO-3; use deepspeed.zero_stage=2 or trainer.backend=torch")
        return cls(drafter, fraction=t.on_policy_fraction, max_new_tokens=t.on_policy_max_new_tokens,
                   temperature=t.on_policy_temperature, seed=cfg.seed, rank=rank, pad_id=pad_id,
                   eos_ids=eos_ids, max_length=cfg.data.max_length,
                   start_step=t.on_policy_start_step)

    def generators(self, step: int, micro: int) -> tuple[torch.Generator, torch.Generator]:
        """(CPU generator for the coin and the turn choice, drafter-device generator for sampling),
        both seeded by (seed, step, micro, rank) alone."""
        key = hashlib.sha256(f"on-policy/{self.seed}/{step}/{micro}/{self.rank}".encode()).digest()
        s = int.from_bytes(key[:8], "little") >> 1
        return torch.Generator().manual_seed(s), torch.Generator(device=_device(self.drafter)).manual_seed(s)

    def __call__(self, raw: dict[str, torch.Tensor], step: int, micro: int) -> dict[str, torch.Tensor]:
        choice, gen = self.generators(step, micro)
        self.last = step >= self.start_step and bool(torch.rand((), generator=choice) < self.fraction)
        if not self.last:
            return raw
        was_training = self.drafter.training
        self.drafter.eval()  # no (LoRA) dropout while writing
        try:
            return on_policy_batch(self.drafter, raw, max_new_tokens=self.max_new_tokens,
                                   sampling=self.sampling, choice=choice, generator=gen,
                                   eos_ids=self.eos_ids, pad_id=self.pad_id,
                                   max_length=self.max_length, progress=self.progress)
        finally:
            self.drafter.train(was_training)
            self.drafter.reset()  # free the drafter's decode cache
