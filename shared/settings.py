"""Settings, parsed once per process from `BUTTERMILK_*` environment variables; CLI flags override.

Cores never import this module: `main()` functions parse settings and hand plain values
or frozen option objects (e.g. `CacheOptions`) to the code they start.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.protocol_internal import DEFAULT_ENGINE_TIMEOUT_S

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_ENGINE_CMD_ADDRESS = "tcp://127.0.0.1:5556"
DEFAULT_ENGINE_OUT_ADDRESS = "tcp://127.0.0.1:5557"
DEFAULT_HTTP_ADDRESS = "127.0.0.1:8000"
DEFAULT_CONTROLLER_ADDRESS = "tcp://127.0.0.1:5558"


class ModelSettings(BaseSettings):
    """What to load and how to cache its KV state (shared by `generate`, `inspect`, `engine`)."""

    model_config = SettingsConfigDict(env_prefix="BUTTERMILK_", extra="ignore")

    model: str = "default"  # "default", "gemma3-270m", a local HF/MLX folder, or a .gguf file
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # weights; auto: fp32 on CPU
    kv_cache: str = "raw"  # raw | affine8 | affine4 | aura{K}v{V}
    kv_raw_layers: tuple[int, ...] = ()  # layer indices kept raw under a compressed scheme
    kv_window_size: int | None = Field(default=None, ge=2)  # tokens per layer, sinks included
    kv_window_keep: int = Field(default=4, ge=0)  # attention sinks pinned under a window
    no_kv_center_keys: bool = False  # store compressed keys as they come (default: centered on their mean, `centering`)
    max_context: int | None = Field(default=None, ge=1)  # tokens; default: the model's advertised window
    prefill_chunk: int = Field(default=512, ge=1)  # tokens per prefill forward
    log_json: bool = False
    log_level: str = "info"


class ControllerSettings(BaseSettings):
    """`buttermilk controller`: the ledger's timeouts and limits."""

    model_config = SettingsConfigDict(env_prefix="BUTTERMILK_", extra="ignore")

    controller_address: str = Field(DEFAULT_CONTROLLER_ADDRESS, description="ROUTER endpoint to bind")
    session_idle_ttl_s: float = Field(300.0, gt=0, description="a session without a turn ends after this many seconds")
    engine_timeout_s: float = Field(DEFAULT_ENGINE_TIMEOUT_S, gt=0, description="an engine silent this long is declared dead (gateway and controller alike), seconds")
    retry_after_ms: int = Field(250, ge=0, description="hint sent with overloaded when no engine has room")
    gateway_timeout_s: float = Field(30.0, gt=0, description="a gateway silent this long loses its reservations, leases and sessions, seconds")
    max_leases: int = Field(10_000, ge=1, description="leases open at once, all clients together")
    log_json: bool = Field(False, description="JSON log lines")
    log_level: str = Field("info", description="debug, info, warning or error")


class GatewaySettings(ModelSettings):
    """`buttermilk gateway`: sockets, admission, per-client limits and the HTTP API."""

    address: str = Field(DEFAULT_ADDRESS, description="client ROUTER endpoint (tcp:// or ipc://)")
    engine_cmd_address: str = Field(DEFAULT_ENGINE_CMD_ADDRESS, description="ROUTER endpoint engines connect to")
    engine_out_address: str = Field(DEFAULT_ENGINE_OUT_ADDRESS, description="PULL endpoint engines push tokens to")
    controller_address: str = Field(DEFAULT_CONTROLLER_ADDRESS, description="the controller's ROUTER endpoint")
    max_active_requests: int = Field(8, ge=1, description="requests generating at once")
    max_queue: int = Field(64, ge=0, description="requests waiting in the FIFO queue")
    queue_timeout_s: float = Field(60.0, gt=0, description="longest wait in the queue, seconds")
    max_tokens_cap: int = Field(4096, ge=1, description="server cap on max_tokens")
    engine_timeout_s: float = Field(DEFAULT_ENGINE_TIMEOUT_S, gt=0, description="an engine silent this long is declared dead (gateway and controller alike), seconds")
    control_timeout_s: float = Field(5.0, gt=0, description="longest wait for the controller, seconds")
    drain_timeout_s: float = Field(5.0, ge=0, description="on shutdown, how long running requests may finish, seconds")
    client_max_active: int = Field(4, ge=1, description="requests one connection may run at once")
    client_max_queued: int = Field(16, ge=0, description="requests one connection may have waiting")
    client_max_sessions: int = Field(8, ge=0, description="live sessions one connection may have started")
    client_max_leases: int = Field(4, ge=0, description="live leases one connection may have opened")
    client_max_pending_control: int = Field(16, ge=1, description="control requests one connection may have waiting for the controller")
    http_address: str = Field(DEFAULT_HTTP_ADDRESS, description="HOST:PORT of the OpenAI-compatible HTTP API and /metrics, or off")
    served_model_name: str | None = Field(None, description="comma-separated model names the HTTP API answers to; the first is listed (default: the model's name, then --model)")


class EngineSettings(ModelSettings):
    """`buttermilk engine`: device, KV pool size, slots, step budget and sockets."""

    engine_id: str = Field("e0", min_length=1, max_length=64, description="this engine's name")
    epoch: int | None = Field(None, ge=0, description="restart count (default: wall-clock seconds, rising across restarts)")
    device: str = Field("cpu", description="cpu or gpu:N")
    capacity_tokens: int = Field(32768, ge=16, description="KV tokens the engine's cache holds, all slots together")
    kv_memory_gib: float | None = Field(None, gt=0, description="size the KV pool to this many GiB instead of --capacity-tokens")
    kv_memory_fraction: float | None = Field(None, gt=0, le=1, description="size the KV pool to this share of the device's memory instead of --capacity-tokens")
    status_interval_s: float = Field(10.0, ge=0, description="seconds between status log lines (0: none)")
    max_slots: int = Field(16, ge=1, description="sequences held at once (sessions included)")
    step_token_budget: int = Field(512, ge=1, description="tokens computed per step (prefill chunks and decodes)")
    page_size: int = Field(16, ge=1, description="tokens per KV page")
    decode_window: int | None = Field(None, ge=1, description="most decode steps per host sync while no prompt waits "
                                      "(default 16 on a GPU, 8 on the CPU; at most the page size); a prompt that "
                                      "arrives mid-window joins at its end")
    wait_timeout_s: float = Field(60.0, gt=0, description="longest wait of an accepted request for a slot, seconds")
    drain_timeout_s: float = Field(5.0, ge=0, description="on shutdown, how long running requests may finish, seconds")
    no_prefix_cache: bool = Field(False, description="do not share cached pages of common prompt prefixes")
    launch_hold: bool = Field(False, description="launch the next decode window ahead as late as the GPU allows, so "
                              "a prompt that arrives meanwhile joins the next step (default: at once; on an H200 "
                              "the hold gained nothing measurable)")
    engine_cmd_address: str = Field(DEFAULT_ENGINE_CMD_ADDRESS, description="the gateway's engine-cmd ROUTER")
    engine_out_address: str = Field(DEFAULT_ENGINE_OUT_ADDRESS, description="the gateway's engine-out PULL")
    controller_address: str = Field(DEFAULT_CONTROLLER_ADDRESS, description="the controller's ROUTER")


class ServeSettings(BaseSettings):
    """`buttermilk serve`: how many engines and where (the rest is passed to each service)."""

    model_config = SettingsConfigDict(env_prefix="BUTTERMILK_", extra="ignore")

    engines: int = Field(1, ge=1, le=64, description="engine processes")
    device: str = Field("auto", description="auto (gpu if there is one, else cpu), cpu (engines share it), "
                        "gpu (one engine per GPU, round robin) or gpu:N (all on GPU N)")
    run_dir: str | None = Field(None, description="folder for the internal ipc sockets (default: a new temporary folder)")
