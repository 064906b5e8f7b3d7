"""A request the SDK cannot encode fails clearly and leaves nothing in flight."""

import asyncio

import pytest

from mlxd.client import AsyncClient, Client, MlxdError

UNPACKABLE = [{"max_tokens": object()}, {"seed": 10**30}, {"stop": [{1, 2}]}]


@pytest.mark.parametrize("params", UNPACKABLE)
def test_unencodable_request_raises_and_frees_its_rid(server, params):
    with Client(server.address, timeout=30) as client:
        with pytest.raises(MlxdError) as err:
            client.generate("Hello", rid="same", **params)
        assert err.value.code == "invalid_request"
        with pytest.raises(MlxdError) as err:
            next(client.stream("Hello", rid="same", **params))
        assert err.value.code == "invalid_request"
        # the rid is free again: not "duplicate_rid"
        assert client.generate("Hello", rid="same", max_tokens=2).finish_reason in (
            "length", "stop")


def test_unencodable_async_request_leaves_nothing_in_flight(server):
    async def main():
        async with AsyncClient(server.address, timeout=30) as client:
            with pytest.raises(MlxdError) as err:
                await client.generate("Hello", rid="same", top_k=object())
            assert err.value.code == "invalid_request"
            return await client.generate("Hello", rid="same", max_tokens=2)

    assert asyncio.run(main()).finish_reason in ("length", "stop")
