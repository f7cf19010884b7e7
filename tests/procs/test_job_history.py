"""`smallstalk job-history`: the whole life of one job as a timeline, from AOFs of real
server runs (tests/support/toollogs.py) and the v2 golden fixture (fanout, discards,
expiry)."""

from __future__ import annotations

import json
from pathlib import Path

from smallstalk.ops import job_history

from ..support.toollogs import (
    FOLDED,
    V2,
    T,
    run,
    run_n,
    times_of,
)

# --- job-history -----------------------------------------------------------------------------


def test_job_history_of_a_job_that_did_everything(log_dir: Path) -> None:
    assert run_n(job_history.main, log_dir, log_dir, 1, "--utc") == (0, f"""\
job 1 (tube emails): put at seq 4 by conn 1; deleted at seq 17 by conn 2

seq  time                          step     held  state     event
  4  {T}                     ready     put by conn 1 into emails: pri 100, delay 0s, ttr 1s, body 7 B "email-1"
  9  {T}         ~           reserved  reserved by conn 2
 10  {T}         ~        ~  ready     TTR (1s) ran out: conn 2 lost it
 11  {T}         ~           reserved  reserved by conn 2
 12  {T}         ~        ~  ready     released by conn 2: pri 50, delay 0s
 13  {T}         ~           reserved  reserved by conn 2
 14  {T}         ~        ~  buried    buried by conn 2: pri 60
 15  {T}         ~           ready     kicked out of buried by conn 1
 16  {T}         ~           reserved  reserved by conn 2
 17  {T}         ~        ~  deleted   deleted by conn 2

lifetime            ~  put to delete
  ready             ~
  reserved          ~  4 reservations: 1 timed out, 1 released, 1 buried, 1 deleted
  buried            ~
""", "")


def test_job_history_disconnect_and_restart(log_dir: Path) -> None:
    assert run_n(job_history.main, log_dir, log_dir, 2, "--utc") == (0, f"""\
job 2 (tube emails): put at seq 5 by conn 1; reserved at the end of the log

seq  time                          step     held  state     event
  5  {T}                     ready     put by conn 1 into emails: pri 200, delay 0s, ttr 60s, body 7 B "email-2"
 18  {T}         ~           reserved  reserved by conn 2
 19  {T}         ~        ~  ready     conn 2 disconnected while holding it
 22  {T}         ~           reserved  reserved by conn 3
 25  {T}         ~        ~  ready     server restarted: conn 3's reservation ended
 30  {T}         ~           reserved  reserved by conn 5
     {T}         ~        ~  reserved  end of the log (seq 30): still reserved by conn 5

lifetime            ~  put to end of the log, still alive
  ready             ~
  reserved          ~  3 reservations: 1 ended by disconnect, 1 ended by a server restart, 1 still held
""", "")


def test_job_history_jsonl_durations(log_dir: Path) -> None:
    code, out, err = run(job_history.main, log_dir, 1, "--format", "jsonl")
    lines = [json.loads(line) for line in out.splitlines()]
    assert (code, err) == (0, "")
    steps, summary = lines[:-1], lines[-1]
    assert [(s["seq"], s["event"], s["conn"]) for s in steps] == [
        (4, "put", 1), (9, "reserve", 2), (10, "timeout", 2), (11, "reserve", 2),
        (12, "release", 2), (13, "reserve", 2), (14, "bury", 2), (15, "kick", 1),
        (16, "reserve", 2), (17, "delete", 2)]
    times = times_of(log_dir)
    timeout = steps[2]
    assert timeout["held_ns"] == times[10] - times[9]
    assert 1_000_000_000 <= timeout["held_ns"] < 5_000_000_000  # the TTR was 1s
    assert [s["held_ns"] for s in steps[4:]] == [
        times[12] - times[11], None, times[14] - times[13], None, None, times[17] - times[16]]
    assert all(s["since_prev_ns"] == times[s["seq"]] - times[p["seq"]]
               for p, s in zip(steps, steps[1:], strict=False))
    assert summary["reservations"] == ["timed out", "released", "buried", "deleted"]
    assert sum(summary["time_in_ns"].values()) == times[17] - times[4]
    assert summary["time_in_ns"]["buried"] == times[15] - times[14]


def test_job_history_of_folded_history(folded_dir: Path) -> None:
    code, out, err = run_n(job_history.main, folded_dir, folded_dir, 2, "--utc")
    assert code == 0
    assert out == f"""\
job 2 (tube emails): put before the log begins; ready at the end of the log

seq  time                          step     held  state     event
 30  {T}                     reserved  in snapshot 00000000000000000030.snap: reserved by conn 5; put at {T} into emails, pri 200, delay 0s, ttr 60s, body 7 B "email-2"; so far 3 reservations, 0 timeouts, 0 releases, 0 buries, 0 kicks
 31  {T}         ~        ?  ready     server restarted: conn 5's reservation ended
     {T}         ~           ready     end of the log (seq 31): still ready

since seq 30        ~  the snapshot to end of the log, still alive
  ready             ~
  reserved          ~  1 reservation: 1 ended by a server restart
"""
    assert err == f"note: job 2's history before seq 31 is gone. Records 1..30 are {FOLDED}\n"
    assert run(job_history.main, folded_dir, 1) == (
        3, "", "smallstalk: job 1 was put and deleted by seq 30: its whole history is gone. "
               f"Records 1..30 are {FOLDED}\n")
    assert run(job_history.main, folded_dir, 77) == (
        1, "", "smallstalk: no job 77 in the log (the log ends at seq 31)\n")



# --- big tubes (format 2): fanout, discards, expiry -------------------------------------------
#

def test_job_history_of_big_tube_jobs() -> None:
    def history_of(jid: int) -> str:
        code, out, err = run_n(job_history.main, V2, V2, jid, "--utc")
        assert (code, err) == (0, "")
        return out

    assert history_of(14) == f"""\
job 14 (tube orders+audit): put at seq 41 by conn 2; ready at the end of the log

seq  time                          step     held  state  event
 41  {T}                     ready  put by conn 2 into orders+audit, a fanout copy of job 13 (orders): pri 20, delay 0s, ttr 3600s, expires +1h00m, body 7 B "order-2"; discarded 1 job (10) to make room
     {T}         ~           ready  end of the log (seq 63): still ready

lifetime            ~  put to end of the log, still alive
  ready             ~
"""
    assert history_of(13) == f"""\
job 13 (tube orders): put at seq 41 by conn 2; discarded at seq 43 by conn 2's put

seq  time                          step     held  state      event
 41  {T}                     ready      put by conn 2 into orders (fanout copies: 14 (orders+audit), 15 (orders+archive)): pri 20, delay 0s, ttr 3600s, expires +1h00m, body 7 B "order-2"; discarded 1 job (10) to make room
 43  {T}         ~           discarded  discarded to make room in full orders by conn 2's put (jobs 16 (orders), 17 (orders+audit))

lifetime            ~  put to discard
  ready             ~
"""
    assert history_of(18) == f"""\
job 18 (tube sessions): put at seq 45 by conn 2; expired at seq 46 (deleted)

seq  time                          step     held  state    event
 45  {T}                     ready    put by conn 2 into sessions: pri 30, delay 0s, ttr 3600s, expires +1.00s, body 9 B "session-1"
 46  {T}         ~           expired  expired in sessions: deleted

lifetime            ~  put to expiry
  ready             ~
"""
    assert history_of(20) == f"""\
job 20 (tube reports, then dead): put at seq 49 by conn 2; ready at the end of the log

seq  time                          step     held  state  event
 49  {T}                     ready  put by conn 2 into reports: pri 40, delay 0s, ttr 3600s, expires +1.00s, body 8 B "report-1"
 50  {T}         ~           ready  expired in reports: moved to dead, expires never
     {T}         ~           ready  end of the log (seq 63): still ready

lifetime            ~  put to end of the log, still alive
  ready             ~
"""
    code, out, _err = run(job_history.main, V2, 20, "--format", "jsonl")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(s["seq"], s["event"], s["state"]) for s in lines[:-1]] == [
        (49, "put", "ready"), (50, "move", "ready"), (None, "end", "ready")]
    assert (lines[-1]["tube"], lines[-1]["moved_to"], lines[-1]["alive"]) == (
        "reports", ["dead"], True)
    # A job known only from a format-2 snapshot shows its expiry time.
    compacted = V2.parent / "compacted"
    code, out, _err = run_n(job_history.main, compacted, compacted, 15, "--utc")
    assert code == 0 and "into orders+archive, pri 20, delay 0s, ttr 3600s, expires +59m" in out
