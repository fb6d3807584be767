"""Context-parallel attention: ring and Ulysses outputs and gradients equal one process's full
attention (a float64 NumPy reference written here) at 2, 3 and 4 ranks, causal or not, for
both shardings; the messages each sends; the causal work per rank; 16-bit inputs; usage
errors before anything is sent; ranks that disagree. Grouped-query attention (k and v with
fewer heads) against the same reference run on k and v repeated per query head."""

import os

import numpy as np
import pytest

import gpucoll
from gpucoll.cp import (RingAttention, UlyssesAttention, sequence_positions, sequence_segments,
                        shard_sequence, unshard_sequence)
from gpucoll.cp.blockwise import TILE_SCORES, visible_pairs
from mp_harness import rank_pools, run_ranks
from test_nccl_gpu import MULTI_RANK_ENV, on_nccl, two_ranks

pytestmark = pytest.mark.timeout(120)

# ranks share the cores: one BLAS thread each
_ONE_BLAS = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")

BATCH, SEQ, HEADS, DIM = 2, 24, 12, 5     # SEQ splits into 2p chunks and HEADS into p, p <= 4
LAYERS = {"ring": RingAttention, "ulysses": UlyssesAttention}

pool = rank_pools([2, 3, 4], env=_ONE_BLAS, shared=True)


def _inputs(dtype=np.float64, seq=SEQ, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BATCH, seq, HEADS, DIM)).astype(dtype) for _ in range(4)]


def reference_attention(q, k, v, grad_out, causal, scale=None):
    """Softmax attention over the whole sequence and its gradients, float64, (b, s, h, d)."""
    q, k, v, g = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, grad_out))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.swapaxes(-1, -2) * scale
    if causal:
        seq = scores.shape[-1]
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ v
    dv = probs.swapaxes(-1, -2) @ g
    dprobs = g @ v.swapaxes(-1, -2)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    dq, dk = dscores @ k * scale, dscores.swapaxes(-1, -2) @ q * scale
    return [x.transpose(0, 2, 1, 3) for x in (out, dq, dk, dv)]


class Counting:
    """The communicator, recording each sendrecv / all_to_all and the bytes it sent."""

    def __init__(self, comm):
        self._comm, self.calls = comm, []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name in ("sendrecv", "all_to_all", "all_reduce", "all_gather", "send", "isend",
                    "broadcast", "reduce_scatter"):
            def counted(x, *args, **kwargs):
                self.calls.append((name, x.nbytes))
                return attr(x, *args, **kwargs)
            return counted
        return attr


def rank_attention(comm, layer, causal, sharding, dtype=np.float64, tile=None):
    from gpucoll.cp import blockwise

    if tile is not None:        # this rank process's tiles: a few rows each
        blockwise.TILE_SCORES = tile
    try:
        return _attention_counted(comm, layer, causal, sharding, dtype)
    finally:
        blockwise.TILE_SCORES = TILE_SCORES


def _attention_counted(comm, layer, causal, sharding, dtype):
    counting = Counting(comm)
    attention = LAYERS[layer](counting, causal=causal, sharding=sharding)
    q, k, v, grad = (shard_sequence(x, comm.rank, comm.size, sharding)
                     for x in _inputs(dtype))
    out = attention.forward(q, k, v)
    forward_calls = list(counting.calls)
    grads = attention.backward(grad)
    backward_calls = counting.calls[len(forward_calls):]
    return ([out] + list(grads), forward_calls, backward_calls, dict(attention.sent_bytes),
            (q.dtype, out.dtype, grads[0].dtype))


def _check_against_reference(per_rank, sharding, causal, rtol, atol):
    want = reference_attention(*_inputs(), causal)
    for index, name in enumerate(("out", "dq", "dk", "dv")):
        got = unshard_sequence([arrays[index] for arrays, *_ in per_rank], sharding)
        np.testing.assert_allclose(np.asarray(got, np.float64), want[index], rtol=rtol,
                                   atol=atol, err_msg=name)


@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_equals_full_attention_in_one_process(pool, layer, causal, sharding):
    per_rank = pool.run(rank_attention, layer, causal, sharding)
    _check_against_reference(per_rank, sharding, causal, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_tiles_of_a_few_query_rows_give_the_same_result(pool, layer):
    """Score tiles of 300 elements: 2 to 4 rows of a segment at a time, diagonal pairs cut
    into visible, masked and hidden tiles."""
    per_rank = pool.run(rank_attention, layer, True, "zigzag", np.float64, 300)
    _check_against_reference(per_rank, "zigzag", True, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_float32_inputs_stay_float32(pool, layer):
    per_rank = pool.run(rank_attention, layer, True, "zigzag", np.float32)
    assert all(dtypes == (np.float32,) * 3 for *_, dtypes in per_rank)
    _check_against_reference(per_rank, "zigzag", True, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_16_bit_inputs_are_computed_in_float32_and_returned_in_their_type(pool, dtype_name):
    if dtype_name == "bfloat16":
        dtype = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    else:
        dtype = np.dtype(np.float16)
    per_rank = pool.run(rank_attention, "ring", True, "zigzag", dtype)
    assert all(dtypes == (dtype,) * 3 for *_, dtypes in per_rank)
    # the inputs themselves are rounded: compare with the reference on the rounded inputs
    rounded = [np.asarray(x.astype(dtype), np.float64) for x in _inputs()]
    want = reference_attention(*rounded, True)
    tolerance = 2e-2 if dtype_name == "bfloat16" else 3e-3
    for index in range(4):
        got = unshard_sequence([arrays[index] for arrays, *_ in per_rank], "zigzag")
        scale = np.abs(want[index]).max()
        assert np.abs(np.asarray(got, np.float64) - want[index]).max() <= tolerance * scale


def test_ring_messages_per_step(pool):
    """Forward: p - 1 exchanges of one rank's k and v; backward: as many again, and p of the
    key/value gradient; nothing else; sent_bytes agrees."""
    n = pool.world_size
    per_rank = pool.run(rank_attention, "ring", True, "zigzag")
    block = 2 * BATCH * (SEQ // n) * HEADS * DIM * 8
    for _, forward, backward, sent, _ in per_rank:
        assert forward == [("sendrecv", block)] * (n - 1)
        kinds = sorted(backward)
        assert kinds == [("sendrecv", block)] * (2 * n - 1)   # float64: gradients as big
        assert sent == {"forward": (n - 1) * block, "backward": (2 * n - 1) * block}


def test_ring_gradients_travel_in_float32_for_16_bit_inputs(pool):
    n = pool.world_size
    per_rank = pool.run(rank_attention, "ring", False, "contiguous", np.float16)
    block16 = 2 * BATCH * (SEQ // n) * HEADS * DIM * 2
    for _, forward, backward, sent, _ in per_rank:
        assert forward == [("sendrecv", block16)] * (n - 1)
        assert sorted(backward) == sorted([("sendrecv", block16)] * (n - 1)
                                          + [("sendrecv", 2 * block16)] * n)


def test_ulysses_messages(pool):
    """Two all-to-alls each way: q, k, v packed, then the output; the output gradient, then
    dq, dk, dv packed."""
    n = pool.world_size
    per_rank = pool.run(rank_attention, "ulysses", True, "contiguous")
    one = BATCH * (SEQ // n) * HEADS * DIM * 8
    for _, forward, backward, sent, _ in per_rank:
        assert forward == [("all_to_all", 3 * one), ("all_to_all", one)]
        assert backward == [("all_to_all", one), ("all_to_all", 3 * one)]
        assert sent == {"forward": 4 * one * (n - 1) // n, "backward": 4 * one * (n - 1) // n}


# ---------------------------------------------------------------------------- grouped-query attention
KV_HEADS = [1, 2, 4]      # multi-query, groups of 6, groups of 3 (one each: the tests above)


def _fitting_kv_heads(size):
    """2 key/value heads, or 1 at 3 ranks (Ulysses cannot spread 2 over 3 ranks)."""
    return 1 if size == 3 else 2


def _grouped_inputs(kv_heads, dtype=np.float64, seq=SEQ, seed=7):
    """q and the output gradient with HEADS heads, k and v with ``kv_heads`` (each head its
    own random values, so a wrong head mapping changes the result)."""
    rng = np.random.default_rng(seed)
    q, grad = (rng.standard_normal((BATCH, seq, HEADS, DIM)) for _ in range(2))
    k, v = (rng.standard_normal((BATCH, seq, kv_heads, DIM)) for _ in range(2))
    return [x.astype(dtype) for x in (q, k, v, grad)]


def reference_grouped_attention(q, k, v, grad_out, causal):
    """Repeat each key/value head for its ``group`` query heads (Hugging Face's
    ``repeat_kv``), attend, and sum the repeated heads' gradients back per key/value head."""
    kv_heads = k.shape[2]
    group = q.shape[2] // kv_heads
    out, dq, dk, dv = reference_attention(q, np.repeat(k, group, axis=2),
                                          np.repeat(v, group, axis=2), grad_out, causal)
    batch, seq, _, dim = k.shape
    return [out, dq] + [g.reshape(batch, seq, kv_heads, group, dim).sum(axis=3)
                        for g in (dk, dv)]


def ulysses_takes(kv_heads, size):
    return kv_heads % size == 0 or size % kv_heads == 0


def rank_grouped(comm, layer, kv_heads, causal, sharding, dtype=np.float64, tile=None):
    """This rank's ``[out, dq, dk, dv]``, the calls it made forward and backward and its
    ``sent_bytes``; the error's text where the layer refuses the inputs."""
    from gpucoll.cp import blockwise

    counting = Counting(comm)
    attention = LAYERS[layer](counting, causal=causal, sharding=sharding)
    q, k, v, grad = (shard_sequence(x, comm.rank, comm.size, sharding)
                     for x in _grouped_inputs(kv_heads, dtype))
    if tile is not None:
        blockwise.TILE_SCORES = tile
    try:
        try:
            out = attention.forward(q, k, v)
        except ValueError as exc:
            return f"ValueError: {exc}", counting.calls
        forward_calls = list(counting.calls)
        grads = attention.backward(grad)
    finally:
        blockwise.TILE_SCORES = TILE_SCORES
    return ([out] + list(grads), forward_calls, counting.calls[len(forward_calls):],
            dict(attention.sent_bytes))


def _check_grouped(per_rank, kv_heads, sharding, causal, dtype=np.float64):
    inputs = [np.asarray(x, np.float64) for x in _grouped_inputs(kv_heads, dtype)]
    want = reference_grouped_attention(*inputs, causal)
    shapes = [(BATCH, SEQ, HEADS, DIM)] * 2 + [(BATCH, SEQ, kv_heads, DIM)] * 2
    for index, name in enumerate(("out", "dq", "dk", "dv")):
        got = unshard_sequence([arrays[index] for arrays, *_ in per_rank], sharding)
        assert got.shape == shapes[index] and got.dtype == dtype, (name, got.shape, got.dtype)
        if dtype == np.float64:
            np.testing.assert_allclose(got, want[index], rtol=1e-10, atol=1e-12, err_msg=name)
        else:   # inputs rounded to 16 bits, the math in float32
            tolerance = 2e-2 if np.dtype(dtype).name == "bfloat16" else 3e-3
            error = np.abs(np.asarray(got, np.float64) - want[index]).max()
            assert error <= tolerance * np.abs(want[index]).max(), (name, error)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_grouped_query_attention_equals_the_repeated_reference(pool, layer, causal, sharding,
                                                               kv_heads):
    n = pool.world_size
    per_rank = pool.run(rank_grouped, layer, kv_heads, causal, sharding)
    if layer == "ulysses" and not ulysses_takes(kv_heads, n):
        for message, calls in per_rank:
            assert message == (
                f"ValueError: UlyssesAttention: {kv_heads} key/value heads can neither be split "
                f"over nor copied to the context-parallel group's {n} ranks (kv_heads must be "
                f"a multiple or a divisor of {n}); RingAttention takes any kv_heads that "
                f"divides heads ({HEADS})") and calls == []
        return
    _check_grouped(per_rank, kv_heads, sharding, causal)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_small_tiles_over_grouped_query_rows(pool, layer):
    """Tiles of 300 scores: each group's rows cut into a few rows at a time."""
    kv_heads = _fitting_kv_heads(pool.world_size)
    per_rank = pool.run(rank_grouped, layer, kv_heads, True, "zigzag", np.float64, 300)
    _check_grouped(per_rank, kv_heads, "zigzag", True)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_16_bit_grouped_inputs(pool, layer, dtype_name):
    if dtype_name == "bfloat16":
        dtype = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    else:
        dtype = np.dtype(np.float16)
    kv_heads = _fitting_kv_heads(pool.world_size)
    per_rank = pool.run(rank_grouped, layer, kv_heads, True, "zigzag", dtype)
    _check_grouped(per_rank, kv_heads, "zigzag", True, dtype)


@pytest.mark.parametrize("kv_heads", KV_HEADS + [HEADS])
def test_ring_sends_keys_and_values_at_their_own_head_count(pool, kv_heads):
    """A ring block is ``2 * batch * local_seq * kv_heads * head_dim`` elements:
    ``kv_heads / heads`` of the block ungrouped attention sends, every step."""
    n = pool.world_size
    per_rank = pool.run(rank_grouped, "ring", kv_heads, True, "zigzag")
    block = 2 * BATCH * (SEQ // n) * kv_heads * DIM * 8
    for _, forward, backward, sent in per_rank:
        assert forward == [("sendrecv", block)] * (n - 1)
        assert backward == [("sendrecv", block)] * (2 * n - 1)
        assert sent == {"forward": (n - 1) * block, "backward": (2 * n - 1) * block}


@pytest.mark.parametrize("kv_heads", KV_HEADS + [HEADS])
def test_ulysses_sends_each_key_value_head_to_the_ranks_that_use_it(pool, kv_heads):
    """q with k and v in one all-to-all: k and v at ``kv_heads`` heads when those split over
    the ranks, else one copy of a head per rank (p heads), never all ``heads``."""
    n = pool.world_size
    if not ulysses_takes(kv_heads, n):
        pytest.skip(f"{kv_heads} key/value heads do not fit {n} ranks (refusal tested above)")
    per_rank = pool.run(rank_grouped, "ulysses", kv_heads, False, "contiguous")
    one = BATCH * (SEQ // n) * HEADS * DIM * 8
    keys_values = 2 * BATCH * (SEQ // n) * max(kv_heads, n) * DIM * 8
    for _, forward, backward, sent in per_rank:
        assert forward == [("all_to_all", one + keys_values), ("all_to_all", one)]
        assert backward == [("all_to_all", one), ("all_to_all", one + keys_values)]
        wire = (2 * one + keys_values) * (n - 1) // n
        assert sent == {"forward": wire, "backward": wire}


# ---------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_and_unshard_are_inverse(size, sharding):
    x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
    parts = [shard_sequence(x, rank, size, sharding) for rank in range(size)]
    assert all(part.flags.c_contiguous and part.shape == (2, 24 // size, 3) for part in parts)
    np.testing.assert_array_equal(unshard_sequence(parts, sharding), x)
    positions = np.concatenate([sequence_positions(24, rank, size, sharding)
                                for rank in range(size)])
    np.testing.assert_array_equal(np.sort(positions), np.arange(24))
    for rank in range(size):
        np.testing.assert_array_equal(parts[rank][0, :, 0] // 3,
                                      sequence_positions(24, rank, size, sharding))


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    assert sequence_segments(16, 1, 4, "zigzag") == [(2, 2), (12, 2)]
    assert sequence_segments(16, 0, 4, "zigzag") == [(0, 2), (14, 2)]
    assert sequence_segments(16, 3, 4, "contiguous") == [(12, 4)]


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(size):
    """Blocks of work per rank over a ring pass (segment pairs with a visible key)."""
    def work(sharding):
        total = 16 * size
        segments = [[(0, start, length) for start, length in
                     sequence_segments(total, rank, size, sharding)] for rank in range(size)]
        return [sum(visible_pairs(segments[rank], segments[other], True)
                    for other in range(size)) for rank in range(size)]

    assert work("contiguous") == list(range(1, size + 1))
    zigzag = work("zigzag")
    assert len(set(zigzag)) == 1 and zigzag[0] == 2 * size + 1


def test_sharding_errors():
    with pytest.raises(ValueError, match="zigzag sharding over 4 ranks needs a sequence length "
                                         "divisible by 8, got 12"):
        sequence_segments(12, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="sharding must be one of"):
        sequence_segments(12, 0, 4, "striped")
    with pytest.raises(ValueError, match="rank 4 is out of range for 4 ranks"):
        sequence_positions(16, 4, 4)
    with pytest.raises(ValueError, match="rank 1's part has 3 tokens, rank 0's 4"):
        unshard_sequence([np.zeros((1, 4)), np.zeros((1, 3))])


# ---------------------------------------------------------------------------- one rank, errors
class SilentComm:
    """A communicator of ``size`` ranks that fails the test if anything is sent."""

    memory = "host"

    def __init__(self, rank=0, size=2):
        self.rank, self.size = rank, size

    def __getattr__(self, name):
        raise AssertionError(f"{name} was called: something was sent")


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_plain_attention(layer, causal):
    q, k, v, grad = _inputs()
    attention = LAYERS[layer](SilentComm(0, 1), causal=causal, scale=0.3)
    got = [attention.forward(q, k, v)] + list(attention.backward(grad))
    for have, want in zip(got, reference_attention(q, k, v, grad, causal, scale=0.3)):
        np.testing.assert_allclose(have, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_bad_inputs_are_refused_before_anything_is_sent(layer):
    attention = LAYERS[layer](SilentComm(), causal=True, sharding="zigzag")
    q = np.zeros((1, 4, 2, 3))
    name = LAYERS[layer].__name__
    cases = [
        (ValueError, r"q must be \(batch, local_seq, heads, head_dim\), got shape \(4, 2, 3\)",
         lambda: attention.forward(q[0], q, q)),
        (ValueError, r"k and v must have one shape, got \(1, 4, 2, 3\), \(1, 2, 2, 3\)",
         lambda: attention.forward(q, q, q[:, :2])),
        (ValueError, r"q and k, v must agree in batch, local_seq and head_dim, got q "
                     r"\(1, 4, 2, 3\), k and v \(1, 2, 2, 3\)",
         lambda: attention.forward(q, q[:, :2], q[:, :2])),
        (TypeError, "q, k and v must have one dtype, got float64, float64, float32",
         lambda: attention.forward(q, q, q.astype(np.float32))),
        (TypeError, "q, k and v must be floating point, got int32",
         lambda: attention.forward(*[q.astype(np.int32)] * 3)),
        (ValueError, "zigzag sharding over 2 ranks needs a sequence length divisible by 4, "
                     "got 6 \\(3 tokens on each of 2 ranks\\)", lambda: attention.forward(*[np.zeros((1, 3, 2, 3))] * 3)),
        (ValueError, r"q, k and v must have no empty axis, got shapes \(0, 4, 2, 3\), \(0, 4, 2, 3\)", lambda: attention.forward(*[np.zeros((0, 4, 2, 3))] * 3)),
        (RuntimeError, r"backward\(\) called before forward\(\)",
         lambda: attention.backward(q)),
    ]
    if layer == "ulysses":
        cases.append((ValueError, "3 heads are not divisible by the context-parallel group "
                                  "size 2", lambda: attention.forward(*[np.zeros((1, 4, 3, 2))] * 3)))
    for error, message, call in cases:
        with pytest.raises(error, match=f"{name}: {message}"):
            call()
    with pytest.raises(ValueError, match="sharding must be one of"):
        LAYERS[layer](SilentComm(), sharding="striped")
    with pytest.raises(ValueError, match="scale must be a positive number, got -1"):
        LAYERS[layer](SilentComm(), scale=-1)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_backward_needs_the_forwards_output_shape_and_runs_once(layer):
    q, k, v, grad = _inputs(seq=8)
    attention = LAYERS[layer](SilentComm(0, 1))
    attention.forward(q, k, v)
    with pytest.raises(ValueError, match=r"grad_out has shape \(2, 7, 12, 5\), the forward's "
                                         r"output \(2, 8, 12, 5\)"):
        attention.backward(grad[:, :7])
    attention.backward(grad)
    with pytest.raises(RuntimeError, match="called before forward"):
        attention.backward(grad)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_one_rank_multi_query_attention(layer):
    q, k, v, grad = _grouped_inputs(1)
    attention = LAYERS[layer](SilentComm(0, 1), causal=True)
    got = [attention.forward(q, k, v)] + list(attention.backward(grad))
    for have, want in zip(got, reference_grouped_attention(q, k, v, grad, True)):
        np.testing.assert_allclose(have, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_bad_grouped_inputs_are_refused_before_anything_is_sent(layer):
    attention = LAYERS[layer](SilentComm(0, 2))
    name = LAYERS[layer].__name__
    q = np.zeros((1, 4, 6, 3))
    cases = [
        (r"q's 6 heads are not a multiple of k and v's 4 heads \(grouped-query attention needs "
         r"heads % kv_heads == 0\)", (q, np.zeros((1, 4, 4, 3)), np.zeros((1, 4, 4, 3)))),
        (r"k and v must have one shape, got \(1, 4, 2, 3\), \(1, 4, 3, 3\)",
         (q, np.zeros((1, 4, 2, 3)), np.zeros((1, 4, 3, 3)))),
        (r"q and k, v must agree in batch, local_seq and head_dim, got q \(1, 4, 6, 3\), k and "
         r"v \(1, 4, 2, 5\)", (q, np.zeros((1, 4, 2, 5)), np.zeros((1, 4, 2, 5)))),
        (r"q and k, v must agree in batch, local_seq and head_dim, got q \(1, 4, 6, 3\), k and "
         r"v \(2, 4, 2, 3\)", (q, np.zeros((2, 4, 2, 3)), np.zeros((2, 4, 2, 3)))),
        (r"q, k and v must have no empty axis, got shapes \(1, 4, 6, 3\), \(1, 4, 0, 3\)",
         (q, np.zeros((1, 4, 0, 3)), np.zeros((1, 4, 0, 3)))),
    ]
    if layer == "ulysses":
        cases.append((r"3 key/value heads can neither be split over nor copied to the "
                      r"context-parallel group's 2 ranks \(kv_heads must be a multiple or a "
                      r"divisor of 2\); RingAttention takes any kv_heads that divides heads "
                      r"\(6\)", (q, np.zeros((1, 4, 3, 3)), np.zeros((1, 4, 3, 3)))))
    for message, (qq, kk, vv) in cases:
        with pytest.raises(ValueError, match=f"{name}: {message}"):
            attention.forward(qq, kk, vv)
    if layer == "ulysses":   # 3 ranks: 1 and 3 key/value heads fit, 2 does not
        attention = LAYERS[layer](SilentComm(0, 3))
        with pytest.raises(ValueError, match="2 key/value heads can neither be split over nor "
                                             "copied to the context-parallel group's 3 ranks"):
            attention.forward(q, np.zeros((1, 4, 2, 3)), np.zeros((1, 4, 2, 3)))


# ---------------------------------------------------------------------------- disagreement
def _forward_outcome(comm, layer, q, k, v):
    """"finished", or the error a forward of ``layer`` raised on this rank, as text."""
    try:
        LAYERS[layer](comm).forward(q, k, v)
        return "finished"
    except gpucoll.GpucollError as exc:
        return f"{type(exc).__name__}: {exc}"


def rank_with_its_own_length(comm, layer):
    q, k, v, _ = _inputs(seq=4 if comm.rank else 6)
    return _forward_outcome(comm, layer, q, k, v)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_ranks_with_different_sequence_lengths_get_an_error_not_a_hang(layer):
    """Rank 0 holds 6 tokens, rank 1 holds 4: the first exchange's sizes differ (ring: k and
    v, 1920 bytes a token; Ulysses: q, k and v, 2880) and both ranks are told both sizes (the
    rank that did not see it first quotes its peer's report if the link went first)."""
    messages = run_ranks(rank_with_its_own_length, 2, layer, timeout=60,
                         env=dict(_ONE_BLAS, GPUCOLL_TIMEOUT="10"))
    per_token = 1920 if layer == "ring" else 2880
    for rank, message in enumerate(messages):
        assert message.startswith(("CollectiveMismatchError", "PeerError")), message
        assert f"rank {rank}" in message
        assert f"{6 * per_token} bytes" in message and f"{4 * per_token} bytes" in message, \
            message


def rank_with_its_own_kv_heads(comm, layer):
    q, k, v, _ = _grouped_inputs(2 if comm.rank == 0 else 4)
    q, k, v = (shard_sequence(x, comm.rank, comm.size) for x in (q, k, v))
    return _forward_outcome(comm, layer, q, k, v)


@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_ranks_with_different_kv_heads_get_an_error_not_a_hang(layer):
    """Rank 0 has 2 key/value heads, rank 1 has 4: the first exchange's sizes differ (ring: k
    and v, 320 bytes a token and key/value head; Ulysses: q with them) and both ranks are
    told both sizes."""
    messages = run_ranks(rank_with_its_own_kv_heads, 2, layer, timeout=60,
                         env=dict(_ONE_BLAS, GPUCOLL_TIMEOUT="10"))
    tokens = SEQ // 2
    queries = 0 if layer == "ring" else tokens * BATCH * HEADS * DIM * 8
    sizes = [queries + tokens * 2 * BATCH * heads * DIM * 8 for heads in (2, 4)]
    for rank, message in enumerate(messages):
        assert message.startswith(("CollectiveMismatchError", "PeerError")), message
        assert f"rank {rank}" in message
        assert all(f"{size} bytes" in message for size in sizes), (sizes, message)


# ---------------------------------------------------------------------------- on a GPU
def _cupy_attention(comm, layer, kv_heads):
    """CuPy arrays; the exchanges on a stream of their own where the backend is NCCL."""
    import cupy

    attention = LAYERS[layer](comm, causal=True, sharding="zigzag")
    q, k, v, grad = (cupy.asarray(shard_sequence(x, comm.rank, comm.size, "zigzag"))
                     for x in _grouped_inputs(kv_heads))
    out = attention.forward(q, k, v)
    grads = attention.backward(grad)
    assert all(isinstance(a, cupy.ndarray) for a in [out, *grads])
    return [cupy.asnumpy(a) for a in [out, *grads]], dict(attention.sent_bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [HEADS, 1])
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_cupy_arrays_over_the_cpu_backend(layer, kv_heads):
    per_rank = run_ranks(_cupy_attention, 2, layer, kv_heads, timeout=120, env=_ONE_BLAS)
    _check_grouped(per_rank, kv_heads, "zigzag", True)


@pytest.mark.gpu
@two_ranks
@pytest.mark.parametrize("kv_heads", [HEADS, 1])
@pytest.mark.parametrize("layer", ["ring", "ulysses"])
def test_over_nccl_two_ranks_on_one_gpu(layer, kv_heads):
    per_rank = run_ranks(on_nccl, 2, _cupy_attention, layer, kv_heads, init=False,
                         env=MULTI_RANK_ENV, timeout=240)
    _check_grouped(per_rank, kv_heads, "zigzag", True)
