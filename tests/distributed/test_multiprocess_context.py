"""The context axis across processes: 2 processes x 4 fake CPU devices with parallel.context=8, so every
context group (one row's tokens) spans both processes, train exactly like 1 process x 8 devices.

Each process then holds every row of the global batch but only its half of each row's (zigzag-reordered)
tokens: `process_rows` is all rows, and `make_array_from_process_local_data` takes the full rows and keeps
the columns its devices hold. The KDA state passing, conv halos and ring attention exchange across the
process boundary (gloo). Per-step loss equal to rel <= 1e-6, as the other 2-process tests (seen: equal
bit for bit). With the mesh's device order (context is the fastest axis) a context group smaller than 8
stays inside one process (e.g. context=4 x data=2), so context=8 is the case that crosses.
"""
import pytest

from tests.distributed.test_distributed_multiprocess import assert_same_losses, losses, run_both


@pytest.mark.slow
def test_two_processes_context_across_the_process_boundary_train_like_one(tmp_path):
    cp = ["parallel=context", "parallel.context=8", "data.seq_length=64", "checkpoint.enabled=false"]
    two, one, _ = run_both(tmp_path, cp, steps=2)
    assert_same_losses(losses(two), losses(one), [1, 2], keys=("loss", "lm_loss", "mtp_loss"))
