"""Tokenizer jobs waiting for the gateway's one tokenizer thread, shared fairly across connections. Pure.

The thread takes one job at a time, by deficit round robin over the connections with jobs waiting
(each connection's own jobs in arrival order; Shreedhar and Varghese, "Efficient Fair Queuing Using
Deficit Round Robin", SIGCOMM 1995). A turn adds `QUANTUM` characters to the connection's credit,
and its next job goes once the credit covers the job's cost: its characters, and at least one
quantum (below that a prompt's time is mostly fixed costs). So prompts up to a quantum go round
robin, one a turn, and a connection's prompt waits behind the job on the thread and at most one
waiting job of each other connection; a prompt of n quanta waits about n turns (credit left from
the connection's earlier turns counts), so one connection's megabyte prompts wait behind others'
short ones instead of taking the thread turn for turn. Credit is kept while the connection has
jobs waiting (a cancelled one's turns count for the next), and forfeited when none is left.

When the bound on outstanding jobs is reached (`GatewayCore` sets it to the pool's places), a
newcomer takes the place of the newest waiting job of the connection holding the most, as long
as that connection then still holds at least as many as the newcomer's: a flood from a few
connections cannot lock the others out (drop from the longest queue, as in FQ-CoDel, RFC 8290
section 4.1.2).

A refused newcomer is told when a place frees: when the job on the thread is done, estimated
from its characters and the thread's rate (characters a second over the last long prompts; a
prior until one is done).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from .control import ToTokenizer

RATE_MIN_CHARS = 65_536  # shorter jobs, their time mostly fixed costs, do not move the rate
RATE_WEIGHT = 0.3  # a new long job's weight in the rate (an exponential moving average)
PRIOR_CHARS_PER_S = 2e6  # until a long job is measured: the default model's tokenizer, one core of a 2-core host
QUANTUM = RATE_MIN_CHARS  # characters of credit a turn, and the least a job costs


class TokenizerQueue:
    """Jobs waiting for the tokenizer thread, per connection, and the one job on the thread.

    `len()` counts both: the jobs outstanding. Identities are ROUTER identities (bytes).
    """

    def __init__(self) -> None:
        self._waiting: OrderedDict[bytes, deque[ToTokenizer]] = OrderedDict()  # turn order: first goes next
        self._credit: dict[bytes, int] = {}  # characters of credit, per connection with jobs waiting
        self._owner: dict[str, bytes] = {}  # request id -> connection, for every job outstanding
        self._chars: dict[str, int] = {}  # request id -> its prompt's characters, for every job waiting
        self._on_thread: str | None = None  # request id of the job the thread has
        self._thread_live = False  # its request has not ended (an ended one counts for no connection)
        self._thread_chars, self._thread_since = 0, 0.0  # its size and when it went to the thread (s)
        self.chars_per_s = PRIOR_CHARS_PER_S  # the thread's rate
        self._measured = False  # a long job has set the rate (the prior no longer counts)

    def __len__(self) -> int:
        return len(self._owner)

    def held_by(self, identity: bytes) -> int:
        """Jobs the connection has outstanding (waiting or on the thread)."""
        waiting = self._waiting.get(identity)
        on_thread = self._thread_live and self._owner[self._on_thread] == identity
        return (len(waiting) if waiting else 0) + on_thread

    def add(self, identity: bytes, job: ToTokenizer) -> None:
        """Queue a job behind the connection's earlier ones. Raises ValueError for a request id already here."""
        if job.request_id in self._owner:
            raise ValueError(f"request {job.request_id!r} already has a tokenizer job")
        self._owner[job.request_id] = identity
        self._chars[job.request_id] = job.msg.prompt_chars  # counted once (messages: a sum over them)
        self._waiting.setdefault(identity, deque()).append(job)

    def next(self, now: float) -> ToTokenizer | None:
        """The job to hand the thread at `now` (seconds), or None while it has one (or none waits); deficit round
        robin (module docstring), one job a turn at most."""
        if self._on_thread is not None or not self._waiting:
            return None
        while True:  # ends: every turn adds a quantum, and a job costs finitely many
            identity, jobs = next(iter(self._waiting.items()))
            self._waiting.move_to_end(identity)  # its turn ends, whatever it takes
            credit = self._credit[identity] = self._credit.get(identity, 0) + QUANTUM
            if credit >= max(self._chars[jobs[0].request_id], QUANTUM):
                break
        job = jobs.popleft()
        chars = self._chars.pop(job.request_id)
        self._credit[identity] -= max(chars, QUANTUM)
        if not jobs:
            self._forget(identity)
        self._on_thread, self._thread_live = job.request_id, True
        self._thread_chars, self._thread_since = chars, now
        return job

    def done(self, request_id: str, now: float, *, encoded: bool) -> None:
        """The thread is back at `now` with `request_id`'s job; `encoded`: its prompt went through the encoder (not
        skipped because its request had ended, nor refused before encoding), so its time counts in the rate.

        Raises:
            KeyError: `request_id` is not the job on the thread.
        """
        if request_id != self._on_thread:
            raise KeyError(f"request {request_id!r} is not the job on the tokenizer thread")
        elapsed = now - self._thread_since
        if encoded and self._thread_chars >= RATE_MIN_CHARS and elapsed > 0:
            rate = self._thread_chars / elapsed
            self.chars_per_s = RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self.chars_per_s if self._measured else rate
            self._measured = True
        self._on_thread, self._thread_live = None, False
        del self._owner[request_id]

    def free_in_s(self, now: float) -> float:
        """Seconds from `now` until the job on the thread is done and its place frees (0 when overdue or none)."""
        if self._on_thread is None:
            return 0.0
        return max(0.0, self._thread_chars / self.chars_per_s - (now - self._thread_since))

    def remove(self, request_id: str) -> bool:
        """Drop a waiting job whose request ended; False when it is on the thread (it still counts in `len()`
        until it is back, and no longer for its connection) or not here."""
        if request_id == self._on_thread:
            self._thread_live = False
            return False
        identity = self._owner.get(request_id)
        if identity is None:
            return False
        jobs = self._waiting[identity]
        jobs.remove(next(j for j in jobs if j.request_id == request_id))
        if not jobs:
            self._forget(identity)
        del self._owner[request_id], self._chars[request_id]
        return True

    def _forget(self, identity: bytes) -> None:
        """A connection with no job left waiting leaves the round, and its credit with it."""
        del self._waiting[identity]
        self._credit.pop(identity, None)

    def victim_for(self, identity: bytes) -> str | None:
        """The request id whose waiting job should make way for a new one of `identity`, or None.

        The newest waiting job of the connection holding the most, when it holds at least two more than
        `identity` (so that after the swap it still holds no fewer than `identity`).
        """
        own = self.held_by(identity)
        best = max(self._waiting, key=self.held_by, default=None)
        if best is None or best == identity or self.held_by(best) < own + 2:
            return None
        return self._waiting[best][-1].request_id
