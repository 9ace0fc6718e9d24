"""Build of the one native extension, torch_kvcm2._C.

CPU kernels are always built. CUDA kernels are built when TORCH_KVCM2_CUDA=auto (default) finds a
CUDA build of torch and a CUDA toolkit, or when TORCH_KVCM2_CUDA=1 demands them (then failing
loudly if impossible). The decision never looks at torch.cuda.is_available(): a GPU-less machine
with a CUDA torch still builds the CUDA kernels.
"""
import glob
import os

# cpp_extension reads CUDA_HOME when imported; the nvcc on PATH may be a wrapper script whose
# folder is not the toolkit root, so prefer the conventional root when nothing is set.
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

_ON = {"1", "on", "true", "yes"}
_OFF = {"0", "off", "false", "no"}


def want_cuda() -> bool:
    mode = os.environ.get("TORCH_KVCM2_CUDA", "auto").strip().lower()
    if mode in _OFF:
        return False
    possible = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
    )
    if mode in _ON and not possible:
        raise RuntimeError(
            f"TORCH_KVCM2_CUDA={mode} but torch.version.cuda={torch.version.cuda!r} and "
            f"CUDA_HOME={CUDA_HOME!r}: install a CUDA build of torch and a CUDA toolkit"
        )
    if mode not in _ON | _OFF | {"auto"}:
        raise RuntimeError(f"TORCH_KVCM2_CUDA must be auto, 0 or 1, not {mode!r}")
    return possible


def extensions():
    use_cuda = want_cuda()
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3", "-g0"]  # -g0 halves the CPU build time
    sources = sorted(glob.glob("torch_kvcm2/csrc/*.cpp") + glob.glob("torch_kvcm2/csrc/cpu/*.cpp"))
    macros = []
    extra = {"cxx": opt, "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]}
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        sources += sorted(glob.glob("torch_kvcm2/csrc/cuda/*.cu"))
        macros.append(("TORCH_KVCM2_WITH_CUDA", "1"))
        if os.environ.get("TORCH_KVCM2_PROFILE", "0") == "1":  # development: resolve phase timing
            macros.append(("KVCM2_PROFILE", "1"))
        threads = os.environ.get("TORCH_KVCM2_RESOLVE_THREADS")  # development: A/B of the CTA size
        if threads:
            macros.append(("KVCM2_RESOLVE_THREADS", threads))
    print(
        f"[torch_kvcm2] {'CUDA' if use_cuda else 'CPU-only'} build, torch {torch.__version__}, "
        f"CUDA_HOME={CUDA_HOME}, TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}"
    )
    cls = CUDAExtension if use_cuda else CppExtension
    return [
        cls(
            "torch_kvcm2._C",
            sources,
            define_macros=macros,
            extra_compile_args=extra,
            py_limited_api=True,
        )
    ]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
