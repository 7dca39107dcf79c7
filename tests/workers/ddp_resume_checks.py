"""Run under `torchrun --nproc-per-node 2` (Gloo on loopback) twice: `straight` trains STEPS
steps, saving a checkpoint per rank (model, optimizer, compressor) at STEPS // 2; `second`, a
fresh process, loads it and trains the rest (for UNLOADED settings,
also once without the compressor's state). DDP rebuilds its buckets
after its first step in each process, so the resumed half starts on other buckets than the
straight run had at that step. Each rank saves OUTDIR/<mode>_rank<r>.npz (final parameters per
setting). The `fsdp` setting trains FSDP2 units with codes in their reduce-scatter instead."""
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
import hvd_aps.fsdp
from common import leave_torchrun, straight_or_resumed

STEPS, WIDTH, LAYERS = 8, 256, 6
SETTINGS = {"feedback": dict(error_feedback=True), "stochastic": dict(rounding="stochastic", seed=11),
            "feedback_one_bucket": dict(error_feedback=True),
            "fsdp": dict(error_feedback=True, rounding="stochastic", seed=3)}
BUCKET_MB = {"feedback": 0.5, "stochastic": 0.5, "feedback_one_bucket": 100}
UNLOADED = ("feedback", "fsdp")  # resumed also without the compressor's state: they must end elsewhere

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
outdir, mode = sys.argv[1], sys.argv[2]


def wrapped(setting, net, compressor):
    """(the module to call, what to close): DDP with the hook, or FSDP2 units with codes."""
    if setting == "fsdp":
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
        hvd_aps.fsdp.apply(net, compressor)
        return net, compressor
    ddp = DDP(net, bucket_cap_mb=BUCKET_MB[setting])
    state = hvd_aps.ddp.APSState(compressor)
    ddp.register_comm_hook(state, hvd_aps.ddp.aps_hook)
    return ddp, state


def build(setting):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    compressor = hvd_aps.APSCompressor("e3m0", **SETTINGS[setting])
    call, closing = wrapped(setting, net, compressor)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return net, call, opt, compressor, closing.close


straight_or_resumed(build, SETTINGS, "", outdir, mode, rank, STEPS, WIDTH, UNLOADED)
leave_torchrun()
