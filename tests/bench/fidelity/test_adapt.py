"""`kvmosaic adapt`: packets trained on generated tuning cases, written as they improve."""

from __future__ import annotations

import pytest

from app.cli import main
from bench.fidelity.adapt import AdaptOptions, adapt
from engine.adapt.packets import Packets
from engine.errors import InvalidRequest


@pytest.fixture(scope="module")
def adapted(smol_tokenizer, tmp_path_factory):
    from tests.engine.helpers import engine_with_packets

    folder = tmp_path_factory.mktemp("adapt")
    engine = engine_with_packets(smol_tokenizer, folder, None)
    options = AdaptOptions(out=folder / "p.safetensors", n=8, head=2, tail=2, budget_s=3.0)
    return engine, options, adapt(engine, options, progress=False)


def test_adapt_writes_the_best_packets_with_what_made_them(adapted):
    engine, options, result = adapted
    packets, meta = Packets.load(options.out)
    assert packets.digest() == result.packets.digest() and packets.shape == (2, 2)
    assert meta["fingerprint"] == engine.fingerprint and meta["seed"] == 8
    assert meta["cases"] == 8 and meta["held_back"] == 4 and meta["chunks"] == 3
    assert meta["steps"] == result.report.steps >= 1
    assert meta["held_kl"][2] == min(kl for _, kl in result.report.curve)
    assert result.teacher_s > 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seed": 1000}, "tuning seed"),
        ({"n": 4}, "at least 8"),
        ({"chunks": 7}, "chunks"),
        ({"budget_s": 0}, "positive"),
        ({"schedule": "linear"}, "constant, cosine"),
    ],
)
def test_options_that_cannot_train_are_refused(tmp_path, change, message):
    with pytest.raises(InvalidRequest, match=message):
        AdaptOptions(out=tmp_path / "p", **change).check()


def test_the_command_refuses_a_report_seed_before_loading_a_model(tmp_path, capsys):
    code = main(["adapt", "--data-dir", str(tmp_path), "--seed", "1500", "--out", "x"])
    assert code == 2 and "tuning seed" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()
