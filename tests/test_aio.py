"""runtime/aio.py: LoopSocket, ZeroMQ in an asyncio loop with one long-lived watch."""

import asyncio
import threading

import pytest
import zmq
import zmq.asyncio

from runtime.aio import LoopSocket

TIMEOUT = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.fixture
def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)   # closes what a failed test left open


def pair(ctx, kind_a, kind_b, addr="inproc://aio-test"):
    a, b = zmq.Socket(ctx, kind_a), zmq.Socket(ctx, kind_b)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
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
        push = zmq.Socket(ctx, zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.bind("inproc://aio-hwm")   # no peer yet: a send cannot go anywhere
        outbox = LoopSocket(push)
        sending = [asyncio.ensure_future(outbox.send(b"%d" % i)) for i in range(3)]
        await asyncio.sleep(0.2)
        assert not any(s.done() for s in sending)
        pull = zmq.Socket(ctx, zmq.PULL)
        pull.connect("inproc://aio-hwm")
        inbox = LoopSocket(pull)
        await asyncio.gather(*sending)   # every waiting sender is woken
        got = sorted([await inbox.recv() for _ in range(3)])
        outbox.close(0)
        inbox.close(0)
        return got
    assert run(main()) == [b"0", b"1", b"2"]


def test_close_stops_watching_the_socket(ctx):
    async def main():
        pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
        inbox = LoopSocket(pull)
        fd = pull.getsockopt(zmq.FD)
        inbox.close(0)
        inbox.close(0)   # twice is harmless
        assert pull.closed
        assert not asyncio.get_running_loop().remove_reader(fd)
        push.close()
    run(main())
