"""Learned chunk packets: the file, the reuse assembly they train through, the training loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.adapt.packets import Packets, prefix_rows, reused_cache, shifted_keys
from engine.adapt.train import Distiller, rate_at, train
from engine.errors import InvalidRequest
from engine.model.ops import rope_shift_twin_
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs


@pytest.fixture(scope="module")
def torch_engine(smol_tokenizer, tmp_path_factory):
    """The tiny model with torch's linear layers: oneDNN's packed linear has no backward."""
    from engine import EngineConfig
    from engine.engine import Engine
    from engine.model.loader import wrap_model
    from tests.conftest import build_tiny_model

    config = EngineConfig(
        data_dir=tmp_path_factory.mktemp("adapt"),
        fidelity="fast",
        encode_dtype="engine",
        linear_kernel="torch",
    )
    model = build_tiny_model(len(smol_tokenizer))
    return Engine(config, wrap_model(model, smol_tokenizer, linear_kernel="torch"))


def test_training_refuses_a_model_whose_linear_has_no_backward(tiny_engine):
    from engine.model.linear import linear_kernel_of

    if linear_kernel_of(tiny_engine.loaded.model) == "torch":
        pytest.skip("this CPU's tiny engine runs torch's linear: nothing to refuse")
    with pytest.raises(ValueError, match="linear_kernel torch"):
        distiller_of(tiny_engine)


def distiller_of(engine) -> Distiller:
    model = engine.loaded.model
    prefix = prefix_rows(model, engine.prompts.prefix_ids)
    return Distiller(model, prefix, engine.stack.inv_freq, engine.loaded.eos_token_ids)


def test_the_file_keeps_the_tokens_and_refuses_an_altered_one(tmp_path):
    packets = Packets(torch.randn(3, 8), torch.randn(2, 8))
    path = tmp_path / "packets.safetensors"
    packets.save(path, {"model": "tiny"})
    back, meta = Packets.load(path)
    assert torch.equal(back.head, packets.head) and torch.equal(back.tail, packets.tail)
    assert meta == {"model": "tiny"} and back.digest() == packets.digest()
    assert packets.extra_rows == 5
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a bit of the last token flipped
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidRequest, match="digest"):
        Packets.load(path)


def test_shifted_keys_are_the_engines_rope_shift():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    keys = torch.randn(1, 2, 5, 16)
    expected = rope_shift_twin_(keys.clone(), 37, inv_freq)
    torch.testing.assert_close(shifted_keys(keys, 37, inv_freq), expected, rtol=1e-5, atol=1e-5)


def test_reuse_without_packets_is_the_engines_naive_prefill(torch_engine):
    chunks = chunk_inputs(torch_engine)
    naive = torch_engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    distiller = distiller_of(torch_engine)
    cache, position = reused_cache(
        distiller.model, distiller.prefix, [c.token_ids for c in chunks], None, distiller.inv_freq
    )
    assert position == naive.layout.chunk_spans[-1][1]
    question = torch_engine.prompts.question_ids(QUESTION)
    with torch.no_grad():
        logits = distiller.greedy(cache, position, question, 0)[1][0]
    reference = torch.log_softmax(naive.logits.reshape(-1).float(), -1)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_training_moves_only_the_packets_and_keeps_the_best_on_the_held_split(torch_engine):
    distiller = distiller_of(torch_engine)
    chunks = [c.token_ids for c in chunk_inputs(torch_engine, cached=False)]
    question = torch_engine.prompts.question_ids(QUESTION)
    examples = [distiller.full_example(chunks[i : i + 2], question, 4) for i in range(3)]
    weights = [p.clone() for p in distiller.model.parameters()]
    start = Packets.initial(distiller.model, [13, 13], 2, 2)
    ticks = itertools.count()  # one tick per clock read: the budget ends after a few steps
    # held back = trained on: a few small steps on one prompt must lower its KL
    best, report = train(
        distiller,
        examples[:1],
        examples[:1],
        start,
        6.0,
        lr=0.002,
        eval_every=1,
        progress=False,
        clock=lambda: float(next(ticks)),
    )
    assert report.steps >= 2 and len(report.curve) == report.steps + 1
    assert report.held_kl_best == min(kl for _, kl in report.curve)
    assert report.held_kl_best < report.held_kl_start
    assert distiller.held_kl(examples[:1], best) == pytest.approx(report.held_kl_best, rel=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(weights, distiller.model.parameters()))


def test_an_interrupted_training_returns_the_best_so_far(torch_engine):
    distiller = distiller_of(torch_engine)
    chunks = [c.token_ids for c in chunk_inputs(torch_engine, cached=False)]
    example = distiller.full_example(chunks[:2], torch_engine.prompts.question_ids(QUESTION), 4)
    start = Packets.initial(distiller.model, [13, 13], 2, 2)
    seen: list[float] = []
    steps = itertools.count()

    def clock() -> float:
        if next(steps) == 4:  # the fourth step's turn: the user presses Ctrl-C
            raise KeyboardInterrupt
        return 0.0

    best, report = train(
        distiller,
        [example],
        [example],
        start,
        10.0,
        lr=0.002,
        eval_every=1,
        progress=False,
        clock=clock,
        on_best=lambda packets, report: seen.append(report.held_kl_best),
    )
    assert report.interrupted and report.steps == 3
    assert seen and seen[-1] == report.held_kl_best < report.held_kl_start
    assert distiller.held_kl([example], best) == pytest.approx(report.held_kl_best, rel=1e-4)


def test_the_cosine_rate_falls_from_the_rate_to_zero_along_the_budget():
    assert rate_at(0.01, "constant", 0.9) == 0.01
    rates = [rate_at(0.01, "cosine", spent / 10) for spent in range(11)]
    assert rates[0] == pytest.approx(0.01) and rates[5] == pytest.approx(0.005)
    assert rates[10] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert rate_at(0.01, "cosine", 1.5) == rates[10]  # a step past the budget's end: clipped
    with pytest.raises(ValueError, match="unknown schedule"):
        rate_at(0.01, "step", 0.5)


def test_a_cosine_schedule_sets_the_optimizers_rate_by_the_clock(torch_engine, monkeypatch):
    distiller = distiller_of(torch_engine)
    chunks = [c.token_ids for c in chunk_inputs(torch_engine, cached=False)]
    example = distiller.full_example(chunks[:2], torch_engine.prompts.question_ids(QUESTION), 2)
    seen: list[float] = []
    step = torch.optim.AdamW.step

    def recording(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    ticks = itertools.count()  # one tick per clock read, one read per step: 0, 1, 2, 3
    train(
        distiller,
        [example],
        [example],
        Packets.initial(distiller.model, [13, 13], 2, 2),
        4.0,
        lr=0.002,
        eval_every=100,
        progress=False,
        clock=lambda: float(next(ticks)),
        schedule="cosine",
    )
    expected = [rate_at(0.002, "cosine", t / 4) for t in (1, 2, 3)]
    assert seen == pytest.approx(expected)
