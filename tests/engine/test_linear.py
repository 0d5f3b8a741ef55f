"""The linear-layer kernel (engine/model/linear.py): oneDNN in place of torch's, same weights and
results."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model.linear import (
    OneDnnLinear,
    linear_kernel_of,
    onednn_agrees,
    resolve_linear_kernel,
    use_linear_kernel,
)
from engine.model.loader import wrap_model
from tests.conftest import build_tiny_model

needs_onednn = pytest.mark.skipif(
    not onednn_agrees(torch.float32), reason="this PyTorch build has no oneDNN linear"
)


def _linear_count(model: torch.nn.Module, kind: type) -> int:
    return sum(type(m) is kind for m in model.modules())


@needs_onednn
def test_onednn_replaces_every_linear_on_the_same_tensors(smol_tokenizer):
    model = build_tiny_model(len(smol_tokenizer))
    linears = _linear_count(model, torch.nn.Linear)
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    x = torch.randint(0, len(smol_tokenizer), (1, 12))
    with torch.inference_mode():
        expected = model(x).logits

    assert use_linear_kernel(model, "onednn") == "onednn"

    assert (
        _linear_count(model, torch.nn.Linear) == 0 and _linear_count(model, OneDnnLinear) == linears
    )
    after = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    assert after == before  # same names, same storage: nothing copied
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights stay tied
    with torch.inference_mode():
        got = model(x).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert linear_kernel_of(model) == "onednn"


def test_torch_leaves_the_model_alone(smol_tokenizer):
    model = build_tiny_model(len(smol_tokenizer))
    linears = _linear_count(model, torch.nn.Linear)
    assert use_linear_kernel(model, "torch") == "torch"
    assert _linear_count(model, torch.nn.Linear) == linears and linear_kernel_of(model) == "torch"


@needs_onednn
def test_the_kernel_is_part_of_the_fingerprint_and_torch_keeps_the_old_one(smol_tokenizer):
    on_torch = wrap_model(build_tiny_model(len(smol_tokenizer)), smol_tokenizer, "torch")
    again = wrap_model(build_tiny_model(len(smol_tokenizer)), smol_tokenizer, "torch")
    on_onednn = wrap_model(build_tiny_model(len(smol_tokenizer)), smol_tokenizer, "onednn")
    assert on_torch.fingerprint == again.fingerprint != on_onednn.fingerprint


@needs_onednn
def test_auto_keeps_mkl_for_float32_on_intel_cpus_only(monkeypatch):
    import engine.model.linear

    cpu = torch.device("cpu")
    monkeypatch.setattr(engine.model.linear, "mkl_is_at_home", lambda: True)
    assert resolve_linear_kernel("auto", cpu, torch.float32) == "torch"
    assert resolve_linear_kernel("onednn", cpu, torch.float32) == "onednn"  # asked for by name
    if onednn_agrees(torch.bfloat16):
        assert resolve_linear_kernel("auto", cpu, torch.bfloat16) == "onednn"


def test_auto_picks_onednn_for_float32_and_bfloat16_on_the_cpu_only(monkeypatch):
    import engine.model.linear

    monkeypatch.setattr(engine.model.linear, "mkl_is_at_home", lambda: False)
    monkeypatch.setattr(
        engine.model.linear, "onednn_agrees", lambda dtype: True
    )  # the rule, whatever this CPU runs
    cpu = torch.device("cpu")
    assert resolve_linear_kernel("auto", cpu, torch.float32) == "onednn"
    assert resolve_linear_kernel("auto", cpu, torch.bfloat16) == "onednn"
    assert resolve_linear_kernel("auto", cpu, torch.float16) == "torch"
    assert resolve_linear_kernel("auto", torch.device("cuda"), torch.float32) == "torch"


def test_bad_kernel_names_and_impossible_choices_are_refused():
    with pytest.raises(ValueError, match="unknown linear kernel"):
        resolve_linear_kernel("mkl", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="needs a float32 or bfloat16 model on the CPU"):
        resolve_linear_kernel("onednn", torch.device("cpu"), torch.float16)
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        EngineConfig(linear_kernel="mkl")


@needs_onednn
def test_a_bfloat16_copy_of_a_onednn_model_still_runs(smol_tokenizer):
    """The bfloat16 encoder copy (engine/model/encode_dtype.py) casts the replaced modules'
    weights."""
    from engine.model.encode_dtype import model_in

    loaded = wrap_model(build_tiny_model(len(smol_tokenizer)), smol_tokenizer, "onednn")
    copy = model_in(loaded, torch.bfloat16)
    x = torch.randint(0, len(smol_tokenizer), (1, 8))
    with torch.inference_mode():
        expected, got = loaded.model(x).logits, copy.model(x).logits.float()
    # oneDNN where it runs bfloat16 on this CPU, else torch's linears (fit_linear_kernel)
    kernel = "onednn" if onednn_agrees(torch.bfloat16) else "torch"
    assert (
        copy.model.lm_head.weight.dtype == torch.bfloat16 and linear_kernel_of(copy.model) == kernel
    )
    # bfloat16 rounding, same model
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.7


@needs_onednn
@pytest.mark.parametrize("shape", ["no rows", "strided rows", "3-d transposed"])
def test_onednn_linear_takes_the_inputs_the_engine_gives_it(shape):
    """A layer may run no active rows (a blend's late layers) or a strided view of them."""
    linear = torch.nn.Linear(16, 8).requires_grad_(False)
    x = {
        "no rows": torch.empty(0, 16),
        "strided rows": torch.randn(4, 32)[:, ::2],
        "3-d transposed": torch.randn(2, 3, 16).transpose(0, 1),
    }[shape]
    with torch.inference_mode():
        got, expected = OneDnnLinear(linear)(x), linear(x)
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)


def test_a_copy_cast_to_a_dtype_onednn_cannot_run_goes_back_to_torch_linears(monkeypatch):
    import engine.model.linear
    from engine.model.linear import (
        OneDnnLinear,
        fit_linear_kernel,
        linear_kernel_of,
        use_linear_kernel,
    )

    if not engine.model.linear.onednn_agrees(torch.float32):
        pytest.skip("oneDNN's float32 linear does not run here")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 8, bias=False))
    assert use_linear_kernel(model, "onednn") == "onednn"
    assert fit_linear_kernel(model) == "onednn"  # still float32: kept
    monkeypatch.setattr(engine.model.linear, "onednn_agrees", lambda dtype: dtype == torch.float32)
    weight = model[0].weight
    torch.nn.Module.to(model, torch.bfloat16)
    assert fit_linear_kernel(model) == "torch" and linear_kernel_of(model) == "torch"
    assert not any(isinstance(m, OneDnnLinear) for m in model.modules())
    assert model[0].weight is weight and model[1].bias is None  # the same tensors, no copy
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(
        torch.nn.functional.linear(x, weight, model[0].bias), model[1].weight
    )
    assert torch.equal(model(x), expected)
