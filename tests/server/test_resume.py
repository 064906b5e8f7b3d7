"""No request lost to a process death, through real processes: 12 concurrent greedy,
seeded, JSON-schema constrained and penalised requests, streamed through the SDK
and the openai client, complete with the tokens of an undisturbed run while a
scheduler, a worker or a rank is SIGKILLed (or a scheduler SIGSTOPped) mid-stream:
the request goes on elsewhere (or on the restarted process) from its tokens so far."""

import re
import signal
import urllib.request

from mlxd.client import Client
from group_support import rank_pids
from resume_support import assert_same, killer, pid_of, resumed, run_workload
from support import Server, wait_until

# room for all 12 requests at once (16 + 2048 tokens each): none waits for another
COMMON = ("--kv-capacity", "32768", "--log-level", "warning")
# replicas take turns, so engine1 runs half the workload when the disturbance comes
DP2 = ("--dp", "2", "--route-policy", "round_robin")


def stats(server: Server) -> dict:
    with Client(server.address, timeout=60) as c:
        return c.stats()


def disturbed_equals_undisturbed(server: Server, disturb) -> dict:
    """Run the workload undisturbed, then with `disturb`; the same outcomes, and
    (when the whole server was disturbed) some of the SDK's requests resumed, as
    their usage says. The server's stats after."""
    undisturbed = run_workload(server)
    disturbed = run_workload(server, disturb)
    assert_same(disturbed, undisturbed)
    if disturb.engine is None:
        assert resumed(disturbed) >= 1, [(o.finish_reason, o.resumes) for o in disturbed]
    return stats(server)


def test_a_replica_s_scheduler_killed_mid_stream_loses_no_request(llama_model):
    server = Server(llama_model, *DP2, *COMMON)
    try:
        after = disturbed_equals_undisturbed(server, killer(
            lambda: pid_of(server, "scheduler_proc", "--engine=engine1"),
            engine="engine1"))
        assert after["router"]["losses"] == 1 and after["router"]["resumes"] >= 1
        assert wait_until(lambda: stats(server)["router"]["engines_up"] == 2, 60)
        assert not any(" ERROR " in line and "Traceback" in line for line in server.stderr_lines)
    finally:
        server.stop()


def test_a_replica_s_worker_killed_mid_stream_loses_no_request(llama_model):
    server = Server(llama_model, *DP2, *COMMON)
    try:
        after = disturbed_equals_undisturbed(
            server, killer(lambda: pid_of(server, "worker_proc", "--name=worker1"),
                           engine="engine1"))
        assert after["engines"]["engine1"]["worker_restarts"] == 1
        assert after["engines"]["engine1"]["resumes"] >= 1
    finally:
        server.stop()


def test_a_single_engine_s_worker_killed_mid_stream_loses_no_request(llama_model):
    server = Server(llama_model, "--kv-capacity", "32768", "--log-level", "info")
    try:
        after = disturbed_equals_undisturbed(
            server, killer(lambda: server.child("worker_proc")))
        assert after["worker_restarts"] == 1 and after["resumes"] >= 1
        # counted where people look: /metrics and the access log
        metrics = urllib.request.urlopen(f"{server.http_url}/metrics").read().decode()
        resumed = re.search(r"^mlxd_requests_resumed_total (\S+)$", metrics, re.M)
        assert resumed and 1 <= float(resumed.group(1)) <= 4   # the openai client's
        assert any("POST /v1/completions 200" in line and "resumes=1" in line
                   for line in server.stderr_lines)
    finally:
        server.stop()


def test_a_single_engine_s_scheduler_killed_mid_stream_loses_no_request(llama_model):
    """The only engine is gone: requests wait at the front end, and go on once the
    restarted engine joins."""
    server = Server(llama_model, *COMMON)
    try:
        after = disturbed_equals_undisturbed(
            server, killer(lambda: server.child("scheduler_proc")))
        assert after["router"]["losses"] == 1 and after["router"]["resumes"] >= 1
    finally:
        server.stop()


def test_a_rank_of_a_tp_group_killed_mid_stream_loses_no_request(llama_model):
    server = Server(llama_model, "--tp", "2", *COMMON)
    try:
        before = rank_pids(server)
        after = disturbed_equals_undisturbed(
            server, killer(lambda: rank_pids(server)[1]))
        assert after["worker_restarts"] == 1 and after["resumes"] >= 1
        assert set(rank_pids(server).values()).isdisjoint(before.values())
    finally:
        server.stop()


def test_a_stopped_scheduler_is_replaced_within_the_worker_timeout(llama_model):
    """A SIGSTOPped scheduler answers nothing: its link's heartbeats go unanswered,
    the front end resumes its requests on the other replica within --worker-timeout
    and the launcher replaces the stopped engine."""
    server = Server(llama_model, *DP2, "--worker-timeout", "8", *COMMON)
    stop = killer(lambda: pid_of(server, "scheduler_proc", "--engine=engine1"),
                  signal.SIGSTOP, engine="engine1")
    try:
        after = disturbed_equals_undisturbed(server, stop)
        assert after["router"]["losses"] == 1 and after["router"]["resumes"] >= 1
        assert wait_until(lambda: stats(server)["router"]["engines_up"] == 2, 60)
        assert pid_of(server, "scheduler_proc", "--engine=engine1") != stop.killed[0]
        assert any("engine engine1 is unresponsive" in line for line in server.stderr_lines)
    finally:
        server.stop()
