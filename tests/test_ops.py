"""hpcrl._C multi-tensor ops against the pure-torch references."""

import os
import random
import sys
import warnings

import pytest
import torch

import hpcrl.ops as ops
from hpcrl.ops import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_extension_is_built():
    # Without this, every kernel-vs-reference test below would compare the reference with itself.
    if os.environ.get("HPCRL_ALLOW_REFERENCE") == "1":
        pytest.skip("HPCRL_ALLOW_REFERENCE=1: running on the reference ops on purpose")
    assert ops.backend() == "extension", "hpcrl._C is not built: pip install --no-build-isolation -e ."


def random_tensors(n, dtype, device="cpu", max_dim=3, max_size=40, seed=0):
    g = random.Random(seed)
    shapes = [tuple(g.randint(0, max_size) for _ in range(g.randint(0, max_dim))) for _ in range(n)]
    return [torch.randn(s, dtype=torch.float32, device=device).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_flatten_matches_reference(dtype, n):
    ts = random_tensors(n, dtype, seed=n)
    assert torch.equal(ops.flatten(ts), reference.flatten(ts))
    out = torch.full((sum(t.numel() for t in ts),), 7.0, dtype=dtype)
    assert ops.flatten(ts, out=out) is out
    assert torch.equal(out, reference.flatten(ts))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1.0 / 3.0])
def test_unflatten_matches_reference(dtype, scale):
    ts = random_tensors(50, dtype, seed=3)
    flat = torch.randn(sum(t.numel() for t in ts)).to(dtype)
    mine = [torch.full_like(t, 9.0) for t in ts]
    ref = [torch.full_like(t, 9.0) for t in ts]
    ops.unflatten_(flat, mine, scale)
    reference.unflatten_(flat, ref, scale)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
    if ts and scale == 1.0:
        assert torch.equal(ops.flatten(mine), flat)


def test_large_tensors_cross_parallel_chunks():
    torch.set_num_threads(2)  # several parallel_for tasks, each crossing tensor boundaries
    ts = [torch.randn(n) for n in (100_003, 1, 65_536 * 3 + 5, 0, 77_777)]
    flat = ops.flatten(ts)
    assert torch.equal(flat, torch.cat(ts))
    back = [torch.empty_like(t) for t in ts]
    ops.unflatten_(flat, back, 0.25)
    for a, b in zip(back, ts):
        assert torch.equal(a, b * 0.25)


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_built_with_openmp():
    # Without -fopenmp, at::parallel_for compiles to a plain loop: 1 thread whatever set_num_threads says.
    if ops.backend() != "extension":
        pytest.skip("reference ops")
    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("setup.py adds -fopenmp only where torch's ATen backend is OpenMP and the compiler takes it")
    assert ops._C.openmp, "hpcrl._C was built without -fopenmp (see setup.py openmp_flags)"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_scaled_unflatten_half_types_every_bit_pattern(dtype, threads, restore_threads):
    # The vectorized fp16 (F16C) / bf16 conversions must give the scalar c10 conversion's bits for every
    # input, NaN / inf / subnormal included; 2 threads split the 2^16 values across the tensors.
    torch.set_num_threads(threads)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    flat = torch.cat([every] * 12)  # 1.5 MiB: above the parallel grain
    sizes = [1, 1001, 7, 2**17 + 3, 0, flat.numel() - (1 + 1001 + 7 + 2**17 + 3)]
    for scale in (0.5, 1 / 3, 3e4, -1.7e-3):
        mine = [torch.empty(n, dtype=dtype) for n in sizes]
        ref = [torch.empty(n, dtype=dtype) for n in sizes]
        ops.unflatten_(flat, mine, scale)
        reference.unflatten_(flat, ref, scale)
        a, b = torch.cat(mine), torch.cat(ref)
        both_nan = a.float().isnan() & b.float().isnan()
        assert torch.equal(a.float().isnan(), b.float().isnan())
        assert torch.equal(a.view(torch.int16)[~both_nan], b.view(torch.int16)[~both_nan]), scale


@pytest.mark.parametrize("n_step", [1, 3])
def test_replay_gather_two_threads_matches_reference(n_step, restore_threads):
    # Each thread's share prefetches rows ahead of the one it copies; the results must not depend on it.
    from hpcrl.replay import ReplayShard

    g = torch.Generator().manual_seed(0)
    E, C, D, A = 16, 50, 8, 3
    shard = ReplayShard(E, C, obs_dim=D, action_dim=A, n_step=n_step, gamma=0.9)
    for _ in range(C + 13):  # wrapped
        u = torch.rand(E, generator=g)
        shard.add(torch.randn(E, D, generator=g), torch.randn(E, A, generator=g), torch.randn(E, generator=g),
                  torch.randn(E, D, generator=g), u < 0.1, (u >= 0.1) & (u < 0.15))
    env = torch.randint(E, (5000,), generator=g)  # above the 1024-row grain: split across threads
    slot = torch.randint(C, (5000,), generator=g)
    ref = reference.replay_gather(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref,
                                  shard.final_pool, shard.head_next_obs, env, slot, shard.ptr, n_step, 0.9)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for a, b in zip(shard.gather(env, slot), ref):
            assert torch.equal(a, b)


def test_empty_list_and_zero_size():
    assert ops.flatten([]).numel() == 0
    assert ops.flatten([], out=torch.empty(0)).numel() == 0
    ops.unflatten_(torch.empty(0), [])
    zs = [torch.empty(0), torch.empty(3, 0), torch.empty(0, 5)]
    assert ops.flatten(zs).numel() == 0
    mixed = [torch.empty(0), torch.tensor([1.0, 2.0]), torch.empty(2, 0), torch.tensor([3.0])]
    assert ops.flatten(mixed).tolist() == [1.0, 2.0, 3.0]


def test_gradient_average_use_case():
    # The reason unflatten_ takes a scale: all-reduce(SUM) then "divide by world size" in the copy.
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    model(torch.randn(4, 5)).square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    expected = [g.clone() / 4 for g in grads]
    flat = ops.flatten(grads)
    ops.unflatten_(flat, grads, 1 / 4)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ops.flatten([torch.zeros(2), torch.zeros(2, dtype=torch.float16)]), "mixed dtypes"),
        (lambda: ops.flatten([torch.zeros(2), torch.zeros(2, device="meta")]), "mixed devices"),
        (lambda: ops.flatten([torch.zeros(4, 4).t()]), "not contiguous"),
        (lambda: ops.flatten([torch.zeros(2)], out=torch.zeros(3)), "size mismatch"),
        (lambda: ops.flatten([torch.zeros(2, dtype=torch.int32)]), "not supported"),
        (lambda: ops.unflatten_(torch.zeros(3), [torch.zeros(2)]), "size mismatch"),
        (lambda: ops.unflatten_(torch.zeros(4, 1), [torch.zeros(4)]), "1-D"),
    ],
)
def test_clear_errors(make, message):
    if ops.backend() != "extension":
        pytest.skip("error messages are the extension's validation")
    with pytest.raises(RuntimeError, match=message):
        make()


def test_reference_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(ops, "_C", None)
    monkeypatch.setattr(ops, "_warned", False)
    ts = [torch.randn(3), torch.randn(2, 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = ops.flatten(ts)
        ops.unflatten_(flat, ts, 2.0)
    assert ops.backend() == "reference"
    assert len([w for w in caught if "reference" in str(w.message)]) == 1
    assert torch.equal(flat, torch.cat([ts[0] / 2, ts[1].reshape(-1) / 2]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    assert ops.with_cuda(), "hpcrl._C was built without CUDA"
    ts = random_tensors(300, dtype, seed=11) + [torch.randn(1_000_003).to(dtype)]
    cts = [t.cuda() for t in ts]
    flat = ops.flatten(cts)
    assert torch.equal(flat.cpu(), ops.flatten(ts))
    for scale in (1.0, 0.125, 1 / 3):
        back = [torch.empty_like(t) for t in cts]
        ops.unflatten_(flat, back, scale)
        ref = [torch.empty_like(t) for t in ts]
        reference.unflatten_(flat.cpu(), ref, scale)
        for a, b in zip(back, ref):
            assert torch.equal(a.cpu(), b)
