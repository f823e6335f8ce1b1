"""`python -m decode` end to end on the tiny target: result JSON checkable against plain decoding."""
import json
import subprocess
import sys
from pathlib import Path

from decode_toys import jsonl_prompt_ids

from specdistill.decode.spec import generate
from specdistill.target.model import load_target

ROOT = Path(__file__).resolve().parents[1]


def test_decode_cli_writes_checkable_results(tmp_path, tiny_target_cfg):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Say {w} {w} {w} {w}."})
                                 for i, w in enumerate(["one", "two", "three"])) + "\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "decode", "target=tiny", "drafter=ngram", "eval=jsonl",
                          f"eval.path={prompts}", "max_new_tokens=12", "k=3", f"run_dir={run_dir}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tau" in out.stdout
    res = json.loads((run_dir / "result.json").read_text())
    assert res["summary"]["prompts"] == 3 and res["summary"]["outputs_identical_to_plain"] is True
    assert (run_dir / "result.md").is_file() and (run_dir / "config.yaml").is_file()
    # anyone can check the saved outputs against plain decoding of the same target
    target = load_target(tiny_target_cfg)
    ids_of = jsonl_prompt_ids(target, prompts)
    for row in res["prompts"]:
        plain = generate(target, None, ids_of[row["id"]], max_new_tokens=12)
        assert plain.tokens.tolist() == row["generated_ids"]
        assert row["new_tokens"] == len(row["generated_ids"]) and row["target_forwards"] >= 1


def test_decode_cli_refuses_untrained_drafter(tmp_path):
    out = subprocess.run([sys.executable, "-m", "decode", "target=tiny", "drafter=eagle",
                          "eval.limit=1", f"run_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0 and "ckpt=" in out.stderr


def test_decode_time_tree_settings_override_a_checkpoint(tiny_run, tiny_target_cfg):
    """`python -m decode ckpt=<run> drafter=eagle drafter.tree_total_tokens=7`: the tree is a
    decoding choice, so it applies to the trained drafter; weight-shaping keys cannot change, and
    the default drafter=ngram leaves the checkpoint's own settings."""
    import pytest
    from hydra import compose, initialize_config_dir

    from specdistill.decode.config import DecodeConfig, store_schemas
    from specdistill.decode.evaluate import load_decode_drafter
    from specdistill.store.drafter import load_drafter

    store_schemas("decode_schema", DecodeConfig)
    target = load_target(tiny_target_cfg)
    saved = json.loads((tiny_run / "best" / "drafter.json").read_text())
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        tuned = compose(config_name="decode", overrides=[
            "target=tiny", f"ckpt={tiny_run}", "drafter=eagle", "drafter.tree_total_tokens=7",
            "drafter.tree_depth=3"])
        default = compose(config_name="decode", overrides=["target=tiny", f"ckpt={tiny_run}"])
    d = load_decode_drafter(tuned, target)
    assert (d.cfg.tree_total_tokens, d.cfg.tree_depth) == (7, 3)
    assert load_decode_drafter(default, target).cfg.tree_total_tokens == saved["tree_total_tokens"]
    assert saved["tree_total_tokens"] != 7
    with pytest.raises(ValueError, match="cannot change after training"):
        load_drafter(tiny_run / "best", target, {"num_layers": 2})
