"""Global order, elastic loader, resume and prefetch (agent.data)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from agent.data import DataError, ElasticLoader, GlobalOrder, TokenDataset, generate, micro_seed
from agent.data.order import epoch_permutation


@pytest.fixture(autouse=True)
def _node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CEASELESS_DATA_CACHE", str(tmp_path / "node-cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    generate(d, n_tokens=60_000, seed=7, seq_len=32)
    return d


B, m = 24, 2  # 12 micro-batches: spreadable over 1..5 ranks (and up to 12)


def _ranks_concat(order, step, W):
    parts = []
    for r in range(W):
        mbs = order.rank_micro_batches(step, W, r, m)
        parts.extend(mbs)
    assert [k for k, _ in parts] == list(range(B // m))
    return np.concatenate([idx for _, idx in parts])


def test_order_identical_for_world_sizes_1_to_5():
    order = GlobalOrder(n_samples=100, global_batch_size=B, seed=3)
    for step in range(order.steps_per_epoch * 2 + 1):
        ref = order.step_indices(step)
        for W in range(1, 6):
            assert np.array_equal(_ranks_concat(order, step, W), ref), (step, W)


def test_loader_batches_identical_for_world_sizes_1_to_5(corpus):
    ds = TokenDataset(corpus, 32)
    order = ds.global_order(B, seed=1)
    ref = {}
    with ElasticLoader(ds, order, m) as one:
        one.seek(0, 0, 1)
        for s in range(3):
            ref[s] = torch.cat([x for _, (x, _) in one])
    for W in range(2, 6):
        loaders = [ElasticLoader(ds, order, m, prefetch=1 + r % 3) for r in range(W)]
        for r, ld in enumerate(loaders):
            ld.seek(0, r, W)
        for s in range(3):
            xs = [x for ld in loaders for _, (x, _) in ld]
            assert torch.equal(torch.cat(xs), ref[s]), (W, s)
        for ld in loaders:
            ld.close()


def test_micro_batch_positions_and_epoch_rollover():
    n = 100  # n_usable = 96 -> 4 steps per epoch, 4 samples dropped per epoch
    order = GlobalOrder(n, B, seed=11)
    assert order.n_usable == 96 and order.steps_per_epoch == 4
    perm0, perm1 = order.permutation(0), order.permutation(1)
    # micro-batch k of step s = positions [s*B + k*m, s*B + (k+1)*m) of the epoch's perm
    assert np.array_equal(order.indices(2, 5, m), perm0[2 * B + 5 * m: 2 * B + 6 * m])
    epoch0 = np.concatenate([order.step_indices(s) for s in range(4)])
    assert len(set(epoch0.tolist())) == 96  # no repeats inside an epoch
    assert np.array_equal(order.step_indices(4), perm1[:B])  # step 4 starts epoch 1
    assert not np.array_equal(perm0, perm1)
    assert sorted(perm1.tolist()) == list(range(n))
    assert order.epoch_of(3) == 0 and order.epoch_of(4) == 1 and order.epoch_of(9) == 2
    # a step never straddles epochs: every step's indices come from a single epoch's prefix
    for s in range(12):
        e = order.epoch_of(s)
        off = (s % 4) * B
        assert np.array_equal(order.step_indices(s), order.permutation(e)[off:off + B])


def test_permutation_is_pure_and_seeded():
    a = epoch_permutation(1000, seed=5, epoch=0)
    assert np.array_equal(a, epoch_permutation(1000, seed=5, epoch=0))
    assert not np.array_equal(a, epoch_permutation(1000, seed=6, epoch=0))
    # pinned values: a change here changes every run's data order (bump ORDER_VERSION)
    assert a[:8].tolist() == [803, 761, 181, 824, 317, 28, 634, 348]
    with pytest.raises(DataError, match="cannot fill one global batch"):
        GlobalOrder(10, 24, 0)
    order = GlobalOrder(100, B, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        order.indices(0, 0, 5)
    with pytest.raises(DataError, match="outside"):
        order.indices(0, 12, m)


def test_permutation_cached_as_npy_and_mmapped(tmp_path):
    o1 = GlobalOrder(5000, 50, seed=2, cache_dir=tmp_path, data_hash="ab" * 32)
    p = o1.permutation(3)
    files = list(tmp_path.glob("order-*.npy"))
    assert len(files) == 1 and "-s2-e3" in files[0].name and "abab" in files[0].name
    o2 = GlobalOrder(5000, 50, seed=2, cache_dir=tmp_path, data_hash="ab" * 32)
    q = o2.permutation(3)
    assert isinstance(q, np.memmap) and np.array_equal(p, q)
    files[0].write_bytes(b"garbage")  # a damaged cache entry is recomputed
    o3 = GlobalOrder(5000, 50, seed=2, cache_dir=tmp_path, data_hash="ab" * 32)
    assert np.array_equal(o3.permutation(3), p)


def test_resume_at_step_k_matches_run_from_zero(corpus):
    ds = TokenDataset(corpus, 32)
    order = ds.global_order(B, seed=4)
    W, r = 3, 1
    run = {}
    with ElasticLoader(ds, order, m) as a:
        a.seek(0, r, W)
        for s in range(order.steps_per_epoch + 3):  # crosses an epoch boundary
            run[s] = a.next_step()
            assert a.step == s + 1
    for k in (0, 5, order.steps_per_epoch - 1, order.steps_per_epoch + 1):
        with ElasticLoader(ds, order=ds.global_order(B, seed=4), micro_batch_size=m) as b:
            b.seek(k, r, W)
            got = b.next_step()
            assert [kk for kk, _ in got] == [kk for kk, _ in run[k]]
            for (_, (x1, y1)), (_, (x2, y2)) in zip(got, run[k]):
                assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_in_process_seek_repositions_without_rebuild(corpus):
    ds = TokenDataset(corpus, 32)
    order = ds.global_order(B, seed=4)
    with ElasticLoader(ds, order, m, prefetch=3) as ld:
        ld.seek(10, 0, 2)
        expected_after_fault = [(k, order.indices(7, k, m)) for k in order.rank_range(3, 2, m)]
        it = iter(ld)
        next(it)  # mid-step, then a fault: re-plan to world 3, rank 2, restore_step + 1 = 7
        tokens_before = ds.tokens
        ld.seek(7, 2, 3)  # O(1); its time is measured in bench/data_bench.py
        assert list(it) == []  # the abandoned iteration stops
        got = ld.next_step()
        assert ds.tokens is tokens_before  # same map, nothing rebuilt
        assert [k for k, _ in got] == [k for k, _ in expected_after_fault]
        for (_, (x, _)), (_, idx) in zip(got, expected_after_fault):
            assert torch.equal(x, ds.batch(idx)[0])
        assert ld.step == 8


def _wait_ready(ld, n, timeout=10.0):
    """Wait until the next ``n`` micro-batches are in the prefetch cache (no timing asserted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with ld._cond:
            if all(k in ld._cache for k in ld._upcoming(n)):
                return
        time.sleep(0.001)
    raise AssertionError(f"prefetch thread did not fill {n} batches in {timeout}s: {ld.stats}")


def test_prefetch_thread_prepares_ahead(corpus):
    ds = TokenDataset(corpus, 32)
    order = ds.global_order(B, 0)
    with ElasticLoader(ds, order, m, prefetch=4) as ld:
        ld.seek(0, 0, 2)  # 6 micro-batches per step for this rank
        _wait_ready(ld, 4)
        got = []
        for _ in range(4):
            for k, (x, _y) in ld:
                got.append((k, x))
                _wait_ready(ld, 1)  # "compute" long enough for the thread to get ahead
        assert ld.stats["prefetched"] == 24 and ld.stats["foreground"] == 0, ld.stats
        assert [k for k, _ in got] == list(range(6)) * 4
        assert torch.equal(got[7][1], ds.batch(order.indices(1, 1, m))[0])


def test_breaking_out_keeps_position(corpus):
    ds = TokenDataset(corpus, 32)
    with ElasticLoader(ds, ds.global_order(B, 0), m) as ld:
        ld.seek(2, 1, 4)  # ranks get 3 micro-batches: 3..5
        ks = []
        for k, _ in ld:
            ks.append(k)
            break
        assert ld.step == 2
        ks += [k for k, _ in ld]
        assert ks == [3, 4, 5] and ld.step == 3


def test_micro_seed_in_python_integers_is_the_numpy_hash():
    """``micro_seed`` (Python integers, issue 44) gives the seeds the numpy ``hash64`` gave,
    so a job keeps its randomness across the change."""
    import numpy as np

    from agent.data.order import hash64

    rng = np.random.default_rng(3)
    cases = [(0, 0, 0), (0, 123, (1 << 63) + 1), (-5, 7, (1 << 62) | (3 << 32) | 2),
             ((1 << 64) + 9, 2 ** 40, (1 << 64) - 1), (2 ** 70, -3, 1)]
    cases += [(int(a), int(b), int(c)) for a, b, c in zip(
        rng.integers(-2 ** 40, 2 ** 62, 200), rng.integers(0, 2 ** 40, 200),
        rng.integers(0, 2 ** 63, 200, dtype=np.uint64))]
    for seed, step, k in cases:
        want = int(hash64(seed, 0x5EED ^ (step << 20), np.array([k], dtype=np.uint64))[0]
                   >> np.uint64(1))
        assert micro_seed(seed, step, k) == want, (seed, step, k)


def test_get_and_micro_seed(corpus):
    ds = TokenDataset(corpus, 32)
    order = ds.global_order(B, 9)
    ld = ElasticLoader(ds, order, m, prefetch=0)
    x, y = ld.get(3, 4)
    assert torch.equal(x, ds.batch(order.indices(3, 4, m))[0])
    assert micro_seed(1, 3, 4) == micro_seed(1, 3, 4) != micro_seed(1, 3, 5)
    assert micro_seed(1, 3, 4) != micro_seed(1, 4, 4)
    torch.Generator().manual_seed(micro_seed(1, 2**40, 7))  # fits
    with pytest.raises(DataError, match="cannot be spread"):
        ld.seek(0, 12, 13)


class _Plain(torch.utils.data.Dataset):
    def __init__(self, n, bad=None):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise RuntimeError(f"bad sample {i}")
        return {"v": torch.tensor([i, 2 * i])}


def test_generic_map_style_dataset_and_worker_errors():
    order = GlobalOrder(50, 10, seed=0)
    with ElasticLoader(_Plain(50), order, 5) as ld:
        ld.seek(1, 1, 2)
        (k, batch), = ld.next_step()
        assert k == 1 and batch["v"].shape == (5, 2)
        assert batch["v"][:, 0].tolist() == order.indices(1, 1, 5).tolist()
    bad = int(order.indices(2, 0, 5)[0])
    with ElasticLoader(_Plain(50, bad=bad), order, 5, prefetch=2) as ld:
        ld.seek(1, 0, 1)
        ld.next_step()
        with pytest.raises(RuntimeError, match=f"bad sample {bad}"):
            ld.next_step()
    with pytest.raises(DataError, match="order is for"):
        ElasticLoader(_Plain(49), order, 5)


def test_warm_spare_first_batch_fast(corpus):
    ld = ElasticLoader.from_dir(corpus, global_batch_size=B, micro_batch_size=m, seed=5, seq_len=32)
    with ld:
        ld.warm(step=40)  # its time is measured in bench/data_bench.py, not asserted here
        assert ld.order.epoch_of(40) in ld.order._epochs  # promotion computes no permutation
        ld.seek(40, 3, 5)
        k, (x, y) = next(iter(ld))
        assert x.shape == (m, 32) and x.dtype == torch.int64 and k == ld.micro_indices[0]
        ex, ey = ld.get(40, k)
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_close_releases_the_map(corpus):
    ds = TokenDataset(corpus, 32)
    mm = ds._mm
    view = ds.window(3).copy()
    ds.close()
    assert mm.closed and len(ds) == ds.n_samples  # nothing left mapping the file
    ds2 = TokenDataset(corpus, 32)
    kept = ds2.window(3)  # a view handed out keeps its pages alive after close
    ds2.close()
    assert np.array_equal(kept, view)


def test_unclosed_loader_thread_exits():
    order = GlobalOrder(50, 10, seed=0)
    ld = ElasticLoader(_Plain(50), order, 5)
    th = ld._thread
    del ld
    th.join(timeout=3)
    assert not th.is_alive()


def test_concurrent_consumers_share_prefetch(corpus):
    """Session may call seek from a control thread while the training thread iterates."""
    ds = TokenDataset(corpus, 32)
    with ElasticLoader(ds, ds.global_order(B, 0), m) as ld:
        ld.seek(0, 0, 1)
        stop = threading.Event()

        def control():
            for s in range(50):
                ld.seek(s % 7, s % 3, 3)
            stop.set()

        th = threading.Thread(target=control)
        th.start()
        while not stop.is_set():
            for _ in ld:
                pass
        th.join()
        ld.seek(2, 0, 1)
        got = ld.next_step()
        assert torch.equal(torch.cat([x for _, (x, _) in got]), ds.batch(ld.order.step_indices(2))[0])


def test_session_batches_prefetch_a_token_dataset_and_build_others_in_place(corpus):
    """``s.batches`` reads a TokenDataset through the prefetching loader (the same batches
    as built directly, built ahead), and any other map-style dataset on the training thread
    (its __getitem__ may draw from the RNG the session seeds per micro-batch)."""
    from agent.data.loader import BatchSource
    from agent.session import Session

    ds = TokenDataset(corpus, 32)
    src = BatchSource(ds, B, 3, m)
    assert src.loader is not None
    for step in range(3):
        src.begin(step, 1, 2)
        for k in range(6, 12):
            x, y = src.get(step, k)
            assert torch.equal(x, ds.batch(src.order.indices(step, k, m))[0])
            _wait_ready(src.loader, 1)
    assert src.loader.stats["prefetched"] >= 12, src.loader.stats
    src.loader.close()

    class Noisy(torch.utils.data.Dataset):  # draws from the global RNG in __getitem__
        def __len__(self):
            return 48

        def __getitem__(self, i):
            return torch.tensor([float(i)]), torch.rand(1)

    def draws() -> list:
        with Session(B, seed=3) as s:
            s.register(model=torch.nn.Linear(1, 1))
            got = []
            for step in s.steps(2):
                for x, r in s.batches(Noisy(), m):
                    got.append(r)
                    s.backward(s.objs["model"](x).sum() * 0)
                s.step()
            assert all(src.loader is None for src in s._feed._sources.values())
        return got

    noise, again = draws(), draws()  # the same draws again: seeded per micro-batch
    assert len(noise) == 2 * (B // m) and all(torch.equal(a, b) for a, b in zip(noise, again))
