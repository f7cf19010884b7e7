"""The tube keys of the job policies (attempt limits, back-off, concurrency, rate):
how they parse, the one-line errors of a mistake, and what they decide
(server/holdback.py's back-off and exhaustion, without a loop)."""

from __future__ import annotations

import pytest

from smallstalk.core import records as r
from smallstalk.core.state import NS, State
from smallstalk.server.holdback import backoff_seconds, limits_changes, move_for
from smallstalk.server.policy import ConfigError, TubePolicy, policies_from, render


def tubes(**tables) -> dict:
    return {"tubes": {k.replace("_", "-"): v for k, v in tables.items()}}


def test_the_keys_parse_and_dump() -> None:
    pol = policies_from(tubes(jobs={
        "max-reserves": 5, "max-timeouts": 3, "dead-letter": "jobs-dead",
        "timeout-backoff": "5s..10m", "release-backoff": "1..60", "max-reserved": 4,
        "max-rate": "100/m"}))
    jobs = pol.of("jobs")
    assert (jobs.max_reserves, jobs.max_timeouts, jobs.on_exhausted, jobs.dead_letter) == (
        5, 3, "dead-letter", "jobs-dead")
    assert jobs.timeout_backoff == (5, 600) and jobs.release_backoff == (1, 60)
    assert jobs.max_reserved == 4 and jobs.max_rate == (100, 60)
    assert jobs.holds_back and jobs.exhausted_to() == "jobs-dead"
    assert not pol.of("other").holds_back and pol.of("other").exhausted_to() is None
    text = render(pol.dump([])).decode()
    assert '  timeout-backoff: "5s..600s"\n' in text and '  max-rate: "100/m"\n' in text
    assert "max-reserves" not in text.split("jobs:")[0]  # shown only where set
    # A limit alone buries (the default); on-exhausted may say so.
    assert policies_from(tubes(a={"max-timeouts": 1})).of("a").exhausted_to() == ""
    assert policies_from(tubes(a={"max-reserves": 1, "on-exhausted": "bury"})).of(
        "a").exhausted_to() == ""


@pytest.mark.parametrize("table, words", [
    ({"max-rate": "100/d"}, 'like "100/s"'),
    ({"max-rate": "0/s"}, 'like "100/s"'),
    ({"timeout-backoff": "5s"}, 'like "5s..10m"'),
    ({"timeout-backoff": "10m..5s"}, "at most the cap"),
    ({"release-backoff": "0s..5s"}, "at least 1s"),
    ({"on-exhausted": "delete"}, 'expected "bury" or "dead-letter"'),
    ({"on-exhausted": "dead-letter"}, "needs `dead-letter"),
    ({"dead-letter": "q"}, "cannot dead-letter into itself"),
    ({"max-reserved": -1}, "expected a whole number"),
])
def test_mistakes_are_one_line(table: dict, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        policies_from(tubes(q=table), "f.toml")
    assert words in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("f.toml: tubes.q")


def test_a_named_tube_turns_the_default_s_back_off_off() -> None:
    """0 or "" in a tube's own table turns off what [tubes.default] sets
    (docs/CONFIG.md), for the back-offs as for every limit; a rate too."""
    pol = policies_from({"tubes": {
        "default": {"timeout-backoff": "5s..1m", "release-backoff": "1s..5s"},
        "fast": {"timeout-backoff": "", "release-backoff": 0, "max-rate": ""},
        "slow": {"max-rate": "5/s"}}})
    fast, other = pol.of("fast"), pol.of("other")
    assert (fast.timeout_backoff, fast.release_backoff, fast.max_rate) == ((0, 0), (0, 0), (0, 0))
    assert not fast.holds_back
    assert other.timeout_backoff == (5, 60) and other.holds_back
    assert pol.of("slow").max_rate == (5, 1)
    with pytest.raises(ConfigError, match='"bury" undoes'):
        policies_from(tubes(q={"on-exhausted": ""}))


def test_limits_belong_to_named_tubes() -> None:
    for key, value in (("max-reserved", 2), ("max-rate", "5/s")):
        with pytest.raises(ConfigError, match="set it in each"):
            policies_from({"tubes": {"default": {key: value}}})


def test_backoff_doubles_to_the_cap() -> None:
    assert [backoff_seconds((5, 60), n) for n in range(1, 7)] == [5, 10, 20, 40, 60, 60]
    assert backoff_seconds((1, 3600), 1000) == 3600


def test_what_a_reservation_end_decides() -> None:
    st = State()
    st.apply(r.Put(1, NS, 1, 1, "q", 0, 0, 60, b"x"))
    st.apply(r.Reserve(2, NS, 1, 1))
    j = st.jobs[1]
    pol = TubePolicy(max_timeouts=2, timeout_backoff=(5, 60), release_backoff=(2, 8))
    assert move_for(pol, j, r.REQUEUE_TIMEOUT, 10 * NS) == (1, 15 * NS, "", "")
    assert move_for(pol, j, r.REQUEUE_RELEASE, 10 * NS) == (1, 12 * NS, "", "")
    assert move_for(pol, j, r.REQUEUE_RELEASE, 10 * NS, delay=3) is None  # the worker's delay
    j.timeouts = 1  # the second timeout reaches max-timeouts 2
    assert move_for(pol, j, r.REQUEUE_TIMEOUT, 10 * NS) == (
        1, 0, "", "exhausted: TTR ran out 2 times (max-timeouts 2)")
    assert move_for(TubePolicy(), j, r.REQUEUE_TIMEOUT, 10 * NS) is None


def test_limits_records_follow_the_configuration() -> None:
    st = State()
    pol = policies_from(tubes(a={"max-reserved": 2}, b={"max-rate": "10/s"}))
    changes = limits_changes(st, pol)
    assert changes == [("a", 2, 0, 0), ("b", 0, 10, NS)]
    for seq, fields in enumerate(changes, 1):
        st.apply(r.Limits(seq, NS, *fields))
    assert limits_changes(st, pol) == []  # nothing to log again
    assert limits_changes(st, policies_from({})) == [("a", 0, 0, 0), ("b", 0, 0, 0)]


def test_policies_keep_their_tubes_in_a_dict_whatever_mapping_they_are_given() -> None:
    # dispatch.put reads it as a dict (the compiled build checks the type).
    from types import MappingProxyType

    from smallstalk.server.policy import Policies
    named = MappingProxyType({"q": TubePolicy(max_jobs=1)})
    pols = Policies(TubePolicy(), named)
    assert type(pols.tubes) is dict and pols.of("q") == named["q"]
