"""--kv-bits: worker_proc/kv_quant.py's formats, the pool and the decode pages holding
quantized KV, and the paged attention over quantized pages (gather_qmm) against the
same attention over the dequantized pages."""

import mlx.core as mx
import numpy as np
import pytest

from mlxd.worker_proc.decode_pages import PageArena, paged_attention, step_pairs
from mlxd.worker_proc.kv_pool import KVGeometry, KVPool
from mlxd.worker_proc.kv_quant import KVFormat, rotation, rotation_signs

PAGE = 16


def test_formats_count_their_bytes():
    assert KVFormat.of(mx.float32, 8, 96).group == 32
    f8 = KVFormat.of(mx.float32, 8, 64)
    assert f8.token_bytes(64) == 64 + 2 * 2 * 4        # codes, two scales and biases
    assert KVFormat(mx.float32).token_bytes(64) == 256
    assert KVFormat.of(mx.float32, 4, 64).token_bytes(64) == 32 + 2 * 2 * 4
    with pytest.raises(ValueError, match="divisible by 32"):
        KVFormat.of(mx.float32, 8, 48)
    with pytest.raises(ValueError, match="takes 4, 8"):
        KVFormat.of(mx.float32, 3, 64)
    # larger groups: fewer scales and biases (float16 KV: 1.78x at 32, 1.94x at 128)
    assert KVFormat.of(mx.float16, 8, 128, 128).token_bytes(128) == 128 + 2 * 2
    assert 256 / KVFormat.of(mx.float16, 8, 128, 128).token_bytes(128) >= 1.9
    assert 256 / KVFormat.of(mx.float16, 8, 128).token_bytes(128) < 1.8
    with pytest.raises(ValueError, match="divisible by 128"):
        KVFormat.of(mx.float32, 8, 64, 128)
    with pytest.raises(ValueError, match="--kv-group-size takes 32, 64, 128"):
        KVFormat.of(mx.float32, 8, 64, 16)


@pytest.mark.parametrize("bits,tolerance", [(8, 0.03), (4, 0.5)])
def test_encode_decode_is_close(bits, tolerance):
    fmt = KVFormat.of(mx.float32, bits, 64)
    x = mx.random.normal((5, 3, 64))
    parts = fmt.encode(x)
    assert [p.shape[-1] for p in parts] == [64 * bits // 32, 2, 2]
    assert mx.abs(fmt.decode(parts) - x).max().item() < tolerance


# the sign flips stored entries depend on (a change needs a new kv_quant.ROTATION)
SIGNS_64 = "0010001000011100011100100011010011100000101000000100100001100000"


@pytest.mark.parametrize("dim", [64, 96, 128])
def test_the_rotation_is_orthogonal_and_pinned(dim):
    r = np.array(rotation(dim))
    assert np.allclose(r @ r.T, np.eye(dim), atol=1e-6)
    block = dim & -dim
    assert set(np.round(np.abs(r[r != 0]) * np.sqrt(block), 6)) == {1.0}
    assert "".join("1" if s < 0 else "0" for s in rotation_signs(64)) == SIGNS_64
    assert np.array_equal(np.sign(r[np.arange(dim), np.arange(dim) // block * block]),
                          rotation_signs(dim))   # row i's sign: its first block entry's


def test_rotated_groups_hold_heads_with_outlier_channels_more_closely():
    """A few channels carrying most of a head's magnitude (as keys have) coarsen
    every group they are in; rotated, the error is what a like-ranged head gets."""
    x = mx.random.normal((256, 2, 64), key=mx.random.key(1))
    x = x * mx.array([12.0 if c in (3, 40) else 1.0 for c in range(64)])
    fmt = KVFormat.of(mx.float32, 8, 64)
    plain = mx.dequantize(*mx.quantize(x, group_size=32, bits=8), group_size=32, bits=8)

    def rms(e):
        return mx.sqrt(mx.mean(e * e)).item()

    assert rms(fmt.decode(fmt.encode(x)) - x) < 0.75 * rms(plain - x)   # measured: 0.61


def test_a_quantized_pool_holds_more_tokens_per_byte_and_reads_back_close():
    plain = KVGeometry(2, 2, 32, 32, mx.float32)
    packed = KVGeometry(2, 2, 32, 32, mx.float32, k_bits=8, v_bits=4)
    assert plain.bytes_per_token / packed.bytes_per_token >= 1.9
    pool = KVPool(packed, 64)
    assert pool.nbytes < KVPool(plain, 64).nbytes / 1.9
    keys, values = mx.random.normal((4, 2, 32)), mx.random.normal((4, 2, 32))
    slots = mx.array([3, 9, 1, 64], mx.int32)
    pool.write(0, slots, keys, values)
    got_k, got_v = pool.read(0, slots)   # head-major: [heads, n, dim]
    assert mx.abs(got_k - keys.swapaxes(0, 1)).max().item() < 0.05
    assert mx.abs(got_v - values.swapaxes(0, 1)).max().item() < 0.5
    raw = pool.read_raw(0, slots)   # as stored: codes, scales, biases of each side
    assert [a.dtype for a in raw] == [mx.uint32, mx.float32, mx.float32] * 2
    pool.write_raw(1, slots, raw)
    assert mx.array_equal(pool.read(1, slots)[0], got_k).item()


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("dim,group,dtype,atol", [
    (32, 32, mx.float32, 1e-4), (128, 128, mx.float32, 1e-4), (64, 64, mx.float16, 2e-2)])
def test_paged_attention_over_quantized_pages_is_attention_over_their_values(
        slots, dim, group, dtype, atol):
    heads, hq, rows = 2, 4, 3
    mx.random.seed(dim + slots)
    arena = PageArena(1, heads, dim, dim, dtype, 12, PAGE, k_bits=8, v_bits=4, group=group)
    lengths = [20, 5, 40]
    tables = [arena.allocate(-(-n // PAGE)) for n in lengths]
    for table, n in zip(tables, lengths):
        for i, page in enumerate(table):
            m = min(PAGE, n - i * PAGE)
            arena.write_run(0, page, mx.random.normal((heads, m, dim)),
                            mx.random.normal((heads, m, dim)))
    pairs = step_pairs(tables, lengths, arena, queries=[slots] * rows)
    q = mx.random.normal((rows, hq, slots, dim)).astype(dtype)
    got = paged_attention(q, arena.keys[0], arena.values[0], pairs, PAGE, 0.2, None,
                          arena.k_format, arena.v_format)
    # the same pages, dequantized, attended in float32
    keys = arena.k_format.decode(arena.keys[0]).astype(mx.float32)
    values = arena.v_format.decode(arena.values[0]).astype(mx.float32)
    want = paged_attention(q.astype(mx.float32), keys, values, pairs, PAGE, 0.2)
    assert got.dtype == dtype
    assert np.allclose(np.asarray(got.astype(mx.float32)), np.asarray(want), atol=atol)


def test_pages_written_per_position_read_back_close():
    arena = PageArena(2, 2, 32, 32, mx.float32, 4, PAGE, k_bits=8, v_bits=8)
    [page] = arena.allocate(1)
    keys = mx.random.normal((2, 32))
    arena.write(1, mx.array([0, 1]), mx.array([page * PAGE + 3] * 2), keys, keys)
    stored = arena.k_format.decode(arena.keys[1])[:, page * PAGE + 3]
    assert mx.abs(stored - keys).max().item() < 0.05
    assert not arena.k_format.decode(arena.keys[0]).any().item()   # another layer untouched
    arena._grow(8)   # growth copies every part
    assert mx.array_equal(arena.k_format.decode(arena.keys[1])[:, page * PAGE + 3], stored).item()
