"""Self-distillation data (`data.regenerate`) and the data command lines, on the tiny target."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdistill.data.regenerate import RegenerateConfig, regenerate
from specdistill.data.sharegpt import Conversation, iter_conversations
from specdistill.target.model import TargetConfig, load_target

ROOT = Path(__file__).resolve().parents[1]


def _conv(cid, *turns):
    return Conversation(id=cid, messages=[{"role": r, "content": c} for r, c in turns])


CONVS = [
    _conv("user_first", ("user", "Name three colours."), ("assistant", "Red, green, blue.")),
    # a ShareGPT split: the conversation starts with the tail of an assistant answer
    _conv("assistant_first", ("assistant", "...and that is all."), ("user", "Say more."),
          ("assistant", "Sure.")),
    _conv("two_turns", ("user", "Hi."), ("assistant", "Hello."), ("user", "Count to three."),
          ("assistant", "1 2 3")),
    _conv("too_long", ("user", "word " * 300), ("assistant", "ok")),
    _conv("no_user", ("system", "Be brief."), ("assistant", "Noted.")),
]


def _cfg(**kw):
    base = dict(target=None, data=None, out="", limit=None, max_turns=2, batch_size=2,
                max_new_tokens=6, max_prompt_tokens=128, temperature=0.0, seed=0)
    base.update(kw)
    return RegenerateConfig(**base)


def _greedy(target, messages, n):
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=n, pad_token_id=target.tokenizer.eos_token_id)
    return target.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_regenerate_answers_are_the_targets_and_every_conversation_is_counted(tmp_path,
                                                                               tiny_target_cfg):
    target = load_target(tiny_target_cfg)
    out = tmp_path / "regen.jsonl"
    counts = regenerate(target, CONVS, _cfg(batch_size=1), out, progress=False)
    assert counts == {"written": 3, "skipped_done": 0, "skipped_too_long": 1,
                      "skipped_no_user_turn": 1}
    recs = {r["id"]: r["conversations"] for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"user_first", "assistant_first", "two_turns"}
    # user turns verbatim, assistant turns are the target's greedy answers to the rebuilt context
    first = recs["user_first"]
    assert [m["from"] for m in first] == ["human", "gpt"]
    assert first[1]["value"] == _greedy(target, [{"role": "user", "content": "Name three colours."}], 6)
    lead = recs["assistant_first"]  # the leading assistant turn is context, kept as written
    assert [m["from"] for m in lead] == ["gpt", "human", "gpt"] and lead[0]["value"] == "...and that is all."
    assert lead[2]["value"] == _greedy(target, [{"role": "assistant", "content": "...and that is all."},
                                                {"role": "user", "content": "Say more."}], 6)
    two = recs["two_turns"]  # max_turns=2: the second answer sees the first regenerated one
    assert [m["from"] for m in two] == ["human", "gpt", "human", "gpt"]
    ctx = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": two[1]["value"]},
           {"role": "user", "content": "Count to three."}]
    assert two[3]["value"] == _greedy(target, ctx, 6)


def test_regenerate_batched_equals_one_at_a_time_and_resumes(tmp_path, tiny_target_cfg):
    target = load_target(tiny_target_cfg)
    one, batched = tmp_path / "one.jsonl", tmp_path / "batched.jsonl"
    regenerate(target, CONVS, _cfg(batch_size=1, max_turns=1), one, progress=False)
    regenerate(target, CONVS, _cfg(batch_size=4, max_turns=1), batched, progress=False)
    read = lambda p: {r["id"]: r for r in map(json.loads, p.read_text().splitlines())}  # noqa: E731
    assert read(one) == read(batched)  # left padding changes nothing
    # a crash mid-line: the partial line is repaired and only the missing conversation is redone
    lines = batched.read_text().splitlines(keepends=True)
    batched.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    counts = regenerate(target, CONVS, _cfg(batch_size=4, max_turns=1), batched, progress=False)
    assert counts["written"] == 1 and counts["skipped_done"] == 2
    assert read(batched) == read(one)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**__import__("os").environ, "CI": "1"})


def test_regenerate_and_capture_command_lines(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": f"Answer {i}."}]}) + "\n"
        for i in range(6)))
    out = tmp_path / "regen.jsonl"
    res = _cli("specdistill.data.regenerate", "target=tiny", "data=jsonl", f"data.path={chats}", f"out={out}",
               "limit=4", "max_new_tokens=5", "batch_size=2")
    assert res.returncode == 0, res.stderr
    assert "'written': 4" in res.stdout and len(out.read_text().splitlines()) == 4
    assert not (ROOT / "regenerate.log").exists()  # no log file left in the working directory
    convs = list(iter_conversations(out))  # the data pipeline reads what it wrote
    assert {c.id for c in convs} <= {f"c{i}" for i in range(4)} and convs
    feats = tmp_path / "feats"
    res = _cli("specdistill.data.capture", "target=tiny", "data=jsonl", f"data.path={chats}", f"out={feats}",
               f"data.cache_dir={tmp_path / 'cache'}", "data.eval_fraction=0.2", "limit=3")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["conversations"] == 3 and manifest["layers"] == [-1]
    assert sum(1 for _ in feats.glob("*.safetensors")) >= 1


def test_self_distilled_data_is_regenerated_once_then_read_from_the_cache(tmp_path, tiny_target_cfg,
                                                                          monkeypatch):
    from omegaconf import OmegaConf

    import specdistill.data.regenerate as regen
    from specdistill.data.dataset import DataConfig, RegenerateSettings, load_chat_dataset

    target = load_target(tiny_target_cfg)
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": "Original."}]}) + "\n"
        for i in range(5)))
    cfg = OmegaConf.structured(DataConfig(kind="file", path=str(chats), eval_fraction=0.0,
                                          regenerate=RegenerateSettings(limit=4, max_new_tokens=4,
                                                                        batch_size=2, dtype="bfloat16")))
    new = regen.self_distilled(target, cfg, progress=False)
    assert new.kind == "file" and new.regenerate is None and new.path != str(chats)
    recs = [json.loads(line) for line in Path(new.path).read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == ["c0", "c1", "c2", "c3"]  # limit=4
    assert all(r["conversations"][1]["value"] != "Original." for r in recs)
    assert target.dtype == torch.float32  # the bf16 copy generated; the target is untouched
    # second use: straight from the cache, nothing generated
    monkeypatch.setattr(regen, "regenerate", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert regen.self_distilled(target, cfg, progress=False).path == new.path
    # other settings are another cache entry
    cfg.regenerate.max_new_tokens = 5
    try:
        regen.self_distilled(target, cfg, progress=False)
        raise RuntimeError("expected a regeneration")
    except AssertionError:
        pass
    data = load_chat_dataset(new, target.tokenizer)
    assert len(data.train) >= 1  # the data pipeline reads it (empty answers are dropped, counted)


def test_regenerate_never_changes_a_file_it_did_not_start(tmp_path, tiny_target_cfg):
    """A user's JSONL whose last line is a complete record without a newline was
    treated as a crash leftover and cut. A file regenerate did not start is refused untouched."""
    target = load_target(tiny_target_cfg)
    mine = tmp_path / "mine.jsonl"
    mine.write_bytes(b'{"id": "a", "conversations": []}\n{"id": "b", "conversations": []}')
    with pytest.raises(FileExistsError, match="was not started by regenerate"):
        regenerate(target, CONVS[:1], _cfg(), mine, progress=False)
    assert mine.read_bytes() == b'{"id": "a", "conversations": []}\n{"id": "b", "conversations": []}'
    assert not (tmp_path / "mine.jsonl.regenerate.json").exists()


def test_regenerate_resume_keeps_a_whole_last_record_and_refuses_other_settings(tmp_path,
                                                                               tiny_target_cfg):
    target = load_target(tiny_target_cfg)
    out = tmp_path / "regen.jsonl"
    regenerate(target, CONVS[:3], _cfg(max_turns=1), out, progress=False)
    whole = out.read_bytes()
    out.write_bytes(whole[:-1])  # the crash came between the last record and its newline
    counts = regenerate(target, CONVS[:3], _cfg(max_turns=1), out, progress=False)
    assert counts["written"] == 0 and counts["skipped_done"] == 3  # that record is kept
    assert out.read_bytes() == whole
    reseeded = load_target(TargetConfig(**{**vars(tiny_target_cfg), "seed": 1}))
    with pytest.raises(ValueError, match=r"target\.seed: 0 -> 1"):
        regenerate(reseeded, CONVS, _cfg(max_turns=1), out, progress=False)
    with pytest.raises(ValueError, match=r"generation\.max_new_tokens: 6 -> 7"):
        regenerate(target, CONVS, _cfg(max_turns=1, max_new_tokens=7), out, progress=False)
    side = tmp_path / "regen.jsonl.regenerate.json"  # answers of a format-1 file: bf16 copies
    side.write_text(json.dumps({**json.loads(side.read_text()), "format": 1}))  # rounded RoPE
    with pytest.raises(ValueError, match=r"format: 1 -> 2"):
        regenerate(target, CONVS, _cfg(max_turns=1), out, progress=False)
    assert out.read_bytes() == whole  # nothing mixed in
