"""Run under `horovodrun -np 2 --gloo`: Horovod's DistributedOptimizer with an APSCompressor (every
gradient as codes) and hvd_aps.torch.DistributedOptimizer on the counting stand-in for CuPy
(standin_device.py), 1, 10 and 1000 parameters, 1 and 8 chunks, each with and without the
stand-in; each rank saves OUTDIR/device_horovod_rank<r>.json as device_checks.py does, with the
counted step's reads on the torch side too (Tensor.tolist: Horovod's reduced tokens, which the
stand-in does not see)."""
import contextlib
import json
import sys

import horovod.torch as hvd
import torch

import hvd_aps
import hvd_aps.torch
from standin_device import ELEMENTS, Tensors, counted, on_device, place_of, standin, summary

STEPS = 3  # two to warm up (the first agrees on the layout), the last counted

hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
PLACE = place_of(rank)


def compressor(chunks: int):
    chunk_bytes = 0 if chunks == 1 else 4 * ELEMENTS // chunks
    return hvd_aps.APSCompressor("e4m3", chunk_bytes=chunk_bytes, hierarchical=False, seed=5, min_elements=0,
                                 bucket_bytes=8 * ELEMENTS)


def one_line(model, chunks: int):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                    named_parameters=model.named_parameters(), compression=compressor(chunks))


def codes_optimizer(model, chunks: int):
    return hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                              named_parameters=model.named_parameters(), compression=compressor(chunks))


@contextlib.contextmanager
def tolist_calls():
    """Inside: every Tensor.tolist call counted in the yielded list."""
    calls, tolist = [], torch.Tensor.tolist

    def counting(tensor):
        calls.append(tensor.shape)
        return tolist(tensor)

    torch.Tensor.tolist = counting
    try:
        yield calls
    finally:
        torch.Tensor.tolist = tolist


def train(make, count: int, chunks: int, device: bool) -> dict:
    with on_device(device, PLACE):
        model = Tensors(count, rank)
        opt = make(model, chunks)
        for step in range(STEPS):
            if step == STEPS - 1:
                hvd.barrier()
                standin.COUNTS.reset()
            with tolist_calls() as tolists:
                opt.zero_grad()
                model(step).backward()
                opt.step()
        events = counted() if device else None
    return dict(summary(torch.cat([p.detach().ravel() for p in model.parameters()]).numpy(), events),
                tolists=len(tolists))


out = {"place": [PLACE.stream, PLACE.device]}
for name, make in (("horovod", one_line), ("codes_optimizer", codes_optimizer)):
    for count in (1, 10, 1000):
        for chunks in (1, 8):
            device, host = train(make, count, chunks, True), train(make, count, chunks, False)
            out[f"{name}-{count}t-{chunks}c"] = dict(device, same_bits=device["digest"] == host["digest"])
with open(f"{sys.argv[1]}/device_horovod_rank{rank}.json", "w") as f:
    json.dump(out, f)
