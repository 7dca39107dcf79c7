"""Run under `torchrun --nproc-per-node 2` (or 4: HSDP on a 2 x 2 mesh too), Gloo on loopback:
hvd_aps.fsdp's codes all-gather of the parameters. Each rank saves OUTDIR/gather<N>_rank<r>.npz
for tests/test_fsdp_gather.py: what APSAllGather made of known shards, and per training setting,
after every step, this rank's sharded parameters (the master), the unsharded copy FSDP computes
with, and the averaged gradients the step applied."""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hvd_aps
import hvd_aps.fsdp
from common import gather_shard, leave_torchrun

STEPS, LR = 3, 0.05
SIZES = (6001, 700)  # the direct calls' shards: several blocks and a short last one, one block

dist.init_process_group("gloo")
rank, size, out = dist.get_rank(), dist.get_world_size(), {}
torch.set_num_threads(1)


def direct():
    """APSAllGather called as FSDP calls it: the input is this rank's slot of the output."""
    for fmt in ("e4m3", "e5m2", "e2m1fn"):
        for n in SIZES:
            for dtype in (torch.float32, torch.bfloat16):
                comm = hvd_aps.fsdp.APSAllGather(hvd_aps.BlockCodes(fmt), "direct")
                output = comm.allocate((n * size,), dtype=dtype, device=torch.device("cpu"))
                mine = output.narrow(0, n * rank, n)
                mine.copy_(torch.from_numpy(gather_shard(rank, n)))
                comm(output, mine, dist.group.WORLD)
                key = f"direct_{fmt}_{n}_{str(dtype)[6:]}"
                out[key], out[f"{key}_bytes"] = output.float().numpy(), np.array(comm.bytes_sent)
    try:
        hvd_aps.BlockCodes("e4m3", block=0)
    except ValueError as err:
        out["block_refused"] = np.array(str(err))
    fallbacks()


def fallbacks():
    """As FSDP sends them: raw bytes (a module of mixed dtypes), and a gather over another group
    than the first one's (an integer reshard_after_forward's smaller group)."""
    comm = hvd_aps.fsdp.APSAllGather(hvd_aps.BlockCodes("e4m3"), "fallback")
    values = comm.allocate((700 * size,), dtype=torch.float32, device=torch.device("cpu"))
    values.narrow(0, 700 * rank, 700).copy_(torch.from_numpy(gather_shard(rank, 700)))
    comm(values, values.narrow(0, 700 * rank, 700), dist.group.WORLD)  # the module's shard group: codes
    raw = torch.empty(700 * size, dtype=torch.uint8)
    raw.narrow(0, 700 * rank, 700).copy_(torch.arange(700, dtype=torch.uint8) + rank)
    comm(raw, raw.narrow(0, 700 * rank, 700), dist.group.WORLD)
    alone = [dist.new_group([r]) for r in range(size)]
    exact = torch.from_numpy(gather_shard(rank, 700).copy())
    comm(exact, exact, alone[rank])
    out["fallback_raw"], out["fallback_exact"] = raw.numpy(), exact.numpy()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Tanh(),
                               torch.nn.Linear(96, 8))


def sharded(net, reshard, mesh, mp):
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, reshard_after_forward=reshard, mesh=mesh, mp_policy=mp)
    fully_shard(net, reshard_after_forward=reshard, mesh=mesh, mp_policy=mp)
    if reshard:  # prefetching: each layer's all-gather issued during the one before
        net[0].set_modules_to_forward_prefetch([net[2]])
        net[2].set_modules_to_forward_prefetch([net[4]])
    return net


def train(key, params="e4m3", grads=None, reshard=True, hsdp=False, mp=None):
    """STEPS steps of plain SGD on each rank's batch; after each step the master shards, the
    gathered copy (an unshard, as the next forward gathers it) and the applied gradients."""
    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    net = sharded(model(), reshard, mesh, mp or MixedPrecisionPolicy())
    units = 0 if params is None else hvd_aps.fsdp.apply(net, None if grads is None else hvd_aps.APSCompressor(grads),
                                                        params=params)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        before = [p.to_local().detach().clone() for p in net.parameters()]
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        losses.append(loss.item())
        out[f"{key}_{step}_untouched"] = np.array(all(torch.equal(b, p.to_local()) for b, p in
                                                     zip(before, net.parameters())))
        out[f"{key}_{step}_grads"] = flat(p.grad.to_local() for p in net.parameters())
        opt.step()
        out[f"{key}_{step}_master"] = flat(p.to_local() for p in net.parameters())
        out[f"{key}_{step}_copy"] = gathered(net)
    out[f"{key}_losses"], out[f"{key}_units"] = np.array(losses), np.array(units)
    out[f"{key}_bytes"] = np.array(hvd_aps.fsdp.gather_bytes(net))


def flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors]).numpy().copy()


def gathered(net):
    """The unsharded parameters FSDP computes with, gathered as a forward gathers them."""
    copies = []
    for layer in (net[0], net[2], net[4]):
        layer.unshard()
        copies += [p.detach().float().reshape(-1).clone() for p in layer.parameters()]
        layer.reshard()
    return torch.cat(copies).numpy()


direct()
train("fp32", params=None)
train("e4m3")
train("e4m3_keep", reshard=False)
train("e5m2_grads", params="e5m2", grads="e4m3")
train("bf16", mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
if size == 4:
    train("hsdp", hsdp=True)
np.savez(f"{sys.argv[1]}/gather{size}_rank{rank}.npz", **out)
leave_torchrun()
