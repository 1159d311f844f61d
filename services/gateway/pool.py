"""The gateway's request pool: at most `max_active` requests run, the rest wait FIFO.

Pure bookkeeping with `now` (monotonic seconds) injected; no I/O. The service asks the pool
before it reserves capacity: `submit` admits or queues, `finish` frees a place and promotes the
queue head(s), `cancel` removes a queued request at once, and `expire` drops queued requests
that waited past `queue_timeout_s` (the service answers them `queue_timeout`).

Each request belongs to a client (its connection). A client runs at most `client_max_active`
requests and queues at most `client_max_queued`; a queued request whose client is at its cap
is passed over (it keeps its place) by later requests of other clients, so one client cannot
take every place. With the client caps at `max_active` and `max_queue` the order is strict FIFO.

`retry_after_ms` in `Overloaded` (queue full) estimates when a queue place frees: a place
frees when any active request finishes (the head is promoted) or when the head times out.
With an exponential moving average `D` of active durations, `max_active` requests finish
about every `D / max_active` seconds, so the hint is `min(D / max_active, head's remaining
queue time)`, clamped to [MIN_RETRY_AFTER_MS, queue_timeout_s]. Before any request has
finished, it is the head's remaining queue time (a place is certain to free by then), or
`queue_timeout_s` when nothing can queue (`max_queue=0`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.errors import BadRequest, Overloaded

MIN_RETRY_AFTER_MS = 50
DURATION_EWMA_WEIGHT = 0.2  # weight of the newest active duration in the moving average


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str


@dataclass(frozen=True, slots=True)
class Queued:
    request_id: str
    position: int  # 1 for the head of the queue
    deadline: float  # monotonic seconds; past it, `expire` drops the request


@dataclass(frozen=True, slots=True)
class PoolStats:
    active: int
    queued: int
    max_active: int
    max_queue: int
    num_admitted: int  # since start, promoted ones included
    num_rejected: int  # Overloaded because the queue was full
    num_expired: int  # dropped by `expire`
    mean_active_s: float | None  # moving average of active durations; None before any finish


class RequestPool:
    """Admission in FIFO order with a bounded queue, a queue timeout and per-client caps.

    Args:
        max_active (int): requests allowed to run at once (>= 1).
        max_queue (int): requests allowed to wait (>= 0); a full queue raises `Overloaded`.
        queue_timeout_s (float): longest wait in the queue, seconds (> 0).
        client_max_active (int | None): requests one client may run at once. Default: max_active.
        client_max_queued (int | None): requests one client may queue. Default: max_queue.
    """

    def __init__(
        self,
        max_active: int,
        max_queue: int,
        queue_timeout_s: float,
        *,
        client_max_active: int | None = None,
        client_max_queued: int | None = None,
    ):
        client_max_active = max_active if client_max_active is None else client_max_active
        client_max_queued = max_queue if client_max_queued is None else client_max_queued
        if max_active < 1 or max_queue < 0 or not 0 < queue_timeout_s < float("inf"):
            raise ValueError(
                f"need max_active >= 1, max_queue >= 0, 0 < queue_timeout_s < inf; got "
                f"{max_active}, {max_queue}, {queue_timeout_s}"
            )
        if client_max_active < 1 or client_max_queued < 0:
            raise ValueError(f"need client_max_active >= 1, client_max_queued >= 0; got "
                             f"{client_max_active}, {client_max_queued}")  # fmt: skip
        self.max_active = max_active
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.client_max_active = client_max_active
        self.client_max_queued = client_max_queued
        self._active: dict[str, tuple[float, bytes]] = {}  # request_id -> (started_at, client)
        self._queue: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # request_id -> (deadline, client)
        self._active_of: dict[bytes, int] = {}  # client -> requests running
        self._queued_of: dict[bytes, int] = {}  # client -> requests queued
        self._mean_active_s: float | None = None
        self._num_admitted = self._num_rejected = self._num_expired = 0

    def can_admit(self, client: bytes = b"") -> bool:
        """Whether `submit` would start a request of `client` at once.

        Queued requests are all blocked (no place, or their client is at its cap), so a
        request starts when a place is free and its own client is under its cap.
        """
        return len(self._active) < self.max_active and self._active_of.get(client, 0) < self.client_max_active

    def submit(self, request_id: str, now: float, client: bytes = b"") -> Admitted | Queued:
        """Admit a request of `client`, or queue it behind the waiting ones.

        Raises:
            BadRequest: the id is already active or queued.
            Overloaded: the queue is full, or the client's part of it is; `retry_after_ms` as
                in the module docstring.
        """
        if request_id in self._active or request_id in self._queue:
            raise BadRequest(f"request id {request_id!r} is already in use")
        if self.can_admit(client):
            self._start(request_id, now, client)
            return Admitted(request_id)
        if len(self._queue) >= self.max_queue:
            self._num_rejected += 1
            raise Overloaded(
                f"{len(self._active)} requests running and {len(self._queue)} queued",
                retry_after_ms=self.retry_after_ms(now),
            )
        if self._queued_of.get(client, 0) >= self.client_max_queued:
            self._num_rejected += 1
            raise Overloaded(
                f"this client has {self._active_of.get(client, 0)} requests running and "
                f"{self._queued_of.get(client, 0)} queued (client_max_active {self.client_max_active}, "
                f"client_max_queued {self.client_max_queued})",
                retry_after_ms=self.retry_after_ms(now),
            )
        deadline = now + self.queue_timeout_s
        self._queue[request_id] = (deadline, client)
        self._queued_of[client] = self._queued_of.get(client, 0) + 1
        return Queued(request_id, position=len(self._queue), deadline=deadline)

    def finish(self, request_id: str, now: float) -> list[str]:
        """End an active request (any reason) and promote waiting ones in FIFO order.

        Idempotent: an unknown id changes nothing; a queued id is cancelled instead.

        Returns:
            list[str]: request ids that became active now, in the order they had queued.
        """
        entry = self._active.pop(request_id, None)
        if entry is None:
            self.cancel(request_id)
            return []
        started_at, client = entry
        _count(self._active_of, client, -1)
        self._record_duration(now - started_at)
        promoted = []
        for queued, (_, queued_client) in list(self._queue.items()):
            if len(self._active) >= self.max_active:
                break
            if self._active_of.get(queued_client, 0) < self.client_max_active:
                self._unqueue(queued)
                self._start(queued, now, queued_client)
                promoted.append(queued)
        return promoted

    def cancel(self, request_id: str) -> bool:
        """Remove a queued request at once.

        Returns:
            bool: True if it was queued and is now gone. False if it is active (abort it on
                its engine, then call `finish`) or unknown.
        """
        return self._unqueue(request_id)

    def expire(self, now: float) -> list[str]:
        """Drop queued requests whose deadline is at or before `now`; returns them, oldest first."""
        expired = []
        # Every request waits the same timeout, so deadlines rise along the FIFO order.
        while self._queue and next(iter(self._queue.values()))[0] <= now:
            expired.append(next(iter(self._queue)))
            self._unqueue(expired[-1])
        self._num_expired += len(expired)
        return expired

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queue

    def stats(self) -> PoolStats:
        return PoolStats(
            active=len(self._active),
            queued=len(self._queue),
            max_active=self.max_active,
            max_queue=self.max_queue,
            num_admitted=self._num_admitted,
            num_rejected=self._num_rejected,
            num_expired=self._num_expired,
            mean_active_s=self._mean_active_s,
        )

    def _start(self, request_id: str, now: float, client: bytes) -> None:
        self._active[request_id] = (now, client)
        _count(self._active_of, client, +1)
        self._num_admitted += 1

    def _unqueue(self, request_id: str) -> bool:
        entry = self._queue.pop(request_id, None)
        if entry is not None:
            _count(self._queued_of, entry[1], -1)
        return entry is not None

    def _record_duration(self, duration_s: float) -> None:
        duration_s = max(0.0, duration_s)
        if self._mean_active_s is None:
            self._mean_active_s = duration_s
        else:
            w = DURATION_EWMA_WEIGHT
            self._mean_active_s = w * duration_s + (1 - w) * self._mean_active_s

    def retry_after_ms(self, now: float) -> int:
        estimates_s = []
        if self._queue:
            estimates_s.append(next(iter(self._queue.values()))[0] - now)
        if self._mean_active_s is not None:
            estimates_s.append(self._mean_active_s / self.max_active)
        return self.retry_ms(min(estimates_s) if estimates_s else self.queue_timeout_s)

    def retry_ms(self, estimate_s: float) -> int:
        """An estimate of the wait (seconds) as a `retry_after_ms`: clamped to [MIN_RETRY_AFTER_MS, queue_timeout_s]."""
        estimate_s = min(max(estimate_s, 0.0), self.queue_timeout_s)
        # Seconds become milliseconds only here, at the edge of the pool.
        return max(MIN_RETRY_AFTER_MS, round(estimate_s * 1000))


def _count(counts: dict[bytes, int], client: bytes, delta: int) -> None:
    """Add `delta` to a client's count; a count of 0 leaves no entry behind."""
    value = counts.get(client, 0) + delta
    if value:
        counts[client] = value
    else:
        counts.pop(client, None)
