"""APSCompressor: one Horovod Compressor for horovod.torch and horovod.tensorflow alike: Horovod's
two methods, the configuration, and the Exchanger (hvd_aps.exchanger: state, stats, threads, the
step) that every other entry point is handed through it.

wire="codes" (the default) sends the format's codes themselves, 1 byte per element for 8-bit
formats and packed below that: compress() hands the gradient to a codes exchange (hvd_aps._batches,
hvd_aps.exchange) and gives Horovod a one-element token to allreduce, whose result tells
decompress() what op and scale factors Horovod applied. wire="values" rounds onto the format's
grid and lets Horovod's own allreduce carry float16 (hvd_aps._values).

The per-framework conversions and collectives live in thin adapters (hvd_aps._tokens.Adapter),
chosen per tensor; the numerics in hvd_aps._stages, the state in hvd_aps._state.
"""
import dataclasses
import enum
import inspect
import secrets
import sys
from typing import Optional, Union

from . import _batches, _horovod, _tokens, calfile, dashboard
from ._schedule import Schedule
from ._state import ExchangeState
from ._stats import STATS_SAMPLE, StatsRecorder, TensorStats
from .config import APSConfig, Policy, Wire, recipe
from .exchanger import Exchanger
from .formats import FloatFormat

# the settings that give a state_dict's residuals and step counts their meaning: a state saved
# under others does not load (chunking, buckets and the policy only schedule, so they may change)
RESUMED_SETTINGS = ("fmt", "rounding", "scaling", "saturate", "wire", "error_feedback", "hybrid")
_SETTINGS = tuple(f.name for f in dataclasses.fields(APSConfig) if f.name != "fmt")  # APSCompressor's **settings


def _not_for_autograph(method):
    """What tf.autograph.experimental.do_not_convert marks, without importing TensorFlow: called in
    a tf.function, AutoGraph runs the method as plain Python instead of converting it and all it
    calls (it builds its graph ops itself; converted, a dataclass's generated __repr__ failed in
    some runs: 'tf____repr__() takes 1 positional argument but 2 were given')."""
    method.autograph_info__ = None
    return method


class APSCompressor:
    """Horovod Compressor that sends gradients in a custom float format with APS.

    Arguments:
        fmt: a FloatFormat or its name ("e4m3", "e5m2", "e3m0", ...).
        seed: base of the stochastic-rounding streams (random if None).
        stats: record what each tensor went through: `stats[label]` holds the last call per tensor
            label (TF: the gradient's graph name; torch: dtype and shape), `totals()` the sum since
            `reset_stats()`, `stats_table()` both as text or CSV; `bytes_sent` counts the bytes this
            rank sent in its exchanges (where policy="auto" chose the framework's own allreduce,
            the bytes a ring of the dtype it chose sends; tensors under min_elements not counted).
        stats_sample: the stats of a tensor come from an evenly strided sample of about this many
            of its elements, scaled up (0: every element: a full pass over every gradient, which
            on a CPU costs about as much as the encode itself). The default keeps their cost
            below what a step's timing resolves; rare events (saturation) resolve to about
            1 / stats_sample of a tensor.

    The other keyword arguments are hvd_aps.APSConfig's fields, passed to it as they are (rounding,
    scaling, saturate, wire, bucket_bytes, min_elements, error_feedback, hybrid, hybrid_threshold,
    chunk_bytes, hierarchical, policy, fallback, timeout; defaults: nearest rounding, APS, codes on the wire, 16 MiB
    buckets, their chunking tuned at run time, tensors under 4096 elements through the framework's
    plain allreduce, two levels where hosts hold several ranks, codes always, 30 minutes' wait for
    the other ranks in a collective).

    Every rank must use an equal compressor and hand it the same tensors in the same order: the
    metadata allreduce checks the configuration and every tensor's size, and raises on a mismatch.
    The compressor owns threads (for eager exchanges): `close()` stops them, or use it as a
    context manager.

    Example::

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd_aps.APSCompressor(hvd_aps.e4m3))
    """

    def __init__(self, fmt: Union[FloatFormat, str], *, seed: Optional[int] = None, stats: bool = True,
                 stats_sample: int = STATS_SAMPLE, **settings):
        try:
            config = APSConfig(fmt=fmt, **settings)
        except TypeError as error:
            unknown = sorted(set(settings) - set(_SETTINGS))
            if not unknown:
                raise
            raise TypeError(f"APSCompressor got unknown arguments {unknown}: its settings are APSConfig's fields "
                            f"{list(_SETTINGS)}, besides seed, stats and stats_sample") from error
        self._setup(config, seed, StatsRecorder(stats, stats_sample))

    @classmethod
    def from_config(cls, config: APSConfig, seed: Optional[int] = None, stats: bool = True,
                    stats_sample: int = STATS_SAMPLE) -> "APSCompressor":
        comp = cls.__new__(cls)
        comp._setup(config, seed, StatsRecorder(stats, stats_sample))
        return comp

    @classmethod
    def from_recipe(cls, name: str, seed: Optional[int] = None, stats: bool = True, **overrides) -> "APSCompressor":
        """A compressor from a named recipe (hvd_aps.config.RECIPES), e.g. "aps-e3m0-ef"."""
        return cls.from_config(recipe(name, **overrides), seed, stats)

    def _setup(self, config: APSConfig, seed: Optional[int], stats: StatsRecorder,
               state: Optional[ExchangeState] = None) -> None:
        if not isinstance(config, APSConfig):
            raise TypeError(f"expected an APSConfig, got {type(config).__name__}")
        if state is None:
            schedule = Schedule(config.candidates, config.policy is Policy.AUTO, calfile.job_link(), config.natives)
            state = ExchangeState(secrets.randbits(63) if seed is None else int(seed), schedule)
        self.config, self.exchanger = config, Exchanger(config, state, stats)
        self._batches = _batches.Batches(self.exchanger)
        self._serves = None  # the optimizer, DDP model or FSDP2 model this compressor was given to
        self._horovod_owner = None  # the Horovod optimizer compressing through it, once one has
        self._logged_bytes = 0  # bytes sent when log_to last wrote

    def _claim_for(self, optimizer) -> None:
        """The first Horovod optimizer to compress through this compressor owns it: a second one's
        first step would be taken for the end of the first's (its gradients sent as zeros)."""
        self.claim(f"Horovod's DistributedOptimizer over {type(optimizer).__name__} (id {id(optimizer):#x})")
        self._horovod_owner = optimizer

    def claim(self, user: str, shared: bool = False) -> None:
        """Give this compressor to `user` (hvd_aps.torch.DistributedOptimizer, APSState, fsdp.apply
        call it): one owner, as its residuals, step counts and schedule are keyed by tensor and
        bucket names that another owner would reuse for other tensors. shared: `user` names one
        owner of several parts that claim it each (the tensor-parallel styles of one model)."""
        if shared and self._serves == user:
            return
        if self._serves is not None:
            raise ValueError(f"this APSCompressor already serves {self._serves}; give {user} an APSCompressor of "
                             "its own (residuals, step counts and the schedule belong to one model)")
        self._serves = user

    @property
    def state(self) -> ExchangeState:
        """The exchange state (the exchanger's)."""
        return self.exchanger.state

    @property
    def recorder(self) -> StatsRecorder:
        return self.exchanger.recorder

    @property
    def fmt(self) -> FloatFormat:
        return self.config.fmt

    @property
    def seed(self) -> int:
        return self.state.seed

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={_shown(value)}" for name, value in vars(self.config).items() if name != "fmt")
        return f"APSCompressor({str(self.fmt)!r}, {fields})"

    # Horovod's Compressor interface -----------------------------------------------------------
    @_not_for_autograph
    def compress(self, tensor):
        adapter = _tokens.adapter_of(tensor)
        if adapter is None or not adapter.is_dense_float(tensor):
            return tensor, None
        small = self.config.wire is Wire.CODES and adapter.numel(tensor) < self.config.min_elements
        if small or adapter.is_empty(tensor):
            return _tokens.pass_through(adapter, tensor, self.exchanger)
        site = adapter.call_site(sys._getframe(1))
        if site.owner is not self._horovod_owner and site.owner is not None:
            self._claim_for(site.owner)
        if not _horovod.included(site.process_set):  # Horovod's own allreduce refuses it, as stock
            return tensor, None
        if self.config.wire is Wire.VALUES:
            return adapter.compress_values(tensor, self.exchanger, site.process_set)
        return self._batches.add(adapter, tensor, site)

    @_not_for_autograph
    def decompress(self, tensor, ctx):
        if ctx is None:  # not compressed (integers, sparse), or Horovod's sparse path calling without one
            return tensor
        if isinstance(ctx, _tokens.Cast):
            return _tokens.adapter_of(tensor).native_result(tensor, ctx.like)
        if isinstance(ctx, _batches.Context):
            return self._batches.result(tensor, ctx)
        return _tokens.adapter_of(tensor).decompress_values(tensor, ctx, self.exchanger)

    # What every entry point shares -------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume bit for bit: the error-feedback residuals (as
        NumPy arrays), every tensor's step count, the seed and the schedule's decisions, and the
        settings that give them their meaning (RESUMED_SETTINGS). Taken once a step has returned,
        it holds that step: a commit still trailing its results is waited for."""
        self.exchanger.settle()
        return self.state.state_dict() | {"settings": self._resumed_settings()}

    def _resumed_settings(self) -> dict:
        return {name: str(getattr(self.config, name)) for name in RESUMED_SETTINGS}

    def load_state_dict(self, state: dict) -> None:
        """Resume from this rank's state_dict(), on every rank, before the same step. Loaded on
        another world size, or on some ranks only, the first exchange raises on every rank;
        on_world_change() after loading drops what belongs to the old world instead. A state of
        other settings (another format, rounding, ...) or not a state_dict at all raises here and
        leaves this compressor as it was."""
        if not isinstance(state, dict):
            raise TypeError("load_state_dict takes what APSCompressor.state_dict() returned, "
                            f"got {type(state).__name__}")
        mine = self._resumed_settings()
        differ = {name: saved for name, saved in dict(state.get("settings", mine)).items() if mine.get(name) != saved}
        if differ:
            raise ValueError("this state_dict was saved by an APSCompressor with "
                             + ", ".join(f"{name}={saved}" for name, saved in differ.items()) + " where this one has "
                             + ", ".join(f"{name}={mine.get(name)}" for name in differ)
                             + ": load it into a compressor made with the same settings")
        self.exchanger.settle()  # a trailing commit would overwrite what is loaded
        self.state.load_state_dict(state)

    def reset(self) -> None:
        """Forget a step in flight (it raised, or Horovod elastic reset the world): nothing it did
        stays, the next step names its batches from the start."""
        self._batches.abort()

    def on_world_change(self) -> None:
        """Horovod elastic's reset callback: the step in flight is forgotten, and what belongs to
        the old world (shard owners' residuals, the tuned schedule, process sets) with it; this
        rank's own residuals and step counts stay its own, and pin()'s decisions stay."""
        self._batches.forget_layouts()
        self.reset()
        self.state.forget_shards()
        self.state.schedule.reset()
        self.exchanger.forget_stages()
        for name in _tokens.ADAPTERS.values():
            if name in sys.modules:  # only frameworks in use hold groups
                sys.modules[name].forget_groups()

    def schedule_report(self) -> list:
        """Per bucket: the schedule chosen (None while still trying) and the median seconds of
        every candidate tried; once the step handed over has committed (every rank reads a step's
        decisions alike)."""
        self.exchanger.settle()
        return self.state.schedule.report()

    def decisions(self) -> dict:
        """The run-time schedule's decisions so far, to pin in a later run: {"chunk_bytes":
        {bucket name: float32 bytes a chunk (0: unchunked)}, "policy": "codes" or "native"
        (policy="auto" only; None while its trials run), and for "native" its "native_dtype"}.
        Bucket names are those of schedule_report(). Read once the step handed over has
        committed: its commit can trail the framework's step by a callback, and a rank that read
        the step before's would branch apart from the others."""
        self.exchanger.settle()
        return self.state.schedule.decisions()

    def pin(self, decisions: dict) -> None:
        """Run with these decisions (decisions() of an earlier run, or written by hand) instead of
        timing trials: named buckets take their chunking at once, a pinned policy skips
        policy="auto"'s trial steps. Call on every rank alike, before the first step. Pinning
        changes when things are sent, never a bit of the result, except that a policy of
        "native" sends the framework's own allreduce in "native_dtype" (default: the first of
        `fallback`'s dtypes, float32 for "auto"). The pins stay through on_world_change() and
        stand where a state_dict loaded later decided nothing; what it decided stands."""
        self.state.schedule.pin(decisions)

    def close(self) -> None:
        """Stop this compressor's threads once their exchanges are done; it cannot run more."""
        self.state.close()

    def __enter__(self) -> "APSCompressor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        return {"config": self.config, "state": self.state, "recorder": (self.recorder.enabled, self.recorder.sample)}

    def __setstate__(self, saved: dict) -> None:
        self._setup(saved["config"], None, StatsRecorder(*saved["recorder"]), saved["state"])

    # Stats -------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """The last TensorStats of every tensor label."""
        return self.recorder.last

    @property
    def bytes_sent(self) -> int:
        return self.recorder.bytes_sent

    def totals(self) -> TensorStats:
        """TensorStats summed over every tensor since reset_stats()."""
        return self.recorder.total

    def stats_table(self, csv: bool = False) -> str:
        return self.recorder.table(csv)

    def log_to(self, writer, step: int, every_rank: bool = False) -> None:
        """Write the last step's fidelity to TensorBoard (hvd_aps.dashboard): relative error,
        flushed and saturated shares, bytes sent since the last call, each bucket's APS shift.
        `writer`: torch's SummaryWriter, a tf.summary writer, or anything with add_scalar(tag,
        value, step). Rank 0 only unless every_rank."""
        sent = self.recorder.bytes_sent
        if every_rank or dashboard.this_rank() == 0:
            dashboard.write(dashboard.step_fidelity(self.recorder, self._logged_bytes), writer, step)
        self._logged_bytes = sent

    def reset_stats(self) -> None:
        self.recorder.reset()


def _signature() -> inspect.Signature:
    """APSCompressor's signature as help() and editors show it: fmt, APSConfig's fields with their
    defaults, then the compressor's own arguments."""
    own = inspect.signature(APSCompressor.__init__).parameters
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
              for f in dataclasses.fields(APSConfig) if f.name != "fmt"]
    return inspect.Signature([own["self"], own["fmt"], *fields, own["seed"], own["stats"], own["stats_sample"]])


APSCompressor.__init__.__signature__ = _signature()


def _shown(value) -> str:
    """A configuration value as the user would write it."""
    if isinstance(value, (enum.Enum, FloatFormat)):
        return repr(str(value))
    return repr(value)
