"""The local report of a training run: PNG plots and a report.md, rebuilt from the run dir's files.

    write_report(run_dir)              # after every eval (the recipe calls it), or by hand:
    python -m train.report <run_dir>

Reads only what the run already wrote, so it works on a finished, crashed or resumed run and gives
a user without W&B the same picture:
  * metrics.jsonl          loss (total and per component) and simulated evals (eval/sim_tau, eval/acc_i);
  * final_eval/result.json the real decoder's summary (tau, per-position acceptance, accepted-length
                           histogram, speedup) and final_eval/result.md, its table;
  * eval_by_context.json   the latest simulated eval split by the context before each drafted
                           position (0-512, 512-2k, 2k-8k, 8k+ tokens: the buckets that hold any).
Writes <run_dir>/plots/{acceptance_by_position,accepted_length,tau,loss}.png and <run_dir>/report.md.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from specdistill.data.report import REPORT_FILE, DataReport

PLOTS = "plots"
ACC_KEY = re.compile(r"^eval/acc_(\d+)$")
LOSS_PART = re.compile(r"^(div|feat)/s\d+$")  # per-component losses from train/losses.py


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of metrics.jsonl (a torn last line from a crash is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def simulated_evals(rows: list[dict[str, Any]]) -> list[tuple[int, float, list[float]]]:
    """(step, sim_tau, per-position acceptance) of every periodic eval, in step order; a resumed
    run that re-logged a step keeps the last one."""
    evals = {}
    for r in rows:
        if isinstance(r.get("eval/sim_tau"), (int, float)):  # null: that eval measured nothing
            acc = sorted((int(m.group(1)), float("nan") if v is None else v)
                         for k, v in r.items() if (m := ACC_KEY.match(k)))
            evals[int(r["step"])] = (float(r["eval/sim_tau"]), [v for _, v in acc])
    return [(s, tau, acc) for s, (tau, acc) in sorted(evals.items())]


def implied_length_distribution(acc: list[float]) -> list[float]:
    """P(exactly n drafts accepted), n = 0..k, from conditional per-position acceptance when every
    round drafts k tokens: P(n) = prod_{i<=n} acc_i * (1 - acc_{n+1})."""
    out, run = [], 1.0
    for a in acc:
        out.append(run * (1 - a))
        run *= a
    return out + [run]


BY_CONTEXT = "eval_by_context.json"


def write_eval_by_context(run_dir: Path, step: int, k: int, buckets: list[dict[str, Any]]) -> None:
    """The latest simulated eval by context bucket (decode/simulate.py by_context), as JSON."""
    path = Path(run_dir) / BY_CONTEXT
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"step": step, "k": k, "buckets": buckets}, indent=1))
    os.replace(tmp, path)


def context_table(run_dir: Path) -> list[str]:
    """The report's section on held-out acceptance by context length (empty without the file)."""
    path = Path(run_dir) / BY_CONTEXT
    if not path.is_file():
        return []
    got = json.loads(path.read_text())
    lines = [f"## Simulated acceptance by context length (step {got['step']}, k={got['k']})", "",
             "Held-out positions by the tokens before them: a drafter trained on shorter rows than "
             "it serves shows it here.", "",
             "| context tokens | positions | drafted | accepted | accepted / drafted | sim tau |",
             "|---|---:|---:|---:|---:|---:|"]
    for b in got["buckets"]:
        rate = b["accepted"] / b["drafted"] if b["drafted"] else None
        lines.append(f"| {b['bucket']} | {b['positions']} | {b['drafted']} | {b['accepted']} | "
                     f"{_num(rate)} | {_num(b['sim_tau'])} |")
    return lines + [""]


def read_final(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The final decoder eval's summary and markdown table, when the run has one."""
    folder = Path(run_dir) / "final_eval"
    summary = markdown = None
    if (folder / "result.json").is_file():
        summary = json.loads((folder / "result.json").read_text())["summary"]
    if (folder / "result.md").is_file():
        markdown = (folder / "result.md").read_text().strip()
    return summary, markdown


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display; safe on servers and in tests
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    tmp = path.with_suffix(f".tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def plot_acceptance(path: Path, evals, final: dict | None) -> None:
    """Per-position acceptance: the first and latest simulated evals and the real decoder's."""
    plt, fig, ax = _figure()
    chosen = [evals[0], evals[-1]] if len(evals) > 1 else evals
    for step, _, acc in chosen:
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"simulated, step {step}")
    if final and final.get("spec_accept_cond"):
        acc = [float("nan") if a is None else a for a in final["spec_accept_cond"]]  # None: not measured
        ax.plot(range(1, len(acc) + 1), acc, marker="s", lw=2, label="decoder (final eval)")
    ax.set(xlabel="draft position i", ylabel="P(accept i | 1..i-1 accepted)", ylim=(0, 1.02),
           title="acceptance by draft position")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_lengths(path: Path, evals, final: dict | None) -> str:
    """Accepted drafts per round: the real decoder's histogram, else the distribution implied by
    the latest simulated eval. Returns what was plotted (for the report's caption)."""
    plt, fig, ax = _figure()
    if final and sum(final.get("spec_accept_hist") or []):
        hist = final["spec_accept_hist"]
        total = sum(hist) or 1
        ax.bar(range(len(hist)), [h / total for h in hist], color="tab:blue")
        what = f"decoder final eval, {sum(hist)} rounds"
    else:
        step, _, acc = evals[-1]
        dist = implied_length_distribution(acc)
        ax.bar(range(len(dist)), dist, color="tab:gray")
        what = f"implied by the simulated acceptance at step {step}"
    ax.set(xlabel="accepted drafts in a round", ylabel="fraction of rounds",
           title=f"accepted length ({what})")
    _save(plt, fig, path)
    return what


def plot_tau(path: Path, evals, final: dict | None, sim_k: int | None = None) -> None:
    """Held-out simulated tau at each eval and the real decoder's tau at the end, each labelled
    with its draft length k (tau grows with k: two curves at different k do not compare)."""
    plt, fig, ax = _figure()
    k_sim = f"k={sim_k}" if sim_k else "k not recorded"
    ax.plot([s for s, _, _ in evals], [t for _, t, _ in evals], marker="o",
            label=f"held-out simulated tau ({k_sim})")
    if final and isinstance(final.get("tau"), (int, float)):
        ax.axhline(final["tau"], color="tab:red", ls="--",
                   label=f"decoder tau {final['tau']:.2f} (k={final.get('k', '?')}, "
                         f"{final.get('eval', 'eval')} {final.get('prompts', '?')} prompts)")
    ax.set(xlabel="step", ylabel="tokens per target forward", title="tau over training")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_loss(path: Path, rows) -> None:
    plt, fig, ax = _figure()
    keys = ["loss"] + sorted({k for r in rows for k in r if LOSS_PART.match(k)})
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), label=key, lw=2 if key == "loss" else 1)
    ax.set(xlabel="step", ylabel="loss", title="training loss (total and per component)")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def write_report(run_dir: Path) -> Path:
    """(Re)write the plots and report.md of `run_dir`; returns the report's path."""
    run_dir = Path(run_dir)
    plots = run_dir / PLOTS
    plots.mkdir(parents=True, exist_ok=True)
    rows = read_metrics(run_dir)
    evals = simulated_evals(rows)
    final, final_md = read_final(run_dir)
    shown: list[tuple[str, str]] = []  # (file name, caption)
    # a final eval that measured nothing (no decode round, no draft) has no curve to draw
    final_acc = final and any(a is not None for a in final.get("spec_accept_cond") or [])
    if evals or final_acc:
        plot_acceptance(plots / "acceptance_by_position.png", evals, final)
        shown.append(("acceptance_by_position.png", "per-position acceptance"))
    if evals or (final and sum(final.get("spec_accept_hist") or [])):
        what = plot_lengths(plots / "accepted_length.png", evals, final)
        shown.append(("accepted_length.png", f"accepted length ({what})"))
    if evals:
        sim_k = next((int(r["eval/k"]) for r in reversed(rows) if "eval/k" in r), None)
        plot_tau(plots / "tau.png", evals, final, sim_k)
        shown.append(("tau.png", "tau over training"))
    if any(isinstance(r.get("loss"), (int, float)) for r in rows):
        plot_loss(plots / "loss.png", rows)
        shown.append(("loss.png", "training loss"))
    text = _markdown(run_dir, rows, evals, final_md, shown)
    out = run_dir / "report.md"
    tmp = out.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, out)
    return out


def read_engine(run_dir: Path) -> dict[str, Any] | None:
    """The engine check's summary (final_eval/engine/engine_check.json), or None."""
    path = Path(run_dir) / "final_eval" / "engine" / "engine_check.json"
    try:
        return json.loads(path.read_text())["summary"]
    except (OSError, ValueError, KeyError):
        return None


def _num(x, fmt: str = ".3f", suffix: str = "") -> str:
    return f"{x:{fmt}}{suffix}" if isinstance(x, (int, float)) else "-"


def serve_commands(run_dir: Path, engine: dict[str, Any] | None) -> list[str]:
    """The export command for the layout the engine check served, and the layout's own serving
    command (its model card's usage line), for the run's drafter and target."""
    from omegaconf import OmegaConf

    from specdistill.drafters.base import DRAFTERS

    config = Path(run_dir) / "config.yaml"
    if engine is None or not engine.get("format") or not config.is_file():
        return []
    cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
    fmt, dcfg = engine["format"], cfg.get("drafter") or {}
    out = f"exports/{Path(run_dir).name}-{fmt}"
    lines = [f"specdistill export run={run_dir} format={fmt} out={out}"]
    layout = getattr(DRAFTERS.get(dcfg.get("name")), "layouts", {}).get(fmt)
    if layout is not None:
        k = int(engine.get("k") or 2)
        base = (cfg.get("target") or {}).get("path", "<target>")
        try:
            lines += layout.usage.format(path=out, base=base, k=k, k1=k + 1, drafter=dcfg).splitlines()
        except (KeyError, IndexError, ValueError):  # a usage field this run's config lacks
            pass
    return lines


def calibration_line(final: dict[str, Any] | None) -> str:
    """One line on the drafter's trained confidence head (decode/survival.py): its ECE and its
    predicted vs observed acceptance per slot in the final eval; "" without a head's numbers."""
    cal = (final or {}).get("spec_calibration")
    if not cal or "head" not in str(cal.get("source", "")):
        return ""
    slots = ", ".join(f"{s['slot']}: {_num(s.get('predicted'), '.2f')} vs "
                      f"{_num(s.get('observed'), '.2f')}" for s in cal.get("slots", []))
    return (f"Confidence head calibration: ECE {_num(cal.get('ece'))} over {cal.get('pairs')} "
            f"verified slots (predicted vs observed acceptance per slot: {slots}).")


def verdict(run_dir: Path, final: dict[str, Any] | None, engine: dict[str, Any] | None) -> list[str]:
    """The report's first section: tau and speedup in our decoder and in the serving engine,
    whether both were lossless, and how to serve the drafter."""
    if final is None and engine is None:
        return []
    lines = ["## Verdict", "", "| decoder | tau | speedup | lossless | |", "|---|---:|---:|---|---|"]
    if final is not None:
        same = final.get("outputs_identical_to_plain")
        loss = {"passed": "yes" if same else "yes (near-ties only)", "failed": "**NO**"}.get(
            final.get("lossless_check"), "not checked")
        lines.append(f"| ours ({final.get('target_dtype', '?')}, k={final.get('k')}) | "
                     f"{_num(final.get('tau'))} | {_num(final.get('speedup'), '.2f', 'x')} | {loss} | "
                     f"{final.get('generations', '?')} {final.get('eval', '')} generations |")
    if engine is not None:
        name = engine.get("engine", "engine")
        if engine.get("verdict") in ("pass", "fail"):
            from specdistill.decode.engine.check import spec_plain_cell

            loss = spec_plain_cell(engine)  # n/N identical to plain, ties said apart
            lines.append(f"| {name} ({engine.get('format')}) | {_num(engine.get('tau_engine'))} "
                         f"(ours replayed {_num(engine.get('tau_replay'))}) | "
                         f"{_num(engine.get('engine_speedup'), '.2f', 'x')} | {loss} | check: "
                         f"**{engine['verdict']}** |")
        else:
            lines.append(f"| {name} | - | - | - | {engine.get('verdict')}: "
                         f"{engine.get('error', '')[:200]} |")
    cal = calibration_line(final)
    if cal:
        lines += ["", cal]
    serve = serve_commands(run_dir, engine)
    if serve:
        lines += ["", "Serve it:", "", "```bash", *serve, "```"]
    return lines + [""]


def _markdown(run_dir: Path, rows, evals, final_md: str | None, shown) -> str:
    last_step = max((int(r["step"]) for r in rows), default=0)
    lines = [f"# Training report: {run_dir.name}", "",
             f"Step {last_step}; written {time.strftime('%Y-%m-%d %H:%M:%S')}. Config: "
             f"[config.yaml](config.yaml); metrics: [metrics.jsonl](metrics.jsonl).", ""]
    lines += verdict(run_dir, read_final(run_dir)[0], read_engine(run_dir))
    if final_md:
        lines += ["## Decoder evaluation (final_eval)", "", final_md, ""]
    if (run_dir / REPORT_FILE).is_file():  # what was trained on (written at the job's start)
        lines += DataReport.load(run_dir / REPORT_FILE).markdown()
    if evals:
        k = max(len(a) for _, _, a in evals)
        lines += ["## Simulated acceptance on held-out conversations", "",
                  "| step | sim tau | " + " | ".join(f"acc_{i + 1}" for i in range(k)) + " |",
                  "|---:" * (k + 2) + "|"]
        lines += [f"| {s} | {t:.3f} | " + " | ".join(f"{a:.3f}" for a in acc) + " |"
                  for s, t, acc in evals]
        lines.append("")
    lines += context_table(run_dir)
    if shown:
        lines += ["## Plots", ""] + [f"![{cap}]({PLOTS}/{name})" for name, cap in shown] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m train.report <run_dir>")
    print(write_report(Path(sys.argv[1])))
