"""Run under `torchrun --nproc-per-node 2` (Gloo on loopback) twice: `straight` trains STEPS
steps, saving a checkpoint per rank (model, optimizer, compressor) at STEPS // 2; `second`, a
fresh process, loads it and trains the rest (for UNLOADED settings,
also once without the compressor's state). DDP rebuilds its buckets
after its first step in each process, so the resumed half starts on other buckets than the
straight run had at that step. Each rank saves OUTDIR/<mode>_rank<r>.npz (final parameters per
setting; the straight run also the names the hook gave the parameters, <setting>_keys). The
`fsdp` settings train FSDP2 units with codes in their reduce-scatter instead (and for
RESUME_PARAMS in their parameters' all-gather)."""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
import hvd_aps.fsdp
from common import RESUME_DDP as SETTINGS, RESUME_PARAMS, leave_torchrun, straight_or_resumed

STEPS, WIDTH, LAYERS = 8, 256, 6
BUCKET_MB = {"feedback": 0.5, "stochastic": 0.5, "feedback_one_bucket": 100}
UNLOADED = ("feedback", "fsdp")  # resumed also without the compressor's state: they must end elsewhere

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
outdir, mode = sys.argv[1], sys.argv[2]
KEYS = {}  # setting -> the hook's name of each parameter, in the model's order


def wrapped(setting, net, compressor):
    """(the module to call, what closes it): DDP with the hook, or FSDP2 units with codes."""
    if setting.startswith("fsdp"):
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
        hvd_aps.fsdp.apply(net, compressor, params=RESUME_PARAMS.get(setting))
        return net, compressor.close
    ddp = DDP(net, bucket_cap_mb=BUCKET_MB[setting])
    state = hvd_aps.ddp.APSState(compressor)
    ddp.register_comm_hook(state, hvd_aps.ddp.aps_hook)

    def close():
        KEYS[setting] = [state._keys[id(p)] for p in net.parameters()]
        state.close()
    return ddp, close


def build(setting):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    compressor = hvd_aps.APSCompressor("e3m0", **SETTINGS[setting])
    call, close = wrapped(setting, net, compressor)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return net, call, opt, compressor, close


straight_or_resumed(build, SETTINGS, "", outdir, mode, rank, STEPS, WIDTH, UNLOADED,
                    more=lambda: {f"{setting}_keys": np.array(keys) for setting, keys in KEYS.items()})
leave_torchrun()
