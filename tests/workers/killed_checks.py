"""A worker killed mid-step under torchrun's restarts (tests/test_faults.py):

    torchrun --nproc-per-node 4 --max-restarts 3 ... killed_checks.py OUTDIR KILL PER_HOST

Each rank takes its host number (GROUP_RANK, what a torchrun agent per machine would give it) from
its local rank: local ranks 0..PER_HOST-1 on host 0, and so on, so the exchange runs on two levels
through shared memory as on several machines. (Two agents on one machine, one per host, do not
restart together: see docs/faults.md.)

Three phases train one after another, each STEPS steps with error feedback and stochastic rounding
in 4 bits (e3m0), a checkpoint per rank after every step: the DDP hook, FSDP2 over every rank,
HSDP (FSDP2 inside a host, codes across hosts); both FSDP2 phases gather their parameters as e4m3
codes too. With KILL=1, rank KILLED_RANK SIGKILLs itself in
each phase once (a marker file, written as it arms the kill, keeps a later attempt from arming it
again), during the backward of step KILL_STEP while the buckets before it are in flight; torchrun
takes the job down and starts every rank again, which resumes every phase from its last checkpoint
that every rank holds. Each rank saves to OUTDIR/killed<KILL>_rank<r>.npz per phase its final
parameters, the attempt (torchrun's restart count) that trained each step, which shows the kill
and the step resumed from, and what shows the phase ran on two levels (the DDP hook's host level
in shared memory, HSDP's replicate group across the hosts).
"""
import os
import pathlib
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps._host_memory
import hvd_aps.ddp
import hvd_aps.fsdp
from common import KILL_STEP, KILLED_PHASES as PHASES, KILLED_STEPS as STEPS, leave_torchrun, parameters

KILLED_RANK = 1
WIDTH, LAYERS = 128, 4
SETTINGS = dict(error_feedback=True, rounding="stochastic", seed=5)
PARAMS = "e4m3"  # the FSDP2 phases' parameters, gathered as codes


def build(phase):
    """(net, the module to call, optimizer, compressor, what closes it, what shows its levels) of a
    phase, made alike in every attempt."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    compressor = hvd_aps.APSCompressor("e3m0", **SETTINGS)
    if phase == "ddp":
        call = DDP(net, bucket_cap_mb=0.1)  # several buckets: some are in flight at the kill
        state = hvd_aps.ddp.APSState(compressor)
        call.register_comm_hook(state, hvd_aps.ddp.aps_hook)
        close = state.close
        levels = {"ddp_host_memory": isinstance(state.lane(0, "cpu")[0].local, hvd_aps._host_memory.HostMemory)}
    else:
        mesh, replicate = hvd_aps.fsdp.host_mesh() if phase == "hsdp" else (None, None)
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        hvd_aps.fsdp.apply(net, compressor, replicate_group=replicate, params=PARAMS)
        call, close = net, compressor.close
        levels = {"hsdp_hosts": dist.get_world_size(replicate)} if phase == "hsdp" else {}
    return net, call, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), compressor, close, levels


def checkpoint(outdir, phase, step, rank):
    return pathlib.Path(outdir) / f"ckpt_{phase}_step{step}_rank{rank}.pt"


def resume_step(outdir, phase, rank) -> int:
    """The last step whose checkpoint every rank wrote (0: none)."""
    mine = max((s for s in range(1, STEPS + 1) if checkpoint(outdir, phase, s, rank).exists()), default=0)
    step = torch.tensor([mine])
    dist.all_reduce(step, op=dist.ReduceOp.MIN)
    return int(step)


def kill_during_backward(net):
    """SIGKILL this process when the backward reaches the first layer: DDP has launched the
    buckets of the later layers by then, FSDP2 the reduce-scatters of the later units."""
    net[0].register_full_backward_pre_hook(lambda module, grad: os.kill(os.getpid(), signal.SIGKILL))


def train(phase, outdir, rank, kill) -> dict:
    """The phase trained (resumed where a checkpoint is) -> its parameters, the attempt that
    trained each step and its levels' flags."""
    net, call, opt, compressor, close, levels = build(phase)
    start, attempts = resume_step(outdir, phase, rank), []
    if start:
        saved = torch.load(checkpoint(outdir, phase, start, rank), weights_only=False)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        compressor.load_state_dict(saved["compressor"])
        attempts = saved["attempts"]
    for step in range(start + 1, STEPS + 1):
        armed = pathlib.Path(outdir) / f"armed_{phase}"
        if kill and step == KILL_STEP and rank == KILLED_RANK and not armed.exists():
            armed.touch()
            kill_during_backward(net)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(call(x), y).backward()
        opt.step()
        attempts = attempts + [int(os.environ["TORCHELASTIC_RESTART_COUNT"])]
        path = checkpoint(outdir, phase, step, rank)
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    "compressor": compressor.state_dict(), "attempts": attempts}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # a kill never leaves half a checkpoint
    close()
    return {phase: parameters(net), f"{phase}_attempts": np.array(attempts), **levels}


def init_attempt():
    """init_process_group on keys of this attempt only. torchrun's static rendezvous keeps one
    store across restarts, and a restarted rank could read a peer's address of the attempt before
    (Gloo: "connectFullMesh failed ... Connection refused"); a prefix per restart count keeps the
    attempts apart (see docs/faults.md)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    attempt = dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group("gloo", store=attempt, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def main():
    outdir, kill, per_host = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    os.environ["GROUP_RANK"] = str(int(os.environ["LOCAL_RANK"]) // per_host)
    init_attempt()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = {key: value for phase in PHASES for key, value in train(phase, outdir, rank, kill).items()}
    np.savez(f"{outdir}/killed{int(kill)}_rank{rank}.npz", **out)
    leave_torchrun()


if __name__ == "__main__":
    main()
