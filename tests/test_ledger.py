"""Controller ledger: admission, accounting back to zero, and scoped expiry and engine death."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.controller.ledger import Ledger, Released
from shared.errors import BadRequest, ErrorCode, LeaseExpired, Overloaded

IDLE_S = 60.0


def make_ledger(*capacities: int) -> Ledger:
    ledger = Ledger(session_idle_ttl_s=IDLE_S, retry_after_ms=300)
    for i, capacity in enumerate(capacities):
        assert ledger.register_engine(f"e{i}", 0, capacity, bytes_per_token=64).is_empty
    return ledger


def usage(ledger: Ledger) -> dict[str, tuple[int, int, int]]:
    return {
        e.engine_id: (e.reserved_tokens, e.held_tokens, e.free_tokens)
        for e in ledger.stats().engines
    }


def assert_all_free(ledger: Ledger) -> None:
    ledger.check_invariants()
    for e in ledger.stats().engines:
        assert (e.reserved_tokens, e.held_tokens, e.free_tokens) == (0, 0, e.capacity_tokens)


# ---- admission --------------------------------------------------------------------------


def test_admits_when_it_fits_and_overloads_when_not():
    ledger = make_ledger(100)
    assert ledger.can_reserve(60)
    ledger.reserve("r1", 60, now=0.0)
    assert not ledger.can_reserve(41) and ledger.can_reserve(40)
    with pytest.raises(Overloaded) as info:
        ledger.reserve("r2", 41, now=0.0)
    assert info.value.retry_after_ms == 300 and info.value.retryable
    assert usage(ledger) == {"e0": (60, 0, 40)}
    ledger.check_invariants()


def test_never_fits_is_bad_request_not_overloaded():
    ledger = make_ledger(100, 50)
    with pytest.raises(BadRequest, match="largest engine holds 100"):
        ledger.reserve("r1", 101, now=0.0)
    assert not ledger.can_reserve(101)


def test_no_live_engine_is_overloaded():
    ledger = make_ledger()
    with pytest.raises(Overloaded):
        ledger.reserve("r1", 1, now=0.0)
    with pytest.raises(BadRequest):
        make_ledger(10).reserve("r1", 0, now=0.0)


def test_chooses_the_engine_with_most_free_tokens_and_honours_a_fitting_hint():
    ledger = make_ledger(100, 200, 200)
    assert ledger.reserve("a", 50, now=0).engine_id == "e1"  # tie e1/e2 → lowest id
    assert ledger.reserve("b", 50, now=0).engine_id == "e2"
    assert ledger.reserve("c", 10, now=0, engine_id="e0").engine_id == "e0"
    assert ledger.reserve("d", 95, now=0, engine_id="e0").engine_id in {"e1", "e2"}  # hint misfit


def test_reconcile_grows_liability_and_release_returns_to_zero():
    ledger = make_ledger(100)
    resv = ledger.reserve("r1", 30, now=0)
    assert ledger.reconcile(resv.resv_id, 20).liability_tokens == 30
    assert ledger.reconcile(resv.resv_id, 45).liability_tokens == 45
    assert usage(ledger)["e0"] == (45, 0, 55)
    assert ledger.release(resv.resv_id, now=1).request_id == "r1"
    assert ledger.release(resv.resv_id, now=1) is None  # idempotent
    assert ledger.reconcile(resv.resv_id, 50) is None
    assert_all_free(ledger)


# ---- leases -----------------------------------------------------------------------------


def test_lease_renew_and_expiry():
    ledger = make_ledger(100)
    lease = ledger.open_lease(10.0, now=0.0)
    assert lease.expires_at == 10.0
    assert ledger.renew(lease.lease_id, now=5.0).expires_at == 15.0
    assert ledger.expire(14.9).is_empty
    assert ledger.expire(15.0).lease_ids == [lease.lease_id]
    with pytest.raises(LeaseExpired):
        ledger.renew(lease.lease_id, now=15.0)
    with pytest.raises(LeaseExpired):
        ledger.reserve("r", 1, now=15.0, lease_id=lease.lease_id)
    with pytest.raises(LeaseExpired) as info:
        ledger.renew("nope", now=0)
    assert info.value.code == ErrorCode.LEASE_EXPIRED
    assert ledger.close_lease(lease.lease_id).is_empty  # idempotent


def test_expired_but_unswept_lease_cannot_reserve():
    ledger = make_ledger(100)
    lease = ledger.open_lease(1.0, now=0.0)
    with pytest.raises(LeaseExpired):
        ledger.reserve("r", 1, now=1.0, lease_id=lease.lease_id)


def test_expiry_releases_only_the_expired_leases_items():
    ledger = make_ledger(100, 100)
    short, long = ledger.open_lease(5.0, now=0), ledger.open_lease(50.0, now=0)
    a = ledger.reserve("a", 10, now=0, lease_id=short.lease_id, engine_id="e0")
    b = ledger.reserve("b", 10, now=0, lease_id=long.lease_id, engine_id="e0")
    c = ledger.reserve("c", 10, now=0, lease_id=short.lease_id, session_id="s1", engine_id="e1")
    ledger.release(c.resv_id, now=1, keep_session_tokens=25)
    d = ledger.reserve("d", 10, now=1)  # no lease
    released = ledger.expire(6.0)
    assert released.lease_ids == [short.lease_id]
    assert released.engines["e0"].request_ids == ["a"] and released.engines["e0"].resv_ids == [
        a.resv_id
    ]
    assert released.engines["e1"].session_ids == ["s1"]
    assert sorted(released.request_ids) == ["a"]
    assert (
        ledger.reservation(b.resv_id)
        and ledger.reservation(d.resv_id)
        and ledger.lease(long.lease_id)
    )
    assert ledger.session("s1") is None
    ledger.check_invariants()


def test_close_lease_releases_reservations_and_sessions():
    ledger = make_ledger(100)
    lease = ledger.open_lease(30, now=0)
    ledger.reserve("a", 10, now=0, lease_id=lease.lease_id)
    ledger.reserve("b", 10, now=0, lease_id=lease.lease_id, session_id="s")
    released = ledger.close_lease(lease.lease_id)
    assert sorted(released.request_ids) == ["a", "b"] and released.session_ids == ["s"]
    assert_all_free(ledger)
    assert ledger.stats().num_leases == 0


# ---- sessions ---------------------------------------------------------------------------


def test_session_keeps_tokens_between_turns_on_its_engine():
    ledger = make_ledger(100, 100)
    t1 = ledger.reserve("t1", 40, now=0, session_id="s")
    ledger.release(t1.resv_id, now=1, keep_session_tokens=30)
    assert usage(ledger)[t1.engine_id] == (0, 30, 70)
    other = "e1" if t1.engine_id == "e0" else "e0"
    t2 = ledger.reserve("t2", 20, now=2, session_id="s", engine_id=other)  # hint ignored
    assert t2.engine_id == t1.engine_id
    with pytest.raises(BadRequest, match="in flight"):
        ledger.reserve("t3", 5, now=2, session_id="s")
    assert not ledger.can_reserve(5, session_id="s")
    ledger.release(t2.resv_id, now=3, keep_session_tokens=55)
    assert usage(ledger)[t1.engine_id] == (0, 55, 45)
    with pytest.raises(BadRequest, match="would need"):
        ledger.reserve("t4", 46, now=4, session_id="s")  # 55 + 46 > 100 on its own engine
    assert ledger.close_session("s").session_ids == ["s"]
    assert ledger.close_session("s").is_empty
    assert_all_free(ledger)


def test_session_turn_that_keeps_nothing_ends_the_session():
    ledger = make_ledger(100)
    t1 = ledger.reserve("t1", 40, now=0, session_id="s")
    ledger.release(t1.resv_id, now=1)
    assert ledger.session("s") is None
    assert_all_free(ledger)


def test_session_belongs_to_its_lease():
    ledger = make_ledger(100)
    lease = ledger.open_lease(30, now=0)
    t1 = ledger.reserve("t1", 10, now=0, session_id="s", lease_id=lease.lease_id)
    ledger.release(t1.resv_id, now=0, keep_session_tokens=10)
    with pytest.raises(BadRequest, match="another lease"):
        ledger.reserve("t2", 10, now=0, session_id="s")


def test_idle_session_expires_but_not_while_a_turn_is_in_flight():
    ledger = make_ledger(100)
    t1 = ledger.reserve("t1", 10, now=0, session_id="s")
    assert ledger.expire(IDLE_S * 10).is_empty  # turn in flight
    ledger.release(t1.resv_id, now=100.0, keep_session_tokens=10)
    assert ledger.expire(100.0 + IDLE_S - 0.1).is_empty
    assert ledger.expire(100.0 + IDLE_S).session_ids == ["s"]
    assert_all_free(ledger)


def test_close_session_aborts_its_turn_in_flight():
    ledger = make_ledger(100)
    t1 = ledger.reserve("t1", 10, now=0, session_id="s")
    released = ledger.close_session("s")
    assert released.request_ids == ["t1"] and released.session_ids == ["s"]
    assert ledger.release(t1.resv_id, now=1, keep_session_tokens=10) is None
    assert_all_free(ledger)


# ---- engines ----------------------------------------------------------------------------


def test_engine_death_drops_only_that_engine_and_epoch():
    ledger = make_ledger(100, 100)
    ledger.register_engine("e1", 1, 100, 64)  # e1 restarted: epoch 0 is history
    a = ledger.reserve("a", 10, now=0, engine_id="e0")
    b = ledger.reserve("b", 10, now=0, engine_id="e1", session_id="s")
    assert ledger.engine_dead("e0", epoch=7).request_ids == ["a"]  # newer epoch reported dead
    assert ledger.engine_dead("e1", epoch=0).is_empty  # a late report changes nothing
    assert ledger.reservation(b.resv_id) and ledger.session("s")
    assert ledger.reservation(a.resv_id) is None
    assert [e.engine_id for e in ledger.stats().engines] == ["e1"]
    assert ledger.engine_dead("e0", epoch=7).is_empty  # idempotent
    with pytest.raises(BadRequest, match="stale"):
        ledger.register_engine("e0", 7, 100, 64)
    assert ledger.register_engine("e0", 8, 100, 64).is_empty
    ledger.check_invariants()


def test_new_epoch_drops_old_epoch_state_and_repeat_hello_keeps_it():
    ledger = make_ledger(100)
    ledger.reserve("a", 10, now=0, session_id="s")
    assert ledger.register_engine("e0", 0, 120, 64).is_empty  # same epoch: geometry update
    assert usage(ledger)["e0"] == (10, 0, 110)
    released = ledger.register_engine("e0", 1, 100, 64)
    assert released.engines["e0"].epoch == 0
    assert released.request_ids == ["a"] and released.session_ids == ["s"]
    assert_all_free(ledger)
    with pytest.raises(BadRequest):
        ledger.register_engine("e0", 0, 100, 64)


# ---- slots, eviction, owners (issue 11 items 1, 6, 8) -------------------------------------


def slotted(slots: int, capacity: int = 100) -> Ledger:
    ledger = Ledger(session_idle_ttl_s=IDLE_S, retry_after_ms=300)
    ledger.register_engine("e0", 0, capacity, 64, max_slots=slots)
    return ledger


def idle_session(ledger: Ledger, session_id: str, now: float, tokens: int = 10) -> None:
    resv = ledger.reserve(f"t-{session_id}", tokens, now=now, session_id=session_id, new_session=True)
    ledger.release(resv.resv_id, now=now, keep_session_tokens=tokens)


def test_admission_counts_slots_as_well_as_tokens():
    ledger = slotted(2)
    ledger.reserve("a", 10, now=0)
    idle_session(ledger, "s", now=0)
    assert ledger.stats().engines[0].reserved_slots == 2
    assert not ledger.can_reserve(1)  # 80 tokens free, no slot
    with pytest.raises(Overloaded, match="free slot"):
        ledger.reserve("b", 1, now=0)
    turn = ledger.reserve("t2", 5, now=0, session_id="s", new_session=False)  # uses the session's slot
    assert ledger.stats().engines[0].reserved_slots == 2
    ledger.release(turn.resv_id, now=0, keep_session_tokens=15)
    ledger.close_session("s")
    assert ledger.stats().engines[0].reserved_slots == 1
    ledger.check_invariants()


def test_idle_sessions_are_evicted_oldest_first_and_only_as_needed():
    # The case: 4 slots, 4 idle sessions, one more request.
    ledger = slotted(4)
    for i in range(4):
        idle_session(ledger, f"s{i}", now=float(i))
    assert ledger.make_room(9, now=10).session_ids == ["s0"]
    ledger.reserve("r", 9, now=10)
    assert [ledger.session(f"s{i}") is None for i in range(4)] == [True, False, False, False]
    ledger.check_invariants()


def test_eviction_for_tokens_spares_busy_and_own_sessions_and_changes_nothing_in_vain():
    ledger = slotted(8, capacity=100)
    idle_session(ledger, "old", now=0, tokens=30)
    idle_session(ledger, "mine", now=1, tokens=30)
    ledger.reserve("busy-turn", 10, now=2, session_id="busy", new_session=True)  # 30 tokens free now
    assert ledger.make_room(20, now=3).is_empty  # fits already
    assert ledger.make_room(95, now=3).is_empty  # 90 at most even after evicting both: evict none
    assert ledger.session("old") and ledger.session("mine")
    released = ledger.make_room(50, now=3, session_id="mine", new_session=False)
    assert released.session_ids == ["old"]  # the turn's own session and the busy one stay
    assert ledger.session("mine") and ledger.session("busy")
    ledger.reserve("turn", 50, now=3, session_id="mine", new_session=False)
    ledger.check_invariants()


def test_drop_gateway_releases_only_that_instances_items():
    ledger = make_ledger(100)
    mine, theirs = ledger.open_lease(30, now=0, gateway_id="g1"), ledger.open_lease(30, now=0, gateway_id="g2")
    a = ledger.reserve("a", 10, now=0, gateway_id="g1")
    ledger.reserve("b", 10, now=0, gateway_id="g1", session_id="s1", lease_id=mine.lease_id)
    c = ledger.reserve("c", 10, now=0, gateway_id="g2")
    idle_session(ledger, "s2", now=0)  # made without an owner: not g1's
    released = ledger.drop_gateway("g1")
    assert sorted(released.request_ids) == ["a", "b"] and released.session_ids == ["s1"]
    assert released.lease_ids == [mine.lease_id]
    assert ledger.reservation(a.resv_id) is None and ledger.reservation(c.resv_id)
    assert ledger.lease(theirs.lease_id) and ledger.session("s2")
    ledger.check_invariants()


def test_a_silent_gateway_loses_its_items_after_the_timeout():
    ledger = Ledger(gateway_timeout_s=5.0)
    ledger.register_engine("e0", 0, 100, 64, now=0.0)
    ledger.gateway_seen("g1", now=0.0)
    ledger.reserve("a", 10, now=0.0, gateway_id="g1")
    ledger.gateway_seen("g1", now=3.0)
    ledger.register_engine("e0", 0, 100, 64, now=7.0)  # the engine stays live
    assert ledger.expire(7.9).is_empty
    assert ledger.expire(8.0).request_ids == ["a"]
    assert_all_free(ledger)


def test_lease_count_is_capped():
    ledger = Ledger(max_leases=2)
    ledger.open_lease(10, now=0)
    lease = ledger.open_lease(10, now=0)
    with pytest.raises(Overloaded, match="max_leases"):
        ledger.open_lease(10, now=0)
    ledger.close_lease(lease.lease_id)
    ledger.open_lease(10, now=0)


# ---- randomized operation sequences -----------------------------------------------------

ENGINES = ["e0", "e1", "e2"]


class LedgerMachine(RuleBasedStateMachine):
    """Random mixes of every verb; accounting must stay exact and end at zero."""

    def __init__(self):
        super().__init__()
        self.ledger = Ledger(session_idle_ttl_s=IDLE_S, retry_after_ms=100)
        self.now = 0.0
        self.epochs = {e: 0 for e in ENGINES}
        self.leases: list[str] = []
        self.resvs: list[str] = []
        self.num_requests = 0
        for engine_id in ENGINES:
            self.ledger.register_engine(engine_id, 0, 64, 16, max_slots=3)

    def live_resvs(self):
        return [r for r in map(self.ledger.reservation, self.resvs) if r is not None]

    def check_released(self, released: Released, dropped_resvs, dropped_sessions) -> None:
        assert sorted(released.request_ids) == sorted(r.request_id for r in dropped_resvs)
        assert sorted(released.session_ids) == sorted(dropped_sessions)

    @rule(dt=st.floats(0.0, 20.0))
    def advance_and_expire(self, dt):
        self.now += dt
        expired = {
            l for l in self.leases if (x := self.ledger.lease(l)) and x.expires_at <= self.now
        }
        before = self.live_resvs()
        sessions = [s for s in map(self.ledger.session, self.all_sessions()) if s]
        dropped_sessions = [
            s.session_id for s in sessions
            if s.lease_id in expired or (s.resv_id is None and s.idle_expires_at <= self.now)
        ]  # fmt: skip
        released = self.ledger.expire(self.now)
        assert set(released.lease_ids) == expired
        self.check_released(
            released, [r for r in before if r.lease_id in expired], dropped_sessions
        )

    @rule(ttl=st.floats(1.0, 30.0))
    def open_lease(self, ttl):
        self.leases.append(self.ledger.open_lease(ttl, self.now).lease_id)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def renew(self, i):
        lease_id = self.leases[i % len(self.leases)]
        lease = self.ledger.lease(lease_id)
        if lease is not None and lease.expires_at > self.now:
            assert self.ledger.renew(lease_id, self.now).expires_at == self.now + lease.ttl_s
        else:
            with pytest.raises(LeaseExpired):
                self.ledger.renew(lease_id, self.now)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def close_lease(self, i):
        lease_id = self.leases[i % len(self.leases)]
        before = [r for r in self.live_resvs() if r.lease_id == lease_id]
        released = self.ledger.close_lease(lease_id)
        assert self.ledger.lease(lease_id) is None
        assert sorted(released.request_ids) == sorted(r.request_id for r in before)

    def all_sessions(self):
        return [f"s{i}" for i in range(4)]

    @rule(
        tokens=st.integers(1, 80),
        lease_i=st.none() | st.integers(0, 100),
        session=st.none() | st.sampled_from(["s0", "s1", "s2", "s3"]),
        hint=st.none() | st.sampled_from(ENGINES),
        gateway=st.sampled_from([None, "g0", "g1"]),
    )
    def reserve(self, tokens, lease_i, session, hint, gateway):
        lease_id = (
            self.leases[lease_i % len(self.leases)] if lease_i is not None and self.leases else None
        )
        self.num_requests += 1
        could = self.ledger.can_reserve(tokens, engine_id=hint, session_id=session)
        try:
            resv = self.ledger.reserve(
                f"r{self.num_requests}", tokens, now=self.now, lease_id=lease_id,
                session_id=session, engine_id=hint, gateway_id=gateway,
            )  # fmt: skip
        except (Overloaded, BadRequest, LeaseExpired):
            # can_reserve ignores leases, so only a lease problem may disagree with it: the
            # request's own lease, or a session held under some lease.
            held = self.ledger.session(session) if session else None
            assert not could or lease_id is not None or (held is not None and held.lease_id is not None)
            return
        assert could
        self.resvs.append(resv.resv_id)

    @rule(tokens=st.integers(1, 80), session=st.none() | st.sampled_from(["s0", "s1", "s2", "s3"]))
    def make_room(self, tokens, session):
        idle = {s.session_id for s in map(self.ledger.session, self.all_sessions()) if s and s.resv_id is None}
        released = self.ledger.make_room(tokens, now=self.now, session_id=session)
        assert set(released.session_ids) <= idle - {session} and not released.request_ids
        if not released.is_empty:
            assert self.ledger.can_reserve(tokens, session_id=session)

    @rule(gateway=st.sampled_from(["g0", "g1"]))
    def gateway_dies(self, gateway):
        mine = {r.request_id for r in self.live_resvs() if r.gateway_id == gateway}
        released = self.ledger.drop_gateway(gateway)
        assert mine <= set(released.request_ids)
        assert not [r for r in self.live_resvs() if r.gateway_id == gateway]

    @precondition(lambda self: self.resvs)
    @rule(i=st.integers(0, 1000), observed=st.integers(0, 100))
    def reconcile(self, i, observed):
        self.ledger.reconcile(self.resvs[i % len(self.resvs)], observed)

    @precondition(lambda self: self.resvs)
    @rule(i=st.integers(0, 1000), keep=st.none() | st.integers(0, 40))
    def release(self, i, keep):
        self.ledger.release(self.resvs[i % len(self.resvs)], now=self.now, keep_session_tokens=keep)

    @rule(session=st.sampled_from(["s0", "s1", "s2", "s3"]))
    def close_session(self, session):
        self.ledger.close_session(session)
        assert self.ledger.session(session) is None

    @rule(engine_id=st.sampled_from(ENGINES), restart=st.booleans())
    def engine_dies(self, engine_id, restart):
        epoch = self.epochs[engine_id]
        others = [r for r in self.live_resvs() if r.engine_id != engine_id]
        mine = [r for r in self.live_resvs() if r.engine_id == engine_id and r.epoch == epoch]
        released = self.ledger.engine_dead(engine_id, epoch)
        assert sorted(released.request_ids) == sorted(r.request_id for r in mine)
        assert all(self.ledger.reservation(r.resv_id) == r for r in others)
        if restart:
            self.epochs[engine_id] += 1
            assert self.ledger.register_engine(engine_id, self.epochs[engine_id], 64, 16, max_slots=3).is_empty

    @invariant()
    def accounting_is_exact(self):
        self.ledger.check_invariants()
        for e in self.ledger.stats().engines:
            assert e.reserved_tokens >= 0 and e.held_tokens >= 0 and e.free_tokens >= 0

    def teardown(self):
        for resv_id in self.resvs:
            self.ledger.release(resv_id, now=self.now, keep_session_tokens=None)
        for lease_id in self.leases:
            self.ledger.close_lease(lease_id)
        for session in self.all_sessions():
            self.ledger.close_session(session)
        assert_all_free(self.ledger)
        stats = self.ledger.stats()
        assert (stats.num_reservations, stats.num_leases, stats.num_sessions) == (0, 0, 0)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
