"""A request the client abandons is aborted on the server, not run on for nobody."""

import asyncio
import gc

import pytest

from mlxd.client import AsyncClient, Client, MlxdError
from support import wait_until

# long enough that, if nobody aborts them, these still run when the checks below end
LONG = dict(max_tokens=2000, ignore_eos=True)
COUNT = 6


def busy(address: str) -> int:
    with Client(address, timeout=30) as probe:
        stats = probe.stats()
    return stats["running"] + stats["waiting"]


def becomes_idle(address: str) -> bool:
    return wait_until(lambda: busy(address) == 0, 3, interval=0.2)


def start_streams(client: Client, count: int = COUNT) -> list:
    streams = [client.stream("Hello", **LONG) for _ in range(count)]
    for stream in streams:
        next(stream)   # each is running once its first chunk is here
    return streams


def test_closing_a_client_aborts_its_requests(server):
    client = Client(server.address, timeout=30)
    streams = start_streams(client)
    client.close()
    assert becomes_idle(server.address)
    with pytest.raises(MlxdError) as err:
        next(streams[0])
    assert err.value.code == "closed"


def test_leaving_an_async_client_aborts_its_requests(server):
    async def main():
        async with AsyncClient(server.address, timeout=30) as client:
            tasks = [asyncio.ensure_future(client.generate("Hello", **LONG))
                     for _ in range(COUNT)]
            while (await client.stats())["running"] < COUNT:
                await asyncio.sleep(0.05)
        idle = await asyncio.to_thread(becomes_idle, server.address)
        return idle, await asyncio.gather(*tasks, return_exceptions=True)

    idle, results = asyncio.run(main())
    assert idle
    assert all(isinstance(r, MlxdError) and r.code == "closed" for r in results)


def test_a_client_side_timeout_aborts_the_request(server):
    async def main():
        async with AsyncClient(server.address, timeout=0.5) as client:
            # one reply each, at the end: they time out first
            results = await asyncio.gather(*(client.generate("Hello", **LONG)
                                             for _ in range(COUNT)), return_exceptions=True)
            return results, await asyncio.to_thread(becomes_idle, server.address)

    results, idle = asyncio.run(main())
    assert all(isinstance(r, MlxdError) and r.code == "timeout" for r in results)
    assert idle


def test_breaking_out_of_streams_aborts_them(server):
    with Client(server.address, timeout=30) as client:
        for _ in range(COUNT):
            for _chunk in client.stream("Hello", **LONG):
                break
        assert becomes_idle(server.address)


def test_closing_or_dropping_a_stream_aborts_it(server):
    with Client(server.address, timeout=30) as client:
        streams = start_streams(client)
        with streams.pop():
            pass
        streams.pop().close()
        del streams
        gc.collect()
        assert becomes_idle(server.address)
        assert client.generate("Hello", max_tokens=2).finish_reason in ("length", "stop")


def test_breaking_out_of_async_streams_aborts_them(server):
    async def main():
        async with AsyncClient(server.address, timeout=30) as client:
            for _ in range(COUNT):
                async for _chunk in client.stream("Hello", **LONG):
                    break
            kept = client.stream("Hello", **LONG)
            await kept.__anext__()
            await kept.aclose()
            await asyncio.sleep(0.05)   # the aborts leave from the loop
            return await asyncio.to_thread(becomes_idle, server.address)

    assert asyncio.run(main())


def test_a_cancelled_async_generate_is_aborted(server):
    async def main():
        async with AsyncClient(server.address, timeout=30) as client:
            task = asyncio.ensure_future(client.generate("Hello", **LONG))
            while (await client.stats())["running"] < 1:
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            return await asyncio.to_thread(becomes_idle, server.address)

    assert asyncio.run(main())
