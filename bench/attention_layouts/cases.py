"""The batches measured, their random KV, and the straightforward reference."""

from dataclasses import dataclass

import mlx.core as mx

from .attend import partial_attention


@dataclass(frozen=True)
class Shape:
    """One attention layer: query heads, KV heads, head dim, dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


@dataclass(frozen=True)
class Case:
    """Rows' KV lengths (positions attended, the new one included); the first
    `prefix_len` positions of every row are one shared prefix; `join_len`: a row
    of that length joins (the join cost is measured)."""

    name: str
    title: str
    lengths: tuple[int, ...]
    prefix_len: int = 0
    join_len: int = 0


def standard_cases(scale: int = 1) -> list[Case]:
    """The issue's four batches; `scale` divides every length and row count (tests)."""
    s = lambda n: max(1, n // scale)
    return [
        Case("A", f"{s(64)} x {s(256)} (reference)", (s(256),) * s(64)),
        Case("B", f"{s(63)} x {s(256)} + 1 x {s(4096)} (ragged)",
             (s(256),) * s(63) + (s(4096),)),
        Case("C", f"{s(64)} x ({s(1024)} shared + {s(32)} own)",
             (s(1024) + s(32),) * s(64), prefix_len=s(1024)),
        Case("D", f"{s(60)} x {s(1280)}, 1 x {s(1280)} joins", (s(1280),) * s(60),
             join_len=s(1280)),
    ]


@dataclass
class Batch:
    """A case's data: queries `[B, Hq, 1, D]`; per row its keys/values
    `[Hkv, L, D]` (rows of a shared-prefix case share the prefix's arrays, also
    given alone as `prefix`, `[Hkv, P, D]` each); the joining row's KV."""

    case: Case
    shape: Shape
    q: mx.array
    rows: list[tuple[mx.array, mx.array]]
    prefix: tuple[mx.array, mx.array] | None
    join_row: tuple[mx.array, mx.array] | None

    @property
    def lengths(self) -> list[int]:
        return list(self.case.lengths)

    def suffix(self, r: int) -> tuple[mx.array, mx.array]:
        """Row r's own positions, after the shared prefix."""
        k, v = self.rows[r]
        p = self.case.prefix_len
        return k[:, p:], v[:, p:]


def make_batch(case: Case, shape: Shape, seed: int = 0) -> Batch:
    key = mx.random.key(seed)
    keys = iter(mx.random.split(key, 2 * len(case.lengths) + 5))

    def kv(n):
        dims = (shape.kv_heads, n, shape.head_dim)
        return (mx.random.normal(dims, key=next(keys)).astype(shape.dtype),
                mx.random.normal(dims, key=next(keys)).astype(shape.dtype))

    prefix = kv(case.prefix_len) if case.prefix_len else None
    rows = []
    for length in case.lengths:
        own = kv(length - case.prefix_len)
        rows.append(own if prefix is None else
                    tuple(mx.concatenate([p, o], axis=1) for p, o in zip(prefix, own)))
    q = mx.random.normal((len(rows), shape.heads, 1, shape.head_dim), key=next(keys))
    batch = Batch(case, shape, q.astype(shape.dtype), rows, prefix,
                  kv(case.join_len) if case.join_len else None)
    mx.eval(batch.q, batch.rows, batch.prefix, batch.join_row)
    return batch


def reference(batch: Batch) -> mx.array:
    """Each row's attention on its own, in float32, heads repeated for GQA:
    `[B, Hq, 1, D]`."""
    g = batch.shape.heads // batch.shape.kv_heads
    outs = []
    for r, (k, v) in enumerate(batch.rows):
        k, v = (mx.repeat(a.astype(mx.float32), g, axis=0) for a in (k, v))
        out, _ = partial_attention(batch.q[r].astype(mx.float32), k, v, batch.shape.scale)
        outs.append(out)
    return mx.stack(outs)
