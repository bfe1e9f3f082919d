"""Batch feeding: the global order is independent of the process count, and each process
materialises exactly its own rows even when its devices hold non-contiguous rows."""

from __future__ import annotations

import io
import json
import textwrap

import numpy as np
import pytest

from helpers import REPO
from data_pipeline.batching import eval_batch_indices, global_batch_indices
from experiments.launcher.local_pod import run_local_pod


def test_global_order_is_a_pure_function_of_seed_and_step():
    a = [global_batch_indices(7, s, 100, 16) for s in range(12)]
    b = [global_batch_indices(7, s, 100, 16) for s in range(12)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    epoch0 = np.concatenate(a[:6])  # 6 steps per epoch, the last 4 examples dropped
    assert len(set(epoch0.tolist())) == 96  # no example twice within an epoch
    assert not np.array_equal(a[0], global_batch_indices(8, 0, 100, 16))  # the seed matters
    idx, valid = eval_batch_indices(10, 4, 2)
    assert idx.tolist() == [8, 9, 0, 0] and valid.tolist() == [True, True, False, False]


WORKER = textwrap.dedent("""
    import json, os, sys
    import jax, numpy as np
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                               int(os.environ["JAX_PROCESS_ID"]))
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    from data_pipeline.batching import global_batch_indices
    from runtime.data_feed import BatchFeeder, process_rows
    from runtime.sharding import batch_sharding

    class Split:  # example i has inputs [i, i, i], label [i], id i (the PuzzleSplit interface)
        def __len__(self):
            return 40

        def rows(self, idx):
            return {"inputs": np.repeat(idx[:, None], 3, axis=1).astype(np.int32),
                    "labels": idx[:, None].astype(np.int32), "puzzle_identifiers": idx.astype(np.int32)}

    devs = sorted(jax.devices(), key=lambda d: (d.id % 2, d.process_index))  # p0d0 p1d0 p0d1 p1d1 ...
    mesh = Mesh(np.array(devs).reshape(len(devs), 1, 1), ("data", "fsdp", "tensor"))
    feeder = BatchFeeder(Split(), batch_sharding(mesh, 1), global_batch=8, seed=3)
    rows = process_rows(batch_sharding(mesh, 1), 8).tolist()
    out = {"rows": rows, "batches": []}
    for step in (0, 1, 4, 5):
        batch = feeder.train_batch(step)
        ids = multihost_utils.process_allgather(batch["puzzle_identifiers"], tiled=True)
        out["batches"].append([np.asarray(ids).tolist(), global_batch_indices(3, step, 40, 8).tolist()])
    evals = [np.asarray(multihost_utils.process_allgather(b["labels"], tiled=True))[:, 0].tolist()
             for b in feeder.eval_batches(20)]
    out["eval"] = evals
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.slow
def test_non_contiguous_rows_on_a_real_two_process_pod(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + WORKER)
    out = io.StringIO()
    code = run_local_pod(2, 2, [], script=str(script), stream=out, timeout=120,
                         extra_env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    assert code == 0, out.getvalue()[-3000:]
    results = {line[:4]: json.loads(line.split("RESULT ", 1)[1]) for line in out.getvalue().splitlines() if "RESULT " in line}
    assert results["[p0]"]["rows"] == [0, 1, 4, 5] and results["[p1]"]["rows"] == [2, 3, 6, 7]  # interleaved blocks
    for result in results.values():
        for got, expected in result["batches"]:
            assert got == expected  # the assembled global batch is exactly the global order
        # eval: 20 examples in order in batches of 8, padding rows labelled -100
        assert result["eval"] == [list(range(8)), list(range(8, 16)), [16, 17, 18, 19, -100, -100, -100, -100]]
