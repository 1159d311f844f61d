"""Weight and KV dtypes by name: the one table, the device default, and names to MLX dtypes.

Used by the GGUF importer and the loader (weights), the cache schemes (persisted K/V meta)
and `pool-size` (bytes per element).
"""

from __future__ import annotations

import mlx.core as mx

from shared.errors import BadRequest

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def resolve_dtype(name: str | None) -> str:
    """Name the weight dtype: `name` itself, or the fast default for the device.

    Args:
        name (str | None): "float32", "float16", "bfloat16", "auto" or None. "auto" and None
            mean float32 on the CPU (MLX's Linux CPU backend runs fp16/bf16 matmuls slowly but
            float32 through BLAS) and float16 on a GPU.

    Returns:
        str: one of the keys of `DTYPES`.

    Raises:
        BadRequest: `name` is not one of those names.
    """
    if name is None or name == "auto":
        return "float32" if mx.default_device().type == mx.cpu else "float16"
    if name not in DTYPES:
        raise BadRequest(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return name


def mx_dtype(name: str) -> mx.Dtype:
    """`"float16"` -> `mx.float16`.

    Raises:
        ValueError: an unknown dtype name (e.g. in a persisted cache's meta).
    """
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]
