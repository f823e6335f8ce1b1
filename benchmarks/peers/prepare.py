"""Step 1 of the side by side: our data path's conversations and our capture of them (the same
function our trainer's offline features go through, so the folder is the one our arm reads), then
the same numbers in each peer's format (features.py)."""
from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

from specdistill.data.capture import CaptureConfig, capture_dir, offline_features
from specdistill.data.sources import training_data
from specdistill.drafters.base import build_drafter
from specdistill.target.model import cache_root, load_target
from specdistill.train.precision import features_storage, training_precision

from benchmarks.peers import features as F

log = logging.getLogger(__name__)


def our_capture(cfg):
    """(target, train rows, offline features, capture autocast) as our trainer resolves them for
    `cfg` (trainer.features=offline): the capture is made here when missing, reused when not."""
    tcfg = cfg.trainer
    precision, autocast_dtype, _ = training_precision(tcfg.precision, tcfg.capture_autocast,
                                                      str(cfg.target.device))
    feats_dtype = features_storage(tcfg.capture_features_dtype, precision)
    target = load_target(cfg.target, training=True)
    layers = list(build_drafter(cfg.drafter, target).feature_layers)
    file = training_data(target, cfg.data, lambda: layers, progress=False).captured
    ccfg = CaptureConfig(layers=layers, autocast=autocast_dtype, features_dtype=feats_dtype)
    folder = capture_dir(cache_root(cfg.target), target, file.train, file.cache_path.name, layers,
                         autocast_dtype, feats_dtype)
    return target, file.train, offline_features(target, file.train, folder, ccfg,
                                                progress=False), autocast_dtype, layers


def val_padding(n: int, ratio: float = 0.9) -> int:
    """Rows to append so that speculators' train split (the first int(len * ratio) rows, its
    default --train-data-ratio) is exactly our n conversations; the appended rows (copies of the
    first ones) only feed its validation loss."""
    v = 1
    while int((n + v) * ratio) != n:
        v += 1
    return v


def write_peer_data(cfg, out: Path, peer_pythons: dict) -> dict:
    """<out>/speculators and <out>/specforge from our capture; returns counts and the layers."""
    marker = out / "done.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    target, rows, offline, autocast_dtype, layers = our_capture(cfg)
    convs = list(F.conversations(target, rows, offline, autocast_dtype))
    n = len(convs)
    spec = convs + convs[:val_padding(n)]  # its validation split: copies, never trained on
    n_spec = F.write_speculators(spec, out / "speculators")
    n_sf = F.write_specforge(convs, out / "specforge")
    if "speculators" in peer_pythons:  # its dataset and token counts, made by its own code
        subprocess.run([str(peer_pythons["speculators"]), str(Path(__file__).with_name(
            "speculators_cpu.py")), "--prepare-data", str(out / "speculators")], check=True)
    info = {"conversations": n, "speculators_rows": n_spec, "specforge_rows": n_sf,
            "tokens": int(sum(len(c["input_ids"]) for c in convs)),
            "answer_tokens": int(sum(int(c["loss_mask"].sum()) for c in convs)),
            "aux_layers": layers, "autocast": autocast_dtype}
    marker.write_text(json.dumps(info, indent=1))
    return info
