"""A tiny random-weight GGUF written with the `gguf` package: a byte-level vocabulary, a ChatML
template, float32 tensors in llama.cpp's names. Converting it runs the real conversion path
(engine/model/gguf.py) in a second or two."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he")


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(
    path: Path,
    arch: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    extra: dict[str, int] | None = None,
) -> Path:
    """Write a tiny decoder of `arch` (qwen2: with q/k/v biases) to `path`; `extra` adds integer
    metadata under the architecture's prefix (e.g. {"expert_count": 8})."""
    import gguf

    rng = np.random.default_rng(seed)
    merged = [merge.replace(" ", "") for merge in MERGES]
    tokens = byte_level_alphabet() + merged + list(SPECIALS)
    vocab, ffn, head_dim = len(tokens), 2 * hidden, hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value in (extra or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (256 + len(merged)) + [3] * len(SPECIALS))
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(vocab - 3)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 3)
    writer.add_chat_template(CHATML)

    def tensor(name: str, *shape: int, scale: float = 0.2) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    for i in range(layers):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(hidden, np.float32))
        tensor(f"{block}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"{block}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"{block}.attn_v.weight", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            tensor(f"{block}.attn_q.bias", heads * head_dim)
            tensor(f"{block}.attn_k.bias", kv_heads * head_dim)
            tensor(f"{block}.attn_v.bias", kv_heads * head_dim)
        tensor(f"{block}.attn_output.weight", hidden, heads * head_dim)
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(hidden, np.float32))
        tensor(f"{block}.ffn_gate.weight", ffn, hidden)
        tensor(f"{block}.ffn_up.weight", ffn, hidden)
        tensor(f"{block}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    tensor("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
