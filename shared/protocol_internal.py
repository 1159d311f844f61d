"""Wire messages between buttermilk processes (engine, gateway, controller, supervisor).

Clients never send these; the gateway's client socket rejects them. Same envelope and rules
as the client messages (see `shared/protocol.py` and docs/protocol.md section 15).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from shared.protocol_base import (
    DEFAULT_MAX_TOKENS,
    MAX_LIST_ITEMS,
    Code,
    Count,
    DeviceText,
    Epoch,
    ErrorText,
    Id,
    Ids,
    MaxTokens,
    MessageType,
    Pid,
    PrefixCacheUsage,
    PromptTokens,
    Reason,
    Seed,
    Struct,
    Temperature,
    TokenId,
    TopK,
    TopP,
    Usage,
    WireMessage,
)

Positive = Annotated[int, Field(ge=1)]
GATEWAY_ROUTING_ID = b"gateway"  # ZeroMQ routing id of the gateway's DEALER to the controller
HEARTBEAT_S = 0.5  # engines send `heartbeat`, the gateway `gateway_heartbeat`, this often, seconds
DEFAULT_ENGINE_TIMEOUT_S = 5.0  # an engine silent this long is dead (ten missed heartbeats), seconds


def is_silent(last_seen: float, now: float, timeout_s: float) -> bool:
    """The one liveness rule: a peer heard last at `last_seen` is dead at `now` after `timeout_s`.

    The gateway (`EngineTable.expire`) and the controller (`Ledger.expire`) both apply it to
    engines, with the same `--engine-timeout-s`; whichever notices first sends `engine_dead`
    to the other, which then follows without judging again.

    Args:
        last_seen (float), now (float): monotonic seconds.
        timeout_s (float): silence allowed, seconds.
    """
    return now - last_seen >= timeout_s


class Geometry(Struct):
    slots: Positive  # sequences the engine can hold at once (sessions included)
    capacity_tokens: Positive  # KV tokens the engine's cache can hold, all slots together
    bytes_per_token: Count  # all layers, K and V, metadata included
    kv_cache: Annotated[str, Field(min_length=1, max_length=32)]  # raw, affine8, aura4v2, ...
    max_context: Positive  # tokens per sequence
    window_tokens: Positive | None = None  # sliding window on every layer: most KV tokens kept
    state_bytes_per_slot: Count = 0  # recurrent state of one slot (hybrid models), allocated for every slot


class Hello(WireMessage):
    TYPE = MessageType.HELLO
    engine_id: Id
    epoch: Epoch  # +1 on every restart of this engine
    geometry: Geometry
    model: Annotated[str, Field(max_length=1024)] | None = None
    pid: Pid | None = None  # the engine's OS process id (operators, tests)
    device: DeviceText | None = None  # where it runs: "cpu", "gpu:0 (NVIDIA H200, <PCI bus id>)"
    cuda_visible_devices: DeviceText | None = None  # its CUDA_VISIBLE_DEVICES; None: unset


class SamplingParams(Struct):
    """How to pick one request's tokens: `engine_generate.sampling`, and the engine's own record.

    The one definition for the wire and the engine (`services/engine/sampling.py` samples with it).
    """

    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS  # tokens to generate at most; the gateway sends it capped
    temperature: Temperature = 0.0  # below 1e-5: greedy (argmax)
    top_p: TopP = 1.0  # nucleus mass in (0, 1]; 1 disables it
    top_k: TopK | None = None  # keep the k most likely tokens; None (or k >= vocabulary) disables it
    seed: Seed | None = None  # the request's PRNG seed; None: the engine draws one


class EngineGenerate(WireMessage):
    """Run a request on the engine chosen by the controller (stop strings stay at the gateway)."""

    TYPE = MessageType.ENGINE_GENERATE
    id: Id
    resv_id: Id
    epoch: Epoch  # the engine refuses it (engine_failed) when this is not its own epoch
    token_ids: PromptTokens
    sampling: SamplingParams
    session_id: Id | None = None  # keep the KV after finishing; positions continue
    # A continued turn: the session's history as the client was told it (prompts + reported
    # completions), tokens. The engine first cuts what it holds beyond that (e.g. tokens
    # generated after a stop string matched, before the abort landed).
    session_tokens: Count | None = None


class TokenChunk(Struct):
    id: Id
    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LIST_ITEMS)]
    index: Count  # position of token_ids[0] in the completion


class EngineTokens(WireMessage):
    TYPE = MessageType.ENGINE_TOKENS
    engine_id: Id
    epoch: Epoch
    chunks: Annotated[list[TokenChunk], Field(max_length=MAX_LIST_ITEMS)]


class EngineFinished(WireMessage):
    """A request ended on the engine; its `engine_tokens` all came before this."""

    TYPE = MessageType.ENGINE_FINISHED
    engine_id: Id
    epoch: Epoch
    id: Id
    reason: Reason
    usage: Usage
    tokens_held: Count | None = None  # the session's KV kept after this request; None: none kept
    code: Code | None = None  # when reason=error: the error's stable code
    message: ErrorText | None = None  # when reason=error
    refused: bool = False  # reason=error before the request ran: the session is unchanged


class EngineAbort(WireMessage):
    TYPE = MessageType.ENGINE_ABORT
    ids: Ids


class EngineSessionClose(WireMessage):
    TYPE = MessageType.ENGINE_SESSION_CLOSE
    session_ids: Ids


class Heartbeat(WireMessage):
    TYPE = MessageType.HEARTBEAT
    engine_id: Id
    epoch: Epoch
    tokens_used: Count = 0  # KV tokens held, requests and sessions together
    used_slots: Count = 0  # slots held, sessions between turns included
    capacity_tokens: Count = 0  # KV tokens of its cache (0: not reported)
    prefix_cache: PrefixCacheUsage | None = None  # None: the engine has no prefix cache


class Reserve(WireMessage):
    TYPE = MessageType.RESERVE
    request_id: Id
    tokens: Positive  # prompt (a session turn: its new tokens) + capped max_tokens
    lease_id: Id | None = None
    session_id: Id | None = None
    new_session: bool | None = None  # True: must be new; False: must be live; None: either
    engine_id: Id | None = None  # a hint; a session is always placed on its own engine


class Reserved(WireMessage):
    TYPE = MessageType.RESERVED
    request_id: Id
    resv_id: Id
    engine_id: Id
    epoch: Epoch


class Reconcile(WireMessage):
    TYPE = MessageType.RECONCILE
    resv_id: Id
    tokens_observed: Count  # KV tokens this request added on its engine so far


class Release(WireMessage):
    TYPE = MessageType.RELEASE
    resv_id: Id
    keep_session_tokens: Count | None = None  # the session's whole KV after this turn


class EngineDead(WireMessage):
    TYPE = MessageType.ENGINE_DEAD
    engine_id: Id
    epoch: Epoch


class GatewayHeartbeat(WireMessage):
    """The gateway instance speaking on this connection; sent first and every 0.5 s.

    Reservations, leases and sessions belong to the instance that made them; they are
    released when another instance takes over the connection or this one falls silent.
    """

    TYPE = MessageType.GATEWAY_HEARTBEAT
    gateway_id: Id


class Revoked(WireMessage):
    """The controller dropped these requests and sessions; end them with `error {code}`."""

    TYPE = MessageType.REVOKED
    code: Code  # lease_expired, engine_failed, or cancelled (lease or session closed, idle)
    request_ids: Ids = []
    session_ids: Ids = []
    lease_ids: Ids = []  # leases that ended: fail their queued requests too
