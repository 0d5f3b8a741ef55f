"""`h4v3`: Hadamard-rotated, per-token 4-bit keys and 3-bit values with a clipped range."""

from __future__ import annotations

import pytest
import torch

from app.store.codecs import CLIPS, RotatedQuantCodec, get_codec, hadamard

SHAPE = (2, 2, 3, 100, 64)  # [layers, 2, kv_heads, tokens, head_dim]


def _kv(seed: int, outlier: int = 0) -> torch.Tensor:
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    kv[:, outlier, :, :, 5] *= 20  # one outlier channel (keys by default, as real models have)
    return kv


def _round_trip(name: str, kv: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(kv), SHAPE[1:], torch.float32)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_hadamard_is_orthonormal_and_its_own_inverse(n):
    h = hadamard(n)
    assert torch.allclose(h @ h, torch.eye(n), atol=1e-6) and torch.equal(h, h.T)
    assert bool(((h.abs() - n**-0.5).abs() < 1e-7).all())


@pytest.mark.parametrize("n", [0, 3, 48, 96])
def test_hadamard_refuses_other_sizes(n):
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(n)


def test_each_rotated_row_is_no_worse_than_min_max_quantization():
    """The clip search includes the plain range (1.0), so every rotated row's squared error is
    at most what min/max quantization guarantees: dim * (step / 2)^2."""
    assert CLIPS[0] == 1.0
    kv = _kv(1)
    rotated, decoded = kv @ hadamard(64), _round_trip("h4v3", kv) @ hadamard(64)
    for part, bits in ((0, 4), (1, 3)):
        x, y = rotated[:, part], decoded[:, part]
        step = (x.amax(-1) - x.amin(-1)) / ((1 << bits) - 1)
        error = (y - x).square().sum(-1)
        assert bool((error <= 64 * (step * 0.51) ** 2 + 1e-4).all()), part


def test_decoding_returns_k_and_v_in_their_own_basis():
    kv = _kv(2)
    decoded = _round_trip("h4v3", kv)
    assert decoded.shape == kv.shape
    relative = (decoded - kv).square().mean(dim=(0, 2, 3, 4)) / kv.square().mean(dim=(0, 2, 3, 4))
    assert float(relative[0]) < 0.01 and float(relative[1]) < 0.05  # keys 4 bits, values 3 bits


def test_a_value_outlier_channel_costs_less_than_under_per_token_k4v3():
    """k4v3's values take one range per token, set by the outlier; rotated, it is spread thin."""
    kv = _kv(3, outlier=1)
    normal = [c for c in range(64) if c != 5]
    errors = {
        name: float((_round_trip(name, kv)[:, 1, ..., normal] - kv[:, 1, ..., normal]).abs().mean())
        for name in ("k4v3", "h4v3")
    }
    assert errors["h4v3"] < 0.5 * errors["k4v3"], errors


def test_encoding_is_deterministic_and_refuses_a_wrong_payload():
    kv, codec = _kv(4), get_codec("h4v3")
    payload = codec.encode(kv)
    assert torch.equal(payload, codec.encode(kv.clone())) and payload.dtype == torch.uint8
    with pytest.raises(ValueError, match="does not fit"):
        codec.decode_layer(payload[0][:-1], SHAPE[1:], torch.float32, 0)


def test_a_head_dim_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        get_codec("h4v3").encode(torch.zeros(1, 2, 1, 4, 48))


def test_a_layer_may_split_the_same_bits_otherwise():
    """A layer coded with 2-bit keys and 5-bit values: the payload keeps its size, that
    layer's V comes back closer and its K coarser than the default split's, the other layer
    is coded exactly as plain h4v3 codes it, and fresh V rounds as each layer stores it."""
    kv = _kv(11)
    plain = get_codec("h4v3")
    split = RotatedQuantCodec("split", 4, 3, layer_bits={1: (2, 5)})
    payload = split.encode(kv)
    assert payload.shape == plain.encode(kv).shape
    assert torch.equal(payload[0], plain.encode(kv)[0])
    decoded, coarse = split.decode(payload, SHAPE[1:], torch.float32), _round_trip("h4v3", kv)
    assert torch.equal(decoded[0], coarse[0])

    def error(x: torch.Tensor, part: int) -> float:
        return float((x[1, part] - kv[1, part]).square().mean())

    assert error(decoded, 1) < error(coarse, 1) / 4 and error(decoded, 0) > error(coarse, 0) * 2
    for layer in range(SHAPE[0]):
        assert torch.equal(split.round_values(kv[layer, 1], layer), decoded[layer, 1])


@pytest.mark.parametrize("layer_bits", [{1: (3, 3)}, {0: (4, 4)}, {1: (0, 7)}, {1: (7, 0)}])
def test_a_layer_split_must_keep_the_bits_per_element(layer_bits):
    with pytest.raises(ValueError):
        RotatedQuantCodec("bad", 4, 3, layer_bits=layer_bits)


def test_centred_keys_take_a_per_channel_offset_out_of_the_range():
    """Keys with a large per-channel offset (as real models' keys have): centred, their error
    is well below plain h4v3's; values are coded exactly as h4v3 codes them."""
    kv = _kv(12)
    kv[:, 0] += torch.linspace(-30, 30, 64)  # an offset per channel, the same for every token
    plain, centred = _round_trip("h4v3", kv), _round_trip("ch4v3", kv)

    def error(x: torch.Tensor) -> float:
        return float((x[:, 0] - kv[:, 0]).square().mean())

    assert error(centred) < 0.25 * error(plain), (error(centred), error(plain))
    assert torch.equal(centred[:, 1], plain[:, 1])


def test_centred_keys_round_each_row_about_the_channel_means():
    """Each centred, rotated K row's squared error is at most what rounding over its symmetric
    range guarantees (dim x (step / 2)^2; the clip search includes the full range), and a
    chunk whose keys are all alike comes back as its mean (float16 rounding)."""
    codec = get_codec("ch4v3")
    kv = _kv(13)
    decoded = codec.decode(codec.encode(kv), SHAPE[1:], torch.float32)
    rotated = kv[:, 0] @ hadamard(64)
    step = 2 * (rotated - rotated.mean(2, keepdim=True)).abs().amax(-1) / 15
    error = (decoded[:, 0] @ hadamard(64) - rotated).square().sum(-1)
    assert bool((error <= 64 * (step * 0.51) ** 2 + 1e-3).all())
    alike = torch.zeros(SHAPE)
    alike[:, 0] = torch.randn(64)
    back = codec.decode(codec.encode(alike), SHAPE[1:], torch.float32)
    assert torch.allclose(back[:, 0], alike[:, 0], atol=1e-2)


@pytest.mark.parametrize(
    "tokens, at_most_a_quarter", [(64, True), (256, True), (1024, True), (32, False)]
)
def test_centred_keys_pay_their_means_with_the_dropped_minimums(tokens, at_most_a_quarter):
    """The channel means (heads x head_dim float16 per layer) cost what the K rows' minimums
    saved at 64 tokens: from there on the entry is within 0.25x float16."""
    layer_shape = (2, 3, tokens, 64)
    quarter = 0.25 * get_codec("float16").layer_bytes(layer_shape)
    assert (get_codec("ch4v3").layer_bytes(layer_shape) <= quarter) is at_most_a_quarter
    assert get_codec("ch4v3c").layer_bytes(layer_shape) == get_codec("ch4v3").layer_bytes(
        layer_shape
    )


def test_a_centred_payload_decodes_by_its_documented_layout():
    """The entry format of `ch4v3`, written by hand: [K scale][V scale][V min][K channel means]
    (float16) then the K codes (4-bit, low nibble first) and V codes (3-bit, eight in three
    bytes, little-endian); K row = (code - 7.5) * scale + mean, V row = min + code * scale,
    both rotated back by H. Pins the layout that stored entries were written in."""
    heads, tokens, dim = 1, 2, 8
    generator = torch.Generator().manual_seed(5)
    k_codes = torch.randint(0, 16, (tokens, dim), generator=generator)
    v_codes = torch.randint(0, 8, (tokens, dim), generator=generator)
    k_scale, v_scale, v_min = (
        torch.tensor([0.5, 0.25]),
        torch.tensor([0.125, 1.0]),
        torch.tensor([-1.0, 2.0]),
    )
    k_mean = torch.arange(dim, dtype=torch.float32) / 4

    def as_bytes(x: torch.Tensor) -> list[int]:
        return x.to(torch.float16).view(torch.uint8).tolist()

    flat_k, flat_v = k_codes.flatten().tolist(), v_codes.flatten().tolist()
    k_bytes = [flat_k[i] | flat_k[i + 1] << 4 for i in range(0, len(flat_k), 2)]
    v_bytes = []
    for i in range(0, len(flat_v), 8):
        word = sum(code << 3 * j for j, code in enumerate(flat_v[i : i + 8]))
        v_bytes += [word & 0xFF, word >> 8 & 0xFF, word >> 16]
    payload = torch.tensor(
        as_bytes(k_scale)
        + as_bytes(v_scale)
        + as_bytes(v_min)
        + as_bytes(k_mean)
        + k_bytes
        + v_bytes,
        dtype=torch.uint8,
    )
    decoded = get_codec("ch4v3").decode_layer(payload, (2, heads, tokens, dim), torch.float32, 0)
    keys = (k_codes - 7.5) * k_scale[:, None] + k_mean
    values = v_min[:, None] + v_codes * v_scale[:, None]
    h = hadamard(dim)
    assert torch.allclose(decoded[0, 0], keys @ h, atol=1e-5)
    assert torch.allclose(decoded[1, 0], values @ h, atol=1e-5)
