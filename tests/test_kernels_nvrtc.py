"""Every kernel instantiation compiles through NVRTC exactly as the loader asks CuPy to, no GPU.

The loader (``gpucoll.kernels._kernel``) hands ``cupy.RawModule`` a source, options and one name
expression per (kernel, dtype pair, and for unpack whether it checks for non-finite values).
Here the same request goes through CuPy's own compile path
(``cupy._core.core.compile_with_cache``: CuPy's include paths, then ``-ftz=true``, the arch and
``--device-as-default-execution-space``) for sm_80, sm_90 and sm_100. Only two things differ from
a run on a GPU: the arch is given instead of read from the device, and NVRTC is asked for PTX
(``compute_XX``) instead of a cubin, so that the instructions can be read; the compile stops
there, before CuPy would load the module into a CUDA context.

Checks: the PTX has the entry point of the name expression, no ``.ftz`` instruction at all (CuPy's
``-ftz=true`` would otherwise flush float32 / bfloat16 subnormals), the scale multiply is
``mul.rn``, and ``ptxas -v`` (where one is installed: the ``nvidia-cuda-nvcc-cu12`` /
``nvidia-cuda-nvcc`` (CUDA 13) wheel or a CUDA toolkit) reports no register spills.

Needs CuPy with NVRTC (``pip install 'cupy-cuda12x[ctk]'``); skipped with the reason otherwise.
"""

import os
import re
import shutil
import subprocess

import pytest

from gpucoll import kernels

ARCHS = ("80", "90", "100")
# (kernel, check): unpack has a variant that flags non-finite values (a template argument)
VARIANTS = (("bucket_pack", False), ("bucket_unpack", False), ("bucket_unpack", True))
VARIANT_IDS = ("pack", "unpack", "unpack-check")
PAIRS = sorted(kernels.SUPPORTED_PAIRS)


def _cupy_compiler():
    try:
        import cupy  # noqa: F401
        from cupy._core import core
        from cupy.cuda import compiler
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or no NVRTC library
        pytest.skip(f"CuPy with NVRTC is not importable ({type(exc).__name__}: {exc}); "
                    f"pip install 'cupy-cuda12x[ctk]'")
    return core, compiler


class _Compiled(Exception):
    """Raised with NVRTC's output once the named program is compiled (before any module load)."""


@pytest.fixture(scope="module")
def compile_like_loader():
    """``compile(variant, array_dtype, bucket_dtype, arch) -> (options, ptx, lowered name)``."""
    core, compiler = _cupy_compiler()
    for attribute in ("_NVRTCProgram", "_get_arch_for_options_for_nvrtc"):
        assert hasattr(compiler, attribute), (
            f"cupy.cuda.compiler.{attribute} is gone: this test follows CuPy's compile path and "
            f"needs updating for this CuPy")
    original = compiler._NVRTCProgram.compile

    def compile_and_stop(program, options=(), log_stream=None):
        output = original(program, options, log_stream)
        if program.name_expressions:  # the kernel itself, not CuPy's empty-file probe
            raise _Compiled(options, output)
        return output

    cache = {}

    def compile(variant, array_dtype, bucket_dtype, arch):
        key = (variant, array_dtype, bucket_dtype, arch)
        if key not in cache:
            source, options, expression = kernels.compile_request(variant[0], array_dtype,
                                                                  bucket_dtype, variant[1])
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(compiler._NVRTCProgram, "compile", compile_and_stop)
                patch.setattr(compiler, "_get_arch_for_options_for_nvrtc",
                              lambda arch=None: (f"-arch=compute_{arch}", "ptx"))
                try:
                    core.compile_with_cache(source, options, arch=arch,
                                            prepend_cupy_headers=False,
                                            name_expressions=[expression])
                except _Compiled as done:
                    used_options, (ptx, mapping) = done.args
                else:  # pragma: no cover - CuPy changed its compile path
                    pytest.fail("CuPy's compile path no longer reaches _NVRTCProgram.compile")
            ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
            cache[key] = (tuple(used_options), ptx, mapping[expression])
        return cache[key]

    return compile


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_instantiation_compiles_without_ftz(compile_like_loader, variant, pair, arch):
    options, ptx, lowered = compile_like_loader(variant, pair[0], pair[1], arch)
    _, loader_options, _ = kernels.compile_request(variant[0], *pair)
    assert all(option in options for option in loader_options)
    assert "-ftz=true" in options, "CuPy's option assembly changed: the .ftz check is moot"
    assert f"-arch=compute_{arch}" in options
    assert re.search(rf"\.entry\s+{re.escape(lowered)}\s*\(", ptx), f"no entry {lowered}"
    ftz = sorted({line.split()[0] for line in ptx.splitlines() if ".ftz" in line})
    assert not ftz, f"flush-to-zero instructions in the PTX: {ftz}"
    compute = "f64" if "float64" in pair else "f32"
    assert f"mul.rn.{compute}" in ptx, "the scale multiply is the PTX mul.rn of the kernel"


def _ptxas():
    """A ptxas: the nvidia-cuda-nvcc wheel's (same release as the NVRTC wheel), else PATH's.

    The CUDA 12 wheels put it in ``nvidia/cuda_nvcc/bin``, the CUDA 13 ones in ``nvidia/cu13/bin``.
    """
    try:
        import nvidia

        for base in nvidia.__path__:
            for folder in ("cuda_nvcc", "cu13"):
                path = os.path.join(base, folder, "bin", "ptxas")
                if os.access(path, os.X_OK):
                    return path
    except ImportError:
        pass
    return shutil.which("ptxas")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_no_register_spills(compile_like_loader, tmp_path, variant, arch):
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas (pip install nvidia-cuda-nvcc-cu12, or a CUDA toolkit on PATH)")
    for array_dtype, bucket_dtype in PAIRS:
        _, ptx, lowered = compile_like_loader(variant, array_dtype, bucket_dtype, arch)
        source = tmp_path / f"{lowered}.ptx"
        source.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"-arch=sm_{arch}", str(source), "-o",
                               str(tmp_path / "out.cubin")], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0 and "Unsupported .version" in proc.stderr:
            pytest.skip(f"{ptxas} is older than this NVRTC's PTX: {proc.stderr.strip()}")
        assert proc.returncode == 0, proc.stderr
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
        assert spills, f"ptxas -v printed no spill line: {proc.stderr}"
        assert all(s == ("0", "0") for s in spills), f"{lowered} on sm_{arch}: {proc.stderr}"
