"""Tiny random-weight checkpoints of every supported family, written to disk offline.

Each `Family` is one row of the matrix in test_families.py: a transformers config of its own
class (rope scaling, biases, QK-norm, tied or untied embeddings), a tokenizer of the family's
kind trained here in milliseconds (byte-level BPE with the Llama-3 or Qwen split, or a
SentencePiece-style Metaspace BPE for Mistral) and a chat template in the family's format.
`save_checkpoint` writes them with save_pretrained, so the engine loads them through its real
loader (`engine.model.loader.load_model`). Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT
from engine.model.selfcheck import SAMPLE_CHUNKS, SAMPLE_QUESTION
from tests.engine.helpers import PASSAGES, QUESTION

# The pre-tokenizer splits of Llama-3 (tiktoken cl100k-style) and Qwen2/3 (digits one by one).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Chat templates in each family's format (the published ones, less tools and multimodal parts).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
# Mistral-7B-Instruct v0.1: no system role (the engine then merges it into the user turn).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
QWEN2_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\n"
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerKind:
    """How a family tokenizes: the split, the special tokens and which of them are BOS/EOS."""

    split: str | None  # a byte-level BPE's pre-tokenizer regex; None: SentencePiece-style Metaspace
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    template: str


LLAMA3 = TokenizerKind(
    LLAMA3_SPLIT,
    (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    "<|begin_of_text|>",
    "<|eot_id|>",
    LLAMA3_TEMPLATE,
)
MISTRAL = TokenizerKind(
    None, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>", MISTRAL_TEMPLATE
)
QWEN2 = TokenizerKind(
    QWEN_SPLIT, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", QWEN2_TEMPLATE
)
QWEN3 = TokenizerKind(
    QWEN_SPLIT,
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    None,
    "<|im_end|>",
    QWEN3_TEMPLATE,
)

# shapes of every tiny model: seconds per family on two CPU cores
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@dataclass(frozen=True)
class Family:
    """One row: a name, the transformers model type, config overrides and the tokenizer kind."""

    name: str
    model_type: str
    tokenizer: TokenizerKind
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_type(self) -> str:
        return str(self.overrides.get("rope_parameters", {}).get("rope_type", "default"))


def _rope(rope_type: str, **params: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **params}}


FAMILIES = (
    Family("llama", "llama", LLAMA3, _rope("default")),
    Family("llama-linear", "llama", LLAMA3, _rope("linear", factor=2.0)),
    Family("llama-dynamic", "llama", LLAMA3, _rope("dynamic", factor=2.0)),
    # Llama-3.1's scaling; an original length below the prompts', so scaled bands are in use
    Family(
        "llama-llama3",
        "llama",
        LLAMA3,
        _rope(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        ),
    ),
    # YaRN as Qwen2.5 long-context checkpoints set it: factor 4, attention factor 0.1 ln 4 + 1
    Family(
        "llama-yarn",
        "llama",
        LLAMA3,
        _rope("yarn", factor=4.0, original_max_position_embeddings=256),
    ),
    Family(
        "mistral", "mistral", MISTRAL, dict(sliding_window=None, head_dim=16, **_rope("default"))
    ),
    Family("qwen2", "qwen2", QWEN2, dict(tie_word_embeddings=True, **_rope("default"))),
    # Qwen3: head_dim set apart from hidden / heads, as in the real checkpoints
    Family(
        "qwen3-tied",
        "qwen3",
        QWEN3,
        dict(head_dim=32, tie_word_embeddings=True, **_rope("default")),
    ),
    Family(
        "qwen3-untied",
        "qwen3",
        QWEN3,
        dict(head_dim=32, tie_word_embeddings=False, **_rope("default")),
    ),
)


def corpus() -> list[str]:
    """Text the tokenizers are trained on: what the tests and the self-check tokenize."""
    texts = [
        DEFAULT_SYSTEM_PROMPT,
        DEFAULT_INSTRUCTION,
        QUESTION,
        SAMPLE_QUESTION,
        "Question: Answer:",
    ]
    texts += [f"{title}\n\n{text}\n\n" for title, text in PASSAGES + SAMPLE_CHUNKS]
    return texts * 4


def build_tokenizer(kind: TokenizerKind, vocab_size: int = 600) -> Any:
    """A fast tokenizer of `kind`, trained on `corpus()`, with the family's chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind.split is not None:  # byte-level BPE (Llama-3, Qwen2/3)
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(kind.split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style (Llama-2, Mistral): spaces as "▁", one prepended to each text;
        # words and newlines never merge (SentencePiece splits at whitespace, newlines are bytes)
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
                pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True),
            ]
        )
        backend.decoder = decoders.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False
        )
        alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\u2581"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(kind.specials),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=kind.bos,
        eos_token=kind.eos,
        unk_token="<unk>" if kind.split is None else None,
    )
    tokenizer.chat_template = kind.template
    return tokenizer


def build_model(family: Family, tokenizer: Any, seed: int = 0) -> Any:
    """A random-weight causal LM of the family's own config class; q/k weights scaled up so
    attention is peaked (as tests/conftest.py does for the tiny Llama)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    eos = tokenizer.convert_tokens_to_ids(family.tokenizer.eos)
    bos = tokenizer.convert_tokens_to_ids(family.tokenizer.bos) if family.tokenizer.bos else None
    settings = dict(
        TINY, vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos, pad_token_id=eos
    )
    settings.update(family.overrides)
    config = AutoConfig.for_model(family.model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model.eval()


def save_checkpoint(family: Family, directory: Path) -> Path:
    """Write the family's tiny model and tokenizer as a Hugging Face checkpoint; returns the
    directory."""
    tokenizer = build_tokenizer(family.tokenizer)
    model = build_model(family, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
