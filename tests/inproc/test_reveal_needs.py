"""What a reserve's reply waits for under --fsync always (`GroupCommit.job_need`):
the seq of the job's put: of each job of a fanout's record (its copies' ids
below the highest), and when a put whose line took its id first
(dispatch.put_heard) is staged after puts of higher ids."""

from __future__ import annotations

import random

from smallstalk.core import records as r
from smallstalk.storage.aof import FSYNC_ALWAYS

from ..support.harness import make_loop


async def test_every_staged_put_is_waited_for(tmp_path) -> None:
    lp = make_loop(tmp_path, fsync=FSYNC_ALWAYS)
    c = lp.commit
    c.track_needs = True
    rnd = random.Random(7)
    try:
        for _ in range(300):
            del c.put_lows[:], c.put_ids[:], c.put_seqs[:]
            staged: dict[int, int] = {}
            for seq in range(1, rnd.randint(2, 30)):
                first = rnd.randint(1, 40)  # now and then below an id staged before
                ids = [i for i in range(first, first + rnd.randint(1, 3)) if i not in staged]
                if not ids:
                    continue
                if len(ids) == 1:
                    rec = r.Put(seq, 1, 1, ids[0], "t", 0, 0, 60, b"x")
                else:  # a fanout's copies
                    rec = r.PutJobs(seq, 1, 1, [(i, "t") for i in ids], 0, 0, 60, 0, [], b"x")
                c._track(rec, type(rec))
                staged.update(dict.fromkeys(ids, seq))
            assert c.put_ids == sorted(c.put_ids) and c.put_seqs == sorted(c.put_seqs)
            assert all(lo <= hi for lo, hi in zip(c.put_lows, c.put_ids, strict=True))
            assert all(hi < lo for hi, lo in zip(c.put_ids, c.put_lows[1:], strict=False))
            durable = rnd.randint(0, 30)
            c._forget_durable(durable)
            for job_id, put_seq in staged.items():
                if put_seq > durable:
                    assert c.job_need(job_id) >= put_seq, (job_id, c.put_ids, c.put_seqs)
            for job_id in range(1, 45):  # and a job outside every range waits for nothing
                if not any(lo <= job_id <= hi for lo, hi in zip(c.put_lows, c.put_ids, strict=True)) \
                        and job_id <= max(c.put_ids, default=0):
                    assert c.job_need(job_id) == c.kick_seq
    finally:
        lp.journal.close()
