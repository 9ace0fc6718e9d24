"""Build of the one native extension, torch_kvcm2._C.

CPU kernels are always built. CUDA kernels are built when TORCH_KVCM2_CUDA=auto (default) finds a
CUDA build of torch and a CUDA toolkit, or when TORCH_KVCM2_CUDA=1 demands them (then failing
loudly if impossible). The decision never looks at torch.cuda.is_available(): a GPU-less machine
with a CUDA torch still builds the CUDA kernels. The build says in one line what it builds and
why (on the terminal, past pip's capture of the build's output, and on stderr).

TORCH_KVCM2_DEV=1 makes a development build (docs/DEVELOPMENT.md): the CUDA kernels' tuning
knobs and test hooks read from the environment; TORCH_KVCM2_DEV=profile adds the resolve kernel's
phase timer; TORCH_KVCM2_RESOLVE_THREADS=N (development builds only) sets resolve's CTA size.
"""
import glob
import os
import sys

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


def want_cuda() -> tuple[bool, str]:
    """Whether to build the CUDA kernels, and why."""
    mode = os.environ.get("TORCH_KVCM2_CUDA", "auto").strip().lower()
    if mode not in _ON | _OFF | {"auto"}:
        raise RuntimeError(f"TORCH_KVCM2_CUDA must be auto, 0 or 1, not {mode!r}")
    if mode in _OFF:
        return False, f"TORCH_KVCM2_CUDA={mode}"
    has_nvcc = CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
    found = f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={CUDA_HOME}"
    if torch.version.cuda is not None and has_nvcc:
        return True, found
    if mode in _ON:
        raise RuntimeError(
            f"TORCH_KVCM2_CUDA={mode} but torch.version.cuda={torch.version.cuda!r} and "
            f"CUDA_HOME={CUDA_HOME!r}: install a CUDA build of torch and a CUDA toolkit"
        )
    missing = "torch is a CPU build" if torch.version.cuda is None else "no nvcc under CUDA_HOME"
    return False, f"{missing}: {found}"


def dev_macros() -> list[tuple[str, str]]:
    """The development switch (TORCH_KVCM2_DEV) as macros; none in a production build."""
    dev = os.environ.get("TORCH_KVCM2_DEV", "0").strip().lower()
    threads = os.environ.get("TORCH_KVCM2_RESOLVE_THREADS")
    if dev in _OFF:
        if threads:
            raise RuntimeError("TORCH_KVCM2_RESOLVE_THREADS is a development choice: "
                               "set TORCH_KVCM2_DEV=1 too")
        return []
    if dev not in _ON | {"profile"}:
        raise RuntimeError(f"TORCH_KVCM2_DEV must be 0, 1 or profile, not {dev!r}")
    macros = [("KVCM2_DEV", "1")]
    if dev == "profile":
        macros.append(("KVCM2_DEV_PROFILE", "1"))
    if threads:
        macros.append(("KVCM2_RESOLVE_THREADS", threads))
    return macros


def announce(line: str) -> None:
    """One line for the person installing: pip hides the build's stdout and stderr unless -v,
    so it also goes to the controlling terminal when there is one."""
    line = f"[torch_kvcm2] {line}\n"
    sys.stderr.write(line)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line)
    except OSError:
        pass  # no terminal (CI, a log): stderr only


def extensions():
    use_cuda, why = want_cuda()
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3", "-g0"]  # -g0 halves the CPU build time
    sources = sorted(glob.glob("torch_kvcm2/csrc/*.cpp") + glob.glob("torch_kvcm2/csrc/cpu/*.cpp"))
    dev = dev_macros()
    macros = list(dev)
    extra = {"cxx": opt, "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]}
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        sources += sorted(glob.glob("torch_kvcm2/csrc/cuda/*.cu"))
        macros.append(("TORCH_KVCM2_WITH_CUDA", "1"))
    metadata_only = any(a in ("egg_info", "dist_info", "--name", "--version") for a in sys.argv)
    if not metadata_only:  # pip imports setup.py for the metadata, then again for the build
        kind = "CPU and CUDA kernels" if use_cuda else "CPU kernels only (no CUDA kernels)"
        arch = f", TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}" if use_cuda else ""
        note = f", development build ({', '.join(f'{k}={v}' for k, v in dev)})" if dev else ""
        announce(f"building {kind}: {why}{arch}{note}")
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
