"""Run under `torchrun --nproc-per-node 2` (or 3), Gloo on loopback: hvd_aps.ddp.aps_hook in
DistributedDataParallel. Each rank saves OUTDIR/ddp<N>_rank<r>.npz for tests/test_ddp.py.
HVD_APS_CHECK_DEVICE=cuda puts the given-gradient models on the GPU (tests/test_gpu.py): the
hook's CuPy stages and Gloo's collectives on CUDA tensors, every rank on the one device."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
from common import DDP_SIZES, codes_grads, leave_torchrun
from torch_models import Given

dist.init_process_group("gloo")
rank, size, out = dist.get_rank(), dist.get_world_size(), {}
DEVICE = torch.device(os.environ.get("HVD_APS_CHECK_DEVICE", "cpu"))
torch.set_num_threads(1)


def recording(order, index_of):
    """aps_hook, noting each bucket's parameters (by index) in the order the exchange sees them."""
    def hook(state, bucket):
        order.append([index_of[id(p)] for p in bucket.parameters()])
        return hvd_aps.ddp.aps_hook(state, bucket)
    return hook


def given_steps(key, grads_per_step, dtype=torch.float32, group=None, compression=None, **ddp_kwargs):
    model = Given(DDP_SIZES, dtype).to(DEVICE)
    ddp = DDP(model, process_group=group, **ddp_kwargs)
    order, index_of = [], {id(p): i for i, p in enumerate(model.ps)}
    compressor = hvd_aps.APSCompressor("e4m3", **(compression or {}))
    ddp.register_comm_hook(hvd_aps.ddp.APSState(compressor, group), recording(order, index_of))
    for step, grads in enumerate(grads_per_step):
        model.zero_grad()
        order.clear()
        ddp([torch.from_numpy(g).to(DEVICE, dtype) for g in grads]).backward()
        for i, p in enumerate(model.ps):
            out[f"{key}_{step}_{i}"] = p.grad.float().cpu().numpy().copy()
        out[f"{key}_{step}_dtype_ok"] = np.array(all(p.grad.dtype == dtype and p.grad.device.type == DEVICE.type
                                                     for p in model.ps))
        out[f"{key}_{step}_order"] = np.array(";".join(",".join(map(str, bucket)) for bucket in order))
    out[f"{key}_bytes"] = np.array(compressor.bytes_sent)


# two steps (DDP rebuilds its buckets after the first), several buckets (bucket_cap_mb small)
grads = codes_grads(rank, DDP_SIZES)
given_steps("plain", [grads, grads], bucket_cap_mb=0.01)
given_steps("view", [grads], gradient_as_bucket_view=True)
given_steps("float16", [grads], dtype=torch.float16)  # models held in low precision
given_steps("bfloat16", [grads], dtype=torch.bfloat16)
given_steps("group", [grads], group=dist.new_group(list(range(size))))
given_steps("chunked", [grads], compression={"chunk_bytes": 4 * 700})  # pipelined on async collectives
poisoned = [g.copy() for g in grads]
poisoned[0][:] = 0.0
if rank == size - 1:
    poisoned[1][3] = np.nan
given_steps("poisoned", [poisoned])


def no_sync_step():
    """Two micro-batches, the first under no_sync(): one exchange of the accumulated sum."""
    model = Given(DDP_SIZES)
    ddp = DDP(model)
    order, index_of = [], {id(p): i for i, p in enumerate(model.ps)}
    ddp.register_comm_hook(hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e4m3")), recording(order, index_of))
    with ddp.no_sync():
        ddp([torch.from_numpy(g) for g in grads]).backward()
    out["no_sync_calls_during_no_sync"] = np.array(len(order))
    ddp([torch.from_numpy(g) for g in codes_grads(rank + 10, DDP_SIZES)]).backward()
    for i, p in enumerate(model.ps):
        out[f"no_sync_{i}"] = p.grad.numpy().copy()
    out["no_sync_order"] = np.array(";".join(",".join(map(str, bucket)) for bucket in order))


no_sync_step()


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
        self.unused = torch.nn.Linear(4, 4)  # never in the graph

    def forward(self, x):
        return self.used(x)


def train(**ddp_kwargs):
    torch.manual_seed(0)
    whole = WithUnused()
    ddp = DDP(whole, **ddp_kwargs)
    state = hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e4m3"))
    ddp.register_comm_hook(state, hvd_aps.ddp.aps_hook)
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        ddp(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().ravel() for p in whole.parameters()]).numpy(), state.buckets_exchanged


out["train_unused"], out["train_unused_buckets"] = train(find_unused_parameters=True, bucket_cap_mb=0.01)
out["train_static"], _ = train(static_graph=True, gradient_as_bucket_view=True)


def stochastic_runs():
    """The same script and seed three times in this process, several buckets on two lanes:
    stochastic rounding's seeds come from (seed, rank, tensor, step), never from thread order."""
    runs = []
    for _ in range(3):
        torch.manual_seed(0)
        whole = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64),
                                    torch.nn.Tanh(), torch.nn.Linear(64, 4))
        ddp = DDP(whole, bucket_cap_mb=0.01)
        state = hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e4m3", rounding="stochastic", seed=7, min_elements=16))
        ddp.register_comm_hook(state, hvd_aps.ddp.aps_hook)
        opt = torch.optim.SGD(whole.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(8):
            opt.zero_grad()
            ddp(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
            opt.step()
        runs.append(torch.cat([p.detach().ravel() for p in whole.parameters()]).numpy())
        state.close()
    return np.stack(runs)


out["stochastic_runs"] = stochastic_runs()


def recovery():
    """Error feedback on; a step whose bucket 0 exchange raises on every rank (injected before any
    collective); then, through a fresh DDP wrapper on the same APSState (DDP's reducer does not
    resume after a failed hook), the same steps as a run that never failed and was wrapped anew
    at the same point (residuals are kept per DDP bucket, whose layout a new wrapper rebuilds),
    bit for bit."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))

    def step(whole, ddp, seed):
        whole.zero_grad()
        ddp(torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * seed + rank))).pow(2).mean().backward()
        with torch.no_grad():
            for p in whole.parameters():
                p -= 0.1 * p.grad

    states = {k: hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e2m1fn", min_elements=16, error_feedback=True))
              for k in ("failing", "clean")}
    models = {k: make() for k in states}

    def wrapped(k):
        ddp = DDP(models[k], bucket_cap_mb=0.01)
        ddp.register_comm_hook(states[k], hvd_aps.ddp.aps_hook)
        return ddp

    ddps = {k: wrapped(k) for k in states}
    for k in states:
        step(models[k], ddps[k], 0)
    real_run = hvd_aps.ddp.exchange.run

    def failing_run(stages, bucket, *args, **kwargs):
        if bucket.name == "ddp.bucket0":
            raise ValueError("injected failure of bucket 0")
        return real_run(stages, bucket, *args, **kwargs)

    hvd_aps.ddp.exchange.run = failing_run
    try:
        step(models["failing"], ddps["failing"], 1)
        out["ddp_error"] = np.array("no error")
    except Exception as err:  # DDP re-raises the hook's error
        out["ddp_error"] = np.array(str(err))
    hvd_aps.ddp.exchange.run = real_run
    ddps = {k: wrapped(k) for k in states}
    for seed in (1, 2):
        for k in states:
            step(models[k], ddps[k], seed)
    out["ddp_recovered"] = np.array(all(torch.equal(a, b) for a, b in zip(models["failing"].parameters(),
                                                                         models["clean"].parameters())))


recovery()


def native_pinned():
    """policy="auto" with its decision pinned (state_dict): the bucket goes through torch's own
    allreduce_hook, bit for bit that hook registered by hand."""
    results = {}
    for key, pinned in (("native", True), ("default", False)):
        model = Given(DDP_SIZES)
        ddp = DDP(model)
        if pinned:
            comp = hvd_aps.APSCompressor("e4m3", policy="auto", min_elements=16)
            comp.pin({"policy": "native"})
            ddp.register_comm_hook(hvd_aps.ddp.APSState(comp), hvd_aps.ddp.aps_hook)
        else:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        ddp([torch.from_numpy(g) for g in codes_grads(rank, DDP_SIZES)]).backward()
        results[key] = torch.cat([p.grad.ravel() for p in model.ps]).numpy()
    # counted as every native exchange is: a float32 ring's bytes, each tensor passed through
    out["native_bytes"] = np.array(comp.bytes_sent)
    out["native_formats"] = np.array(sorted({s.fmt for s in comp.stats.values()}))
    out["native_elements"] = np.array(comp.totals().elements)
    out["native_equals_default"] = np.array(results["native"].tobytes() == results["default"].tobytes())


native_pinned()
shared = hvd_aps.APSCompressor("e4m3")
hvd_aps.ddp.APSState(shared).close()
try:  # one compressor for two models
    hvd_aps.ddp.APSState(shared)
    out["shared_refused"] = np.array("no error")
except ValueError as err:
    out["shared_refused"] = np.array(str(err))
try:  # rank 0 e4m3, the others e5m2: refused where the state is made, on every rank
    hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e4m3" if rank == 0 else "e5m2"))
    out["mismatch"] = np.array("no error")
except ValueError as err:
    out["mismatch"] = np.array(str(err))
np.savez(f"{sys.argv[1]}/ddp{size}_rank{rank}.npz", **out)
leave_torchrun()
