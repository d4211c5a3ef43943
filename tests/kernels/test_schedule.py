"""Tile-schedule logic of the CUDA kernels, on the CPU, against brute force over random masks.

``runtime/schedule.py`` states what the kernels do (which blocks run, which token rows each
touches, which groups gemm_k walks, which KV heads decode reads); these tests pin it down with
plain Python loops, so a GPU run only has to check that the kernels follow the schedule.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from wide_cli.runtime import ops
from wide_cli.runtime.cuda import builds, schedule

# (M, G, p_execute): decode, odd prefill, all-skip, all-execute, one group, more groups than tokens
CASES = [(1, 4, 0.5), (7, 3, 0.5), (129, 5, 0.3), (64, 8, 0.0), (33, 6, 1.0), (50, 1, 0.5), (3, 40, 0.5)]


def _mask(M, G, p, seed=0, structured=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if structured:  # whole groups on/off for runs of tokens (what a router often does)
        runs = torch.rand(math.ceil(M / 8), G, generator=g) < p
        return runs.repeat_interleave(8, dim=0)[:M]
    return torch.rand(M, G, generator=g) < p


def _brute_order(mask):
    M, G = mask.shape
    rows = []
    for j in range(G):
        ex = [m for m in range(M) if mask[m, j]]
        sk = [m for m in range(M) if not mask[m, j]]
        rows.append(ex + sk)
    return rows


@pytest.mark.parametrize("M,G,p", CASES)
@pytest.mark.parametrize("structured", [False, True])
def test_reorder_matches_brute_force_and_reference(M, G, p, structured):
    mask = _mask(M, G, p, seed=M * 31 + G, structured=structured)
    order, counts = schedule.reorder_mask(mask)
    assert order.dtype == torch.int32 and counts.dtype == torch.int32
    assert order.shape == (G, M) and counts.shape == (G,)
    assert order.tolist() == _brute_order(mask)
    assert counts.tolist() == mask.sum(0).tolist()
    ref_order, ref_counts = ops.group_token_lists(mask)  # the runtime's own definition
    assert torch.equal(order.long(), ref_order) and torch.equal(counts.long(), ref_counts)


def test_reorder_batched_equals_per_row():
    mask = torch.rand(3, 11, 4, generator=torch.Generator().manual_seed(1)) < 0.4  # [B, T, H]
    order, counts = schedule.reorder_mask(mask)
    assert order.shape == (3, 4, 11) and counts.shape == (3, 4)
    for b in range(3):
        o, c = schedule.reorder_mask(mask[b])
        assert torch.equal(order[b], o) and torch.equal(counts[b], c)


def test_reorder_rejects_bad_masks():
    with pytest.raises(ValueError, match="bool"):
        schedule.reorder_mask(torch.ones(3, 2))
    with pytest.raises(ValueError, match="shape"):
        schedule.reorder_mask(torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("M,G,p", CASES)
@pytest.mark.parametrize("block_m", [1, 16, 64, 128])
def test_active_tiles_and_rows_match_brute_force(M, G, p, block_m):
    mask = _mask(M, G, p, seed=M + 7 * G)
    order, counts = schedule.reorder_mask(mask)
    tiles = {tuple(t) for t in schedule.active_tiles(counts, M, block_m).tolist()}
    n_tiles = schedule.num_tiles(M, block_m)
    brute_rows = _brute_order(mask)
    loaded = {j: [] for j in range(G)}
    for j in range(G):
        executing = [m for m in range(M) if mask[m, j]]
        for t in range(n_tiles):
            positions = brute_rows[j][t * block_m : (t + 1) * block_m]
            want_exec = [m for m in positions if mask[m, j]]
            want_skip = [m for m in positions if not mask[m, j]]
            # block-level skipping: a tile runs iff it holds an executing token
            assert ((j, t) in tiles) == bool(want_exec), (j, t)
            ex, sk = schedule.tile_rows(order, counts, j, t, block_m)
            # intra-block skipping: exactly the executing rows are loaded, in sorted order
            assert ex.tolist() == want_exec and sk.tolist() == want_skip
            assert positions == want_exec + want_skip  # executing rows first inside a tile
            loaded[j] += ex.tolist()
        assert loaded[j] == executing  # every executing token exactly once, none of the others
    # the launch order is group-major (blockIdx.x = tile is the fastest grid index)
    listed = schedule.active_tiles(counts, M, block_m).tolist()
    assert listed == sorted(listed)


def test_schedule_stats_counts():
    mask = _mask(200, 6, 0.5, seed=3)
    st = schedule.schedule_stats(mask, 64)
    counts = mask.sum(0)
    assert st["rows_active"] == counts.sum()
    assert st["tiles_active"] == sum(math.ceil(int(c) / 64) for c in counts)
    assert st["tiles_dense"] == 6 * math.ceil(200 / 64)
    assert 0.0 <= st["padding"] < 1.0
    assert schedule.schedule_stats(torch.zeros(10, 3, dtype=torch.bool), 16)["tiles_active"] == 0


@pytest.mark.parametrize("M,G", [(1, 3), (31, 2), (32, 5), (33, 5), (129, 7)])
def test_pack_mask_bits(M, G):
    mask = _mask(M, G, 0.5, seed=M)
    packed = schedule.pack_mask(mask)
    assert packed.shape == (math.ceil(M / 32), G)
    for w in range(packed.shape[0]):
        for j in range(G):
            want = sum(1 << r for r in range(32) if 32 * w + r < M and mask[32 * w + r, j])
            assert int(packed[w, j]) == want
            assert 0 <= int(packed[w, j]) < 2**32


@pytest.mark.parametrize("block_m", [16, 32, 128])
@pytest.mark.parametrize("structured", [False, True])
def test_gemm_k_tile_groups(block_m, structured):
    mask = _mask(300, 9, 0.1, seed=block_m, structured=structured)
    groups = schedule.gemm_k_tile_groups(mask, block_m)
    assert len(groups) == math.ceil(300 / block_m)
    for t, gl in enumerate(groups):
        want = [
            j for j in range(9) if any(mask[m, j] for m in range(t * block_m, min(300, (t + 1) * block_m)))
        ]
        assert gl == want
    live = float(schedule.gemm_k_live_fragments(mask, block_m))
    brute = sum(
        any(mask[m, j] for m in range(f * 16, min(300, f * 16 + 16)))
        for f in range(math.ceil(300 / 16))
        for j in range(9)
    ) / (math.ceil(300 / 16) * 9)
    assert live == pytest.approx(brute)


@pytest.mark.parametrize(
    "M,N,bm,bn", [(4096, 4096, 128, 128), (129, 64, 16, 128), (1000, 576, 64, 128), (33, 8, 32, 64)]
)
def test_gemm_k_block_order_is_a_grouped_permutation(M, N, bm, bn):
    order = schedule.gemm_k_block_order(M, N, bm, bn)
    tm, tn = math.ceil(M / bm), math.ceil(N / bn)
    pairs = [tuple(p) for p in order.tolist()]
    assert sorted(pairs) == [(i, j) for i in range(tm) for j in range(tn)]  # every block exactly once
    # consecutive blocks stay inside a band of 8 token tiles, walking down it before moving right
    for (m0, _), (m1, n1) in itertools.pairwise(pairs):
        assert m0 // 8 == m1 // 8 or (m1 % 8 == 0 and n1 == 0)


def test_kv_heads_read():
    head_mask = torch.tensor([[1, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    got = schedule.kv_heads_read(head_mask, 3)  # 2 query heads per KV head
    assert got.tolist() == [[True, False, True], [False, False, False], [False, True, False]]
    assert schedule.kv_heads_read(None, 4, batch=2).all() and schedule.kv_heads_read(
        None, 4, batch=2
    ).shape == (2, 4)
    with pytest.raises(ValueError):
        schedule.kv_heads_read(head_mask, 4)


# ---- dispatch tables and heuristics (pure Python; the GPU only runs what they pick)


def test_tile_tables_are_valid():
    for t in builds.GEMM_MN_TILES + builds.GEMM_K_TILES:
        assert t.valid(False) and t.threads == 128 and t.smem() <= 160 * 1024  # fits sm_80 and sm_90
    swiglu = [t for t in builds.GEMM_MN_TILES if t.valid(True)]
    assert {t.bn_out(True) for t in swiglu} >= {64, 32}
    labels = [b.label for b in builds.kernel_builds()]
    assert len(labels) == len(set(labels))


@pytest.mark.parametrize("M", [9, 16, 100, 1024, 4096])
@pytest.mark.parametrize("n_tiles", [3, 112])
def test_heuristic_tile_fits_the_tokens(M, n_tiles):
    t = builds.heuristic_tile(list(builds.GEMM_MN_TILES[:4]), M, n_tiles, sms=132, density=0.5)
    assert t.bm <= max(16, builds.next_pow2(M))
    if M >= 4096 and n_tiles >= 112:
        assert t.bm == 128


@pytest.mark.parametrize("B,Hkv,S", [(1, 8, 32768), (1, 3, 7), (64, 8, 4096), (2, 2, 129)])
def test_decode_split_covers_every_key(B, Hkv, S):
    chunk, nsplit = builds.decode_split(B, Hkv, S, sms=132)
    assert 64 <= chunk <= 1024 and chunk & (chunk - 1) == 0
    assert (nsplit - 1) * chunk < S <= nsplit * chunk
