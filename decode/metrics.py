"""Aggregate speculative-decoding runs (one GenerationResult per prompt) into the numbers papers
report: tau (tokens per target forward), acceptance per draft position, speed and time split.

Definitions (a round = one decode target forward after the prefill; n = accepted drafts):
  * tau        = mean over rounds of n + 1: tokens committed per target forward, bonus included
                 (plain decoding gives exactly 1.0);
  * tau_draft  = mean over rounds of n: accepted drafts per round, bonus excluded;
  * accept_cond[i]   = P(draft i+1 accepted | drafts 1..i accepted and draft i+1 proposed);
  * accept_uncond[i] = P(draft i+1 accepted | draft i+1 proposed);
  * accept_hist[n]   = rounds that accepted exactly n drafts.
Acceptance counts are taken as verified, before a cut at EOS, a stop string or max_new_tokens.

Nothing measured is never a number: with no prompts, no decode rounds (every answer ended with
the prefill's token: max_new_tokens=1) or no draft token proposed, tau, tau_draft and the speedup
are None ("not measured", null in JSON, said in the table; `not_measured` gives the reason), and
so is the acceptance of a draft position no round reached.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdistill.decode.spec import GenerationResult
from specdistill.decode.survival import calibration


@dataclass
class RunMetrics:
    prompts: int = 0  # GenerationResults aggregated
    new_tokens: int = 0  # generated tokens, all prompts
    rounds: int = 0  # decode target forwards (prefills excluded)
    target_forwards: int = 0  # all target forwards (prefills included)
    drafted: int = 0  # draft tokens proposed, all rounds
    tau: float | None = None  # mean tokens committed per decode round, bonus included (None: not measured)
    tau_draft: float | None = None  # mean accepted drafts per decode round (None: not measured)
    accept_cond: list[float | None] = field(default_factory=list)  # per draft position, see module doc
    accept_uncond: list[float | None] = field(default_factory=list)  # per draft position
    accept_hist: list[int] = field(default_factory=list)  # rounds by accepted drafts 0, 1, ...
    tokens_per_s: float = 0.0  # new_tokens / total wall-clock time
    time_total: float = 0.0  # seconds, all prompts
    time_draft: float = 0.0  # seconds inside the drafter
    time_verify: float = 0.0  # seconds inside target forwards
    time_other: float = 0.0  # seconds elsewhere (the decoder's own overhead)
    # chains with slot confidences (decode/survival.py): predicted vs observed acceptance per slot,
    # the pairs, their source (head | draft_prob) and the ECE; None: no confidence was given
    calibration: dict | None = None
    confidence_ece: float | None = None  # calibration["ece"], at the top for the summary

    @classmethod
    def from_results(cls, results: Sequence[GenerationResult]) -> "RunMetrics":
        """Aggregate the results of one run (one mode, many prompts)."""
        drafted = [m for r in results for m in r.drafted]
        accepted = [n for r in results for n in r.accepted]
        rounds = len(accepted)
        longest = max(drafted, default=0)
        proposed = [0] * longest  # rounds where draft i+1 was proposed
        proposed_reached = [0] * longest  # ... and drafts 1..i were accepted
        passed = [0] * longest  # rounds where draft i+1 was accepted
        hist = [0] * (max(accepted, default=0) + 1)
        for m, n in zip(drafted, accepted):
            hist[n] += 1
            for i in range(m):
                proposed[i] += 1
                passed[i] += i < n
                proposed_reached[i] += i <= n
        t = cls(prompts=len(results), new_tokens=sum(len(r.tokens) for r in results),
                rounds=rounds, target_forwards=sum(r.target_forwards for r in results),
                drafted=sum(drafted), accept_hist=hist if rounds else [])
        if t.not_measured() is None:
            t.tau = (sum(accepted) + rounds) / rounds
            t.tau_draft = sum(accepted) / rounds
        t.accept_cond = [passed[i] / proposed_reached[i] if proposed_reached[i] else None
                         for i in range(longest)]
        t.accept_uncond = [passed[i] / proposed[i] if proposed[i] else None for i in range(longest)]
        t.time_total = sum(r.time_total for r in results)
        t.time_draft = sum(r.time_draft for r in results)
        t.time_verify = sum(r.time_verify for r in results)
        t.time_other = sum(r.time_other for r in results)
        t.tokens_per_s = t.new_tokens / t.time_total if t.time_total > 0 else 0.0
        sources = sorted({r.confidence_source for r in results if r.confidence_source})
        t.calibration = calibration([x for r in results for x in r.slot_confidence],
                                    "+".join(sources))
        t.confidence_ece = t.calibration["ece"] if t.calibration else None
        return t

    def not_measured(self) -> str | None:
        """Why tau, acceptance and the speedup were not measured (None: they were)."""
        if not self.prompts:
            return "no prompts"
        if not self.rounds:
            return ("no decode rounds: every answer ended with the prefill's token "
                    "(max_new_tokens=1, or an immediate end of turn)")
        if not self.drafted:
            return "the drafter proposed no draft token"
        return None

    def to_markdown(self, title: str = "run") -> str:
        """A two-column markdown table of the headline numbers, then the per-position rates."""
        tot = self.time_total or 1.0
        why = self.not_measured()
        rows = [
            ("prompts", f"{self.prompts}"), ("new tokens", f"{self.new_tokens}"),
            ("tokens/s", f"{self.tokens_per_s:.2f}"),
            ("tau (tokens per target forward)", fmt(self.tau, ".3f", why)),
            ("tau_draft (accepted drafts per round)", fmt(self.tau_draft, ".3f", why)),
            ("draft tokens proposed / decode rounds", f"{self.drafted} / {self.rounds}"),
            ("target forwards (prefills included)", f"{self.target_forwards}"),
            ("time draft / verify / other (s)",
             f"{self.time_draft:.2f} / {self.time_verify:.2f} / {self.time_other:.2f} "
             f"({100 * self.time_draft / tot:.0f}% / {100 * self.time_verify / tot:.0f}% / "
             f"{100 * self.time_other / tot:.0f}%)"),
            ("accepted-length histogram (0, 1, ...)", " ".join(str(h) for h in self.accept_hist)),
        ]
        out = [f"| {title} | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
        if self.accept_cond:
            out += ["", "| draft position | " + " | ".join(str(i + 1) for i in
                                                         range(len(self.accept_cond))) + " |",
                    "|---" * (len(self.accept_cond) + 1) + "|",
                    "| P(accept \\| previous accepted) | "
                    + " | ".join(fmt(a, ".3f") for a in self.accept_cond) + " |",
                    "| P(accept) | " + " | ".join(fmt(a, ".3f") for a in self.accept_uncond) + " |"]
        return "\n".join(out + self.calibration_markdown())

    def calibration_markdown(self) -> list[str]:
        """The calibration table (predicted vs observed acceptance per slot, ECE), or nothing."""
        cal = self.calibration
        if not cal:
            return []
        slots = cal["slots"]
        return ["", f"confidence calibration ({cal['source']}, {cal['pairs']} verified slots "
                    f"reached): ECE {fmt(cal['ece'], '.3f')} ({cal['bins']} equal-width bins)", "",
                "| slot | " + " | ".join(str(s["slot"]) for s in slots) + " |",
                "|---" * (len(slots) + 1) + "|",
                "| predicted | " + " | ".join(fmt(s["predicted"], ".3f") for s in slots) + " |",
                "| observed | " + " | ".join(fmt(s["observed"], ".3f") for s in slots) + " |",
                "| pairs | " + " | ".join(str(s["count"]) for s in slots) + " |"]


def fmt(value: float | None, spec: str, why: str | None = None) -> str:
    """A number for a table, or "not measured" (with the reason when given) for None."""
    if value is None:
        return f"not measured ({why})" if why else "not measured"
    return format(value, spec)
