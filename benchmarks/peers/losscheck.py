"""Step 2b: the shims never change what a peer computes, checked once per peer on the prepared
data before any arm trains: each shim's `--check-loss` mode (speculators_cpu.py, specforge_cpu.py)
builds the peer's model through its own trainer, takes the first batch, and compares the loss
the shimmed trainer computes with the same batch's loss from the peer's own loss function called
directly (value and gradient; the shim exits non-zero beyond its LOSS_TOL). The two losses land
in peers.json ("loss_check") and one line each in peers.md.

This needs the peers' virtualenvs, so it runs here, in the benchmark, not in pytest.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
# speculators packs every batch to --total-seq-len tokens, and its loss holds 3 TTT steps of
# (tokens, 49,152) fp32 logits and targets: at its default 8,192 that is ~20 GB. The check's
# batch is shorter; the loss is computed the same way at any length.
SPECULATORS_CHECK_TOKENS = 1024


def check_command(peer: str, python: Path, data_dir: Path, target_dir: Path,
                  aux_layers: list[int], run_dir: Path, report: Path) -> list[str]:
    """The shim's --check-loss command line for `peer` on the prepared data in `data_dir`
    (<data>/speculators or <data>/specforge), its defaults otherwise."""
    if peer == "speculators":
        from benchmarks.peers.arms import speculators_args

        train = speculators_args(data_dir / "speculators", target_dir, run_dir, close=False,
                                 layers=tuple(aux_layers))  # the layers the data holds
        return [str(python), str(HERE / "speculators_cpu.py"), "--check-loss", "--report",
                str(report), "--", *train, "--total-seq-len", str(SPECULATORS_CHECK_TOKENS)]
    if peer == "specforge":
        from benchmarks.peers.specforge_cpu import check_command as specforge_check

        return specforge_check(python, target_dir, data_dir / "specforge", run_dir, report)
    raise ValueError(f"no loss check for peer {peer!r}: peers with one: speculators, specforge")


def read_check(report: Path, rc: int, log_file: Path) -> dict:
    """The check's result from the shim's report and exit status: the two losses, their
    difference, the gradients' largest relative difference, ok; the error when it did not run."""
    rep = json.loads(report.read_text()) if report.is_file() else {}
    keep = ("loss_shimmed", "loss_reference", "loss_diff", "grad_diff", "reference", "tokens")
    out = {k: rep[k] for k in keep if k in rep}
    out.update(rc=rc, ok=rc == 0 and bool(rep.get("ok")))
    if "loss_shimmed" not in rep:
        from benchmarks.peers.arms import last_error

        out["error"] = rep.get("error") or (last_error(log_file) if log_file.is_file()
                                            else f"no report ({report})")
    return out


def check_peer(peer: str, python: Path, out: Path, aux_layers: list[int], target_dir: Path) -> dict:
    """Run `peer`'s loss check on <out>/data; its result (read_check)."""
    from benchmarks.peers.arms import run_arm

    run_dir = out / "checks" / peer
    run_dir.mkdir(parents=True, exist_ok=True)
    report, log_file = run_dir / "loss_check.json", run_dir / "loss_check.log"
    cmd = check_command(peer, python, out / "data", target_dir, aux_layers, run_dir / "run", report)
    got = run_arm(cmd, log_file, {"OMP_NUM_THREADS": "1"})
    return read_check(report, got["rc"], log_file)


def check_line(peer: str, c: dict) -> str:
    """One line of peers.md for a peer's check."""
    if "loss_shimmed" not in c:
        return f"- loss check, {peer}: did not run (exit {c.get('rc')}): {c.get('error', '')}"
    verdict = "same" if c["ok"] else "DIFFERENT: the shims change what it computes"
    return (f"- loss check, {peer}: shimmed trainer {c['loss_shimmed']:.6f}, its own loss function "
            f"({c.get('reference', '?')}) {c['loss_reference']:.6f}; |difference| "
            f"{c['loss_diff']:.2e}, gradients' largest relative difference {c['grad_diff']:.2e}: "
            f"{verdict}")
