"""The kernel library of `engine/csrc/`: it compiles, its ABI holds, each kernel equals its twin.

- Every `.cu` file is compiled with nvcc into a temporary folder once per session (skipped
  only where nvcc is missing; CI has it), linked and loaded: a kernel that does not compile
  fails here.
- `cpu` cases run the library's host twins (kvm_host_*: each kernel's per-element code on the
  CPU) against the PyTorch twins of `engine/model/ops.py`; `cuda` cases (marker `gpu`, skipped
  without CUDA) run the CUDA kernels against the PyTorch twins on the same GPU tensors.
  Outputs are poisoned (NaN, -1) before each run so an unwritten element fails, and memory
  around in-place views is poisoned so a stray write fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import kernels
from engine.kernels import build, launch, library
from engine.model import ops
from engine.planners import Mode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(library, object files): every source compiled for this machine's GPU (or sm_90) and
    linked."""
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    folder = tmp_path_factory.mktemp("kernels")
    objects = build.compile_objects(folder, arch=build.default_arch())
    return library.load_from(build.link_library(objects, folder / build.LIBRARY_NAME)), objects


@pytest.fixture
def lib(built):
    return built[0]


@pytest.fixture(autouse=True)
def fresh_load_state():
    library.reset()
    yield
    library.reset()


def inv_freq(head_dim: int, theta: float = 1e5) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def poisoned_view(dtype, device, start=5, end=29, head_dim=64):
    """(backing, view): K of layer 1 rows start..end of a [3, 2, 3, 40, head_dim] cache; NaN
    elsewhere."""
    backing = torch.full((3, 2, 3, 40, head_dim), math.nan, dtype=dtype, device=device)
    view = backing[1, 0, :, start:end]
    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(start)).to(dtype))
    return backing, view


def assert_only_view_written(backing: torch.Tensor, view_mask: torch.Tensor) -> None:
    assert bool(backing[~view_mask].isnan().all()), "kernel wrote outside its view"
    assert not bool(backing[view_mask].isnan().any()), "kernel left NaN inside its view"


# -- compile and ABI --------------------------------------------------------------------------


def test_every_kernel_source_compiles_and_links(built):
    lib, objects = built
    assert sorted(o.stem for o in objects) == sorted(s.stem for s in build.sources())
    assert all(o.stat().st_size > 0 for o in objects)
    assert lib._dll.kvm_abi_version() == library.ABI_VERSION


def test_abi_rejects_bad_arguments(lib):
    k = torch.randn(3, 4, 8)
    layout = launch._layout(k)
    with pytest.raises(kernels.KernelError, match="dtype"):
        lib.call(
            "kvm_host_rope_shift", launch._ptr(k), 9, layout, 1, None, launch._ptr(inv_freq(8)), 0
        )
    with pytest.raises(kernels.KernelError, match="layout"):
        lib.call(
            "kvm_host_gather_rows",
            launch._ptr(k),
            layout,
            launch._ptr(torch.tensor([0])),
            1,
            launch._ptr(k),
            launch._layout(torch.randn(3, 1, 6)),
            0,
        )


# -- kernels against twins --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta", [1, -5, 4000, "per-row"])
def test_rope_shift_equals_twin(lib, device, dtype, delta):
    backing, k = poisoned_view(dtype, device)
    if delta == "per-row":
        delta = torch.randint(
            -500, 500, (k.shape[1],), generator=torch.Generator().manual_seed(1)
        ).to(device)
    freqs = inv_freq(64).to(device)
    expected = ops.rope_shift_twin_(k.clone(), delta, freqs)
    launch.rope_shift_(lib, k, delta, freqs)
    mask = torch.zeros_like(backing, dtype=torch.bool)
    mask[1, 0, :, 5:29] = True
    assert_only_view_written(backing, mask)
    torch.testing.assert_close(k, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 3, 9, 16), (5, 6)])
@pytest.mark.parametrize("freq_dtype", [torch.float64, torch.bfloat16])
def test_rope_shift_other_layouts_and_frequencies(lib, device, shape, freq_dtype):
    torch.manual_seed(2)
    k = torch.randn(shape[:-2] + (shape[-1], shape[-2]), device=device).transpose(
        -1, -2
    )  # columns strided
    freqs = inv_freq(shape[-1]).to(device=device, dtype=freq_dtype)
    expected = ops.rope_shift_twin_(k.clone(), 123, freqs)
    torch.testing.assert_close(launch.rope_shift_(lib, k, 123, freqs), expected)


def deviation_inputs(dtype, device, tokens, kv_heads=3, head_dim=64, seed=3):
    torch.manual_seed(seed)
    fresh = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype).transpose(0, 1)
    cache = torch.randn(2, kv_heads, tokens + 7, head_dim, device=device).to(dtype)
    return fresh, cache[1, :, 3 : 3 + tokens]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,kv_heads,head_dim", [(1, 1, 8), (37, 3, 64), (700, 8, 128)])
def test_kv_deviation_equals_twin(lib, device, dtype, tokens, kv_heads, head_dim):
    fresh, cached = deviation_inputs(dtype, device, tokens, kv_heads, head_dim)
    out = torch.full((tokens,), math.nan, device=device)
    launch.kv_deviation(lib, fresh, cached, out=out)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out, ops.kv_deviation_twin(fresh, cached), rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 37, 1000, 5000])
@pytest.mark.parametrize("count", [1, 10, 400, 6000])
@pytest.mark.parametrize("ties", [False, True])
def test_top_rows_equals_twin(lib, device, n, count, ties):
    generator = torch.Generator().manual_seed(n + count)
    scores = (
        torch.randint(0, 3, (n,), generator=generator).float()
        if ties
        else torch.rand(n, generator=generator)
    )
    if ties:
        scores[::17] = math.nan
    eligible = torch.rand(n, generator=generator) > 0.3
    for mask in (None, eligible):
        scores_d, mask_d = scores.to(device), None if mask is None else mask.to(device)
        expected = ops.top_rows_twin(scores_d, count, mask_d)
        out = torch.full((expected.numel(),), -1, dtype=torch.long, device=device)
        assert torch.equal(launch.top_rows(lib, scores_d, count, mask_d, out=out), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,offset", [(64, 0), (7, 0), (64, 1)]
)  # 16-byte copies, none, misaligned
def test_gather_rows_equals_twin(lib, device, dtype, head_dim, offset):
    torch.manual_seed(4)
    layer = torch.randn(2, 3, 50, head_dim + offset, device=device).to(dtype)[..., offset:]
    index = torch.tensor([0, 49, 7, 7, 20], device=device)
    out = torch.full((2, 3, 5, head_dim), math.nan, dtype=dtype, device=device)
    assert torch.equal(
        launch.gather_rows(lib, layer, index, out=out), ops.gather_rows_twin(layer, index)
    )
    hidden = torch.randn(50, 96, device=device).to(dtype)  # [tokens, hidden]
    assert torch.equal(launch.gather_rows(lib, hidden, index), ops.gather_rows_twin(hidden, index))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 6])
def test_scatter_rows_equals_twin(lib, device, dtype, head_dim):
    torch.manual_seed(5)
    backing = torch.full((3, 2, 3, 40, head_dim), math.nan, dtype=dtype, device=device)
    index = torch.tensor([3, 0, 39, 12], device=device)
    src = (
        torch.randn(4, 3, head_dim, device=device).to(dtype).transpose(0, 1)
    )  # [kv_heads, 4, head_dim]
    expected = backing.clone()
    ops.scatter_rows_twin_(expected[1, 1], index, src)
    launch.scatter_rows_(lib, backing[1, 1], index, src)
    assert torch.equal(backing.isnan(), expected.isnan()), (
        "rows written where the twin wrote none, or missed"
    )
    assert torch.equal(backing.nan_to_num(), expected.nan_to_num())


# -- dispatch ---------------------------------------------------------------------------------


@pytest.fixture
def kernels_on_cpu(lib, monkeypatch):
    """Route every op through the kernel path; CPU tensors then run the host twins."""
    monkeypatch.setattr(kernels, "for_tensor", lambda x: lib)
    return lib


def test_ops_dispatch_to_the_kernels(kernels_on_cpu):
    fresh, cached = deviation_inputs(torch.float16, "cpu", 60)
    eligible = torch.rand(60) > 0.2
    assert torch.equal(
        ops.deviation_top_rows(fresh, cached, 11, eligible),
        ops.top_rows_twin(ops.kv_deviation_twin(fresh, cached), 11, eligible),
    )
    k = cached.clone()
    assert torch.equal(
        ops.rope_shift_(k, torch.arange(60) - 30, inv_freq(64)),
        ops.rope_shift_twin_(cached.clone(), torch.arange(60) - 30, inv_freq(64)),
    )
    index = torch.tensor([5, 1])
    assert torch.equal(ops.gather_rows(cached, index), ops.gather_rows_twin(cached, index))


def test_unsupported_calls_fall_back_to_the_twin(kernels_on_cpu):
    k = torch.randn(2, 4, 8, dtype=torch.float64)  # no float64 kernel
    assert torch.equal(
        ops.rope_shift_(k.clone(), 3, inv_freq(8)), ops.rope_shift_twin_(k.clone(), 3, inv_freq(8))
    )
    dst, src = torch.zeros(3, 5, 4), torch.ones(3, 2, 4, dtype=torch.float16)  # dtypes differ
    ops.scatter_rows_(dst, torch.tensor([0, 4]), src)
    assert float(dst.sum()) == 24.0


def test_a_prefill_through_the_kernels_equals_the_twins(tiny_engine, kernels_on_cpu, monkeypatch):
    from tests.engine.helpers import QUESTION, chunk_inputs

    chunks = chunk_inputs(tiny_engine)
    through_kernels = tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.3
    )
    monkeypatch.setattr(kernels, "for_tensor", lambda x: None)
    through_twins = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.3)
    torch.testing.assert_close(through_kernels.logits, through_twins.logits, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def cuda_tiny_engine(request, tmp_path_factory):
    """The tiny random Llama on the GPU in float32; tokenizer from .device-stage/model if staged."""
    from pathlib import Path

    from engine import EngineConfig
    from engine.engine import Engine
    from engine.model.loader import wrap_model
    from tests.conftest import REPO, build_tiny_model

    staged = REPO / ".device-stage" / "model"
    if (staged / "tokenizer.json").is_file():  # the GPU machine cannot convert the embedded GGUF
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(staged), local_files_only=True)
    else:
        tokenizer = request.getfixturevalue("smol_tokenizer")
    model = build_tiny_model(len(tokenizer)).to("cuda")
    return Engine(
        EngineConfig(data_dir=tmp_path_factory.mktemp("tiny-cuda"), epic_tokens=4, fidelity="fast"),
        wrap_model(model, tokenizer),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_prefill_through_the_kernels_equals_the_twins(cuda_tiny_engine, lib, monkeypatch):
    from tests.engine.helpers import QUESTION, chunk_inputs

    calls = []
    monkeypatch.setattr(
        kernels, "for_tensor", lambda x: calls.append(1) or (lib if x.is_cuda else None)
    )
    chunks = chunk_inputs(cuda_tiny_engine)
    through_kernels = cuda_tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.3
    )
    assert calls, "no op reached the kernel dispatch"
    monkeypatch.setattr(kernels, "for_tensor", lambda x: None)
    through_twins = cuda_tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.3
    )
    torch.testing.assert_close(through_kernels.logits, through_twins.logits, rtol=1e-4, atol=1e-4)


# -- modes and build cache --------------------------------------------------------------------


def test_mode_off_never_builds(monkeypatch):
    monkeypatch.setenv("KVMOSAIC_KERNELS", "off")
    monkeypatch.setattr(
        build, "build", lambda *a, **k: pytest.fail("built with KVMOSAIC_KERNELS=off")
    )
    assert library.get() is None


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("KVMOSAIC_KERNELS", "sometimes")
    with pytest.raises(kernels.KernelError, match="KVMOSAIC_KERNELS"):
        library.get()


def test_missing_library_falls_back_in_auto_and_fails_in_require(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMOSAIC_KERNEL_LIBRARY", str(tmp_path / "missing.so"))
    monkeypatch.setenv("KVMOSAIC_KERNELS", "auto")
    assert library.get() is None
    monkeypatch.setenv("KVMOSAIC_KERNELS", "require")
    with pytest.raises(kernels.KernelError, match="unavailable"):
        library.get()


def test_prebuilt_library_is_loaded(built, monkeypatch):
    monkeypatch.setenv("KVMOSAIC_KERNEL_LIBRARY", str(built[0].path))
    loaded = library.get()
    assert loaded is not None and loaded.path == built[0].path


def test_build_is_cached_by_key(monkeypatch, tmp_path):
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    calls = []

    def fake_compile(out_dir, arch, nvcc, jobs=None):
        calls.append(arch)
        return []

    monkeypatch.setattr(build, "compile_objects", fake_compile)
    monkeypatch.setattr(
        build, "link_library", lambda objects, target, nvcc: target.write_bytes(b"lib") and target
    )
    first = build.build(arch="90", cache_dir=tmp_path)
    assert build.build(arch="90", cache_dir=tmp_path) == first and calls == ["90"]
    other = build.build(arch="100", cache_dir=tmp_path)
    assert other != first and calls == ["90", "100"]
    assert sorted(p.name for p in first.parent.iterdir()) == [
        build.LIBRARY_NAME
    ]  # no temporary left behind


def test_kernel_bench_runs_on_the_host_twins(lib):
    from bench.compute.kernels import KernelBenchOptions, format_table, run_kernel_bench

    options = KernelBenchOptions(
        device="cpu", layers=2, tokens=64, chunk_tokens=16, repeats=1, warmup=0
    )
    timings = run_kernel_bench(options, lib)
    assert len(timings) == 7 and all(t.max_diff < 1e-2 for t in timings)
    assert "speedup" in format_table(timings)
