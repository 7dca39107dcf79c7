"""hvd_aps.peers against references written apart from it, in the simplest form: NCCL's ring and tree
simulated step by step with torch's own dtypes (half, bfloat16, float8_e4m3fn, float8_e5m2) doing every
cast and add, the tree's topology ported line by line from NCCL's trees.cc/connect.cc and checked
against the trees NCCL's comments draw, and hvd_aps's own exchange (emulate.codes_allreduce).
"""
import numpy as np
import pytest
import torch

import hvd_aps
from hvd_aps import emulate, peers, scaling
from hvd_aps.peers import Wire

TORCH = {Wire.BFLOAT16: torch.bfloat16, Wire.FLOAT16: torch.float16,
         Wire.FLOAT8_E4M3: torch.float8_e4m3fn, Wire.FLOAT8_E5M2: torch.float8_e5m2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# torch references ---------------------------------------------------------------------------------
def t_cast(x, dtype):
    """CUDA's conversion: nearest-even, FP8 saturating to +-max (torch's own cast would give NaN)."""
    if dtype in FP8:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)


def t_add(a, b):
    """NCCL's FuncSum: bf16/half add rounded once; FP8 added in half, then cast back."""
    if a.dtype in FP8:
        return t_cast(a.to(torch.float16) + b.to(torch.float16), a.dtype)
    return a + b


def t_inputs(arrays, dtype, avg):
    """Each rank's input in dtype; ncclAvg: times float(1.0/N) in dtype (FP8: multiplied in half)."""
    held = [t_cast(torch.from_numpy(a.copy()), dtype) for a in arrays]
    if avg:
        scalar = t_cast(torch.tensor(1.0 / len(arrays), dtype=torch.float32), dtype)
        half = torch.float16 if dtype in FP8 else dtype
        held = [t_cast(h.to(half) * scalar.to(half), dtype) for h in held]
    return held


def ring_reference(held):
    """runRing's steps: rank r sends chunk r-1, then at step j adds its own part of chunk r-j to what
    rank r-1 sent; after step N rank r holds chunk r; the all-gather concatenates."""
    n, count = len(held), held[0].numel()
    align = 16 // held[0].element_size()
    size = ((count + n - 1) // n + align - 1) // align * align

    def chunk(t, c):
        return t[c * size:(c + 1) * size]

    sent = {r: chunk(held[r], (r - 1) % n) for r in range(n)}
    for j in range(2, n + 1):
        sent = {r: t_add(chunk(held[r], (r - j) % n), sent[(r - 1) % n]) for r in range(n)}
    return torch.cat([sent[c] for c in range(n)]).float().numpy()


def nccl_btree(nranks, rank):
    """ncclGetBtree, line by line: (up, down0, down1)."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1)
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, down0, down1


def nccl_dtree(nranks, rank, which):
    """ncclGetDtree: tree 0 the btree; tree 1 shifted by one (odd nranks) or mirrored (even)."""
    if which == 0:
        return nccl_btree(nranks, rank)
    if nranks % 2 == 1:
        u, d0, d1 = nccl_btree(nranks, (rank - 1 + nranks) % nranks)
        return tuple(-1 if v == -1 else (v + 1) % nranks for v in (u, d0, d1))
    u, d0, d1 = nccl_btree(nranks, nranks - 1 - rank)
    return tuple(-1 if v == -1 else nranks - 1 - v for v in (u, d0, d1))


def nccl_tree_down(nranks, local_ranks, which):
    """ncclTopoPreset's chain and connectTrees' setTreeDown, rank by rank: tree.down of every rank."""
    nnodes = nranks // local_ranks
    intra = [list(range(n * local_ranks, (n + 1) * local_ranks)) for n in range(nnodes)]
    child0_index, child1_index = (0, 0) if local_ranks == 1 else (1, 0)  # TREE, BALANCED_TREE
    down = {}
    for rank in range(nranks):
        node, i = divmod(rank, local_ranks)
        down[rank] = [] if i == local_ranks - 1 else [intra[node][i + 1]]
        _, d0, d1 = nccl_dtree(nnodes, node, which)
        if rank == intra[node][child0_index] and d0 != -1:
            down[rank].append(intra[d0][0])
        if rank == intra[node][child1_index] and d1 != -1:
            down[rank].append(intra[d1][0])
    return down


def tree_reference(held, local_ranks, which):
    down = nccl_tree_down(len(held), local_ranks, which)
    root = [r for r in down if all(r not in d for d in down.values())]
    assert len(root) == 1

    def up(rank):  # own input first, then each child's sum in down[] order
        acc = held[rank]
        for child in down[rank]:
            acc = t_add(acc, up(child))
        return acc
    return up(root[0]).float().numpy()


# data -------------------------------------------------------------------------------------------
def ranks_data(n, count, wire, seed):
    """Log-uniform magnitudes over many binades, random signs: sums whose rounding depends on
    the order; FP8 ones that flush and saturate."""
    rng = np.random.default_rng(seed)
    lo, hi = (-14, 9) if wire.is_fp8 else (-30, 6)
    return [(rng.choice([-1, 1], count) * 2.0 ** rng.uniform(lo, hi, count)).astype(np.float32)
            for _ in range(n)]


CASES = [(n, wire) for n in (2, 3, 5, 8) for wire in Wire]


@pytest.mark.parametrize("n, wire", CASES)
def test_ring_is_nccl_runring_step_by_step_in_torch_dtypes(n, wire):
    arrays = ranks_data(n, 203, wire, seed=n)
    for op in peers.Op:
        want = ring_reference(t_inputs(arrays, TORCH[wire], op is peers.Op.AVG))
        np.testing.assert_array_equal(peers.nccl_ring_allreduce(arrays, wire, op), want)


def test_the_ring_order_matters_and_chunks_start_where_nccl_starts_them():
    """bfloat16, 3 ranks, 8 elements a chunk: chunk 0 is summed by ranks 1, 2, 0 and chunk 1 by
    ranks 2, 0, 1. 1 + 2**-8 is a tie that rounds to 1: 1 + t + t is 1, but t + t + 1 is 1 + 2**-7."""
    t = 2.0 ** -8

    def ranks(*pairs):  # each rank's elements 0 (chunk 0) and 8 (chunk 1)
        out = [np.zeros(16, np.float32) for _ in pairs]
        for x, (first, second) in zip(out, pairs):
            x[0], x[8] = first, second
        return out

    got = peers.nccl_ring_allreduce(ranks((t, t), (1, t), (t, 1)), "bfloat16")
    assert got[0] == 1 and got[8] == 1  # the 1 comes first: rank 1 in chunk 0, rank 2 in chunk 1
    got = peers.nccl_ring_allreduce(ranks((1, t), (t, 1), (t, t)), "bfloat16")
    assert got[0] == 1 + 2 * t and got[8] == 1 + 2 * t  # the 1 comes last: rank 0, rank 1


def test_fp8_sums_widen_to_half_and_saturate():
    """448 + 448 is 896 in half, 448 in e4m3 (satfinite, not NaN); e5m2's 57344 + 57344 overflows
    half to Inf, which saturates to 57344; a NaN stays NaN."""
    e4, e5 = Wire.FLOAT8_E4M3, Wire.FLOAT8_E5M2
    assert peers.nccl_ring_allreduce([np.float32([448, 1e9])] * 2, e4).tolist() == [448, 448]
    assert peers.nccl_ring_allreduce([np.float32([57344, np.inf])] * 2, e5).tolist() == [57344, 57344]
    assert np.isnan(peers.nccl_ring_allreduce([np.float32([np.nan]), np.float32([1])], e4)).all()
    # ncclAvg in e4m3 at 1024 ranks: the scalar 2**-10 rounds to 0 (half the smallest subnormal, to even)
    assert peers.cast(np.float32(1.0 / 1024), e4) == 0 and peers.cast(np.float32(1.0 / 512), e4) == 2.0 ** -9


@pytest.mark.parametrize("n, per_node", [(3, 8), (8, 8), (4, 2), (6, 2), (8, 2), (5, 1), (12, 4)])
@pytest.mark.parametrize("wire", [Wire.BFLOAT16, Wire.FLOAT8_E4M3])
def test_tree_is_nccl_double_tree_in_torch_dtypes(n, per_node, wire):
    arrays = ranks_data(n, 101, wire, seed=n + per_node)
    half = 50
    for op in peers.Op:
        held = t_inputs(arrays, TORCH[wire], op is peers.Op.AVG)
        want = np.concatenate([tree_reference([h[:half] for h in held], min(per_node, n), 0),
                               tree_reference([h[half:] for h in held], min(per_node, n), 1)])
        np.testing.assert_array_equal(peers.nccl_tree_allreduce(arrays, wire, op, ranks_per_node=per_node), want)


def test_tree_topology_is_the_one_nccl_comments_draw():
    """trees.cc draws the btree of 14 ranks and the mirrored twin of 12 (one rank a node)."""
    drawn = {0: [8], 8: [4, 12], 4: [2, 6], 12: [10, 13], 2: [1, 3], 6: [5, 7], 10: [9, 11]}
    assert {r: d for r, d in enumerate(peers.tree_children(14, 1)) if d} == drawn
    twin = {11: {3}, 3: {1, 7}, 1: {0, 2}, 7: {5, 9}, 5: {4, 6}, 9: {8, 10}}
    assert {r: set(d) for r, d in enumerate(peers.tree_children(12, 1, second=True)) if d} == twin
    for n, g in [(16, 4), (24, 8), (10, 2), (7, 1)]:
        for which in (0, 1):
            assert peers.tree_children(n, g, which == 1) == [nccl_tree_down(n, g, which)[r] for r in range(n)]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("wire", [Wire.BFLOAT16, Wire.FLOAT16])
def test_torch_hook_casts_then_divides_then_sums(n, wire):
    arrays = ranks_data(n, 203, wire, seed=10 + n)
    dtype = TORCH[wire]
    held = [torch.from_numpy(a.copy()).to(dtype) for a in arrays]
    if n & (n - 1) == 0:  # torch's own div_ (on the CPU it divides; by a power of two that is the CUDA multiply)
        held = [h.div_(n) for h in held]
    else:  # the CUDA kernel: times the float32 reciprocal
        held = [(h.float() * (torch.tensor(1.0) / n)).to(dtype) for h in held]
    np.testing.assert_array_equal(peers.torch_hook_allreduce(arrays, wire), ring_reference(held))


def test_torch_hook_pre_divides_so_large_sums_do_not_overflow():
    """fp16: 8 x 32768 overflows half; divided first, it does not."""
    arrays = [np.full(16, 32768, np.float32)] * 8
    assert np.isinf(peers.nccl_ring_allreduce(arrays, "float16")).all()
    np.testing.assert_array_equal(peers.torch_hook_allreduce(arrays, "float16"), 32768)


@pytest.mark.parametrize("wire", [Wire.FLOAT8_E4M3, Wire.FLOAT8_E5M2])
def test_scaled_fp8_is_aps_shift_then_nccl_fp8_ring(wire):
    for n in (2, 3, 8):
        arrays = [(a * 1e-4).astype(np.float32) for a in ranks_data(n, 203, Wire.BFLOAT16, seed=n)]
        shift = scaling.shift_for(max(float(np.abs(a).max()) for a in arrays), n, wire.fmt)
        total = ring_reference(t_inputs([np.ldexp(a, shift) for a in arrays], TORCH[wire], False))
        want = np.ldexp(total, -shift) / np.float32(n)
        np.testing.assert_array_equal(peers.scaled_fp8_allreduce(arrays, wire), want)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m0"])
def test_aps_allreduce_is_the_codes_exchange_bit_for_bit(fmt):
    """emulate.allreduce alone lacks the owner's per-block re-encode; with it, the codes exchange."""
    for n in (2, 4, 8):
        rng = np.random.default_rng(n)
        grads = [[(rng.standard_normal(k) * 10.0 ** rng.uniform(-6, 0, k)).astype(np.float32) for k in (5000, 3000)]
                 for _ in range(n)]
        codes = emulate.codes_allreduce([hvd_aps.APSCompressor(fmt, stats=False) for _ in range(n)], grads)
        for t in range(2):
            arrays = [g[t] for g in grads]
            assert peers.aps_allreduce(arrays, fmt).tobytes() == codes[t].tobytes()
            assert not np.array_equal(emulate.allreduce(arrays, fmt), codes[t])
    # error feedback's first step: no residuals yet, the same bits
    ef = emulate.codes_allreduce([hvd_aps.APSCompressor(fmt, error_feedback=True, stats=False) for _ in range(n)],
                                 grads)
    assert ef[0].tobytes() == codes[0].tobytes()
    with pytest.raises(ValueError, match="power-of-two"):
        peers.aps_allreduce(arrays[:3], fmt)
