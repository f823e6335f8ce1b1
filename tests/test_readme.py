"""The README's Python example runs as written: its one ```python block (README "Use a trained
drafter from Python") is executed with its two settings, TARGET and DRAFTER, pointed at the tiny
random-init target and a drafter folder saved for it, and its greedy output must be plain
decoding's. A README whose example stops running (a renamed function, a changed signature) fails
here."""
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, f"README.md should hold exactly one ```python block, found {len(blocks)}"
    return blocks[0]


def point_at(code: str, **settings: str) -> str:
    """Replace the example's `NAME = ...` line of each setting by `NAME = <expression>`."""
    for name, expr in settings.items():
        code, n = re.subn(rf"^{name} = .*$", f"{name} = {expr}", code, flags=re.M)
        assert n == 1, f"the README example should set {name} on one line of its own"
    return code


def test_readme_example_decodes_losslessly(tiny_target_cfg, tmp_path, capsys):
    from specdistill.decode.spec import generate
    from specdistill.drafters.base import build_drafter
    from specdistill.store.drafter import save_drafter
    from specdistill.target.model import load_target

    target = load_target(tiny_target_cfg)
    cfg = {"name": "eagle3"}
    torch.manual_seed(0)
    save_drafter(build_drafter(cfg, target), cfg, tmp_path / "drafter")

    code = point_at(readme_example(), TARGET="tiny_target_cfg", DRAFTER="drafter_dir")
    ns = {"tiny_target_cfg": tiny_target_cfg, "drafter_dir": str(tmp_path / "drafter")}
    exec(compile(code, str(README), "exec"), ns)

    out, prompt = ns["out"], ns["prompt"]
    assert prompt.dim() == 1 and len(out.tokens) > 0
    plain = generate(ns["target"], None, prompt, max_new_tokens=64)
    assert out.tokens.tolist() == plain.tokens.tolist()  # lossless: the target's own greedy tokens
    assert out.target_forwards <= plain.target_forwards
    printed = capsys.readouterr().out
    assert re.search(r"tau \d\.\d\d, \d+ target forwards for \d+ tokens", printed), printed
