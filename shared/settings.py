"""Settings, parsed once per process from `BUTTERMILK_*` environment variables; CLI flags override.

Cores never import this module: `main()` functions parse settings and hand plain values
or frozen option objects (e.g. `CacheOptions`) to the code they start.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ModelSettings(BaseSettings):
    """What to load and how to cache its KV state (shared by `generate`, `inspect`, `engine`)."""

    model_config = SettingsConfigDict(env_prefix="BUTTERMILK_", extra="ignore")

    model: str = "default"  # "default", "gemma3-270m", a local HF/MLX folder, or a .gguf file
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # weights; auto: fp32 on CPU
    kv_cache: str = "raw"  # raw | affine8 | affine4 | aura{K}v{V}
    kv_raw_layers: tuple[int, ...] = ()  # layer indices kept raw under a compressed scheme
    kv_window_size: int | None = Field(default=None, ge=2)  # tokens per layer, sinks included
    kv_window_keep: int = Field(default=4, ge=0)  # attention sinks pinned under a window
    max_context: int | None = Field(default=None, ge=1)  # tokens; default: the model's advertised window
    prefill_chunk: int = Field(default=512, ge=1)  # tokens per prefill forward
    log_json: bool = False
    log_level: str = "info"
