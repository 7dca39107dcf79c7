"""Run under `horovodrun -np 2` (or 3) --gloo: APSCompressor through horovod.torch's own API
(allreduce, grouped, the optimizer). Each rank saves what it got to OUTDIR/torch<N>_rank<r>.npz
for tests/test_horovod_torch.py."""
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
from hvd_aps._schedule import max_trial_steps
from common import codes_grads, poisoned, rank_data, spiked

hvd.init()
rank, size, out = hvd.rank(), hvd.size(), {}


def reduce(x, comp, op=hvd.Average, name=None):
    return hvd.allreduce(torch.from_numpy(x), op=op, compression=comp, name=name).numpy()


def error_of(fn):
    try:
        fn()
        return np.array("no error")
    except Exception as err:  # what every rank saw
        return np.array(f"{type(err).__name__}: {err}")


e4m3 = hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=16)
out["avg"] = reduce(rank_data(rank), e4m3, name="avg")
out["sum_e5m2"] = reduce(rank_data(rank, sigma=3.0, seed=1), hvd_aps.APSCompressor("e5m2", min_elements=16), hvd.Sum, "sum")
out["naive"] = reduce(rank_data(rank), hvd_aps.APSCompressor("e4m3", scaling="none", min_elements=16), name="naive")
out["zeros"] = reduce(np.zeros(100, np.float32), e4m3, name="zeros")
out["nan"] = reduce(poisoned(rank, np.nan), e4m3, name="nan")
out["inf"] = reduce(poisoned(rank, np.inf), hvd_aps.APSCompressor("e2m1fn", min_elements=16), name="inf")
out["after"] = reduce(rank_data(rank), e4m3, name="after")
out["bytes_sent"] = np.array(e4m3.bytes_sent)
# one compressor, Average and then Sum: the second average is divided at decode (learned from the
# first); the Sum after it cannot be given from averaged sums and raises on every rank; the next
# Sum runs undivided, and so does the Average after it
switch = hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=16)
for step in range(2):
    out[f"switch_avg_{step}"] = reduce(rank_data(rank), switch, name="switch")
out["switch_error"] = error_of(lambda: reduce(rank_data(rank), switch, hvd.Sum, "switch"))
out["switch_sum"] = reduce(rank_data(rank), switch, hvd.Sum, "switch")
out["switch_avg_2"] = reduce(rank_data(rank), switch, name="switch")
half = hvd.allreduce(torch.from_numpy(rank_data(rank)).bfloat16(), compression=e4m3, name="bf16")
ef = hvd_aps.APSCompressor("e2m1fn", min_elements=16, error_feedback=True)
for step in range(3):  # one batch name each call: the residuals carry from call to call
    out[f"ef_{step}"] = reduce(rank_data(rank, seed=step), ef, name="ef")
hybrid = hvd_aps.APSCompressor("e2m1fn", min_elements=16, hybrid="e4m3")  # one batch of both tensors
pair = [torch.from_numpy(rank_data(rank, seed=4)), torch.from_numpy(spiked(rank)[:999].copy())]  # stats by shape
out["hybrid"] = np.concatenate([t.numpy() for t in hvd.grouped_allreduce(pair, compression=hybrid, name="hybrid")])
out["hybrid_formats"] = np.array([s.fmt for s in hybrid.stats.values()])
chunked = hvd_aps.APSCompressor("e4m3", min_elements=16, chunk_bytes=4 * 300)  # 4 chunks, async collectives
out["chunked"] = reduce(rank_data(rank, seed=6), chunked, name="chunked")
out["bf16_dtype_ok"] = np.array(half.dtype == torch.bfloat16 and half.shape == (1000,))
# a bfloat16 tensor too small for codes: Horovod's Gloo allreduce refuses bfloat16, so it goes in float32
small = torch.from_numpy(rank_data(rank)[:8]).bfloat16()
out["bf16_small"] = hvd.allreduce(small, compression=e4m3, name="bf16_small").float().numpy()
out["bf16_small_in"] = small.float().numpy()
out["ints"] = hvd.allreduce(torch.arange(5) * (rank + 1), op=hvd.Sum, compression=e4m3, name="ints").numpy()

# wire="values": the float16 carrier through Horovod's allreduce
values = hvd_aps.APSCompressor(hvd_aps.e4m3, wire="values")
out["values_avg"] = reduce(rank_data(rank), values, name="values_avg")
out["values_avg_shift"] = np.array(values.stats["float32[1000]"].shift)
out["values_nan"] = reduce(poisoned(rank, np.nan), values, name="values_nan")


def one_step(key, grads, dtype=torch.float32, **kwargs):
    """horovod.torch.DistributedOptimizer on parameters of `dtype` whose gradients are exactly
    `grads` in that dtype (loss = sum(p * g)); every tensor is its own batch (bucket_bytes=1)."""
    params = [torch.zeros(g.shape, dtype=dtype, requires_grad=True) for g in grads]
    comp = hvd_aps.APSCompressor("e4m3", bucket_bytes=1, min_elements=16)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), compression=comp,
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)], **kwargs)
    sum((p * torch.from_numpy(g).to(dtype)).sum() for p, g in zip(params, grads)).backward()
    opt.synchronize()
    out[f"{key}_dtype_ok"] = np.array(all(p.grad.dtype == dtype for p in params))
    return [p.grad.float().numpy().copy() for p in params]


for key, dtype, kwargs in (("step_avg", torch.float32, {}),
                           ("step_predivide", torch.float32, dict(gradient_predivide_factor=2.0)),
                           ("step_sum_groups", torch.float32, dict(op=hvd.Sum, groups=2)),
                           ("step_bfloat16", torch.bfloat16, {}), ("step_float16", torch.float16, {})):
    for i, g in enumerate(one_step(key, codes_grads(rank), dtype, **kwargs)):
        out[f"{key}_{i}"] = g


def train(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=hvd_aps.APSCompressor("e4m3", min_elements=64), **kwargs)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for _ in range(kwargs.get("backward_passes_per_step", 1)):
            model(torch.randn(8, 10, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()


out["params_avg"] = train()
out["params_sum_groups"] = train(op=hvd.Sum, groups=2)
out["params_bpps_predivide"] = train(backward_passes_per_step=2, gradient_predivide_factor=2.0)

# rank 0 sends e4m3, the others e5m2: only the signature can tell
out["mismatch"] = error_of(lambda: reduce(rank_data(rank), hvd_aps.APSCompressor("e4m3" if rank == 0 else "e5m2",
                                                                                 min_elements=16), name="mismatch"))
# the last rank hands over other gradients under the names (the group's name and positions)
pair = [torch.ones(5000), torch.ones(7000)]
out["order"] = error_of(lambda: hvd.grouped_allreduce(pair if rank < size - 1 else pair[::-1],
                                                      compression=hvd_aps.APSCompressor("e4m3"), name="order"))
out["after_errors"] = reduce(rank_data(rank), hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=16), name="after2")


def recovery():
    """One compressor (error feedback) through a good step, a step whose tensors the last rank
    hands over in another order (raises on every rank), and two more good steps."""
    comp = hvd_aps.APSCompressor("e2m1fn", min_elements=16, error_feedback=True)
    good = [[torch.from_numpy(rank_data(rank, seed=20 + s)), torch.from_numpy(rank_data(rank, seed=30 + s)[:700].copy())]
            for s in range(3)]
    results = [hvd.grouped_allreduce(good[0], compression=comp, name="rec")]
    bad = [torch.ones(5000), torch.ones(7000)]
    out["recovery_error"] = error_of(lambda: hvd.grouped_allreduce(bad if rank < size - 1 else bad[::-1],
                                                                   compression=comp, name="rec_bad"))
    buffers = len(comp.state.buffers)  # the good steps after the error reuse the buffers of the first
    for step in good[1:]:
        results.append(hvd.grouped_allreduce(step, compression=comp, name="rec"))
    for s, pair in enumerate(results):
        for t, tensor in enumerate(pair):
            out[f"recovery_{s}_{t}"] = tensor.numpy()
    out["recovery_names_restart"] = np.array(len(comp.state.buffers) == buffers)


recovery()


def stochastic_training():
    """The same script and seed, three times in this process: stochastic rounding's seeds come from
    (seed, rank, tensor, step), so the compressor's threads cannot change a bit."""
    hashes = []
    for _ in range(3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64))
        comp = hvd_aps.APSCompressor("e4m3", rounding="stochastic", seed=7, min_elements=64, bucket_bytes=20_000)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=comp)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(8, 64, generator=gen)).pow(2).mean().backward()
            opt.step()
        hashes.append(torch.cat([p.detach().ravel() for p in model.parameters()]).numpy())
        comp.close()
    out["stochastic_runs"] = np.stack(hashes)


stochastic_training()


def auto_policy():
    """policy="auto" with its decision pinned: the batch passes through to
    Horovod's own allreduce (fp32, or float16), bit for bit Horovod's Compression.none / .fp16;
    and a run that tries both candidates decides alike on every rank."""
    for fallback, stock in (("float32", hvd.Compression.none), ("float16", hvd.Compression.fp16)):
        comp = hvd_aps.APSCompressor("e4m3", policy="auto", fallback=fallback, min_elements=16, chunk_bytes=0)
        comp.pin({"policy": "native"})
        x = torch.from_numpy(rank_data(rank, seed=9))
        out[f"native_{fallback}"] = hvd.allreduce(x, compression=comp, name=f"native_{fallback}").numpy()
        out[f"stock_{fallback}"] = hvd.allreduce(x, compression=stock, name=f"stock_{fallback}").numpy()
        out[f"native_{fallback}_bytes"] = np.array(comp.bytes_sent)
        out[f"native_{fallback}_carried"] = np.array(comp.stats["float32[1000]"].fmt)
    comp = hvd_aps.APSCompressor("e4m3", policy="auto", min_elements=16, chunk_bytes=0)
    # the rounds of trial blocks (each an untimed step and timed ones), each round's step to agree on medians
    for step in range(max_trial_steps() + 3):
        hvd.allreduce(torch.from_numpy(rank_data(rank, seed=step)), compression=comp, name="tried")
    out["auto_decision"] = np.array(str(comp.schedule_report()[-1]["chosen"]))
    refused = hvd_aps.APSCompressor("e4m3", policy="auto", fallback="bfloat16", min_elements=16)
    try:  # Horovod's CPU allreduce does not carry bfloat16: refused at the first exchange, not after the trials
        hvd.allreduce(torch.from_numpy(rank_data(rank)), compression=refused, name="bfloat16")
        out["bfloat16_refused"] = np.array(False)
    except ValueError as err:
        out["bfloat16_refused"] = np.array("fallback='float16'" in str(err))


auto_policy()

np.savez(f"{sys.argv[1]}/torch{size}_rank{rank}.npz", **out)
