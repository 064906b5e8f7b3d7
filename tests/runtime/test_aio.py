"""runtime/aio.py: LoopSocket, ZeroMQ in an asyncio loop with one long-lived watch."""

import asyncio
import threading

import pytest
import zmq
import zmq.asyncio

from mlxd.runtime.aio import LoopSocket

TIMEOUT = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


OPEN: list[zmq.Socket] = []


def new_socket(ctx, kind) -> zmq.Socket:
    """A plain socket that the fixture closes even if the test fails (a socket left
    open would block the context's termination)."""
    sock = zmq.Socket(ctx, kind)
    sock.setsockopt(zmq.LINGER, 0)
    OPEN.append(sock)
    return sock


@pytest.fixture
def ctx():
    c = zmq.asyncio.Context()
    yield c
    while OPEN:
        OPEN.pop().close(0)
    c.term()


def pair(ctx, kind_a, kind_b, addr="inproc://aio-test"):
    a, b = new_socket(ctx, kind_a), new_socket(ctx, kind_b)
    a.bind(addr)
    b.connect(addr)
    return a, b


def test_frames_queued_before_the_first_receive_all_arrive_in_order(ctx):
    async def main():
        pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
        for i in range(500):
            push.send(b"%d" % i)
        inbox = LoopSocket(pull)
        got = [await inbox.recv() for _ in range(500)]
        inbox.close(0)
        push.close()
        return got
    assert run(main()) == [b"%d" % i for i in range(500)]


def test_a_receive_waits_for_a_frame_sent_later_from_another_thread(ctx):
    async def main():
        pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
        inbox = LoopSocket(pull)
        timer = threading.Timer(0.2, lambda: push.send(b"late"))
        timer.start()
        got = await inbox.recv()
        timer.join()
        inbox.close(0)
        push.close()
        return got
    assert run(main()) == b"late"


def test_ping_pong_on_sockets_that_send_and_receive_loses_no_wakeup(ctx):
    """Sends consume ZeroMQ's descriptor signal; a missed drain would hang here."""
    async def main():
        router_sock, dealer_sock = pair(ctx, zmq.ROUTER, zmq.DEALER)
        router, dealer = LoopSocket(router_sock, multipart=True), LoopSocket(dealer_sock)

        async def echo():
            for _ in range(2000):
                ident, frame = await router.recv()
                await router.send_multipart([ident, frame + b"!"])

        server = asyncio.ensure_future(echo())
        for i in range(2000):
            await dealer.send(b"%d" % i)
            assert await dealer.recv() == b"%d!" % i
        await server
        router.close(0)
        dealer.close(0)
    run(main())


def test_sends_at_the_high_water_mark_wait_until_a_peer_takes_them(ctx):
    async def main():
        push = new_socket(ctx, zmq.PUSH)
        push.bind("inproc://aio-hwm")   # no peer yet: a send cannot go anywhere
        outbox = LoopSocket(push)
        sending = [asyncio.ensure_future(outbox.send(b"%d" % i)) for i in range(3)]
        await asyncio.sleep(0.2)
        assert not any(s.done() for s in sending)
        pull = new_socket(ctx, zmq.PULL)
        pull.connect("inproc://aio-hwm")
        inbox = LoopSocket(pull)
        await asyncio.gather(*sending)   # every waiting sender is woken
        got = sorted([await inbox.recv() for _ in range(3)])
        outbox.close(0)
        inbox.close(0)
        return got
    assert run(main()) == [b"0", b"1", b"2"]


@pytest.mark.parametrize("raw_first", [False, True], ids=["wrapper", "socket-closed-first"])
def test_close_stops_watching_the_socket(ctx, raw_first):
    async def main():
        pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
        inbox = LoopSocket(pull)
        fd = pull.getsockopt(zmq.FD)
        if raw_first:   # the wrapper must still let go of the descriptor
            pull.close(0)
        inbox.close(0)
        inbox.close(0)   # twice is harmless
        assert pull.closed
        assert not asyncio.get_running_loop().remove_reader(fd)
        push.close()
    run(main())


def test_receiving_on_a_send_only_socket_is_an_error(ctx):
    async def main():
        push = new_socket(ctx, zmq.PUSH)
        outbox = LoopSocket(push)
        with pytest.raises(TypeError):
            await outbox.recv()
        outbox.close(0)
    run(main())


def full_dealer(ctx, addr, hwm):
    """A ROUTER that reads nothing, and a DEALER filled up to its high-water mark."""
    router = new_socket(ctx, zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, hwm)
    router.bind(addr)
    dealer = new_socket(ctx, zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, hwm)
    dealer.setsockopt(zmq.IDENTITY, b"D")
    dealer.connect(addr)
    queued = 0
    while True:
        try:
            dealer.send(b"fill", zmq.NOBLOCK)
            queued += 1
        except zmq.Again:
            return router, dealer, queued


def test_a_reply_arriving_while_a_sender_waits_at_the_high_water_mark_wakes_the_receiver(ctx):
    """The failed send and the sender's look at the socket's events consume the
    descriptor's signal for the reply; the receiver must be woken anyway."""
    async def main():
        router, dealer_sock, _ = full_dealer(ctx, "inproc://aio-reply", 1)
        dealer = LoopSocket(dealer_sock)
        receiving = asyncio.ensure_future(dealer.recv())
        await asyncio.sleep(0.1)

        async def reply_then_send():
            router.send_multipart([b"D", b"reply"])
            await dealer.send(b"more")

        sending = asyncio.ensure_future(reply_then_send())
        got = await asyncio.wait_for(receiving, 3)
        sending.cancel()
        dealer.close(0)
        router.close(0)
        return got
    assert run(main()) == b"reply"


def test_a_sender_at_the_high_water_mark_is_woken_when_the_receiver_drained_the_signal(ctx):
    async def main():
        router, dealer_sock, queued = full_dealer(ctx, "inproc://aio-writer", 4)
        dealer = LoopSocket(dealer_sock)
        sending = asyncio.ensure_future(dealer.send(b"waiting"))
        await asyncio.sleep(0.1)
        assert not sending.done()

        async def take_all_then_receive():
            for _ in range(queued):
                router.recv_multipart()   # room again: the DEALER is told ...
            return await dealer.recv()    # ... and this receive reads that news first

        receiving = asyncio.ensure_future(take_all_then_receive())
        await asyncio.wait_for(sending, 3)
        receiving.cancel()
        dealer.close(0)
        router.close(0)
    run(main())


def test_close_cancels_whoever_waits(ctx):
    async def main():
        router, dealer_sock, _ = full_dealer(ctx, "inproc://aio-close", 1)
        dealer = LoopSocket(dealer_sock)
        waiting = [asyncio.ensure_future(dealer.send(b"x")) for _ in range(2)]
        waiting.append(asyncio.ensure_future(dealer.recv()))
        await asyncio.sleep(0.1)
        dealer.close(0)
        done, pending = await asyncio.wait(waiting, timeout=3)
        router.close(0)
        return [t.cancelled() for t in done], pending
    cancelled, pending = run(main())
    assert not pending and cancelled == [True, True, True]


def test_socket_cpu_bench_reports_every_way():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "bench.socket_cpu", "--messages", "20",
                          "--period-ms", "1", "--repeats", "1"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if "us CPU per received message" in line]
    assert [line.split()[0] for line in lines] == ["zmq.asyncio", "LoopSocket", "blocking"]


def test_recv_nowait_takes_waiting_frames_and_recv_still_wakes_after(ctx):
    async def main():
        pull, push = pair(ctx, zmq.PULL, zmq.PUSH, "inproc://aio-nowait")
        inbox = LoopSocket(pull)
        assert inbox.recv_nowait() is None
        push.send(b"a")
        push.send(b"b")
        await asyncio.sleep(0.05)
        taken = [inbox.recv_nowait(), inbox.recv_nowait(), inbox.recv_nowait()]
        waiter = asyncio.ensure_future(inbox.recv())   # asleep until the next frame
        await asyncio.sleep(0.05)
        threading.Thread(target=push.send, args=(b"c",)).start()
        later = await waiter
        inbox.close(0)
        push.close()
        return taken, later
    assert run(main()) == ([b"a", b"b", None], b"c")
