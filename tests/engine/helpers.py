"""Helpers for engine tests: passages, chunk inputs, KL."""

from __future__ import annotations

import torch

from engine.decoding import read_out
from engine.plan import ChunkInput, PlanRequest

PASSAGES = [
    (
        "Ada",
        "Ada Lovelace wrote the first published algorithm for Babbage's Analytical Engine in 1843.",
    ),
    (
        "Tea",
        "Green tea is made from leaves that are steamed or pan-fired soon after picking, so they "
        "do not oxidise.",
    ),
    (
        "Rivers",
        "The Danube flows through ten countries and four capital cities before it reaches the "
        "Black Sea.",
    ),
    (
        "Bees",
        "A honey bee colony keeps its brood near 35 degrees Celsius by clustering and fanning "
        "its wings.",
    ),
]
QUESTION = "Who wrote the first published algorithm?"


def chunk_inputs(engine, passages=PASSAGES, cached: bool = True) -> list[ChunkInput]:
    """Chunks with their base-variant KV (computed alone after the system prefix)."""
    chunks = []
    for i, (title, text) in enumerate(passages):
        ids = engine.chunk_ids(text, title)
        chunks.append(ChunkInput(i, ids, engine.encode_chunk(ids) if cached else None))
    return chunks


def kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) of the softmax distributions."""
    p = torch.log_softmax(reference_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def answer_ids(engine, result, params=None) -> list[int]:
    """Decode `result` to its end; the answer's token ids (from the decode's record)."""
    return list(read_out(engine.generate(result, params))[1].token_ids)


def plan_request(engine, chunks, config=None) -> PlanRequest:
    """The request a planner sees for `chunks` and QUESTION at ratio 0.15, under `config`
    (default: the engine's) and its fidelity level."""
    config = config or engine.config
    layout = engine.prompts.layout([tuple(c.token_ids) for c in chunks], QUESTION)
    return PlanRequest(
        layout,
        tuple(chunks),
        engine.prefix_kv,
        0.15,
        config,
        engine.loaded.spec.num_layers,
        config.fidelity,
    )


def engine_with_packets(smol_tokenizer, data_dir, packets: str | None):
    """The tiny model on torch's linear layers, loaded with the packets file `packets`."""
    from engine import EngineConfig
    from engine.engine import Engine
    from engine.model.loader import wrap_model
    from tests.conftest import build_tiny_model

    config = EngineConfig(
        data_dir=data_dir,
        fidelity="fast",
        encode_dtype="engine",
        linear_kernel="torch",
        packets=packets,
    )
    model = build_tiny_model(len(smol_tokenizer))
    return Engine(config, wrap_model(model, smol_tokenizer, linear_kernel="torch"))
