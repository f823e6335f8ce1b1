"""Chat formats as the target serves them: tool calls, thinking, history-rewriting templates, every
OpenAI / ShareGPT message form, and what happens to records that cannot be trained.

The golden check (`assert_as_served`) is independent of data/chat.py: for every run of trained
tokens, the tokens before it must be the served prefix (the messages before the turn rendered with
the generation prompt) token for token, and the run must be what the template renders for that turn
when it is the newest, through its end-of-turn token, nothing else; every assistant turn with
something to write is trained exactly once.
"""
import itertools
import json
import logging

import pytest
from chat_templates import llama31_tokenizer, qwen3_tokenizer, smollm2_tokenizer

from specdistill.data.assets import asset_path
from specdistill.data.chat import Template, encode_chat, encode_chats, trains
from specdistill.data.dataset import DataConfig, load_chat_dataset
from specdistill.data.sharegpt import Counts, iter_conversations

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
AGENT = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "content": "sunny, 21 C"},
         {"role": "assistant", "content": "It is sunny in Paris."}]
TWO_TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
             {"role": "user", "content": "bye"}, {"role": "assistant", "content": "goodbye"}]
THINKING = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "The user greets."}]


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def qwen3(smollm2):
    return qwen3_tokenizer(smollm2)


@pytest.fixture(scope="module")
def llama31(smollm2):
    return llama31_tokenizer(smollm2)


def runs(row):
    """[start, stop) of each maximal run of trained tokens."""
    out, i = [], 0
    for on, group in itertools.groupby(row.loss_mask):
        n = len(list(group))
        if on:
            out.append((i, i + n))
        i += n
    return out


def trained_texts(tok, enc):
    return [[tok.decode(row.input_ids[a:b]) for a, b in runs(row)] for row in enc.rows]


def assert_as_served(tok, messages, enc, template=Template()):
    """Every trained token is one the target writes at serving time, in the context it serves it."""
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tools=template.tools, tokenize=False,
                                       add_generation_prompt=gen, **template.kwargs)

    served = {}
    for i, m in enumerate(messages):
        if trains(m):
            prefix, newest = render(messages[:i], True), render(messages[: i + 1], False)
            assert newest.startswith(prefix)
            served[i] = (tok(prefix, add_special_tokens=False)["input_ids"], newest[len(prefix):])
    seen = []
    for row in enc.rows:
        for a, b in runs(row):
            turn = next(i for i, (ids, _) in served.items() if ids == row.input_ids[:a])
            trained, written = tok.decode(row.input_ids[a:b]), served[turn][1]
            assert written.startswith(trained) and not written[len(trained):].strip()
            assert trained.endswith(tok.eos_token) or trained.endswith("<|eot_id|>")
            seen.append(turn)
    assert sorted(seen) == sorted(served)  # each turn trained once: nothing written left out


# ---------------------------------------------------------------------------------------------
# ChatML (SmolLM2's own template): one row per conversation, as before
# ---------------------------------------------------------------------------------------------
def test_chatml_one_row_as_served(smollm2):
    conv = [{"role": "system", "content": "Be brief."}] + TWO_TURNS
    enc = encode_chat(smollm2, conv, 4096)
    full = smollm2.apply_chat_template(conv, tokenize=False)
    assert len(enc.rows) == 1 and enc.input_ids == smollm2(full, add_special_tokens=False)["input_ids"]
    assert trained_texts(smollm2, enc) == [["hello there<|im_end|>", "goodbye<|im_end|>"]]
    assert enc.stats["own_context"] == 0 and enc.stats["turns"] == 2
    assert_as_served(smollm2, conv, enc)


def test_packaged_sharegpt_encodes_as_one_row_each(smollm2):
    convs = [c.messages for c in itertools.islice(iter_conversations(asset_path("sharegpt")), 120)]
    for conv, enc in zip(convs, encode_chats(smollm2, convs, 1024)):
        if enc.drop_reason:
            assert enc.drop_reason == "too_long"
            continue
        full = smollm2.apply_chat_template(conv, tokenize=False)
        assert len(enc.rows) == 1  # the full rendering is how every turn is served
        assert enc.input_ids == smollm2(full, add_special_tokens=False)["input_ids"][:1024]


# ---------------------------------------------------------------------------------------------
# Qwen3: history rewritten, thinking gated, tool calls
# ---------------------------------------------------------------------------------------------
def test_qwen3_earlier_turn_trained_in_its_served_context(qwen3):
    enc = encode_chat(qwen3, TWO_TURNS, 4096)
    # the full rendering shows the first reply without a think block; served, the target writes one
    assert trained_texts(qwen3, enc) == [["<think>\n\n</think>\n\ngoodbye<|im_end|>"],
                                         ["<think>\n\n</think>\n\nhello there<|im_end|>"]]
    assert enc.stats["own_context"] == 1 and enc.stats["extra_tokens"] == len(enc.rows[1].input_ids)
    assert_as_served(qwen3, TWO_TURNS, enc)
    off = Template(kwargs={"enable_thinking": False})  # the served prefix holds the empty block
    enc = encode_chat(qwen3, TWO_TURNS, 4096, off)
    # served, the prompt ends in the token "\n\n"; the full rendering splits "\n\ngoodbye" as "\n",
    # "\n", "goodbye" (SmolLM2's pre-tokeniser): a context never served, so the last turn gets its own
    # row too, token for token as served
    assert trained_texts(qwen3, enc) == [["hello there<|im_end|>"], ["goodbye<|im_end|>"]]
    assert qwen3.decode(enc.rows[0].input_ids).endswith("<think>\n\n</think>\n\nhello there<|im_end|>")
    assert_as_served(qwen3, TWO_TURNS, enc, off)


def test_qwen3_tool_call_trained_tool_result_never(qwen3):
    enc = encode_chat(qwen3, AGENT, 4096, Template(TOOLS))
    assert trained_texts(qwen3, enc) == [
        ["<think>\n\n</think>\n\nIt is sunny in Paris.<|im_end|>"],
        ['<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
         '\n</tool_call><|im_end|>']]
    assert enc.stats["tool_call"] > 0 and enc.stats["reasoning"] > 0 and enc.stats["answer"] > 0
    for row in enc.rows:  # the tool result and the tool definitions are context only
        assert "sunny, 21 C" not in "".join(trained_texts(qwen3, enc)[0] + trained_texts(qwen3, enc)[1])
        assert "get_weather" in qwen3.decode(row.input_ids[:runs(row)[0][0]])
    assert_as_served(qwen3, AGENT, enc, Template(TOOLS))


def test_qwen3_thinking_trained_where_served(qwen3):
    enc = encode_chat(qwen3, THINKING, 4096)
    assert trained_texts(qwen3, enc) == [["<think>\nThe user greets.\n</think>\n\nhello<|im_end|>"]]
    assert enc.stats["reasoning"] == len(qwen3.encode("<think>\nThe user greets.\n</think>"))
    assert_as_served(qwen3, THINKING, enc)
    inline = [THINKING[0], {"role": "assistant", "content": "<think>\nThe user greets.\n</think>\n\nhello"}]
    assert trained_texts(qwen3, encode_chat(qwen3, inline, 4096)) == trained_texts(qwen3, enc)
    # the data thinks, the target is served without thinking: refused, not trained out of context
    off = encode_chat(qwen3, THINKING, 4096, Template(kwargs={"enable_thinking": False}))
    assert off.drop_reason == "not_as_served" and off.rows == [] and "turn 1" in off.detail


# ---------------------------------------------------------------------------------------------
# Llama-3.1: tools in the first user turn, JSON calls, ipython results
# ---------------------------------------------------------------------------------------------
def test_llama31_tool_template(llama31):
    conv = [{"role": "system", "content": "Be brief."}] + AGENT
    enc = encode_chat(llama31, conv, 4096, Template(TOOLS))
    # the served prompt ends in the token "\n\n"; in the full rendering SmolLM2's pre-tokeniser
    # splits "\n\nIt" as "\n", "\n", "It": each turn is trained in a row of its served tokens
    assert trained_texts(llama31, enc) == [['{"name": "get_weather", "parameters": {"city": "Paris"}}'
                                            '<|eot_id|>'], ["It is sunny in Paris.<|eot_id|>"]]
    assert enc.stats["own_context"] == 2
    text = llama31.decode(enc.rows[1].input_ids)
    assert "<|start_header_id|>ipython<|end_header_id|>" in text and '"sunny, 21 C"' in text
    assert enc.stats["tool_call"] == len(llama31.encode(
        '{"name": "get_weather", "parameters": {"city": "Paris"}}', add_special_tokens=False)) + 1
    assert_as_served(llama31, conv, enc, Template(TOOLS))


# ---------------------------------------------------------------------------------------------
# What a template cannot render is refused per record, with a reason
# ---------------------------------------------------------------------------------------------
def test_unrendered_forms_refused_with_reason(smollm2, qwen3):
    assert encode_chat(smollm2, AGENT, 4096, Template(TOOLS)).drop_reason == "tool_call_not_rendered"
    assert encode_chat(smollm2, THINKING, 4096).drop_reason == "reasoning_not_rendered"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
             {"role": "assistant", "content": "Sunny."}]
    assert encode_chat(qwen3, parts, 4096).drop_reason == "content_not_rendered"  # Qwen3: '' for lists
    assert encode_chat(smollm2, parts, 4096).drop_reason == "template_error"  # str + list
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
             {"role": "assistant", "content": "A cat."}]
    enc = encode_chat(qwen3, image, 4096)
    assert enc.drop_reason == "non_text_content" and "image_url" in enc.detail


def test_turns_cut_by_max_length_counted(qwen3):
    enc = encode_chat(qwen3, TWO_TURNS, 16)
    assert enc.stats["turns"] + enc.stats["turns_too_long"] == 2
    assert all(len(r.input_ids) <= 16 for r in enc.rows)


# ---------------------------------------------------------------------------------------------
# The reader: every message form, intact
# ---------------------------------------------------------------------------------------------
def test_reader_keeps_every_message_form(tmp_path):
    oa = {"id": "oa", "tools": TOOLS, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "?"}],
         "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [dict(CALL, id="c1")]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "function", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}
    sg = {"id": "sg", "tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call",
         "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny"},
        {"from": "ipython", "value": "21 C"},
        {"from": "gpt", "value": "Sunny.", "reasoning": "Easy."}]}
    path = tmp_path / "forms.jsonl"
    path.write_text(json.dumps(oa) + "\n" + json.dumps(sg) + "\n")
    counts = Counts()
    a, b = iter_conversations(path, counts)
    assert counts.kept == 2 and counts.dropped == {}
    m = a.messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "tool", "assistant", "assistant"]
    assert m[1]["content"] == oa["messages"][1]["content"] and m[1]["name"] == "ann"  # parts intact
    assert m[2]["tool_calls"] == [dict(CALL, id="c1")] and m[2]["content"] is None
    assert m[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}
    assert m[5]["reasoning_content"] == "Easy." and m[5]["content"] == "Sunny."
    assert m[6]["tool_calls"] == [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}] and "function_call" not in m[6]
    assert a.tools == TOOLS and b.tools == TOOLS
    assert [x["role"] for x in b.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert b.messages[1]["tool_calls"] == [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert b.messages[4] == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."}


# ---------------------------------------------------------------------------------------------
# Drops: said with reasons, counts and the first record; stop rules
# ---------------------------------------------------------------------------------------------
def _records(n_good, bad):
    good = [{"id": f"g{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}]} for i in range(n_good)]
    return good + bad


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_drops_warned_and_too_many_stop(tmp_path, monkeypatch, smollm2, caplog):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    narrator = [{"id": f"n{i}", "messages": [{"role": "narrator", "content": "x"},
                                             {"role": "assistant", "content": "y"}]} for i in range(3)]
    path = _write(tmp_path / "d.jsonl", _records(7, narrator))  # 3 of 10 dropped: over a quarter
    with pytest.raises(ValueError, match=r"3 of 10 records \(30%\).*unknown_role 3 \(first: id n0.*"
                                         r"'narrator'.*data.max_drop_fraction=1"):
        load_chat_dataset(DataConfig(kind="file", path=path), smollm2)
    with caplog.at_level(logging.WARNING):
        data = load_chat_dataset(DataConfig(kind="file", path=path, max_drop_fraction=0.5), smollm2)
    assert data.counts.kept == 7 and data.counts.dropped == {"unknown_role": 3}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("unknown_role 3" in w and "first unknown_role: id n0" in w for w in warned)
    nothing = _write(tmp_path / "none.jsonl", narrator)
    with pytest.raises(ValueError, match=r"none.jsonl: no usable conversation \(read 3, kept 0, "
                                         r"dropped: unknown_role 3.*first unknown_role: id n0"):
        load_chat_dataset(DataConfig(kind="file", path=nothing, max_drop_fraction=1), smollm2)


def test_data_report_by_kind_and_own_contexts(tmp_path, monkeypatch, qwen3):
    """Thinking and non-thinking, tool and plain conversations in one file, one job."""
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    recs = [{"id": "agent", "messages": AGENT, "tools": TOOLS}, {"id": "two", "messages": TWO_TURNS},
            {"id": "think", "messages": THINKING}]
    data = load_chat_dataset(DataConfig(kind="file", path=_write(tmp_path / "m.jsonl", recs),
                                        eval_fraction=0.0), qwen3)
    assert sorted(data.train["id"]) == ["agent", "agent", "think", "two", "two"]  # own contexts
    rep = data.report
    assert (rep.conversations, rep.rows, rep.turns, rep.own_context) == (3, 5, 5, 2)
    assert all(rep.tokens[k] > 0 for k in ("answer", "reasoning", "tool_call"))
    assert sum(rep.tokens.values()) == sum(sum(m) for m in data.train["loss_mask"])
    assert "## Training data" in rep.markdown()[0] and "own" in rep.summary()


def test_selfgen_prompts_use_the_template_kwargs(tmp_path, qwen3):
    """Self-generation prompts the target as served: with thinking off, after the empty think block."""
    from specdistill.data.selfgen import first_turns

    path = _write(tmp_path / "p.jsonl", _records(2, []))
    on, _ = first_turns(path, qwen3, None, 64)
    off, counts = first_turns(path, qwen3, None, 64, template_kwargs={"enable_thinking": False})
    assert counts["kept"] == 2
    assert qwen3.decode(on[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert qwen3.decode(off[0]["prompt_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
