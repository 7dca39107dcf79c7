"""Run under `torchrun --nproc-per-node 2` (or 3), Gloo on loopback: hvd_aps.fsdp in FSDP2. Each
rank saves OUTDIR/fsdp<N>_rank<r>.npz for tests/test_fsdp.py."""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hvd_aps
import hvd_aps.fsdp
from common import codes_grads, leave_torchrun
from hvd_aps._schedule import max_trial_steps

AUTO_STEPS = max_trial_steps() + 1  # the first step sees every unit, then at most every round of trials

dist.init_process_group("gloo")
rank, size, out = dist.get_rank(), dist.get_world_size(), {}
torch.set_num_threads(1)


def direct():
    """APSReduceScatter called as FSDP calls it, on known inputs: rows (world, n), row r for rank r."""
    rows = np.stack([np.concatenate([g.ravel() for g in codes_grads(10 * rank + r)])[:6001] for r in range(size)])
    for fmt in ("e4m3", "e2m1fn"):
        comm = hvd_aps.fsdp.APSReduceScatter(hvd_aps.APSCompressor(fmt), "direct")
        output = torch.empty(rows.shape[1])
        comm(output, torch.from_numpy(rows).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
        out[f"direct_{fmt}"] = output.numpy()
    poisoned = rows.copy()
    if rank == size - 1:
        poisoned[0, 5] = np.inf  # block 0 of row 0: NaN for rank 0 only
    output = torch.empty(rows.shape[1])
    hvd_aps.fsdp.APSReduceScatter(hvd_aps.APSCompressor("e4m3"), "poisoned")(
        output, torch.from_numpy(poisoned).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
    out["poisoned"] = output.numpy()
    for dtype in (torch.bfloat16, torch.float16):  # a MixedPrecisionPolicy's reduce_dtype
        key = str(dtype).replace("torch.", "")
        output = torch.empty(rows.shape[1], dtype=dtype)
        hvd_aps.fsdp.APSReduceScatter(hvd_aps.APSCompressor("e4m3"), key)(
            output, torch.from_numpy(rows).to(dtype).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
        out[f"direct_{key}"], out[f"direct_{key}_dtype_ok"] = output.float().numpy(), np.array(output.dtype == dtype)
    native = hvd_aps.APSCompressor("e4m3", policy="auto")
    native.pin({"policy": "native"})
    output = torch.empty(rows.shape[1])
    hvd_aps.fsdp.APSReduceScatter(native, "native")(output, torch.from_numpy(rows).reshape(-1), dist.group.WORLD,
                                                     dist.ReduceOp.SUM)
    out["native"] = output.numpy()
    native = hvd_aps.APSCompressor("e4m3", policy="auto", fallback="bfloat16")
    native.pin({"policy": "native"})
    output = torch.empty(rows.shape[1])
    hvd_aps.fsdp.APSReduceScatter(native, "native_bf16")(output, torch.from_numpy(rows).reshape(-1),
                                                          dist.group.WORLD, dist.ReduceOp.SUM)
    out["native_bf16"], out["native_bf16_fmt"] = output.numpy(), np.array(native.stats["native_bf16"].fmt)
    out["native_bf16_bytes"] = np.array(native.bytes_sent)
    try:
        hvd_aps.fsdp.APSReduceScatter(hvd_aps.APSCompressor("e4m3"), "avg")(
            output, torch.from_numpy(rows).reshape(-1), dist.group.WORLD, dist.ReduceOp.AVG)
    except ValueError as err:
        out["avg_refused"] = np.array("ReduceOp.SUM" in str(err))


direct()


class Recording(hvd_aps.fsdp.APSReduceScatter):
    """APSReduceScatter keeping what FSDP handed it, for the model."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        super().__call__(output_tensor, input_tensor, group, op, async_op)
        calls = out.setdefault("_calls", [])
        out[f"rec_{len(calls)}_in"] = input_tensor.float().numpy().copy()
        out[f"rec_{len(calls)}_out"] = output_tensor.float().numpy().copy()
        calls.append(self.name)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Sequential(
        torch.nn.Linear(96, 96), torch.nn.Tanh()), torch.nn.Linear(96, 8))


def train(key, reshard=True, mp=None, recording=False, steps=4, **compressor):
    """Nested fully_shard units (the inner Sequential, then the root), AdamW; parameters gathered."""
    net = model()
    policy = MixedPrecisionPolicy(reduce_dtype=mp) if mp else MixedPrecisionPolicy()
    fully_shard(net[2], reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(net, reshard_after_forward=reshard, mp_policy=policy)
    comp = hvd_aps.APSCompressor(compressor.pop("fmt", "e4m3"), **compressor)
    units = hvd_aps.fsdp.apply(net, comp)
    if recording:
        for name, m in net.named_modules():
            if isinstance(m, hvd_aps.fsdp.FSDPModule):
                m.set_custom_reduce_scatter(Recording(comp, f"fsdp.{name or 'root'}"))
    commits = []
    commit = comp.state.commit
    comp.state.commit = lambda: (commits.append(1), commit())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
    out[f"{key}_units"] = np.array(units)
    out[f"{key}_residuals"] = np.array(len(comp.state_dict()["residuals"]))
    out[f"{key}_commits"] = np.array(len(commits))
    out[f"{key}_policy"] = np.array(str(comp.decisions().get("policy")))
    out[key] = torch.cat([p.full_tensor().detach().ravel() for p in net.parameters()]).float().numpy()


train("rec", recording=True, steps=1)
out["rec_calls"] = np.array(out.pop("_calls"))
train("plain")
train("keep_unsharded", reshard=False)
train("bf16", mp=torch.bfloat16)
train("fp16", mp=torch.float16)
train("ef", fmt="e2m1fn", error_feedback=True)
train("hybrid", fmt="e2m1fn", hybrid="e4m3")
train("auto", policy="auto", steps=AUTO_STEPS)
try:  # rank 0 e4m3, the others e5m2: refused by apply, on every rank
    hvd_aps.fsdp.apply(fully_shard(model()), hvd_aps.APSCompressor("e4m3" if rank == 0 else "e5m2"))
    out["mismatch"] = np.array("no error")
except ValueError as err:
    out["mismatch"] = np.array(str(err))
shared = hvd_aps.APSCompressor("e4m3")
hvd_aps.fsdp.apply(fully_shard(model()), shared)
try:  # one compressor for two models: refused by the second apply, on every rank
    hvd_aps.fsdp.apply(fully_shard(model()), shared)
    out["shared_refused"] = np.array("no error")
except ValueError as err:
    out["shared_refused"] = np.array(str(err))
np.savez(f"{sys.argv[1]}/fsdp{size}_rank{rank}.npz", **out)
leave_torchrun()
