"""Packets in the engine: a chunk encoded and read between them, as training assembled it."""

from __future__ import annotations

import pytest
import torch

from engine.adapt.packets import Packets, packets_for, prefix_rows, reused_cache
from engine.adapt.train import Distiller
from engine.errors import InvalidRequest, KvMosaicError
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import PASSAGES, QUESTION, engine_with_packets


@pytest.fixture(scope="module")
def packets_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("packets") / "packets.safetensors"
    generator = torch.Generator().manual_seed(3)
    head, tail = torch.randn(3, 64, generator=generator), torch.randn(2, 64, generator=generator)
    Packets(head, tail).save(path, {"model": "tiny"})
    return path


@pytest.fixture(scope="module")
def packets_engine(smol_tokenizer, tmp_path_factory, packets_file):
    return engine_with_packets(smol_tokenizer, tmp_path_factory.mktemp("served"), str(packets_file))


def test_a_chunk_read_between_packets_gives_the_trained_assembly(packets_engine):
    engine = packets_engine
    chunks = []
    for i, (title, text) in enumerate(PASSAGES[:3]):
        ids = engine.packeted(engine.chunk_ids(text, title))
        chunks.append(ChunkInput(i, ids, engine.encode_chunk(ids)))
    served = engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    model = engine.loaded.model
    distiller = Distiller(
        model,
        prefix_rows(model, engine.prompts.prefix_ids),
        engine.stack.inv_freq,
        engine.loaded.eos_token_ids,
    )
    plain = [engine.chunk_ids(text, title) for title, text in PASSAGES[:3]]
    cache, position = reused_cache(
        model, distiller.prefix, plain, engine.packets, distiller.inv_freq
    )
    assert position == served.layout.chunk_spans[-1][1]
    with torch.no_grad():
        trained = distiller.greedy(cache, position, engine.prompts.question_ids(QUESTION), 0)[1][0]
    reference = torch.log_softmax(served.logits.reshape(-1).float(), -1)
    torch.testing.assert_close(trained, reference, rtol=1e-4, atol=1e-4)
    # the packets changed what the question reads: without them the logits differ
    without = reused_cache(model, distiller.prefix, plain, None, distiller.inv_freq)
    with torch.no_grad():
        bare = distiller.greedy(*without, engine.prompts.question_ids(QUESTION), 0)[1][0]
    assert not torch.allclose(bare, reference, atol=1e-3)


def test_soft_ids_embed_as_the_packets_rows_and_real_ids_as_before(packets_engine):
    engine, packets = packets_engine, packets_engine.packets
    ids = engine.packeted([5, 6])
    vocab = engine.stack.embed_tokens.weight.shape[0]
    assert ids == (vocab, vocab + 1, vocab + 2, 5, 6, vocab + 3, vocab + 4)
    rows = engine.stack.embed(torch.tensor(ids))
    torch.testing.assert_close(rows[:3], packets.head.to(rows.dtype))
    torch.testing.assert_close(rows[5:], packets.tail.to(rows.dtype))
    assert torch.equal(rows[3:5], engine.stack.embed_tokens(torch.tensor([5, 6])))


def test_packets_join_the_fingerprint(packets_engine, tiny_engine, smol_tokenizer, tmp_path):
    assert packets_engine.fingerprint != tiny_engine.fingerprint
    other = tmp_path / "other.safetensors"
    Packets(torch.zeros(3, 64), torch.zeros(2, 64)).save(other, {})
    assert engine_with_packets(smol_tokenizer, tmp_path, str(other)).fingerprint not in {
        packets_engine.fingerprint,
        tiny_engine.fingerprint,
    }


def test_an_engine_without_packets_refuses_to_wrap(tiny_engine):
    assert tiny_engine.packets is None
    with pytest.raises(InvalidRequest, match="no packets"):
        tiny_engine.packeted([1, 2])


def test_packets_of_another_hidden_size_are_refused(tiny_engine, tmp_path):
    import dataclasses

    path = tmp_path / "wide.safetensors"
    Packets(torch.zeros(2, 32), torch.zeros(2, 32)).save(path, {})
    config = dataclasses.replace(tiny_engine.config, packets=str(path))
    with pytest.raises(KvMosaicError, match="hidden size"):
        packets_for(config, tiny_engine.loaded)


def test_auto_takes_the_file_beside_the_checkpoint_or_none(tiny_engine, tmp_path, monkeypatch):
    import dataclasses

    import engine.adapt.packets as module

    monkeypatch.setattr(module, "checkpoint_of", lambda data_dir, model, path: tmp_path)
    config = dataclasses.replace(tiny_engine.config, packets="auto")
    assert packets_for(config, tiny_engine.loaded) is None
    Packets(torch.ones(2, 64), torch.ones(1, 64)).save(tmp_path / module.PACKETS_FILE, {})
    found = packets_for(config, tiny_engine.loaded)
    assert found is not None and found.shape == (2, 1)
