"""The training job's precision policy: `trainer.precision`, `trainer.capture_autocast` and
`trainer.capture_features_dtype` with `auto` resolved for the device (bf16 where it runs bf16
natively: target/precision.py native_bf16). Inference dtypes are the target's (target/precision.py)."""
from __future__ import annotations

from specdistill.target.precision import native_bf16


def training_precision(precision: str, capture_autocast: str | None, device: str
                       ) -> tuple[str, str | None, str]:
    """trainer.precision and trainer.capture_autocast with `auto` resolved for `device`: bf16 /
    bfloat16 where it runs bf16 natively (native_bf16), else fp32 / None; and why, in words."""
    if precision not in ("fp32", "bf16", "auto"):
        raise ValueError(f"trainer.precision={precision!r}: use fp32, bf16 or auto")
    if capture_autocast not in (None, "bfloat16", "float16", "auto"):
        raise ValueError(f"trainer.capture_autocast={capture_autocast!r}: use bfloat16, float16, "
                         f"auto or null")
    if "auto" not in (precision, capture_autocast):
        return precision, capture_autocast, "set explicitly"
    native, why, _ = native_bf16(device)
    return (("bf16" if native else "fp32") if precision == "auto" else precision,
            ("bfloat16" if native else None) if capture_autocast == "auto" else capture_autocast, why)


def features_storage(setting: str, precision: str) -> str | None:
    """trainer.capture_features_dtype (float32 | bfloat16 | auto) -> the storage dtype of captured
    layer features (data/capture.py CaptureConfig.features_dtype; None: as the final hidden state,
    fp32). auto: bfloat16 when the drafter trains under bf16 autocast (`precision`), whose first
    layer reads them at bf16 anyway: storing them rounded changes no value it computes (EAGLE-3,
    P-EAGLE, DFlash fuse them with a linear layer; an EAGLE-1 head on a non-final layer regresses
    them: its targets round to bf16, as in SpecForge's bf16 captures), at half the disk and page
    cache. The final hidden state (the teacher's logits) stays fp32 either way."""
    if setting not in ("float32", "bfloat16", "auto"):
        raise ValueError(f"trainer.capture_features_dtype={setting!r}: use float32, bfloat16 or auto")
    if setting == "auto":
        return "bfloat16" if precision == "bf16" else None
    return None if setting == "float32" else setting
