"""ModelRunner on sliding-window and recurrent-state models against mlx_lm: batched,
alone, longer than the window, in chunks (state carried in a state slot), with
overlap on and off."""

import pytest

import test_model_runner
from mlxd.protocol import PrefillInput, SamplingParams, Step
from support import PROMPTS, encode, reference_tokens

MAX_TOKENS = 12
WINDOWED = ["gemma3_text", "gpt_oss", "cohere2"]
RECURRENT = ["qwen3_next", "lfm2", "mamba2", "falcon_h1", "granitemoehybrid"]
LONG = " ".join(PROMPTS)   # longer than the test models' 8-token windows


class Driver(test_model_runner.Driver):
    """Plays the scheduler: books token slots and state slots, records the tokens."""

    def __init__(self, model_path: str, overlap: bool = False, state_slots: int = 16,
                 window_capacity: int = 0):
        super().__init__(model_path, overlap=overlap, state_slots=state_slots,
                         window_capacity=window_capacity)

    def prefill(self, rid, ids, prefix=(), needs_logits=True, state_from=0, state_slot=0):
        return PrefillInput(rid, ids, list(prefix), self.new_slots(rid, len(ids), len(prefix)),
                            SamplingParams(), needs_logits, state_from=state_from,
                            state_slot=state_slot)

    def chunks(self, rid: int, ids: list[int], size: int) -> None:
        """Prefill `ids` in chunks of `size`, the state carried in state slot rid + 1."""
        for start in range(0, len(ids), size):
            last = start + size >= len(ids)
            stateful = self.runner.pool.states is not None
            self.step([self.prefill(rid, ids[start:start + size],
                                    self.slot_ids.get(rid, [])[:start], needs_logits=last,
                                    state_from=rid + 1 if start and stateful else 0,
                                    state_slot=0 if last or not stateful else rid + 1)])

    def finish(self, n: int = MAX_TOKENS) -> None:
        while self.running:
            self.step(releases=[r for r in self.running if len(self.out[r]) >= n])
        self.runner.close()


def assert_matches(path, ids, got):
    ref = reference_tokens(path, ids, MAX_TOKENS)
    got = got[:len(ref)]
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert max(abs(a[1] - b[1]) for a, b in zip(got, ref)) < 1e-3


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
@pytest.mark.parametrize("arch", WINDOWED + RECURRENT)
def test_staggered_batch_matches_mlx_lm(arch, overlap, hybrid_model):
    path = hybrid_model(arch)
    d = Driver(path, overlap)
    ids = [encode(path, p) for p in PROMPTS] + [encode(path, LONG)]
    for step in range(4):   # rows join a running batch, prompts of many lengths
        d.step([d.prefill(r, ids[r]) for r in range(len(ids)) if r % 4 == step])
    d.finish()
    for r in range(len(ids)):
        assert_matches(path, ids[r], d.out[r])


@pytest.mark.parametrize("arch", WINDOWED + RECURRENT)
def test_each_prompt_alone_matches_mlx_lm(arch, hybrid_model):
    path = hybrid_model(arch)
    for prompt in (PROMPTS[0], PROMPTS[4], LONG):
        d = Driver(path)
        ids = encode(path, prompt)
        d.step([d.prefill(0, ids)])
        d.finish()
        assert_matches(path, ids, d.out[0])


@pytest.mark.parametrize("size", [3, 5, 11])
@pytest.mark.parametrize("arch", WINDOWED + RECURRENT)
def test_chunked_prefill_matches_mlx_lm(arch, size, hybrid_model):
    """Chunks that split the window; the recurrent state crosses chunks in a slot."""
    run_two_chunked(hybrid_model(arch), Driver, size)


def run_two_chunked(path: str, driver, size: int):
    """A long prompt and a short one in chunks of `size`, the second joining the first
    while it runs; both must match mlx_lm. Returns the driver."""
    d = driver(path)
    ids = [encode(path, LONG), encode(path, PROMPTS[6])]
    d.chunks(0, ids[0], size)
    d.chunks(1, ids[1], size)   # joins a running row
    d.finish()
    for r in range(2):
        assert_matches(path, ids[r], d.out[r])
    return d


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_prefix_without_its_state_is_refused(arch, hybrid_model):
    d = Driver(hybrid_model(arch))
    ids = encode(hybrid_model(arch), LONG)
    d.step([d.prefill(0, ids[:5], needs_logits=False, state_slot=1)])
    with pytest.raises(ValueError, match="state"):
        d.runner.run(Step(9, prefills=[d.prefill(0, ids[5:], d.slot_ids[0][:5])]))
    with pytest.raises(ValueError, match="state slot"):
        d.runner.run(Step(10, prefills=[d.prefill(1, ids, state_slot=17)]))


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_prefix_resumed_from_a_snapshot_matches_mlx_lm(arch, hybrid_model):
    """A request fills the pool and a snapshot slot; others extend its prompt from
    there (alone and as a group with a plain row beside them)."""
    path = hybrid_model(arch)
    d = Driver(path)
    base = encode(path, LONG)
    d.step([PrefillInput(0, base[:30], [], d.new_slots(0, 30), SamplingParams(),
                         needs_logits=False, snapshot_slot=9)])
    tails = [base[30:], base[30:40], encode(path, PROMPTS[1])[1:]]
    d.step([d.prefill(1 + i, tail, d.slot_ids[0], state_from=9) for i, tail in
            enumerate(tails[:2])] + [d.prefill(3, encode(path, PROMPTS[2]))])
    d.step([d.prefill(4, tails[2], d.slot_ids[0], state_from=9)])
    d.finish()
    for rid, tail in zip((1, 2, 4), tails):
        assert_matches(path, base[:30] + tail, d.out[rid])
    assert_matches(path, encode(path, PROMPTS[2]), d.out[3])


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next", "falcon_h1"])
def test_forward_pieces_within_one_prefill_match_mlx_lm(arch, hybrid_model):
    """A prompt longer than the worker's forward size runs as several forwards on
    the same caches (evaluated between them)."""
    path = hybrid_model(arch)
    d = Driver(path)
    d.runner.prefill_step_size = 6
    ids = encode(path, LONG)
    d.step([d.prefill(0, ids)])
    d.finish()
    assert_matches(path, ids, d.out[0])


@pytest.mark.parametrize("arch", RECURRENT)
def test_rows_from_states_after_prefixes_of_different_lengths_match_mlx_lm(arch, hybrid_model):
    """Rows resuming from stored states with equally many new tokens share a forward,
    their prefixes left-padded to the longest: that padding is the KV's only; the
    recurrent layers must still read every new token of the shorter-prefix rows
    (a retracted request resuming beside a prompt's short last chunk)."""
    path = hybrid_model(arch)
    d = Driver(path)
    base = encode(path, LONG)
    d.step([PrefillInput(0, base[:6], [], d.new_slots(0, 6), SamplingParams(),
                         needs_logits=False, state_slot=1, snapshot_slot=8)])
    d.step([PrefillInput(0, base[6:30], d.slot_ids[0][:6], d.new_slots(0, 24),
                         SamplingParams(), needs_logits=False, state_from=1,
                         snapshot_slot=9)])
    tails = {1: (6, 8, base[30:35]), 2: (30, 9, base[40:45]), 3: (6, 8, base[50:55])}
    d.step([d.prefill(rid, tail, d.slot_ids[0][:n], state_from=snap)
            for rid, (n, snap, tail) in tails.items()])
    d.finish()
    for rid, (n, _, tail) in tails.items():
        assert_matches(path, base[:n] + tail, d.out[rid])
