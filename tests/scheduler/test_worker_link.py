"""scheduler_proc/worker_link.py: the Step socket notices the worker's end going away,
and a restarted worker is checked against the first one's limits."""

import dataclasses

import pytest
import zmq

from mlxd.scheduler_proc.worker_link import WorkerLink, replacement_mismatch
from proc_support import short_ipc_dir
from support import wait_until, worker_limits


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def _bound_pull(ctx, address):
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def test_the_link_reports_the_workers_end_closing_and_reopens_for_the_next(ctx, tmp_path):
    address = f"ipc://{short_ipc_dir(tmp_path)}/worker_in"
    worker = _bound_pull(ctx, address)
    link = WorkerLink(ctx, address)
    try:
        link.send(b"step 1")
        assert worker.poll(5000) and worker.recv() == b"step 1"
        assert not link.lost()
        worker.close(linger=0)                      # the worker's process dies
        assert wait_until(lambda: link.monitors[0].poll(0) and link.lost(), 5)
        link.reopen()
        worker = _bound_pull(ctx, address)          # the next worker
        link.send(b"step 2")
        assert worker.poll(5000) and worker.recv() == b"step 2"
        assert not link.lost()
    finally:
        link.close()
        worker.close(linger=0)


def test_every_rank_of_a_group_gets_every_step_and_any_ranks_end_is_the_workers(
        ctx, tmp_path):
    from mlxd.runtime.worker_group import rank_input_addr

    address = f"ipc://{short_ipc_dir(tmp_path)}/worker_in"
    ranks = [_bound_pull(ctx, rank_input_addr(address, r)) for r in range(3)]
    link = WorkerLink(ctx, address, ranks=3)
    try:
        link.send(b"step 1")
        for rank in ranks:
            assert rank.poll(5000) and rank.recv() == b"step 1"
        assert not link.lost()
        ranks[2].close(linger=0)                    # rank 2 dies
        assert wait_until(lambda: link.monitors[2].poll(0) and link.lost(), 5)
        link.reopen()
        ranks[2] = _bound_pull(ctx, rank_input_addr(address, 2))
        link.send(b"step 2")
        assert all(r.poll(5000) and r.recv() == b"step 2" for r in ranks)
    finally:
        link.close()
        for rank in ranks:
            rank.close(linger=0)


FIRST = worker_limits(kv_capacity=256)


@pytest.mark.parametrize("change", [
    {}, {"kv_capacity": 512, "decode_cache_tokens": FIRST.decode_cache_tokens + 1},
    {"device": "gpu", "kv_pool_bytes": 1, "weights_bytes": 7},
], ids=["the same", "larger", "other figures"])
def test_a_worker_that_holds_the_first_ones_limits_may_replace_it(change):
    assert replacement_mismatch(FIRST, dataclasses.replace(FIRST, **change)) is None


@pytest.mark.parametrize("change,why", [
    ({"kv_capacity": 255}, "smaller"),
    ({"decode_cache_tokens": FIRST.decode_cache_tokens - 1}, "smaller"),
    ({"vocab_size": FIRST.vocab_size + 1}, "another model"),
    ({"max_context": FIRST.max_context * 2}, "another model"),
])
def test_a_worker_with_a_smaller_pool_or_another_model_may_not(change, why):
    assert why in replacement_mismatch(FIRST, dataclasses.replace(FIRST, **change))
