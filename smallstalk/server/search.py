"""search-jobs and bulk-jobs on the mutation loop: each search runs in slices,
one slice of one search per loop turn, and is answered when it is done.

A search's session waits, running nothing else (as a failed `auth` does:
`Session.deferred`), while the loop takes one slice of one running search
per turn (round robin; a search started while none runs gets its first
slice in the turn that started it), between the turns that serve everyone
else; so a search over a million jobs costs the other clients at most one
slice per turn (core/search.py bounds a slice), however many searches run.
At most `MAX_SEARCHES` run at once, and a connection that closes drops its
own.

A bulk action changes the jobs each slice matched before the next slice
runs, as records the loop logs like any command's: `Kick` (one per slice),
`FlushTube` naming exactly the jobs deleted (one per slice), or one `Move`
per job (at most `ACT_SLICE` per slice). A crash in the middle leaves the
slices logged so far done and the rest not: running the same bulk action
again acts on what still matches (docs/PROTOCOL-EXTENSIONS.md).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.search import ACTION_STATES, Scan, SearchError
from smallstalk.core.state import State
from smallstalk.server.commit import Unavailable
from smallstalk.server.session import Session
from smallstalk.storage.bodies import BodyError

log = logging.getLogger("smallstalk.server.search")

MAX_SEARCHES = 4  # running at once, server-wide (each holds its session)
ACT_SLICE = 128  # jobs one slice of a bulk action changes at most


class Loop(Protocol):
    """What searches read and call of the mutation loop (loop.MutationLoop)."""

    state: State
    read_only: str | None
    sessions: dict[int, Session]

    def log(self, cls: type, *fields) -> r.Record: ...

    def body_of(self, job) -> bytes: ...

    def answer_deferred(self, s: Session, reply: bytes, logged: bool = False) -> None: ...


class Search:
    """One running search or bulk action: its session, scan and what it found."""

    __slots__ = ("session", "scan", "cmd", "action", "left", "found", "acted", "logged", "state")

    def __init__(self, s: Session, scan: Scan, cmd: p.SearchJobs | p.BulkJobs,
                 state: State) -> None:
        self.session = s
        self.scan = scan
        self.cmd = cmd
        self.action = cmd.action if type(cmd) is p.BulkJobs else ""
        self.left = cmd.count if type(cmd) is p.SearchJobs else cmd.max  # matches still wanted
        self.found: list[int] = []  # search-jobs: the page so far
        self.acted = 0  # bulk-jobs: jobs counted or changed so far
        self.logged = False  # some slice logged a record
        self.state = state  # the loop's state the last slice saw


class Searches:
    """The running searches, in the order their slices come (round robin)."""

    def __init__(self) -> None:
        self.running: dict[int, Search] = {}  # session id -> its search
        self._order: deque[int] = deque()
        self.slices = 0  # slices run, ever (for the tests and ext-stats)
        self.last: tuple[int, int, int] = (0, 0, 0)  # the last slice's probed, examined, bytes

    def start(self, lp: Loop, s: Session, cmd: p.SearchJobs | p.BulkJobs) -> bytes | None:
        """A refusal, or None: the search is set up and its session waits
        (`run` takes its slices, the first in this same turn)."""
        bulk = type(cmd) is p.BulkJobs
        if bulk:
            if cmd.state not in ACTION_STATES[cmd.action]:
                return p.bad_search(f"{cmd.action} takes jobs that are "
                                    + " or ".join(sorted(ACTION_STATES[cmd.action])))
            if cmd.action == "move" and cmd.target == cmd.tube:
                return p.bad_search("a move needs another tube")
            if cmd.action != "count" and lp.read_only:
                return p.READ_ONLY
        if len(self.running) >= MAX_SEARCHES:
            return p.bad_search(f"{MAX_SEARCHES} searches are running: try again when one ends")
        st = lp.state
        try:
            scan = Scan(st, cmd.tube, cmd.state, cmd.how, cmd.pattern,
                        0 if bulk else cmd.after, max(st.next_job_id, 1))
        except SearchError as e:
            return p.bad_search(str(e))
        self.running[s.id] = Search(s, scan, cmd, st)
        self._order.append(s.id)
        s.blocked = s.deferred = True
        return None

    def run(self, lp: Loop) -> None:
        """One slice of the next running search; answer it if that ends it."""
        order = self._order
        while order:
            sid = order.popleft()
            search = self.running.get(sid)
            if search is None:
                continue  # dropped: its connection closed
            reply = self._slice(lp, search)
            if reply is None:
                order.append(sid)
            else:
                del self.running[sid]
                lp.answer_deferred(search.session, reply, search.logged)
            return

    def drop(self, sid: int) -> None:
        """The connection `sid` closed: its search, if any, ends unanswered."""
        self.running.pop(sid, None)  # its id leaves `_order` when `run` meets it

    def _slice(self, lp: Loop, search: Search) -> bytes | None:
        """Scan one slice and act on its matches; the reply once done, else None."""
        if lp.state is not search.state:
            # A turn's commit failed and the loop went back to what the disk
            # holds: records of an earlier slice may be gone with it, so
            # `acted` would count changes that did not happen.
            if search.logged:
                return p.INTERNAL_ERROR
            search.state = lp.state
        scan = search.scan
        want = search.left if search.action in ("", "count") else min(search.left, ACT_SLICE)
        ids = scan.step(lp.state, lambda j: _body(lp, j), want)
        self.slices += 1
        self.last = (scan.probed, scan.examined, scan.matched_bytes)
        if ids:
            search.left -= len(ids)
            if not search.action:
                search.found += ids
            elif search.action != "count":
                if lp.read_only:
                    return p.READ_ONLY  # fenced meanwhile: what was done stays done
                try:
                    _act(lp, search, ids)
                except Unavailable:
                    return p.INTERNAL_ERROR
                search.logged = True
            search.acted += len(ids)
        if not scan.done and search.left > 0:
            return None
        if not search.action:
            return p.yaml_list(map(str, search.found))
        if search.action == "count":
            return p.counted(search.acted)
        return p.acted(search.acted)


def _body(lp: Loop, job) -> bytes | None:
    try:
        return lp.body_of(job)
    except BodyError as e:
        log.error("search skips job %d: %s", job.id, e)
        return None


def _act(lp: Loop, search: Search, ids: list[int]) -> None:
    """A bulk action on the jobs one slice matched, as its records."""
    sid = search.session.id
    if search.action == "kick":
        lp.log(r.Kick, sid, ids)
    elif search.action == "delete":
        lp.log(r.FlushTube, sid, search.cmd.tube, ids)
    else:
        for jid in ids:
            lp.log(r.Move, sid, jid, search.cmd.target)

