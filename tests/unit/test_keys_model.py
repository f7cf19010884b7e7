"""Idempotency keys against a small model: random keyed puts, deletes, flushes,
expiry (deleting and moving to another tube), discards, plain puts and time
passing, applied as records to the real State. After every step the state's
answer for every key (`keys.find`) equals the model's, `State.check()` holds,
a duplicate put record is refused (a replay decides as the primary did), and
at the end a snapshot and a replay of the same records give the same keys.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hs

from smallstalk.core import records as r
from smallstalk.core.model import NS, READY, RESERVED, StateError
from smallstalk.core.state import State
from smallstalk.storage import snapshot_codec

KEYS = ("a", "b", "c")
TUBES = ("t1", "t2")


class Model:
    """Keys as lists and dicts, written apart from core/keys.py."""

    def __init__(self) -> None:
        self.live: dict[tuple[str, str], int] = {}
        self.job_key: dict[int, tuple[str, str]] = {}
        self.gone: dict[str, list[list]] = {t: [] for t in TUBES}  # [key, jid, until]
        self.params: dict[str, tuple[int, int]] = {}
        self.dropped = {t: 0 for t in TUBES}

    def find(self, tube: str, key: str, now: int) -> int | None:
        if (tube, key) in self.live:
            return self.live[tube, key]
        for k, jid, until in self.gone[tube]:
            if k == key and now < until:
                return jid
        return None

    def _prune(self, tube: str, now: int) -> None:
        gone = self.gone[tube]
        while gone and gone[0][2] <= now:
            gone.pop(0)
        while len(gone) > self.params[tube][1]:
            gone.pop(0)
            self.dropped[tube] += 1

    def put(self, tube: str, key: str, jid: int, window: int, keys_max: int, now: int) -> None:
        self.gone[tube] = [g for g in self.gone[tube] if g[0] != key]
        self.params[tube] = (window, keys_max)
        self.live[tube, key] = jid
        self.job_key[jid] = (tube, key)
        self._prune(tube, now)

    def remove(self, jid: int, now: int) -> None:
        held = self.job_key.pop(jid, None)
        if held is None:
            return
        tube, key = held
        del self.live[held]
        if self.params[tube][0]:
            self.gone[tube].append([key, jid, now + self.params[tube][0]])
        self._prune(tube, now)


OPS = hs.lists(hs.tuples(
    hs.sampled_from(["put", "put", "put", "plain", "delete", "flush", "expire", "move",
                     "discard", "reserve", "wait"]),
    hs.integers(0, 2), hs.integers(0, 1), hs.integers(0, 3), hs.integers(0, 3),
), max_size=60)


@given(OPS)
@settings(max_examples=300, deadline=None)
def test_keys_match_the_model(ops) -> None:
    st, m = State(), Model()
    recs: list = []
    seq, now, next_id = 0, NS, 1

    def log(cls, *fields) -> None:
        nonlocal seq
        seq += 1
        rec = cls(seq, now, *fields)
        st.apply(rec)
        recs.append(rec)

    log(r.Restart)
    for op, ki, ti, a, b in ops:
        key, tube = KEYS[ki], TUBES[ti]
        ids = sorted(st.jobs)
        pick = ids[a % len(ids)] if ids else None
        if op == "put":
            window, keys_max = (0, 3, 10, 30)[a], (0, 1, 2, 5)[b]
            held = st.keys.find(tube, key, now)
            assert held == m.find(tube, key, now)
            if held is not None:
                dup = r.PutUnique(seq + 1, now, 1, tube, key, window, keys_max,
                                  [(next_id, tube)], 0, 0, 60, 0, [], b"x")
                copy = snapshot_codec.load(list(snapshot_codec.dump(st)))
                try:
                    copy.apply(dup)
                except StateError:
                    pass
                else:
                    raise AssertionError("a duplicate keyed put applied")
                continue
            log(r.PutUnique, 1, tube, key, window, keys_max, [(next_id, tube)], 0, 0, 60, 0,
                [], b"x")
            m.put(tube, key, next_id, window * NS, keys_max, now)
            next_id += 1
        elif op == "plain":
            log(r.Put, 1, next_id, tube, 0, 0, 60, b"p")
            next_id += 1
        elif op == "reserve" and pick is not None and st.jobs[pick].state != RESERVED:
            log(r.Reserve, 1, pick)
        elif op == "delete" and pick is not None:
            log(r.Delete, 1, pick)
            m.remove(pick, now)
        elif op == "flush":
            gone = sorted(j.id for j in st.jobs.values()
                          if j.tube.name == tube and j.state != RESERVED)
            if gone:
                log(r.FlushTube, 1, tube, gone)
                for jid in gone:
                    m.remove(jid, now)
        elif op in ("expire", "move") and pick is not None and st.jobs[pick].state == READY:
            to = "" if op == "expire" else TUBES[1 - TUBES.index(st.jobs[pick].tube.name)]
            log(r.Expire, [(pick, to, 0)])
            if not to:
                m.remove(pick, now)  # a move keeps the job, and so its key
        elif op == "discard" and pick is not None and st.jobs[pick].state == READY:
            log(r.PutJobs, 1, [(next_id, tube)], 0, 0, 60, 0, [pick], b"d")
            m.remove(pick, now)
            next_id += 1
        elif op == "wait":
            now += (1, 5, 11, 40)[a] * NS
        st.check()
        for t in TUBES:
            for k in KEYS:
                assert st.keys.find(t, k, now) == m.find(t, k, now), (t, k, now)
            tk = st.keys.tubes.get(t)
            assert (tk.dropped_n if tk else 0) == m.dropped[t]
            assert sorted(tk.gone if tk else ()) == sorted(g[0] for g in m.gone[t])
    # A snapshot and a replay of the records hold the same keys.
    items = list(snapshot_codec.dump(st))
    loaded = snapshot_codec.load(items)
    loaded.check()
    assert list(snapshot_codec.dump(loaded)) == items
    replayed = State()
    for rec in recs:
        replayed.apply(rec)
    assert list(snapshot_codec.dump(replayed)) == items
