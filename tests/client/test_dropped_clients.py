"""A client dropped without close() never blocks its user's program: the garbage
collector returns at once, the process exits, and a ResourceWarning says what was
left open. Each scenario runs in a child process, so that a hang fails its test
(bounded) instead of hanging the suite."""

import subprocess
import sys
import threading

import pytest

from support import Server

CHILD_BOUND_S = 30   # a child that takes longer hangs
GC_BOUND_S = 3       # in the child, for one gc.collect()

# argv: address, "sync" or "async", "after_request" or "mid_stream", GC_BOUND_S. It
# prints "ready" with its request done or its stream started, drops the client once
# its stdin ends, and checks that the client left no descriptor open. A gc.collect()
# that hangs makes it exit 1 with every thread's stack (faulthandler).
CHILD = r"""
import asyncio, faulthandler, gc, os, sys, threading, time
from mlxd.client import AsyncClient, Client

ADDRESS, KIND, WAY = sys.argv[1:4]
GC_BOUND_S = float(sys.argv[4])
LONG = dict(max_tokens=2000, ignore_eos=True)


def open_fds():
    return len(os.listdir("/dev/fd"))


def collect(where):
    faulthandler.dump_traceback_later(GC_BOUND_S, exit=True)
    start = time.monotonic()
    gc.collect()
    faulthandler.cancel_dump_traceback_later()
    print(f"gc {where}: {time.monotonic() - start:.3f} s", flush=True)


def wait_for_go():
    print("ready", flush=True)
    sys.stdin.read()


def run_sync():
    client = Client(ADDRESS, timeout=30)
    if WAY == "mid_stream":
        stream = client.stream("Hello", **LONG)
        next(stream)
    else:
        client.generate("Hello", max_tokens=4)
    wait_for_go()
    stream = client = None
    collect("after the drop")
    # its thread ends on its own, with the loop it ran
    for thread in threading.enumerate():
        if thread.name == "mlxd-client":
            thread.join(GC_BOUND_S)
            assert not thread.is_alive(), "the dropped Client's thread still runs"


async def run_async():
    client = AsyncClient(ADDRESS, timeout=30)
    if WAY == "mid_stream":
        stream = client.stream("Hello", **LONG)
        await stream.__anext__()
    else:
        await client.generate("Hello", max_tokens=4)
    await asyncio.to_thread(wait_for_go)
    stream = client = None
    collect("in the loop")


fds = open_fds()
if KIND == "sync":
    run_sync()
else:
    asyncio.run(run_async())
collect("at the end")
assert open_fds() == fds, f"{open_fds() - fds} descriptors left open"
print("done", flush=True)
"""

WARNING = {"sync": "ResourceWarning: unclosed mlxd Client",
           "async": "ResourceWarning: unclosed mlxd AsyncClient"}


def drop_in_child(address: str, kind: str, way: str, before_drop=lambda: None) -> None:
    """Run CHILD; `before_drop()` runs once it is ready to drop its client. Fails
    unless it exits 0 within CHILD_BOUND_S, having warned of the unclosed client."""
    child = subprocess.Popen(
        [sys.executable, "-W", "always::ResourceWarning", "-c", CHILD, address, kind, way,
         str(GC_BOUND_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = _readline_within(child, CHILD_BOUND_S)
        assert ready == "ready\n", f"the child did not get ready:\n{_rest(child)}"
        before_drop()
        try:
            out, err = child.communicate("", timeout=CHILD_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the child hangs after dropping its client:\n{_rest(child)}")
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == 0, f"exit status {child.returncode}:\n{out}\n{err}"
    assert out.endswith("done\n"), out
    assert WARNING[kind] in err, err


def _readline_within(child: subprocess.Popen, timeout: float) -> str:
    line = []
    reader = threading.Thread(target=lambda: line.append(child.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(timeout)
    if not line:
        child.kill()
        reader.join()
    return line[0]


def _rest(child: subprocess.Popen) -> str:
    """What a child that must end now said."""
    child.kill()
    out, err = child.communicate()
    return f"{out}\n{err}"


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("way", ["after_request", "mid_stream"])
def test_a_dropped_client_never_hangs(server, kind, way):
    drop_in_child(server.address, kind, way)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_client_dropped_after_its_server_went_never_hangs(llama_model, kind):
    server = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning")
    try:
        drop_in_child(server.address, kind, "mid_stream", before_drop=server.stop)
    finally:
        server.stop()
