"""Gateway request pool: strict FIFO, bounded queue, immediate queued cancel, queue timeout."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.pool import (
    MIN_RETRY_AFTER_MS,
    Admitted,
    RequestPool,
    Queued,
)
from shared.errors import BadRequest, ErrorCode, Overloaded


def test_fifo_order_of_starts_with_two_places_and_six_requests():
    pool = RequestPool(max_active=2, max_queue=10, queue_timeout_s=30.0)
    results = [pool.submit(f"r{i}", now=float(i)) for i in range(6)]
    assert results[:2] == [Admitted("r0"), Admitted("r1")]
    assert [(q.request_id, q.position) for q in results[2:]] == [
        ("r2", 1),
        ("r3", 2),
        ("r4", 3),
        ("r5", 4),
    ]
    started = ["r0", "r1"]
    # Finish in an order unrelated to the start order; starts must still follow submit order.
    for finished in ["r1", "r0", "r3", "r2", "r5", "r4"]:
        started += pool.finish(finished, now=10.0)
    assert started == [f"r{i}" for i in range(6)]
    assert pool.stats().active == 0 and pool.stats().num_admitted == 6


def test_one_finish_promotes_one_and_a_new_submit_queues_behind_waiters():
    pool = RequestPool(max_active=1, max_queue=3, queue_timeout_s=30.0)
    pool.submit("a", now=0)
    pool.submit("b", now=0)
    assert pool.finish("a", now=1) == ["b"]
    assert isinstance(pool.submit("c", now=1), Queued)  # b holds the place
    assert not pool.can_admit()


def test_queue_full_is_overloaded_with_retry_hint():
    pool = RequestPool(max_active=2, max_queue=2, queue_timeout_s=10.0)
    for i in range(4):
        pool.submit(f"r{i}", now=0.0)
    with pytest.raises(Overloaded) as info:
        pool.submit("r4", now=4.0)
    err = info.value
    assert err.code == ErrorCode.OVERLOADED and err.retryable
    assert err.retry_after_ms == 6000  # no history yet: the head's remaining queue time
    assert pool.finish("r0", now=4.0) == ["r2"]  # r0 ran 4 s: ~2 s until one of two finishes
    pool.submit("r5", now=4.0)
    with pytest.raises(Overloaded) as info:
        pool.submit("r6", now=4.0)
    assert info.value.retry_after_ms == 2000
    assert pool.stats().num_rejected == 2
    assert not pool.is_queued("r4") and not pool.is_active("r6")


def test_retry_hint_is_clamped():
    pool = RequestPool(max_active=1, max_queue=0, queue_timeout_s=5.0)
    pool.submit("a", now=0)
    with pytest.raises(Overloaded) as info:
        pool.submit("b", now=0)
    assert info.value.retry_after_ms == 5000  # nothing can queue and no history
    pool.finish("a", now=0.0)
    pool.submit("c", now=0)
    with pytest.raises(Overloaded) as info:
        pool.submit("d", now=0)
    assert info.value.retry_after_ms == MIN_RETRY_AFTER_MS


def test_queued_cancel_is_immediate_and_active_cancel_is_not():
    pool = RequestPool(max_active=1, max_queue=4, queue_timeout_s=30.0)
    for rid in ["a", "b", "c", "d"]:
        pool.submit(rid, now=0)
    assert pool.cancel("c") is True
    assert not pool.is_queued("c") and pool.stats().queued == 2
    assert pool.cancel("c") is False  # idempotent
    assert pool.cancel("a") is False and pool.is_active("a")  # engine must abort, then finish
    assert pool.finish("a", now=1) == ["b"]
    assert pool.finish("b", now=2) == ["d"]  # c never starts
    assert pool.cancel("unknown") is False


def test_queue_timeout_expiry_in_fifo_order():
    pool = RequestPool(max_active=1, max_queue=5, queue_timeout_s=5.0)
    pool.submit("a", now=0.0)
    queued = [pool.submit("b", now=0.0), pool.submit("c", now=1.0), pool.submit("d", now=3.0)]
    assert [q.deadline for q in queued] == [5.0, 6.0, 8.0]
    assert pool.expire(4.9) == []
    assert pool.expire(6.0) == ["b", "c"]
    assert pool.is_queued("d") and pool.is_active("a")
    assert pool.finish("a", now=7.0) == ["d"]
    assert pool.expire(100.0) == [] and pool.stats().num_expired == 2


def test_finish_is_idempotent_and_finishing_a_queued_request_cancels_it():
    pool = RequestPool(max_active=1, max_queue=2, queue_timeout_s=5.0)
    pool.submit("a", now=0)
    pool.submit("b", now=0)
    assert pool.finish("b", now=0) == [] and not pool.is_queued("b")
    assert pool.finish("a", now=1) == []
    assert pool.finish("a", now=1) == []
    assert pool.stats().active == 0


def test_duplicate_id_and_bad_config_are_rejected():
    pool = RequestPool(max_active=1, max_queue=1, queue_timeout_s=5.0)
    pool.submit("a", now=0)
    with pytest.raises(BadRequest):
        pool.submit("a", now=0)
    for args in [(0, 1, 1.0), (1, -1, 1.0), (1, 1, 0.0), (1, 1, float("nan"))]:
        with pytest.raises(ValueError):
            RequestPool(*args)


ops = st.lists(
    st.tuples(
        st.sampled_from(["submit", "finish", "cancel", "expire"]),
        st.integers(0, 30),
        st.floats(0, 3),
    ),
    max_size=80,
)


@given(max_active=st.integers(1, 3), max_queue=st.integers(0, 4), sequence=ops)
@settings(max_examples=300, deadline=None)
def test_random_sequences_keep_strict_fifo_and_bounds(max_active, max_queue, sequence):
    pool = RequestPool(max_active, max_queue, queue_timeout_s=4.0)
    now, waiting, started, next_id = 0.0, [], [], 0  # waiting: model of the queue
    for op, i, dt in sequence:
        now += dt
        if op == "submit":
            rid, next_id = f"r{next_id}", next_id + 1
            try:
                result = pool.submit(rid, now)
            except Overloaded as err:
                assert len(waiting) == max_queue and err.retry_after_ms >= MIN_RETRY_AFTER_MS
                continue
            if isinstance(result, Admitted):
                assert not waiting
                started.append(rid)
            else:
                waiting.append(rid)
                assert result.position == len(waiting)
        elif op == "finish" and started:
            promoted = pool.finish(started[i % len(started)], now)
            assert promoted == waiting[: len(promoted)]
            del waiting[: len(promoted)]
            started += promoted
        elif op == "cancel" and waiting:
            rid = waiting[i % len(waiting)]
            assert pool.cancel(rid)
            waiting.remove(rid)
        elif op == "expire":
            expired = pool.expire(now)
            assert expired == waiting[: len(expired)]
            del waiting[: len(expired)]
        stats = pool.stats()
        assert stats.active <= max_active and stats.queued == len(waiting) <= max_queue
        assert all(pool.is_queued(rid) for rid in waiting)
        assert not waiting or stats.active == max_active  # nobody waits behind a free place


# ---- per-client caps (issue 11 item 8) ----------------------------------------------------


def test_one_client_cannot_take_every_place():
    pool = RequestPool(3, 10, 30.0, client_max_active=1, client_max_queued=2)
    assert isinstance(pool.submit("a1", 0.0, b"A"), Admitted)
    assert isinstance(pool.submit("a2", 0.1, b"A"), Queued)  # places are free, but A is at its cap
    assert isinstance(pool.submit("b1", 0.2, b"B"), Admitted)  # passes A's waiting request
    assert pool.finish("a1", 1.0) == ["a2"]
    assert pool.stats().active == 2


def test_a_clients_queue_share_is_capped_with_a_reason():
    pool = RequestPool(1, 10, 30.0, client_max_active=1, client_max_queued=2)
    pool.submit("a1", 0.0, b"A")
    pool.submit("a2", 0.0, b"A")
    pool.submit("a3", 0.0, b"A")
    with pytest.raises(Overloaded, match="client_max_queued 2") as info:
        pool.submit("a4", 0.0, b"A")
    assert info.value.retry_after_ms >= MIN_RETRY_AFTER_MS
    assert isinstance(pool.submit("b1", 0.0, b"B"), Queued)  # other clients still queue


client_ops = st.lists(
    st.tuples(st.sampled_from(["submit", "finish", "cancel", "expire"]), st.integers(0, 30),
              st.floats(0, 3), st.sampled_from([b"A", b"B", b"C"])),
    max_size=80,
)  # fmt: skip


@given(cap=st.integers(1, 2), queued_cap=st.integers(0, 3), sequence=client_ops)
@settings(max_examples=300, deadline=None)
def test_random_sequences_with_clients_keep_caps_and_waste_no_place(cap, queued_cap, sequence):
    pool = RequestPool(3, 6, 4.0, client_max_active=cap, client_max_queued=queued_cap)
    owner, started, order, next_id, now = {}, [], [], 0, 0.0
    for op, i, dt, client in sequence:
        now += dt
        if op == "submit":
            rid, next_id = f"r{next_id}", next_id + 1
            owner[rid] = client
            try:
                if isinstance(pool.submit(rid, now, client), Admitted):
                    started.append(rid)
                    order.append(rid)
            except Overloaded:
                pass
        elif op == "finish" and started:
            promoted = pool.finish(started.pop(i % len(started)), now)
            started += promoted
            order += promoted
        elif op == "cancel":
            pool.cancel(f"r{i}")
        else:
            pool.expire(now)
        active = [r for r in started if pool.is_active(r)]
        queued = [r for r in owner if pool.is_queued(r)]
        per_client = {c: sum(owner[r] == c for r in active) for c in (b"A", b"B", b"C")}
        assert all(n <= cap for n in per_client.values())
        assert all(sum(owner[r] == c for r in queued) <= queued_cap for c in per_client)
        if len(active) < 3:  # a free place: every waiting request's client is at its cap
            assert all(per_client[owner[r]] == cap for r in queued)
    for client in (b"A", b"B", b"C"):  # each client's requests start in the order they came
        mine = [int(r[1:]) for r in order if owner[r] == client]
        assert mine == sorted(mine)
