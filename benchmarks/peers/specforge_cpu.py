"""Runs SpecForge's offline EAGLE-3 training on the CPU for a wall-clock budget, then its own
export: executed by SpecForge's python (its virtualenv, benchmarks/peers/venvs.py), except
`specforge_command`, which our side calls to build the command line.

    <venv>/bin/python benchmarks/peers/specforge_cpu.py --minutes 3 --report r.json \
        --config run.yaml --draft-config draft.json --export <dir>
    <venv>/bin/python benchmarks/peers/specforge_cpu.py --check-loss --report r.json --config run.yaml

The shims, each small and named; none changes what the peer computes:
- `eager_loss`: its EAGLE-3 loss is a Triton kernel (specforge/core/loss.py imports triton, which
  does not run on a CPU). Replaced by the same math in eager torch: its own reference
  implementation in that file (`_compute_loss`: -(mask * p * log_softmax(logits)).sum(-1).mean()
  over the B*T rows, fp32), with autograd giving the kernel's gradient.
- `single_process`: the distributed variables of one process (rank 0 of 1, gloo), so its launcher
  trains in this process (its launch plan's "worker") instead of starting torchrun.
- `wall_clock_budget`: the same stop as our trainer.max_minutes through its own max_steps path:
  after the optimizer step that crosses the budget its controller's max_steps is set to that
  step, so fit() returns and its trainer saves the final checkpoint as at any max_steps.
- `count_tokens`: counts each training batch's tokens (attention mask) for tokens/s.
- `eager_kernels`: its draft model wraps RMSNorm, the rotary embedding and parts of its loss in
  `torch.compile` (modeling/draft/llama3_eagle.py); on a CPU that means inductor building C++
  for each at the first step (minutes on a loaded 2-core machine, inside the timed minutes).
  TORCHDYNAMO_DISABLE=1 runs the same functions eagerly.
`--check-loss` checks that claim on the run's first batch (`check_loss`): its strategy's
`forward_loss` (its target head, TTT unroll, masks and 0.8^i step weights: the loss its trainer
backpropagates) with the eager loss above, against the same batch with the loss its Triton kernel
implements in its own reference code (`_compute_loss` in specforge/core/loss.py, read from its
source: the module imports triton), value and gradient of every draft parameter; the run stops
there, nothing is trained.
The run config sets training.fsdp_sharding=NO_SHARD (DDP: its FSDP refuses a CPU) and sdpa
attention, and model.lm_head_key=model.embed_tokens.weight where the target ties its head
(SmolLM2: no lm_head.weight) on a folder of links to the target's files with the index file its
head loader looks for.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

try:  # this checkout's package, or (run as a script in the peer's virtualenv) this folder
    from benchmarks.peers.procstat import own_peak_rss_mb
except ImportError:
    from procstat import own_peak_rss_mb

SMOLLM2_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
                  "hidden_act", "head_dim", "bos_token_id", "eos_token_id", "vocab_size")


def eager_loss() -> None:
    import torch

    import specforge.core  # noqa: F401  (the package first; its loss module is replaced)

    class LogSoftmaxLoss:  # the Triton autograd Function's interface: .apply(logits, p, mask)
        @staticmethod
        def apply(logits, target_p, position_mask):
            out_logp = torch.log_softmax(logits.float(), dim=2)
            return -torch.sum(position_mask * (target_p * out_logp), 2).mean()

    mod = types.ModuleType("specforge.core.loss")
    mod.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = mod


LOSS_TOL = 1e-5  # |shimmed - reference| / max(|reference|, 1) allowed, and the same for gradients


class LossChecked(Exception):
    """Raised after the first batch's loss check: the run stops there."""


def reference_loss():
    """Its reference implementation of the EAGLE-3 loss (`_compute_loss`, specforge/core/loss.py),
    with the Triton autograd Function's interface. The file imports triton, so the function is
    read from it; its torch.compile decorator is dropped (the same function, run eagerly)."""
    import ast

    import torch

    spec = importlib.util.find_spec("specforge")
    path = Path(spec.submodule_search_locations[0]) / "core" / "loss.py"
    ref = next(n for n in ast.parse(path.read_text()).body
               if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
    ref.decorator_list = []
    ns = {"torch": torch, "nn": torch.nn}
    exec(compile(ast.Module([ref], []), str(path), "exec"), ns)
    return type("ReferenceLoss", (), {"apply": staticmethod(ns["_compute_loss"])})


def check_loss(stats: dict) -> None:
    """On the first training batch: its loss with the eager shim against its reference loss
    (module docstring) into `stats`, then LossChecked."""
    import torch

    import specforge.algorithms.eagle3.model as eagle3
    from specforge.training.controller import TrainerController

    shimmed, reference = eagle3.LogSoftmaxLoss, reference_loss()

    def first_step(self, data, progress):
        strategy = self.core.strategy
        module = strategy.trainable_module()
        module.train()
        batch = next(iter(data))
        got = {}
        for name, loss_cls in (("shimmed", shimmed), ("reference", reference)):
            eagle3.LogSoftmaxLoss = loss_cls  # the name its model calls
            module.zero_grad(set_to_none=True)
            out = strategy.forward_loss(batch)
            out.loss.backward()
            got[name] = (float(out.loss.detach()), [p.grad.detach().clone() for p in
                                                     module.parameters() if p.grad is not None])
        eagle3.LogSoftmaxLoss = shimmed
        module.zero_grad(set_to_none=True)
        (a, ga), (b, gb) = got["shimmed"], got["reference"]
        stats.update(loss_shimmed=a, loss_reference=b, loss_diff=abs(a - b),
                     grad_diff=max(float((x - y).abs().max()) for x, y in zip(ga, gb))
                     / max(max(float(y.abs().max()) for y in gb), 1e-12),
                     grads=len(gb), tokens=int(batch.tensors["attention_mask"].sum()),
                     reference="specforge.core.loss._compute_loss")
        stats["ok"] = (len(ga) == len(gb) > 0 and stats["loss_diff"] / max(abs(b), 1.0) <= LOSS_TOL
                       and stats["grad_diff"] <= LOSS_TOL)
        raise LossChecked()

    TrainerController._fit = first_step


def single_process() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def wall_clock_budget(minutes: float, stats: dict) -> None:
    from specforge.training.controller import TrainerController

    fit = TrainerController._fit

    def budgeted(self, data, progress):
        core_step = self.core.train_step
        start = time.monotonic()

        def train_step(batch, ctx):
            mask = batch.tensors.get("attention_mask")
            stats["tokens"] = stats.get("tokens", 0) + int(
                mask.sum() if mask is not None else batch.tensors["input_ids"].numel())
            result = core_step(batch, ctx=ctx)
            stats["train_s"] = time.monotonic() - start
            if result.optimizer_stepped:
                stats["steps"] = self.global_step + 1
                if stats["train_s"] >= 60 * minutes:
                    stats["stopped_by_budget"] = True
                    self.max_steps = self.global_step + 1  # its loop returns after this step
            return result

        self.core.train_step = train_step
        return fit(self, data, progress)

    TrainerController._fit = budgeted


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-loss", action="store_true", help="the first batch's loss check only")
    ap.add_argument("--minutes", type=float)
    ap.add_argument("--report", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--draft-config")
    ap.add_argument("--export")
    args = ap.parse_args()
    if not args.check_loss and None in (args.minutes, args.draft_config, args.export):
        ap.error("a training run needs --minutes, --draft-config and --export (or --check-loss)")
    stats: dict = {"peer": "specforge"}
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # eager_kernels: read when torch is first imported
    eager_loss()
    single_process()
    if args.check_loss:
        check_loss(stats)
    else:
        wall_clock_budget(args.minutes, stats)
    from specforge.cli import main as cli

    try:
        stats["rc"] = cli(["train", "-c", args.config])
        if not args.check_loss:
            stats["export"] = export(args)
    except LossChecked:
        print(json.dumps({k: stats.get(k) for k in ("loss_shimmed", "loss_reference", "loss_diff",
                                                    "grad_diff", "ok")}))
    finally:
        stats["peak_rss_mb"] = own_peak_rss_mb()
        Path(args.report).write_text(json.dumps(stats))
    return 0 if stats.get("ok", not args.check_loss) else 1


def export(args) -> str | None:
    """Its own `specforge export --to hf` of the last checkpoint, with the run's vocabulary map."""
    import yaml

    from specforge.cli import main as cli

    cfg = yaml.safe_load(open(args.config))
    out = Path(cfg["output_dir"])
    ckpts = sorted(out.glob(f"{cfg['run_id']}-step*"), key=lambda p: int(p.name.rsplit("step", 1)[1]))
    maps = sorted((Path(cfg["data"]["cache_dir"]) / "vocab_mapping").glob("*.pt"))
    if not ckpts:
        return None
    cli(["export", "--to", "hf", "--checkpoint", str(ckpts[-1]), "--draft-config",
         args.draft_config, "--output-dir", args.export,
         "--embedding-source", cfg["model"]["target_model_path"],  # its checkpoints omit it
         *(["--vocab-mapping", str(maps[-1])] if maps else [])])
    return args.export


if __name__ == "__main__":
    sys.exit(main())


# -- our side: the run's files and command line (imported by benchmarks/peers/arms.py) ----------
def linked_target(target_dir: Path, out: Path) -> Path:
    """A folder of links to the target's files plus the `*.index.json` its head loader reads."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    index = out / "model.safetensors.index.json"
    if not index.is_file():
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as fh:
            keys = list(fh.keys())
        index.write_text(json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors"
                                                                    for k in keys}}))
    return out


def draft_config(target_dir: Path, draft_vocab: int) -> dict:
    """What its provider derives from the target for EAGLE-3 (training/model_loading.py
    _generate_draft_config: the target's fields, 1 llama layer, untied), at `draft_vocab`."""
    tc = json.loads((target_dir / "config.json").read_text())
    out = {k: tc[k] for k in SMOLLM2_FIELDS if tc.get(k) is not None}
    return {**out, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "num_hidden_layers": 1, "tie_word_embeddings": False, "use_cache": True,
            "pad_token_id": tc.get("pad_token_id") or 0, "draft_vocab_size": draft_vocab}


def run_files(target: Path, data: Path, run_dir: Path, close: bool,
              total_steps: int | None = None, precision: str = "bf16") -> tuple[Path, Path]:
    """(run.yaml, draft_config.json) of a SpecForge run in `run_dir` on `target` (a linked_target
    folder) and the offline files in `data`: its defaults (7 TTT steps, lr 1e-4, batch 1,
    32,000-token draft vocabulary, bf16) or as close to our default recipe as it allows (1 TTT
    step, lr 1e-3 with 30 warm-up steps, batch 4, 8192-token vocabulary, the draft model in
    `precision`: our job's resolved trainer.precision, as model.torch_dtype). Both: cosine over
    `total_steps` (our default job's length or the fitted one; None: its own, for a loss check),
    offline features, CPU settings. Its target head (the teacher) stays bf16 in either: SpecForge
    0.2.0 casts it in code (modeling/target/target_head.py TargetHead.from_pretrained), no setting
    reaches it."""
    import yaml

    from benchmarks.peers.arms import PEER_DTYPE

    if close and not total_steps:
        raise ValueError("the close arm warms up for 30 of its total_steps: give total_steps")
    if precision not in PEER_DTYPE:
        raise ValueError(f"precision={precision!r}: our resolved trainer.precision is bf16 or fp32")
    run_dir.mkdir(parents=True, exist_ok=True)
    dcfg = run_dir / "draft_config.json"
    dcfg.write_text(json.dumps(draft_config(target, 8192 if close else 32000), indent=1))
    training = {"strategy": "eagle3", "num_epochs": 1000, "fsdp_sharding": "NO_SHARD",
                "attention_backend": "sdpa", "save_interval": 0, "log_interval": 5,
                "dist_timeout": 60}
    if total_steps:
        training["total_steps"] = total_steps
    if close:
        training.update({"ttt_length": 1, "learning_rate": 1e-3, "warmup_ratio": 30 / total_steps,
                         "batch_size": 4})
    weights = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    run = {"model": {"target_model_path": str(target), "draft_model_config": str(dcfg),
                     # SmolLM2 ties its head (no lm_head.weight): the embedding is the head
                     "lm_head_key": "lm_head.weight" if "lm_head.weight" in weights
                     else "model.embed_tokens.weight"},
           "data": {"hidden_states_path": str(data), "cache_dir": str(run_dir / "cache"),
                    "dataloader_num_workers": 0},
           "training": training, "output_dir": str(run_dir / "output"), "run_id": run_dir.name}
    if close:
        run["model"]["torch_dtype"] = PEER_DTYPE[precision]
    (run_dir / "run.yaml").write_text(yaml.safe_dump(run))
    return run_dir / "run.yaml", dcfg


def specforge_command(python: Path, args, run_dir: Path, report: Path, close: bool, cfg,
                      total_steps: int, precision: str = "bf16"):
    """(command, one-line description) of a SpecForge arm (run_files: its defaults or close, the
    close one's draft model in `precision`; its schedule over `total_steps`)."""
    from benchmarks.peers.arms import target_folder

    target = linked_target(target_folder(cfg), args.out / "specforge_target")
    run, dcfg = run_files(target, args.out / "data" / "specforge", run_dir, close, total_steps,
                          precision)
    cmd = [str(python), str(Path(__file__)), "--minutes", str(args.minutes), "--report",
           str(report), "--config", str(run), "--draft-config", str(dcfg),
           "--export", str(run_dir / "export")]
    what = (f"1 TTT step, lr 1e-3, 30 warm-up, batch 4, vocab 8192, draft {precision} as ours "
            f"(its head bf16)" if close
            else "its defaults: 7 TTT steps, lr 1e-4, batch 1, vocab 32000")
    return cmd, what


def check_command(python: Path, target_dir: Path, data: Path, run_dir: Path, report: Path):
    """The loss check's command line: its defaults (7 TTT steps: every step's loss and weight)
    on the first batch of `data`."""
    target = linked_target(target_dir, run_dir / "target")
    run, _ = run_files(target, data, run_dir, close=False)
    return [str(python), str(Path(__file__)), "--check-loss", "--report", str(report),
            "--config", str(run)]
