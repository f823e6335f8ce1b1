"""A tiny GGUF target written with the `gguf` package: a 2-layer Llama with random weights and a
byte-level tokenizer (256 bytes + 3 ChatML specials, no merges) so that transformers de-quantises
and converts it in under a second (the packaged SmolLM2's 49k-token tokenizer takes ~17 s)."""
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one printable character per byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path: Path, hidden: int = 32, layers: int = 2, ff: int = 64, heads: int = 4,
                    kv: int = 2, seed: int = 0) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    tokens = SPECIALS + byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * 256)  # 3 = control, 1 = normal
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(TEMPLATE)
    w.add_vocab_size(len(tokens))
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    weight("token_embd.weight", len(tokens), hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    d = hidden // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", hidden, hidden)
        weight(f"blk.{i}.attn_k.weight", kv * d, hidden)
        weight(f"blk.{i}.attn_v.weight", kv * d, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, hidden)
        weight(f"blk.{i}.ffn_gate.weight", ff, hidden)
        weight(f"blk.{i}.ffn_up.weight", ff, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
