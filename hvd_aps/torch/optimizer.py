"""hvd_aps.torch.DistributedOptimizer: Horovod data parallelism over fixed buckets of codes.

horovod.torch.DistributedOptimizer with an APSCompressor already sends codes; this optimizer is
for users who want buckets fixed at construction (reverse parameter order, as gradients become
ready) and the results written into the gradients in place. When a bucket's last gradient is
accumulated, its exchange (hvd_aps.exchange, with Horovod's collectives) starts on the
compressor's threads while backward goes on; step() waits for all of them. Tensors below the
compressor's min_elements go through a plain Horovod allreduce, and so does every gradient where
policy="auto" chose Horovod's float32 allreduce. The lifecycle is Horovod's:
synchronize(), skip_synchronize(), and zero_grad() refused between backward and step. A
synchronize() that raises leaves the optimizer and the compressor as they were before the step.
"""
import contextlib
import time
import warnings
from typing import NamedTuple

import horovod.torch as hvd
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import _arrays, _device, _layout
from .._stages import Bucket
from ..compressor import APSCompressor
from .adapter import label, levels, reducible, wait
from ..config import Fallback, Path, Policy, Wire


class _Allreduce(NamedTuple):
    """A gradient on Horovod's own allreduce in place: its handle, the tensor it reduces (the
    gradient, or a float32 copy written back), its name, and what synchronize() divides it by."""
    handle: object
    wire: torch.Tensor
    name: str
    divisor: int = 1


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op):
        super(self.__class__, self).__init__(params)
        _check_arguments(compression, op)
        compression.claim("an hvd_aps.torch.DistributedOptimizer")
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        names = dict((p, n) for n, p in named_parameters) if named_parameters is not None else {}
        missing = [p for p in params if p not in names]
        if named_parameters is not None and missing:
            raise ValueError(f"{len(missing)} optimized parameters are missing from named_parameters")
        self._names = {p: names.get(p, f"param.{i}") for i, p in enumerate(params)}
        self._compression, self._op, self._passes_per_step = compression, op, backward_passes_per_step
        cfg = compression.config
        groups, small = _layout.buckets([p.numel() for p in params], cfg.bucket_bytes, cfg.min_elements)
        self._small = [params[i] for i in small]
        self._buckets = [[params[i] for i in group] for group in groups]
        self._bucket_of = {p: b for b, bucket in enumerate(self._buckets) for p in bucket}
        self.bytes_sent = 0
        self._should_synchronize, self._synchronized = True, False
        self._reset()
        if hvd.size() > 1:
            levels(cfg.hierarchical, timeout=cfg.timeout)  # the groups, made now (collectively), not on a thread
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self):
        self._passes = {p: 0 for p in self._names}
        self._ready = [set() for _ in self._buckets]
        self._futures, self._targets, self._handles, self._native = {}, {}, {}, {}

    def _on_grad(self, p):
        if self._passes[p] >= self._passes_per_step:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before "
                                 "step(): increase backward_passes_per_step to accumulate gradients locally")
        self._passes[p] += 1
        if self._passes[p] < self._passes_per_step:
            return
        if p not in self._bucket_of:
            self._allreduce_small(p)
            return
        b = self._bucket_of[p]
        self._ready[b].add(p)
        if len(self._ready[b]) == len(self._buckets[b]):
            self._launch(b)

    def _allreduce_small(self, p):
        """Horovod's own allreduce, in place; a dtype it refuses (bfloat16 on Gloo) goes as a
        float32 copy, written back in synchronize()."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        wire = p.grad if reducible(p.grad) else p.grad.to(torch.float32)
        self._compression.exchanger.pass_through(label(p.grad), p.grad.numel())
        name = f"hvd_aps.small.{self._names[p]}"
        self._handles[p] = _Allreduce(hvd.allreduce_async_(wire, op=self._op, name=name), wire, name)

    def _launch(self, b):
        for p in self._buckets[b]:  # parameters that got no gradient this step count as zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self._buckets[b]]
        if self._compression.exchanger.native_dtype() is Path.FLOAT32 and all(g.dtype == torch.float32 for g in grads):
            self._launch_native(b, grads)
            return
        # one float32 copy of the bucket's gradients end to end, exchanged in place; synchronize()
        # copies the results back into the gradients
        flat = _flatten_dense_tensors([g.detach() if g.dtype == torch.float32 else g.detach().to(torch.float32)
                                       for g in grads])
        bucket = Bucket.whole(f"hvd_aps.bucket{b}", [self._names[p] for p in self._buckets[b]],
                              [label(g) for g in grads], [g.numel() for g in grads])
        cfg = self._compression.config
        lv = levels(cfg.hierarchical, timeout=cfg.timeout)  # anew after an elastic reset
        array = _arrays.as_array(flat)
        self._futures[b] = self._compression.exchanger.bucket(lv, bucket, array, place=_device.place_of(flat),
                                                              out=array, average=self._op == hvd.Average)
        self._targets[b] = flat

    def _launch_native(self, b, grads):
        """policy="auto" chose Horovod's float32 allreduce: every gradient of bucket `b` summed in
        place, as Horovod's own optimizer sends it (no bucket copy, no exchange thread), averaged
        in synchronize() by the division the codes path's native exchange makes (the same bits)."""
        divisor = hvd.size() if self._op == hvd.Average else 1
        for p, g in zip(self._buckets[b], grads):
            name = f"hvd_aps.native.{self._names[p]}"
            self._handles[p] = _Allreduce(hvd.allreduce_async_(g, op=hvd.Sum, name=name), g, name, divisor)
        self._native[b] = [self._names[p] for p in self._buckets[b]], [(label(g), g.numel()) for g in grads]

    def synchronize(self):
        """Finish every exchange of this step and write the results into the gradients. If one
        raises, the others are waited for, the step is forgotten (the compressor's state as before
        it; gradients of buckets that finished hold their results) and the error is raised: run
        the step again from zero_grad()."""
        if hvd.size() == 1:
            self._synchronized = True
            return
        sent_before = self._compression.bytes_sent
        try:
            for b in range(len(self._buckets)):
                if b not in self._futures and b not in self._native:
                    self._launch(b)
            for p in self._small:
                if p not in self._handles:
                    self._allreduce_small(p)
            for future in self._futures.values():
                self._compression.exchanger.result(future)
            for p in self._handles:
                self._wait_allreduce(p, self._compression.config.timeout)
        except BaseException:
            deadline = time.monotonic() + self._compression.config.timeout  # one bound for them all
            for p in self._handles:
                with contextlib.suppress(Exception):
                    self._wait_allreduce(p, max(0.0, deadline - time.monotonic()))
            self._compression.exchanger.abort_step()  # after its exchanges: nothing writes once forgotten
            self._reset()
            raise
        for keys, labelled_sizes in self._native.values():  # counted once sent, in this step's bytes
            self._compression.exchanger.count_native(keys, labelled_sizes, Path.FLOAT32, hvd.size())
        for b, flat in self._targets.items():
            grads = [p.grad for p in self._buckets[b]]
            torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))
        for p, reduced in self._handles.items():
            if reduced.divisor != 1:
                reduced.wire.div_(reduced.divisor)
            if reduced.wire is not p.grad:
                p.grad.copy_(reduced.wire)
        self._compression.exchanger.end_step()
        self.bytes_sent = self._compression.bytes_sent - sent_before
        self._reset()
        self._synchronized = True

    def _wait_allreduce(self, p, timeout):
        """Horovod's allreduce of `p`'s gradient (below min_elements, or in a native bucket),
        waited for `timeout` seconds at most."""
        reduced = self._handles[p]
        wait(reduced.handle, f"the allreduce {reduced.name}", hvd.global_process_set, timeout)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this context applies the gradients without exchanging them: for
        `opt.synchronize(); clip; with opt.skip_synchronize(): opt.step()`."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized and not self._pending():
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): the gradients were already exchanged, so "
                              "they are applied as they are")
            else:
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if self._pending():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(): the exchange still reads "
                                 "the gradients")
        return super(self.__class__, self).zero_grad(set_to_none)

    def _pending(self):
        return bool(self._futures or self._handles or any(self._passes.values()))


def _check_arguments(compression, op):
    if not isinstance(compression, APSCompressor):
        raise TypeError("hvd_aps.torch.DistributedOptimizer sends APS codes: pass "
                        f"compression=hvd_aps.APSCompressor(...), got {compression!r}")
    if compression.config.wire is not Wire.CODES:
        raise ValueError("hvd_aps.torch.DistributedOptimizer sends codes; an APSCompressor with "
                         "wire='values' belongs in horovod.torch.DistributedOptimizer")
    if compression.config.policy is Policy.AUTO and compression.config.fallback is Fallback.BFLOAT16:
        raise ValueError("hvd_aps.torch.DistributedOptimizer's own allreduce carries float32 or float16 (NumPy "
                         "and CuPy hold no bfloat16): fallback='bfloat16' belongs with the DDP hook, FSDP2, or "
                         "horovod.torch.DistributedOptimizer on NCCL")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("op must be hvd.Average or hvd.Sum")


def DistributedOptimizer(optimizer, named_parameters=None, *, compression, backward_passes_per_step=1,
                         op=hvd.Average):
    """Wrap a torch optimizer like horovod.torch.DistributedOptimizer, sending APS codes in
    buckets fixed at construction.

    Arguments:
        optimizer: the torch optimizer to wrap.
        named_parameters: (name, parameter) pairs, for collective names and error messages.
        compression: an hvd_aps.APSCompressor (its format, rounding, scaling, bucket_bytes and
            min_elements apply).
        backward_passes_per_step: backward passes accumulated locally before an exchange.
        op: hvd.Average or hvd.Sum.

    After each synchronize(), `optimizer.bytes_sent` holds this rank's code bytes sent in it.

    Example::

        opt = hvd_aps.torch.DistributedOptimizer(opt, model.named_parameters(),
                                                 compression=hvd_aps.APSCompressor(hvd_aps.e4m3))
    """
    # Horovod's broadcast_optimizer_state (and elastic's TorchState.sync) fills an empty optimizer
    # state with a step on zero gradients: through the wrapped optimizer for a class of Horovod's
    # optimizer module, else through step(), which here would exchange the zeros as a step of
    # training (counted, and error feedback's residuals sent with them). So the class names
    # Horovod's module, as Horovod's own wrapper does.
    body = dict(_DistributedOptimizer.__dict__, __module__=hvd.DistributedOptimizer.__module__)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), body)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op)
