"""engine/cpu's instruction-set-specific kernels compile for every instruction set the engine
serves, whatever this machine's CPU: a change that breaks the AVX-512 build is caught on an AVX2
machine, and the reverse.

decode_step.c (vec16.h) and prefill_attention.c are compiled to objects with library.py's flags,
`-march=native` replaced; decode_attention.c is portable vector code, built natively by every
run of the engine. Which targets run the native decode step is read off the preprocessor.
"""

from __future__ import annotations

import platform
import subprocess

import pytest

from engine.cpu import library

# -march value: whether the decode step runs there (vec16.h's KVM_VEC16)
TARGETS = {
    "sapphirerapids": True,  # AVX-512, AVX512-BF16, AMX
    "cooperlake": True,  # AVX512-BF16, no AMX: the prefill attention kernel too
    "skylake-avx512": True,
    "x86-64-v3": True,  # AVX2 with FMA and F16C
    "x86-64-v2": False,  # no AVX: the PyTorch twin decodes
}

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or library.find_compiler() is None,
    reason="needs an x86-64 C compiler",
)


def compile_for(march: str, *extra: str, source: str | None = None) -> subprocess.CompletedProcess:
    flags = [flag for flag in library.COMPILE_FLAGS if flag not in ("-march=native", "-shared")]
    command = [str(library.find_compiler()), *flags, f"-march={march}", *extra]
    if source is not None:
        command.append(str(library.SOURCE_DIR / source))
    return subprocess.run(command, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_the_kernels_compile_for_every_instruction_set(march, tmp_path):
    for source in ("decode_step.c", "prefill_attention.c"):
        built = compile_for(march, "-c", "-o", str(tmp_path / f"{source}.o"), source=source)
        assert built.returncode == 0, built.stderr
    header = library.SOURCE_DIR / "vec16.h"
    macros = compile_for(march, "-dM", "-E", str(header)).stdout.splitlines()
    assert f"#define KVM_VEC16 {int(TARGETS[march])}" in macros
