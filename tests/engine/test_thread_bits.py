"""A prefill whose bits depend on the CPU thread count names the count in its fingerprint, and
builds its exact variants on that count."""

from __future__ import annotations

import torch

from engine.serving.thread_bits import thread_fingerprint, threads_change_bits
from tests.conftest import build_tiny_model


class CountedLinear(torch.nn.Linear):
    """A linear layer whose last bits follow the thread count, as MKL's did on an Intel Xeon."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.get_num_threads() * 1e-6


def counted_model(vocab_size: int = 100):
    """The tiny model with its first layer's down projection on a `CountedLinear`."""
    model = build_tiny_model(vocab_size)
    layer = model.model.layers[0]
    original = layer.mlp.down_proj
    counted = CountedLinear(original.in_features, original.out_features, bias=False)
    counted.weight = original.weight
    layer.mlp.down_proj = counted
    return model


def test_an_invariant_model_is_told_from_one_whose_bits_follow_the_count():
    assert not threads_change_bits(build_tiny_model(100), 2)
    assert threads_change_bits(counted_model(), 2)
    assert not threads_change_bits(counted_model(), 1)  # one thread: nothing to compare


def test_the_count_makes_another_fingerprint():
    assert len({thread_fingerprint("abc", 2), thread_fingerprint("abc", 4), "abc"}) == 3
    assert thread_fingerprint("abc", 2) == thread_fingerprint("abc", 2)


def test_an_engine_whose_bits_follow_the_count_names_it_and_builds_on_it(smol_tokenizer, tmp_path):
    from engine import EngineConfig
    from engine.engine import Engine
    from engine.model.loader import wrap_model

    def engine_of(model, threads: int = 2) -> Engine:
        loaded = wrap_model(model, smol_tokenizer, linear_kernel="torch")
        config = EngineConfig(data_dir=tmp_path, num_threads=threads, linear_kernel="torch")
        return Engine(config, loaded), loaded.fingerprint

    plain, plain_print = engine_of(build_tiny_model(len(smol_tokenizer)))
    assert not plain.threads_change_bits and plain.build_threads == 1
    assert plain.fingerprint == plain_print
    assert "2 threads (bits as on one thread), prefill rows" in plain.summary
    counted, counted_print = engine_of(counted_model(len(smol_tokenizer)))
    assert counted.threads_change_bits and counted.build_threads == 2
    assert counted.fingerprint == thread_fingerprint(counted_print, 2)
    assert "2 threads (bits depend on the count: it is in the fingerprint)" in counted.summary
    one, one_print = engine_of(counted_model(len(smol_tokenizer)), threads=1)
    assert not one.threads_change_bits and one.fingerprint == one_print
    assert ", 1 thread, prefill rows" in one.summary  # one thread: nothing to compare or say
    plain.close()
    counted.close()
    one.close()
