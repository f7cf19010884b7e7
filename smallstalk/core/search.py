"""Finding a tube's jobs in a state by body or key: the matching and the scan
behind `search-jobs` and `bulk-jobs`, in slices of bounded work.

Pure: reads the state it is given and never changes it (server/search.py runs
the slices on the loop and logs what a bulk action does). A scan looks at the
tube's jobs in ascending id order, so `after-id` pages:

- a tube whose list of jobs in the state (its ready or delayed heap, its
  buried list, the reserved jobs of every connection) holds at most `SMALL`
  entries is listed whole when the scan starts, sorted by id;
- a bigger one is scanned by id, from `after + 1` up to the ids given out
  when the search started (`ceiling`): each id is one dictionary lookup.

Either way a job that is in the tube and the state for the whole scan is found
exactly once; one that comes or goes meanwhile may or may not be; a job put
after the search started is not. A key search (`key`) is one lookup in the
tube's idempotency keys (core/keys.py).

What one match may cost is bounded: a pattern is matched against the first
`MATCH_BYTES` of each body only, and a regular expression is compiled by RE2
(the `google-re2` package: linear time in the text, no backtracking, its
memory capped at `REGEX_MEM`) from at most `REGEX_MAX` bytes. A slice stops
at `SLICE_PROBES` ids looked at or `SLICE_BYTES` of bodies matched, whichever
comes first (a regular expression's match counts as `REGEX_COST` ids), or
when the caller has as many matches as it wants.
"""

from __future__ import annotations

from collections.abc import Callable

from smallstalk.core.model import BURIED, DELAYED, READY, STATE_BY_NAME, STATE_NAMES
from smallstalk.core.readyheap import entry_id

HOWS = ("substr", "regex", "key")
ACTIONS = ("count", "kick", "delete", "move")
# Which states each bulk action takes (a reserved job belongs to its worker).
ACTION_STATES = {
    "count": frozenset(STATE_NAMES),
    "kick": frozenset(("buried", "delayed")),
    "delete": frozenset(("ready", "delayed", "buried")),
    "move": frozenset(("ready", "delayed", "buried")),
}
PATTERN_MAX = 1024  # bytes of any pattern; the parser skips a longer one unread
REGEX_MAX = 256  # bytes of a regular expression
REGEX_MEM = 1 << 20  # RE2's memory for one compiled expression
MATCH_BYTES = 64 << 10  # of each body a pattern is matched against
SEARCH_PAGE_MAX = 1000  # ids per search-jobs answer; page on with after-id
# One slice: ids looked up, body bytes matched; a regular expression's match
# counts as REGEX_COST ids more (its call costs that much; docs/PERFORMANCE.md).
SLICE_PROBES = 1024
SLICE_BYTES = 256 << 10
REGEX_COST = 4
SMALL = 4096  # a tube's list this short is taken whole, not scanned by id


class SearchError(ValueError):
    """A search that cannot run, with the one line that says why."""


def _re2():
    try:
        import re2
    except ImportError:
        raise SearchError("regex search needs the google-re2 package: "
                          "pip install 'smallstalk[search]'") from None
    return re2


def matcher(how: str, pattern: bytes) -> Callable[[bytes], bool]:
    """A test of one body for `how` (substr or regex): does `pattern` occur
    within its first MATCH_BYTES? Raises SearchError for a pattern that cannot be used."""
    if len(pattern) > PATTERN_MAX:
        raise SearchError(f"pattern longer than {PATTERN_MAX} bytes")
    if how == "substr":
        def has(body: bytes) -> bool:
            return body.find(pattern, 0, MATCH_BYTES) >= 0
        return has
    if how == "regex":
        if len(pattern) > REGEX_MAX:
            raise SearchError(f"regular expression longer than {REGEX_MAX} bytes")
        re2 = _re2()
        opts = re2.Options()
        opts.max_mem = REGEX_MEM
        opts.log_errors = False
        try:
            rx = re2.compile(pattern, opts)
        except re2.error as e:
            why = e.args[0] if e.args else "invalid"
            if isinstance(why, bytes):
                why = why.decode("utf-8", "replace")
            raise SearchError(f"bad regular expression: {why}") from None
        search = rx.search

        def matches(body: bytes) -> bool:
            return search(body, 0, min(len(body), MATCH_BYTES)) is not None
        return matches
    raise SearchError(f"unknown search {how!r}: substr, regex or key")


def _listed(st, t, state: int) -> list[int] | None:
    """The ids in `t`'s list of jobs in `state` (stale entries too), sorted, or
    None when the list is longer than SMALL."""
    if state == READY:
        if len(t.ready) > SMALL:
            return None
        ids = [entry_id(key) for key in t.ready]
    elif state == DELAYED:
        if len(t.delayed) > SMALL:
            return None
        ids = [e[1] for e in t.delayed]
    elif state == BURIED:
        if len(t.buried) > SMALL:
            return None
        ids = list(t.buried)
    else:
        if st.reserved_n > SMALL:
            return None
        ids = [jid for c in st.conns.values() for jid in c.reserved]
    return sorted(set(ids))


class Scan:
    """One search's place in a tube: what it looks for and which ids are left.

    `step` looks at the next slice and returns the matches it found; `done`
    says nothing is left. `probed`, `examined` and `matched_bytes` count the
    work of the last step (the tests hold the bounds to them)."""

    def __init__(self, st, tube: str, state: str, how: str, pattern: bytes, after: int,
                 ceiling: int) -> None:
        if state not in STATE_NAMES:
            raise SearchError(f"unknown state {state!r}")
        self.tube = tube
        self.state = STATE_BY_NAME[state]
        self.how = how
        self.done = False
        self.probed = self.examined = self.matched_bytes = 0
        self.match: Callable[[bytes], bool] | None = None
        self.ids: list[int] | None = None  # the candidates, when listed whole
        self.pos = 0  # into `ids`
        self.next = after + 1  # the next id to look up (scanned by id)
        self.ceiling = ceiling
        t = st.tubes.get(tube)
        if how == "key":
            if not pattern:
                raise SearchError("an empty key")
            k = st.keys.tubes.get(tube)
            jid = k.live.get(pattern.decode("ascii", "replace")) if k is not None else None
            self.ids = [jid] if jid is not None and jid > after else []
            return
        # An empty substring matches every body: none is read (nor read back from disk).
        self.match = matcher(how, pattern) if pattern or how != "substr" else None
        if t is None:
            self.ids = []
        else:
            listed = _listed(st, t, self.state)
            if listed is not None:
                self.ids = [jid for jid in listed if after < jid < ceiling]

    def step(self, st, body_of: Callable, want: int, probes: int = SLICE_PROBES,
             nbytes: int = SLICE_BYTES) -> list[int]:
        """Up to `want` more matching ids, ascending, from at most `probes` ids
        looked at and `nbytes` of bodies matched. `body_of(job)` gives a body
        that is on disk (None: it cannot be read, so the job does not match)."""
        out: list[int] = []
        self.probed = self.examined = self.matched_bytes = 0
        t = st.tubes.get(self.tube)
        if t is None or want <= 0:
            self.done = t is None
            return out
        jobs = st.jobs
        state = self.state
        match = self.match
        ids = self.ids
        if ids is not None:
            i = self.pos
            end = min(len(ids), i + probes)
        else:
            i = self.next
            end = min(self.ceiling, i + probes)
        left = nbytes
        extra = REGEX_COST if self.how == "regex" else 0
        while i < end:
            jid = ids[i] if ids is not None else i
            i += 1
            j = jobs.get(jid)
            if j is None or j.tube is not t or j.state != state:
                continue
            self.examined += 1
            end -= extra
            if match is not None:
                body = j.body
                if type(body) is int:
                    body = body_of(j)
                    if body is None:
                        continue
                left -= min(len(body), MATCH_BYTES)
                if not match(body):
                    if left <= 0:
                        break
                    continue
            out.append(jid)
            if len(out) >= want or left <= 0:
                break
        if ids is not None:
            self.probed = i - self.pos
            self.pos = i
            self.done = i >= len(ids)
        else:
            self.probed = i - self.next
            self.next = i
            self.done = i >= self.ceiling
        self.matched_bytes = nbytes - left
        return out

