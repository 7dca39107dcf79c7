"""hvd_aps.torch.DistributedOptimizer: Horovod data parallelism that sends the codes themselves
(1 byte per element for 8-bit formats, packed for narrower ones) instead of float16 values.

Buckets are fixed at construction (reverse parameter order, as gradients become ready), so every
rank forms the same ones. When a bucket's last gradient is accumulated, its exchange (hvd_aps.wire)
starts on one of two communication threads while backward goes on with the next layers; the
results land in the gradients themselves; step() waits for all of them. Tensors below
`min_elements` go through a plain Horovod allreduce instead.
"""
import concurrent.futures

import horovod.torch as hvd
import torch

from .. import codec, wire
from ..compressor import APSCompressor


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 bucket_bytes, min_elements):
        super(self.__class__, self).__init__(params)
        if not isinstance(compression, APSCompressor):
            raise TypeError("hvd_aps.torch.DistributedOptimizer sends APS codes: pass "
                            f"compression=hvd_aps.APSCompressor(...), got {compression!r}")
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("op must be hvd.Average or hvd.Sum")
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        names = dict((p, n) for n, p in named_parameters) if named_parameters is not None else {}
        missing = [p for p in params if p not in names]
        if named_parameters is not None and missing:
            raise ValueError(f"{len(missing)} optimized parameters are missing from named_parameters")
        self._names = {p: names.get(p, f"param.{i}") for i, p in enumerate(params)}
        self._exchange = wire.CodesExchange(compression, hvd.size(), hvd.rank())
        self._op, self._passes_per_step = op, backward_passes_per_step
        groups, small = wire.buckets([p.numel() for p in params], bucket_bytes, min_elements)
        self._small = [params[i] for i in small]
        self._buckets = [[params[i] for i in group] for group in groups]
        self._bucket_of = {p: b for b, bucket in enumerate(self._buckets) for p in bucket}
        # two threads: one bucket's encoding and decoding overlap another's transfers
        self._thread = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hvd_aps_comm")
        self.bytes_sent = 0
        self._reset()
        if hvd.size() > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self):
        self._passes = {p: 0 for p in self._names}
        self._ready = [set() for _ in self._buckets]
        self._futures, self._handles = {}, {}

    def _on_grad(self, p):
        self._passes[p] += 1
        if self._passes[p] < self._passes_per_step:
            return
        if p not in self._bucket_of:
            self._handles[p] = hvd.allreduce_async_(p.grad, op=self._op, name=f"hvd_aps.small.{self._names[p]}")
            return
        b = self._bucket_of[p]
        self._ready[b].add(p)
        if len(self._ready[b]) == len(self._buckets[b]):
            self._launch(b)

    def _launch(self, b):
        grads = [p.grad for p in self._buckets[b]]
        self._futures[b] = self._thread.submit(self._exchange_bucket, b, grads)

    def _exchange_bucket(self, b, grads):
        ex, name = self._exchange, f"hvd_aps.bucket{b}"
        flats = [codec.as_array(g.detach().to(torch.float32).reshape(-1)) for g in grads]
        agreed = hvd.allreduce(torch.from_numpy(ex.metadata(flats)), op=hvd.Max, name=f"{name}.meta")
        send, splits, state = ex.begin(flats, agreed.numpy(), key=b)
        received, _ = hvd.alltoall(torch.from_dlpack(send), splits=torch.tensor(splits, dtype=torch.int32),
                                   name=f"{name}.codes")
        gathered = hvd.allgather(torch.from_dlpack(ex.reduce_shard(codec.as_array(received), state, key=b)),
                                 name=f"{name}.shards")
        # float32 gradients take the result in place; others get a float32 copy converted back later
        targets = [grads[i].view(-1) if grads[i].dtype == torch.float32 and grads[i].is_contiguous()
                   else torch.empty(grads[i].numel(), dtype=torch.float32, device=grads[i].device)
                   for i in state.included]
        ex.finish(codec.as_array(gathered), state, self._op == hvd.Average, [codec.as_array(t) for t in targets])
        out = dict(zip(state.included, targets))
        for i in state.fallback:  # a NaN/Inf somewhere: unchanged through Horovod, so every rank sees it
            out[i] = hvd.allreduce(grads[i].detach().to(torch.float32), op=self._op, name=f"{name}.nonfinite{i}")
        return [out[i] for i in range(len(grads))], state.bytes_sent

    def synchronize(self):
        """Finish every exchange of this step and write the results into the gradients."""
        if hvd.size() == 1:
            return
        for b, bucket in enumerate(self._buckets):
            if b not in self._futures:  # parameters that got no gradient this step count as zeros
                for p in bucket:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                self._launch(b)
        for p in self._small:
            if p not in self._handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._handles[p] = hvd.allreduce_async_(p.grad, op=self._op, name=f"hvd_aps.small.{self._names[p]}")
        self.bytes_sent = 0
        for b, future in self._futures.items():
            results, sent = future.result()
            self.bytes_sent += sent
            for p, r in zip(self._buckets[b], results):
                if r.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(r.reshape(p.shape))
        for handle in self._handles.values():
            hvd.synchronize(handle)
        self._reset()

    def step(self, closure=None):
        self.synchronize()
        return super(self.__class__, self).step(closure)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=hvd.Average, bucket_bytes=16 << 20, min_elements=4096):
    """Wrap a torch optimizer like horovod.torch.DistributedOptimizer, sending APS codes.

    compression: an hvd_aps.APSCompressor (its format, rounding and scaling apply).
    bucket_bytes: float32 gradient bytes per bucket (one metadata allreduce, one alltoall and one
    allgather each). min_elements: smaller tensors take a plain float32 allreduce.
    After step(), `optimizer.bytes_sent` holds this rank's code bytes sent in that step.
    """
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               bucket_bytes, min_elements)
