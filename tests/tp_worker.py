"""One rank of a tensor-parallel check (tests/test_parallel.py), launched as torchrun would.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python tests/tp_worker.py MODEL.om IDS.npy OUT.json [die]

Runs prefill on the ids (last_token = the last row), then one decode step at the next
position with copy_outputs=False under the allocation profiler; rank 0 writes both
programs' logits and the decode step's allocations as JSON. With `die`, rank 1 exits
at once after loading (a peer that dies): the others must fail, not hang.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def main() -> None:
    from npuc.runtime import Session, parallel
    from npuc.tools.alloc_profile import profile_run

    om, ids_path, out = sys.argv[1:4]
    die = len(sys.argv) > 4 and sys.argv[4] == "die"
    parallel.init_from_env()
    s = Session.load(om)
    rank, world = parallel.current()
    if die and rank == 1:
        os._exit(9)
    ids = np.load(ids_path)
    n = ids.shape[1]
    feeds = {"input_ids": ids}
    if "last_token" in {t.name for t in s.programs["prefill"].inputs}:
        feeds["last_token"] = np.array([n - 1], dtype=np.int64)
    prefill = s.run(feeds, "prefill")["logits"]
    token = int(prefill.reshape(-1, prefill.shape[-1])[-1].argmax())
    step = {"input_ids": np.array([[token]], dtype=np.int64), "position": np.array([n], dtype=np.int64)}
    s.run(step, "decode", copy_outputs=False)  # warm: the first run may build kernels
    decode = s.run(step, "decode")["logits"]
    allocs = profile_run(s, step, "decode", copy_outputs=False)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "prefill": prefill.float().tolist(), "decode": decode.float().tolist(),
                       "alloc_count": allocs.count, "alloc_bytes": allocs.bytes,
                       "collective_alloc_count": allocs.collective_count}, f)
    parallel.finish()


if __name__ == "__main__":
    main()
    # The profiler's threads can abort the interpreter's teardown ("terminate called without an
    # active exception"), after everything above has been written: end here instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
