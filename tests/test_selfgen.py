"""Self-generated data (data/generate.py, data/selfgen.py): the target's answers come with the
hidden states a separate capture would compute, the store resumes and refuses what it was not made
from, and training on it reads those features."""
import json
from pathlib import Path

import pytest
import torch
from conftest import write_chats
from test_train import make_cfg, run

from specdistill.data.generate import generate_with_features
from specdistill.target.model import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(request):
    from conftest import TINY_MODEL

    from specdistill.target.model import TargetConfig

    return load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                    model_config=dict(TINY_MODEL), seed=0, dtype="float32"))


@pytest.mark.parametrize("compact_below,prefill_rows", [(1.0, None), (0.0, None), (1.0, 1), (0.0, 3)])
def test_answers_are_each_prompts_greedy_answer_with_the_features_of_a_fresh_forward(
        tiny, compact_below, prefill_rows):
    """Rows leave the batch at once / never (compact_below); the prompts prefilled in one forward,
    one at a time, or 3 + 1 (each part cut to its own longest prompt, the caches joined)."""
    torch.manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,)) for n in (5, 9, 3, 12)]
    first = generate_with_features(tiny.model, prompts, max_new_tokens=16, eos_ids={-1})
    # EOS ids the rows meet at different steps: rows 0 and 2 end early, the others run out
    eos = {int(first[0].answer[4]), int(first[2].answer[9])}
    out = generate_with_features(tiny.model, prompts, max_new_tokens=16, eos_ids=eos,
                                 layers=(1, 2), compact_below=compact_below,
                                 prefill_rows=prefill_rows)
    assert [o.ended for o in out][0] and out[0].answer[-1].item() in eos
    H = tiny.hidden_size
    for p, o in zip(prompts, out):
        ref = tiny.model.generate(p[None], max_new_tokens=16, do_sample=False, pad_token_id=0,
                                  eos_token_id=sorted(eos))[0, len(p):]
        assert o.answer.tolist() == ref.tolist()  # each row as if it were alone
        assert len(o.answer) < 16 if o.ended else len(o.answer) == 16
        fresh = tiny.forward(torch.cat([p, o.answer])[None], layers=(1, 2, -1), logits=False)
        assert o.features.shape == (len(p) + len(o.answer), 2 * H)  # the EOS's own included
        torch.testing.assert_close(o.features, fresh.features[0, :, :2 * H], atol=1e-5, rtol=0)
        torch.testing.assert_close(o.final, fresh.features[0, :, 2 * H:], atol=1e-5, rtol=0)


def test_sampled_answers_follow_each_rows_own_generator(tiny):
    prompts = [torch.arange(100, 106), torch.arange(200, 203)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2)]  # noqa: E731
    a = generate_with_features(tiny.model, prompts, max_new_tokens=8, eos_ids={-1},
                               temperature=1.0, generators=gens())
    b = generate_with_features(tiny.model, prompts[::-1], max_new_tokens=8, eos_ids={-1},
                               temperature=1.0, generators=gens()[::-1])
    assert a[0].answer.tolist() == b[1].answer.tolist() and a[1].answer.tolist() == b[0].answer.tolist()


def _cfg(tmp_path, chats, *extra):
    return make_cfg(tmp_path, chats, "data=sharegpt_selfgen", "data.kind=file",
                    f"data.path={chats}", "data.eval_fraction=0.2", "data.selfgen.prompts=12",
                    "data.selfgen.max_new_tokens=10", "data.selfgen.batch_size=5",
                    "data.selfgen.dtype=float32", "data.selfgen.features_dtype=float32",
                    "drafter=eagle3", "drafter.draft_vocab_size=256", "drafter.ttt_length=1",
                    "trainer.features=offline", "trainer.max_steps=2", "trainer.eval_every=0",
                    "trainer.save_every=0", *extra)


def test_training_reads_the_rows_and_features_the_target_wrote(tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", 14, 8)
    r = run(_cfg(tmp_path, chats))
    store = r.selfgen.folder
    done = json.loads((store / "COMPLETE").read_text())
    assert done["kept"] == 12 and len(r.split_ds) + len(r.eval_ds) == 12
    row = r.split_ds[0]
    P = row["loss_mask"].index(1)  # the prompt is the chat template's render of the first turn
    text = r.target.tokenizer.decode(row["input_ids"][:P])
    assert text.endswith("<|im_start|>assistant\n") and "Continue from" in text
    # the offline batch of the store equals an online capture of the same rows (fp32 here)
    from specdistill.data.capture import capture
    from specdistill.data.dataset import pad_batch

    rows = [r.train_ds[i] for i in range(3)]
    feats, final = r.offline.batch([0, 1, 2], rows, max(len(x["input_ids"]) for x in rows))
    b = pad_batch(rows, 0)
    f2, h2 = capture(r.target, b["input_ids"], b["attention_mask"], r.drafter.feature_layers)
    m = b["attention_mask"].bool()
    torch.testing.assert_close(feats[m], f2[m], atol=1e-4, rtol=0)
    torch.testing.assert_close(final[m], h2[m], atol=1e-4, rtol=0)
    answers = [json.loads(x) for x in (store / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 12 and answers[0]["conversations"][-1]["from"] == "gpt"
    # the run's data report counts the target's own rows: one answer turn each, every trained token
    report = json.loads((Path(r.cfg.run_dir) / "data_report.json").read_text())
    all_rows = [r.split_ds[i] for i in range(len(r.split_ds))] + [r.eval_ds[i] for i in range(len(r.eval_ds))]
    assert report["conversations"] == report["rows"] == report["turns"] == 12
    assert report["tokens"]["answer"] == sum(sum(x["loss_mask"]) for x in all_rows) > 0


def test_an_interrupted_store_resumes_and_another_setting_is_refused(tmp_path, monkeypatch):
    from specdistill.data import selfgen

    chats = write_chats(tmp_path / "chats.jsonl", 14, 8)
    r = run(_cfg(tmp_path, chats))
    folder = r.selfgen.folder
    def contents():  # tensors and metadata (the header's key order is not fixed)
        from safetensors import safe_open

        out = {}
        for p in sorted(folder.glob("shard-*")):
            with safe_open(str(p), framework="pt") as f:
                out[p.name] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
        return out

    before = contents()
    (folder / "COMPLETE").unlink()  # as if killed after writing shard 1 of 3
    (folder / "shard-00002.safetensors").unlink()
    calls = []
    real = selfgen._write_shard
    monkeypatch.setattr(selfgen, "_write_shard", lambda p, *a: calls.append(p.name) or real(p, *a))
    run(_cfg(tmp_path, chats, f"run_dir={tmp_path / 'run2'}"))
    assert calls == ["shard-00002.safetensors"]  # only the missing shard generated again
    after = contents()  # deterministic: the regenerated shard equals the lost one
    assert after.keys() == before.keys()
    for name, (tensors, meta) in after.items():
        assert meta == before[name][1]
        assert all(torch.equal(t, before[name][0][k]) for k, t in tensors.items())
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["settings"]["temperature"] = 0.7  # a store made with other settings under this key
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="other settings"):
        run(_cfg(tmp_path, chats, f"run_dir={tmp_path / 'run3'}"))


def test_a_mix_trains_on_the_files_rows_then_the_targets_answers_to_later_prompts(tmp_path):
    lines = write_chats(tmp_path / "c.jsonl", 19, 8).read_text().splitlines()
    lines.insert(3, json.dumps({"id": "bad", "conversations": [{"from": "human", "value": "Hi."}]}))
    chats = tmp_path / "chats.jsonl"  # record 4 has no answer: the file reads 9 records for 8 rows
    chats.write_text("\n".join(lines) + "\n")
    r = run(_cfg(tmp_path, chats, "data=sharegpt_mix", "data.max_conversations=8",
                 "data.selfgen.prompts=6", "trainer.capture_autocast=null"))
    rows = [r.split_ds[i] for i in range(len(r.split_ds))] + [r.eval_ds[i] for i in range(len(r.eval_ds))]
    file_ids = {x["id"] for x in rows if x["store_index"] < 0}
    own_ids = {x["id"] for x in rows if x["store_index"] >= 0}
    assert file_ids == {f"c{i}" for i in range(8)}  # the file's first 8 conversations, own answers
    assert own_ids == {f"c{i}" for i in range(8, 14)}  # then the target's, after record 9: no overlap
    n_file = sum(x["store_index"] < 0 for x in [r.split_ds[i] for i in range(len(r.split_ds))])
    assert all(r.split_ds[i]["store_index"] < 0 for i in range(n_file))  # file rows first
    assert json.loads((r.selfgen.folder / "COMPLETE").read_text())["skipped_records"] == 9
    report = json.loads((Path(r.cfg.run_dir) / "data_report.json").read_text())  # file + own rows
    assert report["conversations"] == 8 + 6 and report["read"] == 9 + 6
    assert report["tokens"]["answer"] == sum(sum(x["loss_mask"]) for x in rows)
    # each row's features are its own: a file row's from the capture, an own row's from the store
    from specdistill.data.capture import capture
    from specdistill.data.dataset import pad_batch

    idx = [n_file, 0, len(r.split_ds) - 1, 1]
    batch_rows = [r.train_ds[i] for i in idx]
    feats, final = r.offline.batch(idx, batch_rows, max(len(x["input_ids"]) for x in batch_rows))
    b = pad_batch(batch_rows, 0)
    f2, h2 = capture(r.target, b["input_ids"], b["attention_mask"], r.drafter.feature_layers)
    m = b["attention_mask"].bool()
    torch.testing.assert_close(feats[m], f2[m], atol=1e-4, rtol=0)
    torch.testing.assert_close(final[m], h2[m], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="file row past"):
        r.offline.batch([len(r.split_ds)], [{**batch_rows[1], "store_index": -1}], 8)


def test_a_store_made_before_mix_and_skip_existed_keeps_its_key():
    from dataclasses import asdict

    from specdistill.data.dataset import SelfGenSettings
    from specdistill.data.selfgen import store_key

    class T:
        identity = {"sha": "x"}

    old = {k: v for k, v in asdict(SelfGenSettings()).items() if k not in ("mix", "skip")}
    assert store_key(T, "d", SelfGenSettings(mix=True), [1], 0)["settings"] == old
    assert store_key(T, "d", SelfGenSettings(), [1], 9)["settings"] == {**old, "skip": 9}
