"""Idempotency keys: which job a tube's key made, and the keys of jobs that are gone.

A keyed put (`put-unique`, or any put into a tube with `unique = "body"`) is
logged as a `PutUnique` record naming its tube, its key, the window
(`unique-for`) and the bound (`unique-keys-max`) in force when it was made.
While the job it made exists (in any state, in any tube an expiry moved it
to) the key is *live*; once the job is gone (delete, flush, expiry, discard)
the key is *retained* until the window has passed, measured in record time,
and at most `keys_max` retained keys are kept per tube, the oldest dropped
first. Both numbers come from the tube's last keyed put record, never from
the configuration, so a replay and a replica keep exactly the keys the
primary kept, and decide every later put as it did.

Pure, like the rest of core/: the state (core/state.py) owns one `KeyIndex`
and tells it of every job that goes (`release`); the mutation loop asks it
(`find`) before it logs a keyed put.
"""

from __future__ import annotations

from types import SimpleNamespace

from smallstalk.core.model import StateError

# The compiled build's class decorators, as in core/model.py (the import is for
# the compiler's eyes only).
cython = SimpleNamespace(no_gc=lambda cls: cls, cclass=lambda cls: cls)
if not cython:  # never true
    import cython


class TubeKeys:
    """One tube's keys. `gone` is in the order the jobs went (oldest first)."""

    __slots__ = ("live", "gone", "window", "keys_max", "dropped_n")

    def __init__(self) -> None:
        self.live: dict[str, int] = {}  # key -> id of the job it made (exists)
        self.gone: dict[str, tuple[int, int]] = {}  # key -> (job id, retained until, ns)
        self.window = 0  # ns a key is retained after its job went (the last keyed put's)
        self.keys_max = 0  # retained keys kept at most (the last keyed put's)
        self.dropped_n = 0  # retained keys dropped before their window ended (the bound)

    def holder(self, key: str, now) -> int | None:
        """The id of the job `key` made, if a put with it at `now` is a
        duplicate: its job exists, or went less than the window ago."""
        jid = self.live.get(key)
        if jid is not None:
            return jid
        if self.gone:  # most tubes' keys are all live: no lookup of an empty dict
            held = self.gone.get(key)
            if held is not None and now < held[1]:
                return held[0]
        return None

    def prune(self, now) -> None:
        """Forget retained keys whose window ended, then the oldest past the bound."""
        gone = self.gone
        while gone:
            key = next(iter(gone))
            if gone[key][1] > now:
                break
            del gone[key]
        while len(gone) > self.keys_max:
            del gone[next(iter(gone))]
            self.dropped_n += 1


@cython.no_gc
@cython.cclass
class KeyHold:
    """What a keyed job that exists was put with: its tube, its key, and the
    seq of the put's record (0 for a job loaded from a snapshot, which does
    not keep it). Two strs and an int refer to nothing, so the compiled build
    leaves it out of the cyclic collector (`no_gc`, as core/model.py's Job): a
    keyed put otherwise adds one object to the collector's youngest
    generation, and a collection every few hundred puts walks them."""

    __slots__ = ("tube", "key", "seq")

    def __init__(self, tube: str, key: str, seq) -> None:
        self.tube = tube
        self.key = key
        self.seq = seq


class KeyIndex:
    """Every tube's keys, and the key of each keyed job that exists."""

    __slots__ = ("tubes", "of_job")

    def __init__(self) -> None:
        # Kept apart from the tubes: a tube is dropped when it holds no job,
        # but the keys of its deleted jobs must outlive it.
        self.tubes: dict[str, TubeKeys] = {}
        # job id -> its KeyHold. The put's seq is there because under
        # --min-replica-acks a repeat is answered only once a replica has that
        # record (dispatch.put_unique).
        self.of_job: dict[int, KeyHold] = {}

    def find(self, tube: str, key: str, now) -> int | None:
        """The id of the job `key` made in `tube`, if a put with it now changes nothing."""
        k: TubeKeys = self.tubes.get(tube)  # (typed: compiled, `holder` is a C call)
        return None if k is None else k.holder(key, now)

    def key_of(self, jid: int) -> tuple[str, str] | None:
        """(tube, key) of a job that was put with a key and still exists."""
        held: KeyHold = self.of_job.get(jid)
        return None if held is None else (held.tube, held.key)

    def put_seq(self, jid: int) -> int:
        """The seq of the put that made keyed job `jid` (0: loaded from a snapshot)."""
        held: KeyHold = self.of_job.get(jid)
        return 0 if held is None else held.seq

    def add(self, tube: str, key: str, jid, window, keys_max, now, seq=0) -> None:
        """A keyed put made job `jid` at `now`. Raises StateError, changing
        nothing, if the job has a key already or the key is taken (`find`
        would have found it: the put was a duplicate). `jid`, `window` (ns),
        `keys_max`, `now` and `seq` are ints (unannotated: see keys.pxd)."""
        if jid in self.of_job:
            raise StateError(f"job {jid} already has a key")
        k: TubeKeys = self.tubes.get(tube)
        if k is None:
            k = self.tubes[tube] = TubeKeys()
        else:
            live: dict = k.live  # k.holder(key, now), inlined (typed: a direct call)
            if key in live or (k.gone and k.holder(key, now) is not None):
                raise StateError(f"key {key!r} of tube {tube!r} is taken: "
                                 "the put was a duplicate")
            if k.gone:
                k.gone.pop(key, None)  # its window had passed
        k.window = window
        k.keys_max = keys_max
        k.live[key] = jid
        held: KeyHold = KeyHold.__new__(KeyHold)  # compiled, a direct allocation
        held.tube, held.key, held.seq = tube, key, seq
        self.of_job[jid] = held
        if k.gone:  # k.prune(now), when there is anything to prune
            k.prune(now)

    def release(self, jid, now) -> None:
        """Job `jid` is gone at `now`: its key, if any, is retained for the window."""
        held: KeyHold = self.of_job.pop(jid, None)
        if held is None:
            return
        tube, key = held.tube, held.key
        k: TubeKeys = self.tubes[tube]
        del k.live[key]
        if k.window > 0:
            k.gone[key] = (jid, now + k.window)
        k.prune(now)
        if not k.live and not k.gone and not k.dropped_n:
            del self.tubes[tube]

    def restore(self, tube: str, window: int, keys_max: int, dropped_n: int,
                live: list, gone: list) -> None:
        """Load one `keys` snapshot item (several may name one tube: they add up)."""
        k = self.tubes.get(tube)
        if k is None:
            k = self.tubes[tube] = TubeKeys()
        k.window, k.keys_max, k.dropped_n = window, keys_max, dropped_n
        for key, jid in live:
            k.live[key] = jid
            self.of_job[jid] = KeyHold(tube, key, 0)
        for key, jid, until in gone:
            k.gone[key] = (jid, until)

    def retained(self) -> int:
        return sum(len(k.gone) for k in self.tubes.values())

    def check(self, job_ids) -> None:
        """Assert the index agrees with itself and with the jobs that exist (tests)."""
        live = 0
        for tube, k in self.tubes.items():
            assert k.live or k.gone or k.dropped_n, tube
            assert len(k.gone) <= k.keys_max, tube
            for key, jid in k.live.items():
                assert self.key_of(jid) == (tube, key), (tube, key)
                assert jid in job_ids, (tube, key, jid)
                assert key not in k.gone, (tube, key)
            live += len(k.live)
        assert live == len(self.of_job)
