"""Run under `horovodrun -np 2` (or 3) --gloo: hvd_aps.torch.DistributedOptimizer sending codes.
Each rank saves OUTDIR/codes<N>_rank<r>.npz for tests/test_codes_path.py."""
import dataclasses
import sys
import warnings

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
import hvd_aps.torch
from common import codes_grads

hvd.init()
rank, size, out = hvd.rank(), hvd.size(), {}


def exchange(grads, fmt, key, dtype=torch.float32, compression=None, **kwargs):
    """Parameters of `dtype` whose gradients are exactly `grads` in that dtype (loss = sum(p * g));
    returns the averaged grads (as float32). compression: default an APSCompressor of `fmt`."""
    params = [torch.zeros(g.shape, dtype=dtype, requires_grad=True) for g in grads]
    compression = compression or hvd_aps.APSCompressor(fmt, min_elements=16)
    opt = hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), compression=compression, **kwargs)
    sum((p * torch.from_numpy(g).to(dtype)).sum() for p, g in zip(params, grads)).backward()
    out[f"{key}_threaded"] = np.array(len(opt._futures))  # buckets handed to the compressor's threads
    opt.synchronize()
    out[f"{key}_bytes"] = np.array(opt.bytes_sent)
    out[f"{key}_dtype_ok"] = np.array(all(p.grad.dtype == dtype for p in params))
    return [p.grad.float().numpy().copy() for p in params]


for fmt in ("e4m3", "e2m1fn"):
    for i, g in enumerate(exchange(codes_grads(rank), fmt, fmt)):
        out[f"{fmt}_{i}"] = g
for dtype in (torch.bfloat16, torch.float16):  # a model held in low precision
    key = str(dtype).replace("torch.", "")
    for i, g in enumerate(exchange(codes_grads(rank), "e4m3", key, dtype)):
        out[f"{key}_{i}"] = g
for fallback in ("float32", "float16"):  # policy="auto" settled on Horovod's own allreduce
    native = hvd_aps.APSCompressor("e4m3", min_elements=16, policy="auto", fallback=fallback)
    native.pin({"policy": "native"})
    for i, g in enumerate(exchange(codes_grads(rank), "e4m3", f"native_{fallback}", compression=native)):
        out[f"native_{fallback}_{i}"] = g
poisoned = codes_grads(rank)
poisoned[1][:] = 0.0  # an all-zero tensor
if rank == size - 1:
    poisoned[0][5] = np.inf
for i, g in enumerate(exchange(poisoned, "e4m3", "poisoned")):
    out[f"poisoned_{i}"] = g


def train():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
    unused = torch.nn.Linear(8, 8)  # parameters that never get a gradient
    params = list(model.parameters()) + list(unused.parameters())
    named = list(model.named_parameters()) + [(f"unused.{n}", p) for n, p in unused.named_parameters()]
    opt = hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), named_parameters=named,
                                             compression=hvd_aps.APSCompressor("e4m3", bucket_bytes=40_000, min_elements=100),
                                             backward_passes_per_step=2)
    gen = torch.Generator().manual_seed(rank)
    before = unused.weight.detach().clone()
    for _ in range(3):
        for _ in range(2):
            model(torch.randn(8, 64, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["unused_unchanged"] = np.array(bool(torch.equal(before, unused.weight)))
    out["buckets"] = np.array(len(opt._buckets))
    return torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()


out["params"] = train()


def lifecycle():
    """Horovod's pattern: synchronize(), clip, then step() inside skip_synchronize(); zero_grad()
    between backward and step() refused; a second exchange never happens by accident."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                             compression=hvd_aps.APSCompressor("e4m3", min_elements=16))
    comp = opt._compression
    model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))).sum().backward()
    try:
        opt.zero_grad()
        out["zero_grad_refused"] = np.array(False)
    except AssertionError as err:
        out["zero_grad_refused"] = np.array("zero_grad() was called after loss.backward()" in str(err))
    opt.synchronize()
    sent = comp.bytes_sent
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with opt.skip_synchronize():
        opt.step()
    out["skip_sent_nothing"] = np.array(comp.bytes_sent == sent)
    opt.zero_grad()
    model(torch.randn(4, 64)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sent = comp.bytes_sent
        opt.step()  # after synchronize() without skip_synchronize(): warns, exchanges nothing again
    out["plain_step_warned"] = np.array(comp.bytes_sent == sent and any("skip_synchronize" in str(w.message)
                                                                        for w in caught))
    out["lifecycle_params"] = model.weight.detach().numpy().ravel()
    try:  # one compressor for two optimizers: their bucket names would share residuals and counts
        hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=comp)
        out["shared_refused"] = np.array("no error")
    except ValueError as err:
        out["shared_refused"] = np.array(str(err))
    try:
        hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    except TypeError as err:
        out["compression_required"] = np.array("compression" in str(err))
    with hvd_aps.APSCompressor("e4m3", policy="auto", fallback="bfloat16") as bf16:
        try:  # its native path casts with NumPy or CuPy, which hold no bfloat16
            hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=bf16)
        except ValueError as err:
            out["bfloat16_fallback_refused"] = np.array("fallback='bfloat16'" in str(err))


lifecycle()


class Failing:
    """The optimizer's collectives, but the metadata allreduce of bucket 1 raises (on every rank,
    before any rank sends): a step whose other buckets finish and whose bucket 1 fails."""

    def __init__(self, coll):
        self.coll = coll

    def max_allreduce(self, vector, name):
        if name.startswith("hvd_aps.bucket1"):
            raise ValueError("injected failure of bucket 1")
        return self.coll.max_allreduce(vector, name)

    def __getattr__(self, attr):
        return getattr(self.coll, attr)


def recovery():
    """Error feedback on; a step whose bucket 1 raises on every rank (bucket 0 finishes); later
    steps equal those of an optimizer that never saw the failed step, bit for bit."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64))
        comp = hvd_aps.APSCompressor("e2m1fn", min_elements=64, bucket_bytes=20_000, error_feedback=True)
        return model, hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                         model.named_parameters(), compression=comp)

    def step(model, opt, seed):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * seed + rank))).pow(2).mean().backward()
        opt.step()

    failing, clean = make(), make()
    step(*failing, 0)
    step(*clean, 0)
    model, opt = failing
    buffers, made = len(opt._compression.state.buffers), hvd_aps.torch.adapter._LEVELS._made
    key = (None, opt._compression.config.timeout)  # the levels of hierarchical=None and this wait
    levels = made[key]
    made[key] = dataclasses.replace(levels, world=Failing(levels.world))
    try:
        step(model, opt, 1)
        out["optimizer_error"] = np.array("no error")
    except ValueError as err:
        out["optimizer_error"] = np.array(str(err))
    made[key] = levels
    for seed in (1, 2):
        step(*failing, seed)
        step(*clean, seed)
    out["optimizer_recovered"] = np.array(all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                                               clean[0].parameters())))
    out["optimizer_buffers_kept"] = np.array(len(opt._compression.state.buffers) == buffers)
    out["optimizer_params"] = torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()


recovery()
np.savez(f"{sys.argv[1]}/codes{size}_rank{rank}.npz", **out)
