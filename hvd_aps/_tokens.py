"""Codes through Horovod's own allreduce: batches of gradients, and the token Horovod reduces.

Horovod allreduces what compress(t) returns and hands the result to decompress(). So compress()
puts the gradient in a *batch* (its name and process set read from the calling Horovod function,
hvd_aps._horovod.call_site) and returns a token, [1, rank]; the batch's codes exchange starts once
it is full or at the step's first decompress(). Named horovod.torch gradients take their slots in
the buckets their process set agreed on (hvd_aps._agreed), so a rank that skips a parameter still
exchanges the others' buckets; unnamed ones (TensorFlow's) join the open batch as they come. The
token, reduced as the gradient would be, says what to do with the sum ([c N, c N (N-1) / 2]: c = 1/N
an average, 1 a sum); Adasum, Min, Max and Product are refused. It comes back too late to fold an
average into the decode, so a batch averages where its name's tokens said Average the step before
(a step whose tokens then disagree raises). A step ends once every gradient came back through
decompress(); one that raises is abandoned, nothing of it kept. One Horovod optimizer owns a
compressor. Adapters: hvd_aps.torch.adapter, hvd_aps.tensorflow.adapter; see docs/how-it-works.md.
"""
import dataclasses
import functools
import threading
import warnings
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from . import _agreed, _horovod, _metadata, exchange
from ._stages import Bucket
from .config import Fallback, Path, Policy

# The token's reduced value is 1 or N up to a few float32 roundings of the scale factors.
TOKEN_TOLERANCE = 1e-4
NOT_A_SUM = ("APSCompressor's codes need an allreduce that sums (op Average or Sum, with any pre/postscale); this "
             "reduction is not one (Adasum, Min, Max or Product?): use APSCompressor(..., wire='values') for it")
NOT_AVERAGED = ("APSCompressor averaged these sums as the same gradients' allreduce did in the step before, and "
                "this allreduce does not average (op Sum or other pre/postscale factors): this step is abandoned "
                "on every rank and the next one runs as this op asks. Use one APSCompressor for each reduction.")
ADAPTERS = {"torch": "hvd_aps.torch.adapter", "tensorflow": "hvd_aps.tensorflow.adapter"}


@runtime_checkable
class Adapter(Protocol):
    """What the Horovod path needs of a framework: conversions between its tensors and the
    codec's arrays, its collectives as exchange.Levels, and where its exchanges run. Each of
    hvd_aps.torch.adapter and hvd_aps.tensorflow.adapter is a module of these functions."""

    threaded: bool  # exchanges run on the exchanger's threads (eager torch, so backward goes on)

    def is_dense_float(self, tensor) -> bool: ...

    def is_empty(self, tensor) -> bool: ...

    def numel(self, tensor) -> int: ...

    def label(self, tensor) -> str:
        """The tensor's name in the stats."""

    def flatten(self, tensor):
        """The gradient as a float32 flat array (a graph tensor in a graph)."""

    def join(self, flats):
        """flatten()'s arrays end to end in one flat array: a batch's bucket."""

    def place(self, tensor):
        """Where a threaded exchange of this gradient runs (hvd_aps._device.Place), None: anywhere."""

    def token(self, tensor, process_set):
        """What Horovod allreduces in place of a gradient sent as codes (token_values)."""

    def call_site(self, frame):
        """The hvd_aps._horovod.Site of a compress() whose caller is `frame` (its key None where
        the framework's gradients go in the order they arrive: TensorFlow, whose graph fixes its
        exchanges when traced)."""

    def world(self, process_set) -> int:
        """The ranks Horovod's allreduce spans on the process set."""

    def levels(self, hierarchical, process_set, timeout: float) -> exchange.Levels:
        """The exchange's groups on the process set, each wait for the other ranks bounded by
        `timeout` seconds where the framework can bound it (collective on first use)."""


    def forget_groups(self) -> None: ...

    def finish(self, total, token_out, like, reduction: "Reduction", ranks: int):
        """The exchanged sum `total` (float32 flat) over `ranks` ranks as Horovod's op left
        `token_out`, in the gradient's shape and dtype (apply_op: with `reduction` where the op
        is known now; or, where the batch averaged already, the token left in reduction.unread
        for the step's end to check)."""

    def read_tokens(self, tokens: list) -> list:
        """The reduced tokens' values on the host, in one read (where finish leaves any unread)."""

    def at_step_end(self, out, end_step, results):
        """`out` (the step's last result) once `end_step` ran after every one of `results`."""

    def native_wire(self, tensor, fallback):
        """The tensor in the dtype the framework's allreduce carries it in."""

    def carries_bfloat16(self, tensor) -> bool:
        """Whether the framework's allreduce takes this tensor in bfloat16."""

    def native_result(self, reduced, like): ...

    def compress_values(self, tensor, exchanger, process_set) -> tuple:
        """wire="values": (what Horovod allreduces, decompress_values' context)."""

    def decompress_values(self, tensor, ctx, exchanger): ...


@runtime_checkable
class LayoutAdapter(Adapter, Protocol):
    """An adapter whose call_site gives keys (horovod.torch): what the agreed layouts need too."""

    def tokens(self, like, process_set, count) -> list:
        """`count` tokens made at once (a step's tokens of a layout's gradients)."""

    def gather(self, obj, process_set, name, timeout: float) -> list:
        """Every rank's picklable `obj`, in rank order (eagerly: the layout's agreement), waited
        for `timeout` seconds at most."""

    def zeros(self, like, count):
        """`count` float32 zeros where `like` lies: a gradient a rank did not hand over."""


def adapter_of(tensor) -> "Adapter | None":
    """The framework adapter for a tensor, or None for anything else (found once per tensor type:
    every gradient of every step asks, on the thread backward runs on)."""
    return _adapter_of_type(type(tensor))


@functools.lru_cache(maxsize=None)
def _adapter_of_type(kind: type):
    root = kind.__module__.split(".")[0]
    # __import__, not importlib: TF's autograph traces compress() and warns on importlib's frames
    return __import__(ADAPTERS[root], fromlist=["compress"]) if root in ADAPTERS else None


@dataclasses.dataclass
class Reduction:
    """Whether a batch's exchange averaged its sums (learned from the batch of the same name in
    the step before), for each of its tokens whether it said Average, and the tokens of an
    averaged batch not read yet (`unread`: (token, ranks), checked when the step ends)."""
    averaged: bool = False
    said_average: list = dataclasses.field(default_factory=list)
    unread: list = dataclasses.field(default_factory=list)

    def all_average(self) -> bool:
        """Every token said Average (and one came): the next step's batch of this name averages."""
        return bool(self.said_average) and all(self.said_average)


@dataclasses.dataclass
class _Batch:
    name: str
    adapter: Adapter     # the framework adapter of every tensor in the batch
    native: Optional[Path] = None  # the dtype of the framework's allreduce the schedule sends it in, else codes
    process_set: object = None    # the Horovod process set its gradients are reduced on (None: every rank)
    flats: list = dataclasses.field(default_factory=list)   # codes batches: the gradients (None: not yet in)
    labels: list = dataclasses.field(default_factory=list)
    sizes: list = dataclasses.field(default_factory=list)
    nbytes: int = 0      # float32 bytes of the gradients in it
    present: int = 0     # a layout's batch: how many of its gradients are in
    future: object = None  # the exchange's Future (exchanger.bucket), once launched
    bucket: object = None  # its Bucket (hvd_aps._stages), once launched
    parts: Optional[list] = None  # the exchange's results per gradient, once split
    ranks: int = 0       # the ranks its exchange spans, once launched (every gradient's result asks)
    reduction: Reduction = dataclasses.field(default_factory=Reduction)  # averaged? what its tokens said

    @property
    def full(self) -> bool:
        return self.present == len(self.sizes)


class Context:
    """decompress()'s context for a gradient compress() took on the codes path (slots: every
    gradient of every step makes one)."""
    __slots__ = ("generation", "like", "batch")

    def __init__(self, generation: int, like, batch: Optional[_Batch]):
        # like: the gradient (its dtype and shape come back); batch: the one it joined (None
        # until its step's layout is agreed)
        self.generation, self.like, self.batch = generation, like, batch

    @property
    def adapter(self) -> Adapter:
        return self.batch.adapter


class Ticket(Context):
    """A gradient that went into a batch of codes."""
    __slots__ = ("index",)

    def __init__(self, generation: int, like, batch: Optional[_Batch], index: int):
        self.generation, self.like, self.batch, self.index = generation, like, batch, index


class Passed(Context):
    """A gradient the framework's own allreduce carried (policy="auto")."""
    __slots__ = ()


@dataclasses.dataclass
class _Waiting:
    """A named gradient of a step with no layout yet for its scope (hvd_aps._agreed)."""
    scope: tuple
    entry: _agreed.Entry
    flat: object
    ticket: Ticket


class _Layouts:
    """The layouts the ranks agreed on, per scope (kept from step to step), and this step's
    batches placed in them, which launch in the layout's order."""

    def __init__(self):
        self.forget()

    def forget(self) -> None:
        self.agreed = {}  # scope -> its agreed Layout
        self.free = {}    # scope -> the first number its layout leaves free for arriving batches
        self.new_step()

    def new_step(self) -> None:
        self.placed = {}  # (scope, bucket) -> the layout batch filling this step
        self.next = {}    # scope -> the next bucket of its layout to launch

    def batch(self, scope: tuple, b: int, make) -> "_Batch":
        """Bucket b of the scope's layout as this step's batch (make(scope, b): a new, empty one)."""
        batch = self.placed.get((scope, b))
        if batch is None:
            batch = self.placed[(scope, b)] = make(scope, b)
        return batch

    def fill(self, scope: tuple, slot: tuple, flat, make) -> tuple:
        """Put a gradient in its slot of its scope's layout -> (its batch, its index there)."""
        b, i, _ = slot
        batch = self.batch(scope, b, make)
        batch.flats[i] = flat
        batch.present += 1
        return batch, i

    def ready(self, scope: tuple) -> list:
        """The scope's full buckets not launched yet, in the layout's order (every rank launches
        them in that order, whatever order their gradients came in: the exchanges share two
        threads), taken as launched."""
        b, count, out = self.next.get(scope, 0), len(self.agreed[scope].buckets), []
        while b < count and (batch := self.placed.get((scope, b))) is not None and batch.full:
            out.append(batch)
            b += 1
        self.next[scope] = b
        return out

    def unlaunched(self, scope: tuple, make) -> list:
        """Every bucket of the scope's layout not launched yet, as this step's batches."""
        return [self.batch(scope, b, make) for b in range(self.next.get(scope, 0), len(self.agreed[scope].buckets))]


class _Launches:
    """Gradients joining batches in the order they arrive, and a batch's launch (or, where the
    framework's own allreduce carries it, its count): what Batches builds the step from. Its
    fields are Batches' (the step's open batch, numbering and launched batches)."""

    def _arrive(self, adapter: Adapter, tensor, process_set) -> tuple:
        """A gradient that joins the open batch (in the order gradients arrive)."""
        batch = self._open_batch(adapter, process_set)
        batch.nbytes += 4 * adapter.numel(tensor)
        batch.labels.append(adapter.label(tensor))
        batch.sizes.append(adapter.numel(tensor))
        if batch.native:
            context = Passed(self._generation, tensor, batch)
            wire = adapter.native_wire(tensor, batch.native)
        else:
            context = Ticket(self._generation, tensor, batch, len(batch.flats))
            batch.flats.append(adapter.flatten(tensor))
            wire = adapter.token(tensor, process_set)
        if batch.nbytes >= self._ex.config.bucket_bytes:
            self._close(batch)
        return wire, context

    def _open_batch(self, adapter: Adapter, process_set) -> _Batch:
        """The open batch of arriving gradients of this framework and process set (a new one,
        named next, where there is none)."""
        if self._open is not None and (self._open.adapter is not adapter or self._open.process_set is not process_set):
            self._close(self._open)
        if self._open is None:
            scope = (adapter, _horovod.set_key(process_set))
            number = self._counts.get(scope, self._layouts.free.get(scope, 0))
            self._counts[scope] = number + 1
            name = _agreed.name(scope[1], number)
            self._open = _Batch(name, adapter, self._native, process_set,
                                reduction=Reduction(averaged=name in self._averaged))
        return self._open

    def _alone(self, waiting: _Waiting) -> _Batch:
        """A batch of the one gradient that waited."""
        if self._open is not None:  # not joined to the open batch: closed at once, on its own
            self._close(self._open)
        batch = self._open_batch(waiting.scope[0], self._scopes[waiting.scope][1])
        batch.flats, batch.labels, batch.sizes = [waiting.flat], [waiting.entry.label], [waiting.entry.size]
        waiting.ticket.batch = batch
        return batch

    def _close(self, batch: _Batch) -> None:
        """No more gradients join `batch`: launch its exchange, or count the framework's allreduce
        that carries a passed-through batch as every native exchange is counted."""
        adapter = batch.adapter
        if batch.native:
            self._ex.count_native([f"{batch.name}[{i}]" for i in range(len(batch.sizes))],
                                  zip(batch.labels, batch.sizes), batch.native, adapter.world(batch.process_set))
        else:
            batch.bucket = Bucket.whole(batch.name, _keys(batch.name, len(batch.sizes)), batch.labels, batch.sizes)
            batch.ranks = adapter.world(batch.process_set)
            # threaded: the gradients are joined on the exchange's thread, off backward's
            flat = functools.partial(adapter.join, batch.flats) if adapter.threaded else adapter.join(batch.flats)
            config = self._ex.config
            batch.future = self._ex.bucket(adapter.levels(config.hierarchical, batch.process_set, config.timeout),
                                           batch.bucket, flat, adapter.threaded, adapter.place(batch.flats[0]),
                                           average=batch.reduction.averaged)
            batch.flats = []  # the join holds them
            self._launched.append(batch)
        if self._open is batch:
            self._open = None


class Batches(_Launches):
    """The step's batches and their naming, for one exchanger. compress() runs on the thread
    backward runs on, decompress() on the thread that steps: a lock keeps them apart.

    A named gradient (hvd_aps._horovod.Site) goes to its slot of the layout the ranks agreed on
    for its scope (framework and process set; hvd_aps._agreed), and a layout's buckets launch in
    order once full; in the first step of a scope the named gradients wait for the step's first
    decompress(), where the ranks agree on the layout. Unnamed gradients (and every gradient
    once policy="auto" chose the framework's allreduce) form batches in the order they arrive."""

    def __init__(self, exchanger):
        self._ex, self._lock = exchanger, threading.Lock()
        self._layouts = _Layouts()
        self._generation = 0
        # the last step's one gradient, where its step was that one gradient alone (see _end_step)
        self._lone = None
        self._averaged = set()  # names of the batches whose every token said Average last step
        self._new_step()

    def _new_step(self) -> None:
        self._open, self._outstanding, self._launched = None, 0, []
        self._native = self._started = None
        self._counts = {}       # scope -> the number the next batch of arriving gradients takes
        self._keys = set()      # (scope, key) handed over this step (a repeated one goes by arrival)
        self._waiting = []      # _Waiting gradients of scopes with no layout yet
        self._layouts.new_step()
        self._scopes = {}       # scope -> (a gradient of the step, where zeros go; its process set)
        self._tokens = {}       # scope -> the step's tokens of its layout's gradients, in the layout's order
        self._handed = False    # the step's first decompress() came: its gradients were handed over

    def add(self, adapter: Adapter, tensor, site) -> tuple:
        """-> (what Horovod allreduces, Context) for compress(); `site`: hvd_aps._horovod.Site."""
        with self._lock:
            try:
                return self._add(adapter, tensor, site)
            except BaseException:  # a launch that raises gives the step up as abort() does
                self._give_up()
                raise

    def _add(self, adapter: Adapter, tensor, site) -> tuple:
        if not self._started:
            self._start(adapter, tensor)
        self._outstanding += 1
        scope = (adapter, _horovod.set_key(site.process_set))
        key = site.key if (scope, site.key) not in self._keys else None
        if self._native or key is None or self._handed:
            return self._arrive(adapter, tensor, site.process_set)
        layout = self._layouts.agreed.get(scope)
        slot = None if layout is None else layout.slot(key, adapter.numel(tensor))
        if layout is not None and slot is None:  # not in the layout: by arrival, as on every rank alike
            return self._arrive(adapter, tensor, site.process_set)
        self._keys.add((scope, key))
        if scope not in self._scopes:
            self._scopes[scope] = (tensor, site.process_set)
            if layout is not None:  # the step's tokens of this scope, made in one call
                self._tokens[scope] = adapter.tokens(tensor, site.process_set, layout.count)
        if layout is None:
            ticket = Ticket(self._generation, tensor, None, 0)
            entry = _agreed.Entry(key, adapter.label(tensor), adapter.numel(tensor))
            self._waiting.append(_Waiting(scope, entry, adapter.flatten(tensor), ticket))
            return adapter.token(tensor, site.process_set), ticket
        placed = self._layouts.fill(scope, slot, adapter.flatten(tensor), self._place)
        ticket = Ticket(self._generation, tensor, *placed)
        if ticket.batch.full:  # the layout's order decides what launches
            self._launch_ready(scope)
        return self._tokens[scope][slot[2]], ticket

    def _start(self, adapter: Adapter, tensor) -> None:
        """The step's first gradient: the schedule's path for the step, the one-at-a-time warning."""
        self._started = True
        self._native = self._ex.native_dtype()
        if self._lone not in (None, adapter.label(tensor)):
            _warn_one_by_one()
        check_fallback(self._ex.config, adapter, tensor)

    def _place(self, scope: tuple, b: int) -> _Batch:
        """Bucket b of the scope's layout, as a new, empty batch of this step."""
        layout = self._layouts.agreed[scope]
        entries, name = layout.buckets[b], layout.name(b)
        return _Batch(name, scope[0], None, self._scopes[scope][1], flats=[None] * len(entries),
                      labels=[e.label for e in entries], sizes=[e.size for e in entries],
                      reduction=Reduction(averaged=name in self._averaged))

    def _launch_ready(self, scope: tuple) -> None:
        """Launch the scope's full buckets, in the layout's order."""
        for batch in self._layouts.ready(scope):
            self._close(batch)

    def _hand_over(self) -> None:
        """The step's first decompress(): every gradient of it was handed over. The scopes
        without a layout agree on one, the buckets of a layout still missing gradients take
        zeros for them (as Horovod sends a parameter no hook saw), and everything launches."""
        self._handed = True
        self._learn()
        for scope in sorted(self._scopes, key=_scope_order):  # every rank launches the scopes alike
            if scope not in self._layouts.agreed:  # its one gradient went alone
                continue
            like = self._scopes[scope][0]
            for batch in self._layouts.unlaunched(scope, self._place):
                for i, size in enumerate(batch.sizes):
                    if batch.flats[i] is None:
                        batch.flats[i] = scope[0].zeros(like, size)
                batch.present = len(batch.sizes)
            self._launch_ready(scope)
        if self._open is not None:
            self._close(self._open)

    def _learn(self) -> None:
        """Agree on a layout for every scope whose named gradients waited (one gradient alone
        needs none: it goes as a batch of its own, as Horovod hands gradients one at a time)."""
        scopes = {}
        for waiting in self._waiting:
            scopes.setdefault(waiting.scope, []).append(waiting)
        self._waiting = []
        for scope in sorted(scopes, key=_scope_order):  # every rank gathers on the sets in one order
            items, (adapter, _), process_set = scopes[scope], scope, self._scopes[scope][1]
            if len(items) == 1:
                self._close(self._alone(items[0]))
                continue
            config = self._ex.config  # settings first: another bucket_bytes cuts other buckets
            seen = adapter.gather((config.settings(), [w.entry for w in items]), process_set, "hvd_aps.layout",
                                  config.timeout)
            if any(settings != seen[0][0] for settings, _ in seen):
                raise _metadata.settings_differ([settings for settings, _ in seen])
            # after the numbers this step's arriving batches of the scope took
            base = self._counts.get(scope, self._layouts.free.get(scope, 0))
            layout = _agreed.agree([entries for _, entries in seen], config.bucket_bytes, scope[1], base)
            self._layouts.agreed[scope] = layout
            self._layouts.free[scope] = self._counts[scope] = base + len(layout.buckets)
            for w in items:
                w.ticket.batch, w.ticket.index = self._layouts.fill(scope, layout.slots[w.entry.key], w.flat,
                                                                     self._place)

    def result(self, reduced, context: Context):
        """decompress(): the exchanged gradient, reduced as Horovod's op would have left it."""
        with self._lock:
            if context.generation != self._generation:
                raise RuntimeError("this gradient's step was abandoned after an error in an earlier exchange: "
                                   "start the step again")
            try:  # the step's gradients are all handed over once one comes back: its last batches go
                if not self._handed:  # now, beside the others, not when reached
                    self._hand_over()
                elif self._open is not None:
                    self._close(self._open)
            except BaseException:
                self._give_up()
                raise
        try:
            if isinstance(context, Passed):
                out = context.adapter.native_result(reduced, context.like)
            else:
                batch = context.batch
                total = self._parts(batch)[context.index]
                out = batch.adapter.finish(total, reduced, context.like, batch.reduction, batch.ranks)
        except BaseException:
            self.abort()
            raise
        with self._lock:
            if context.generation != self._generation:  # abandoned meanwhile (another thread's error)
                raise RuntimeError("this gradient's step was abandoned after an error in another exchange of it: "
                                   "start the step again")
            self._outstanding -= 1
            if self._outstanding == 0:  # the step is over
                try:
                    out = self._end_step(context, out)
                except BaseException:  # an exchange no gradient waited for (zeros alone) raised
                    self._give_up()
                    raise
        return out

    def _parts(self, batch: _Batch) -> list:
        """The batch's results per gradient: its flat result split once (every thread that asks
        splits alike, so a race only repeats the split)."""
        if batch.parts is None:
            batch.parts = batch.bucket.split(self._ex.result(batch.future))
        return batch.parts

    def _end_step(self, context: Context, out):
        """End the step (after every exchange of it, in a graph too) and restart the naming."""
        launched = self._launched
        results = [self._ex.result(batch.future) for batch in launched]
        _check_unread(launched)
        self._averaged = {batch.name for batch in launched if batch.reduction.all_average()}
        # a step of one gradient, then one of another: Horovod hands them over one at a time
        alone = len(launched) == 1 and len(launched[0].sizes) == 1
        self._lone = launched[0].labels[0] if alone else None
        self._new_step()
        return context.adapter.at_step_end(out, self._ex.end_step, results)

    def abort(self) -> None:
        """Forget the step in flight: its exchanges waited for (none may write after this), its
        state rolled back, its contexts void, the naming restarted."""
        with self._lock:
            self._forget()
        self._ex.abort_step()

    def forget_layouts(self) -> None:
        """The world changed (Horovod elastic): a rank that joins has no layout, so every rank
        agrees anew at its next step."""
        with self._lock:
            self._layouts.forget()
            self._forget()

    def _forget(self) -> None:
        self._new_step()
        self._lone = None
        self._averaged = set()  # the next step's exchanges divide nothing until tokens say Average again
        self._generation += 1

    def _give_up(self) -> None:
        """What abort() does, the lock held."""
        self._forget()
        self._ex.abort_step()



def _scope_order(scope: tuple) -> tuple:
    """Scopes sorted alike on every rank: by framework, then the global set first, then by set."""
    adapter, key = scope
    return adapter.__name__, key is not None, key or ()


@functools.lru_cache(maxsize=None)
def _warn_one_by_one() -> None:
    """Once per process: Horovod hands the gradients over one at a time, each exchanged alone."""
    warnings.warn("hvd_aps: Horovod hands APSCompressor one gradient at a time (each one compressed, reduced and "
                  "decompressed before the next is compressed), so every gradient is exchanged on its own and pays "
                  "an exchange's fixed cost (its collectives) alone: let Horovod compress them all first, with "
                  "num_groups=1 in TensorFlow's hvd.DistributedGradientTape / hvd.DistributedOptimizer, or "
                  "hvd.grouped_allreduce for a list of tensors", RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=None)
def _keys(name: str, count: int) -> tuple:
    """A batch's gradients' keys (made once per batch name and size)."""
    return tuple(f"{name}[{i}]" for i in range(count))


def check_fallback(config, adapter: Adapter, tensor) -> None:
    """Refuse a fallback Horovod's allreduce cannot carry at the first exchange, not after the
    trials, when policy="auto" first sends a step that way."""
    if config.policy is Policy.AUTO and config.fallback is Fallback.BFLOAT16 and not adapter.carries_bfloat16(tensor):
        raise ValueError("APSCompressor(policy='auto', fallback='bfloat16'): Horovod's own allreduce does not "
                         "carry bfloat16 here (horovod.torch only for CUDA tensors on NCCL, horovod.tensorflow "
                         "never): use fallback='float16' or 'float32', or bfloat16 with the DDP hook or FSDP2")


def pass_through(adapter: Adapter, tensor, exchanger) -> tuple:
    """A tensor too small for codes: the framework's plain allreduce carries it, in float32 as
    the codes' tokens are (Horovod's grouped allreduce takes one dtype, its Gloo no bfloat16),
    and decompress() gives it back in its dtype -> (wire, Cast context)."""
    exchanger.pass_through(adapter.label(tensor), adapter.numel(tensor))
    return adapter.native_wire(tensor, Path.FLOAT32), Cast(tensor)


class Cast:
    """decompress()'s context for a gradient too small for codes that went through the
    framework's allreduce in float32: `like` holds the dtype it comes back in."""

    def __init__(self, like):
        self.like = like


def _said(token, world: int, reduction: Optional[Reduction]) -> tuple:
    """(scale, whether it is an average) of a reduced token, checked to be a sum of tokens and,
    where the batch averaged already, an average; recorded in `reduction`."""
    scale = float(token[0])
    summed, average = _read(scale, float(token[1]), world)
    if not summed:
        raise ValueError(NOT_A_SUM)
    average = bool(average)
    if reduction is not None:
        reduction.said_average.append(average)
        if reduction.averaged and not average:
            raise RuntimeError(NOT_AVERAGED)
    return scale, average


def _read(scale, ranks, world):
    """(whether it is a sum of tokens, whether an average) of reduced tokens [scale, ranks] over
    `world` ranks: floats, or NumPy arrays of a step's tokens checked at once."""
    summed = np.abs(ranks - scale * (world - 1) / 2) <= TOKEN_TOLERANCE * np.maximum(1.0, np.abs(scale) * world * world)
    return summed, np.abs(scale - 1.0) <= TOKEN_TOLERANCE


def _check_unread(launched: list) -> None:
    """The step's tokens left unread (averaged batches: their results needed none), read in one
    go and checked at once as _said checks each: on a device, one read a step instead of one a
    gradient, and no Python per token but the record of what it said."""
    for adapter in {batch.adapter for batch in launched if batch.reduction.unread}:
        batches = [batch for batch in launched if batch.adapter is adapter]
        unread = [(batch.reduction, ranks) for batch in batches for _, ranks in batch.reduction.unread]
        values = np.asarray(adapter.read_tokens([token for batch in batches for token, _ in batch.reduction.unread]),
                            np.float64).reshape(len(unread), 2)
        summed, average = _read(values[:, 0], values[:, 1], np.array([ranks for _, ranks in unread], np.float64))
        if not summed.all():
            raise ValueError(NOT_A_SUM)
        for (reduction, _), said in zip(unread, average.tolist()):
            reduction.said_average.append(said)
        if not average.all():  # only an averaged batch leaves its tokens unread (Adapter.finish)
            raise RuntimeError(NOT_AVERAGED)


def token_values(rank: int) -> np.ndarray:
    """What compress() hands Horovod to reduce in place of the gradient."""
    return np.array([1.0, rank], np.float32)


def apply_op(total, token, world: int, reduction: Optional[Reduction] = None):
    """The exchanged sum (NumPy/CuPy float32, changed in place) as Horovod's reduction would have
    left it, from the reduced token: average (divided by N in float32, as every codes path
    divides), sum, or sum times the factor Horovod applied. With `reduction`, what the token says
    is recorded there, and sums its exchange already averaged come back as they are."""
    scale, average = _said(token, world, reduction)
    if reduction is not None and reduction.averaged:
        return total
    if average:
        total /= np.float32(world)
    elif abs(scale - world) > TOKEN_TOLERANCE * world:
        total *= np.float32(scale / world)
    return total
