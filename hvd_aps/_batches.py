"""Horovod's gradients in batches: which codes exchange each gradient compress() is handed joins,
and when that exchange launches (hvd_aps._tokens: the token Horovod reduces in its place).

A named gradient (horovod.torch's, hvd_aps._horovod.Site) takes its slot in the layout its process
set agreed on (hvd_aps._agreed), whose buckets launch in the layout's order once full, so a rank
that skips a parameter still exchanges the others' buckets; unnamed ones (TensorFlow's) and every
gradient of a step the framework's own allreduce carries (policy="auto") join the open batch as
they come. A step ends once every gradient came back through decompress(); one that raises is
abandoned, nothing of it kept.
"""
import dataclasses
import functools
import threading
import warnings
from typing import Optional

from . import _agreed, _horovod, _metadata
from ._stages import Bucket
from ._tokens import Adapter, Reduction, check_fallback, check_unread
from .config import Path


@dataclasses.dataclass
class Batch:
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

    def __init__(self, generation: int, like, batch: Optional[Batch]):
        # like: the gradient (its dtype and shape come back); batch: the one it joined (None
        # until its step's layout is agreed)
        self.generation, self.like, self.batch = generation, like, batch

    @property
    def adapter(self) -> Adapter:
        return self.batch.adapter


class Ticket(Context):
    """A gradient that went into a batch of codes."""
    __slots__ = ("index",)

    def __init__(self, generation: int, like, batch: Optional[Batch], index: int):
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

    def batch(self, scope: tuple, b: int, make) -> "Batch":
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


class Launches:
    """One step's gradients joining batches in the order they arrive, and a batch's launch (or,
    where the framework's own allreduce carries it, its count): the step's open batch, the
    numbers its batches take and the batches launched. `native`: the path the schedule sends the
    step in (None: codes), set at its first gradient."""

    def __init__(self, exchanger, layouts: _Layouts, generation: int, averaged: set):
        self._ex, self._layouts, self._generation, self._averaged = exchanger, layouts, generation, averaged
        self.native: Optional[Path] = None
        self.open: Optional[Batch] = None
        self.counts = {}    # scope -> the number the next batch of arriving gradients takes
        self.launched = []  # the step's launched batches, in launch order

    def number(self, scope: tuple) -> int:
        """The number the scope's next batch takes: after those its layout and this step took."""
        return self.counts.get(scope, self._layouts.free.get(scope, 0))

    def arrive(self, adapter: Adapter, tensor, process_set) -> tuple:
        """A gradient that joins the open batch (in the order gradients arrive)."""
        batch = self.open_batch(adapter, process_set)
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
            self.close(batch)
        return wire, context

    def open_batch(self, adapter: Adapter, process_set) -> Batch:
        """The open batch of arriving gradients of this framework and process set (a new one,
        named next, where there is none)."""
        if self.open is not None and (self.open.adapter is not adapter or self.open.process_set is not process_set):
            self.close(self.open)
        if self.open is None:
            scope = (adapter, _horovod.set_key(process_set))
            number = self.number(scope)
            self.counts[scope] = number + 1
            name = _agreed.name(scope[1], number)
            self.open = Batch(name, adapter, self.native, process_set,
                              reduction=Reduction(averaged=name in self._averaged))
        return self.open

    def alone(self, waiting: "_Waiting", process_set) -> Batch:
        """A batch of the one gradient that waited."""
        self.close_open()  # not joined to the open batch: closed at once, on its own
        batch = self.open_batch(waiting.scope[0], process_set)
        batch.flats, batch.labels, batch.sizes = [waiting.flat], [waiting.entry.label], [waiting.entry.size]
        waiting.ticket.batch = batch
        return batch

    def close(self, batch: Batch) -> None:
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
            self.launched.append(batch)
        if self.open is batch:
            self.open = None

    def close_open(self) -> None:
        """Launch (or count) the open batch, if one is open."""
        if self.open is not None:
            self.close(self.open)


class Batches:
    """The step's batches and their naming, for one exchanger. compress() runs on the thread
    backward runs on, decompress() on the thread that steps: a lock keeps them apart.

    A named gradient (hvd_aps._horovod.Site) goes to its slot of the layout the ranks agreed on
    for its scope (framework and process set; hvd_aps._agreed), and a layout's buckets launch in
    order once full; in the first step of a scope the named gradients wait for the step's first
    decompress(), where the ranks agree on the layout. Unnamed gradients (and every gradient
    once policy="auto" chose the framework's allreduce) join the step's Launches as they arrive."""

    def __init__(self, exchanger):
        self._ex, self._lock = exchanger, threading.Lock()
        self._layouts = _Layouts()
        self._generation = 0
        # the last step's one gradient, where its step was that one gradient alone (see _end_step)
        self._lone = None
        self._averaged = set()  # names of the batches whose every token said Average last step
        self._new_step()

    def _new_step(self) -> None:
        self._outstanding, self._started = 0, False
        self._launches = Launches(self._ex, self._layouts, self._generation, self._averaged)
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
        if self._launches.native or key is None or self._handed:
            return self._launches.arrive(adapter, tensor, site.process_set)
        layout = self._layouts.agreed.get(scope)
        slot = None if layout is None else layout.slot(key, adapter.numel(tensor))
        if layout is not None and slot is None:  # not in the layout: by arrival, as on every rank alike
            return self._launches.arrive(adapter, tensor, site.process_set)
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
        self._launches.native = self._ex.native_dtype()
        if self._lone not in (None, adapter.label(tensor)):
            _warn_one_by_one()
        check_fallback(self._ex.config, adapter, tensor)

    def _place(self, scope: tuple, b: int) -> Batch:
        """Bucket b of the scope's layout, as a new, empty batch of this step."""
        layout = self._layouts.agreed[scope]
        entries, name = layout.buckets[b], layout.name(b)
        return Batch(name, scope[0], None, self._scopes[scope][1], flats=[None] * len(entries),
                      labels=[e.label for e in entries], sizes=[e.size for e in entries],
                      reduction=Reduction(averaged=name in self._averaged))

    def _launch_ready(self, scope: tuple) -> None:
        """Launch the scope's full buckets, in the layout's order."""
        for batch in self._layouts.ready(scope):
            self._launches.close(batch)

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
        self._launches.close_open()

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
                self._launches.close(self._launches.alone(items[0], process_set))
                continue
            config = self._ex.config  # settings first: another bucket_bytes cuts other buckets
            seen = adapter.gather((config.settings(), [w.entry for w in items]), process_set, "hvd_aps.layout",
                                  config.timeout)
            if any(settings != seen[0][0] for settings, _ in seen):
                raise _metadata.settings_differ([settings for settings, _ in seen])
            # after the numbers this step's arriving batches of the scope took
            base = self._launches.number(scope)
            layout = _agreed.agree([entries for _, entries in seen], config.bucket_bytes, scope[1], base)
            self._layouts.agreed[scope] = layout
            self._layouts.free[scope] = self._launches.counts[scope] = base + len(layout.buckets)
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
                else:
                    self._launches.close_open()
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

    def _parts(self, batch: Batch) -> list:
        """The batch's results per gradient: its flat result split once (every thread that asks
        splits alike, so a race only repeats the split)."""
        if batch.parts is None:
            batch.parts = batch.bucket.split(self._ex.result(batch.future))
        return batch.parts

    def _end_step(self, context: Context, out):
        """End the step (after every exchange of it, in a graph too) and restart the naming."""
        launched = self._launches.launched
        results = [self._ex.result(batch.future) for batch in launched]
        check_unread(launched)
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
        self._lone = None
        self._averaged = set()  # the next step's exchanges divide nothing until tokens say Average again
        self._generation += 1
        self._new_step()  # its contexts of the new generation

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
