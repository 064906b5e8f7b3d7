"""Which BLAS the worker gets, found without importing MLX (the launcher must not).

mlx's Linux CPU wheel links a slow reference BLAS; the launcher preloads an optimized
one into the worker (`LD_PRELOAD`), and none where an MLX GPU backend runs the
matmuls."""

import glob
import os
import sys
import sysconfig
from importlib import metadata

# MLX's GPU backends on Linux, as distributions (`pip install mlx[cuda13]`).
GPU_BACKENDS = ("mlx-cuda-13", "mlx-cuda-12")


def mlx_gpu_backend() -> str | None:
    """The installed MLX GPU backend distribution, if any."""
    for name in GPU_BACKENDS:
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return None


def find_blas(choice: str, system_lib: str = "/usr/lib") -> str | None:
    """An optimized BLAS to preload into the worker (Linux CPU backend only): a system
    OpenBLAS (Debian's `libopenblas0-pthread`) first, else MKL from the `mkl` wheel,
    which `pip install` brings on Linux x86_64. mlx calls only `cblas_sgemm`. With a
    GPU backend `auto` preloads nothing: the matmuls run on the GPU."""
    if not sys.platform.startswith("linux") or choice == "off":
        return None
    if choice != "auto":
        return choice
    if mlx_gpu_backend():
        return None
    prefixes = dict.fromkeys([sysconfig.get_config_var("LIBDIR") or "",
                              os.path.join(sys.prefix, "lib")])
    candidates = [
        *sorted(glob.glob(os.path.join(system_lib, "*-linux-gnu/openblas-pthread/libblas.so.3"))),
        *sorted(glob.glob(os.path.join(system_lib, "*-linux-gnu/libopenblas.so.0"))),
        *(m for prefix in prefixes if prefix
          for m in sorted(glob.glob(os.path.join(prefix, "libmkl_rt.so*")))),
    ]
    return next((c for c in candidates if os.path.exists(c)), None)
