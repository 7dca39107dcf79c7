"""The package's GPU path (hvd_aps/_cupy_engine.py, ops/kernels.cu and the exchange's device arrays)
on the counting stand-in for CuPy (counting_cupy.py), on a machine without a GPU: bit for bit as
the host engine on NumPy arrays, and what one steady-state step of a bucket reads, uploads,
allocates and launches per rank (`pytest -s` prints the table)."""
import contextlib
import dataclasses
import functools
import importlib.resources
import json
import sys
import threading
import types
from collections import Counter

import numpy as np
import pytest

import counting_cupy as standin
import hvd_aps
from device_ranks import DeviceCollectives, run_ranks
from counting_cupy import cupy as cp
from hvd_aps import _arrays, _device, _inprocess, _tables, codec, exchange
from hvd_aps._stages import Bucket
from horovod_run import horovodrun, torchrun

FORMATS = ["e4m3", "e5m2", "e3m0", "e2m1fn"]  # e3m0 and e2m1fn: 4-bit codes, two a byte
TENSORS, CHUNKS = (1, 10, 1000), (1, 8)
# a bucket's, however many tensors share them: every owner's part of each of 8 chunks at least one
# re-encode block (hvd_aps._layout.BLOCK) on 2 ranks, so no chunk's stage has nothing to launch
ELEMENTS = 1 << 15
STEPS = 3  # two to warm up, one counted


def assert_same(got, want):
    """A device result holding the host's bytes."""
    assert isinstance(got, standin.ndarray), type(got)
    got = standin.peek(got)
    assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


# The codec ------------------------------------------------------------------------------------------
def codec_inputs(fmt, shift: int, n: int = 3000) -> np.ndarray:
    """float32 inputs that take every path of an encode at `shift`: each value of the format's grid
    (subnormals included) and each tie between neighbours (to the even code), of both signs;
    float32 subnormals, signed zeros, NaN, Inf and overflow; a spread over float32's exponents."""
    fmt = hvd_aps.FloatFormat.parse(fmt)
    grid = hvd_aps.decode(np.arange(1 << fmt.bits, dtype=fmt.code_dtype), fmt, shift=shift).astype(np.float64)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    ties = (grid[:-1] + grid[1:]) / 2
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):
        spread = rng.standard_normal(n) * np.exp2(rng.uniform(-150, 129, n))
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1e-40, 3e38, 1.5 * fmt.max * 2.0 ** -shift]
    with np.errstate(over="ignore"):
        return np.concatenate([grid, -grid, ties, -ties, specials, spread]).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_codec_on_device_arrays_gives_the_host_engines_bits(counting_cupy, fmt, rounding):
    """encode, decode, quantize, decode_sum, pack and unpack, amax and amax_blocks at APS shifts
    of both signs: the kernels on device arrays (their text, on the CPU) against the compiled host engine."""
    for shift in (0, 5, -3):
        x = codec_inputs(fmt, shift)
        options = dict(rounding=rounding, seed=7, shift=shift)
        codes = hvd_aps.encode(x, fmt, **options)
        assert_same(hvd_aps.encode(cp.asarray(x), fmt, **options), codes)
        assert_same(hvd_aps.decode(cp.asarray(codes), fmt, shift=shift), hvd_aps.decode(codes, fmt, shift=shift))
        assert_same(hvd_aps.quantize(cp.asarray(x), fmt, **options), hvd_aps.quantize(x, fmt, **options))
        ranks = np.stack([codes, codes[::-1], codes])
        assert_same(codec.decode_sum(cp.asarray(ranks), fmt, shift=shift), codec.decode_sum(ranks, fmt, shift=shift))
        packed = hvd_aps.pack(codes, fmt)
        assert_same(hvd_aps.pack(cp.asarray(codes), fmt), packed)
        assert_same(hvd_aps.unpack(cp.asarray(packed), fmt, codes.size), codes)
        assert codec.amax(cp.asarray(x)) == codec.amax(x)
        assert codec.amax_blocks(cp.asarray(x), 256).tobytes() == codec.amax_blocks(x, 256).tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_packed_rows_on_device_arrays_give_the_host_engines_bits(counting_cupy, fmt, rounding):
    """encode_into (pieces at odd code positions, then blocks at their own exponents), decode_sum_rows
    over rows lying apart, decode_row and codes_at: the kernels on device arrays against the host engine."""
    x = codec_inputs(fmt, 2)
    n, block = x.size, 512
    shifts = np.random.default_rng(1).integers(-3, 6, -(-(n + 5) // block))
    size = codec.packed_size(n + 5, fmt)
    rows = {"host": np.zeros((3, size + 4), np.uint8), "device": cp.zeros((3, size + 4), np.uint8)}
    for where, xp in (("host", np), ("device", cp)):
        for r in range(2):
            for a, b in [(0, 7), (7, n // 2), (n // 2, n)]:
                codec.encode_into(xp.asarray(x[a:b]), fmt, rows[where][r, 2:2 + size], 5 + a, rounding, seed=r,
                                  shift=2, index=a)
        codec.encode_into(xp.asarray(x), fmt, rows[where][2, 2:2 + size], 5, rounding, seed=9,
                          shift=shifts[:-(-n // block)], block=block)
    assert_same(rows["device"], rows["host"])
    host, device = rows["host"][:, 2:2 + size], rows["device"][:, 2:2 + size]
    want, want_peak = codec.decode_sum_rows(host, fmt, 3, n, shift=2)
    got, peak = codec.decode_sum_rows(device, fmt, 3, n, shift=2)
    assert_same(got, want)
    assert peak == want_peak
    want, want_peaks = codec.decode_sum_rows(host, fmt, 3, n, shift=2, block=block)
    got, peaks = codec.decode_sum_rows(device, fmt, 3, n, shift=2, block=block)
    assert_same(got, want)
    assert peaks.tobytes() == want_peaks.tobytes()
    options = dict(shift=shifts[:-(-(n - 3) // block)], block=block, divisor=3)
    assert_same(codec.decode_row(device[2], fmt, 3, n, **options), codec.decode_row(host[2], fmt, 3, n, **options))
    positions = np.arange(0, n, 7)
    assert_same(codec.codes_at(device[1], fmt, positions), codec.codes_at(host[1], fmt, positions))


# The exchange ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One bucket's exchange: ELEMENTS float32 in `tensors` tensors over `world` ranks, cut into
    `chunks` chunks, averaged; feedback: error feedback with stochastic rounding."""
    fmt: str = "e4m3"
    tensors: int = 10
    chunks: int = 1
    world: int = 2
    feedback: bool = False

    def __str__(self) -> str:
        return f"{self.fmt}-{self.tensors}t-{self.chunks}c-w{self.world}{'-ef-sr' if self.feedback else ''}"

    def bucket(self) -> Bucket:
        rng = np.random.default_rng(self.tensors)
        cuts = np.sort(rng.choice(np.arange(1, ELEMENTS), self.tensors - 1, replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [ELEMENTS]]))
        keys = [f"t{i}" for i in range(self.tensors)]
        return Bucket.whole(f"bucket-{self.tensors}", keys, keys, sizes)

    def grads(self, step: int, rank: int) -> np.ndarray:
        """A rank's gradients of one step, each tensor at its own scale."""
        rng = np.random.default_rng([step, rank])
        scales = 10.0 ** rng.uniform(-6, 0, self.tensors)
        return (rng.standard_normal(ELEMENTS) * np.repeat(scales, self.bucket().sizes)).astype(np.float32)

    def compressors(self) -> list:
        chunk_bytes = 0 if self.chunks == 1 else 4 * ELEMENTS // self.chunks
        return [hvd_aps.APSCompressor(self.fmt, chunk_bytes=chunk_bytes, error_feedback=self.feedback,
                                      rounding="stochastic" if self.feedback else "nearest", seed=5)
                for _ in range(self.world)]


@dataclasses.dataclass(frozen=True)
class Run:
    """STEPS steps of an exchange: results[step][rank] (NumPy copies), every rank's stats table
    and, on device arrays, the stream handle each rank ran on."""
    results: list
    stats: list
    streams: list


def run_exchange(case: Case, counts: standin.Counts = None, spread: bool = False) -> Run:
    """The case's exchange, one thread a rank: on NumPy arrays over the package's own thread
    collectives, or (given the stand-in's `counts`) on device arrays, each rank on a stream of its
    own on device 0 (spread: rank r on device r), the counts reset before the last step."""
    world, bucket, compressors = case.world, case.bucket(), case.compressors()
    if counts is None:
        levels = _inprocess.flat_levels(world)
    else:
        group = _inprocess.Group(world)
        levels = [exchange.Levels.flat(DeviceCollectives(group, r)) for r in range(world)]
    last_step = threading.Barrier(world, action=None if counts is None else counts.reset,
                                  timeout=_inprocess.BARRIER_TIMEOUT_S)
    run = Run([[None] * world for _ in range(STEPS)], [None] * world, [None] * world)

    def rank(r):
        stages = compressors[r].exchanger.stages(world, r)
        with contextlib.ExitStack() as on:
            if counts is not None:
                on.enter_context(cp.cuda.Device(r if spread else 0))
                run.streams[r] = on.enter_context(cp.cuda.Stream()).ptr
                on.enter_context(counts.rank(r))
            for step in range(STEPS):
                flat = case.grads(step, r) if counts is None else cp.asarray(case.grads(step, r))
                if step == STEPS - 1:
                    last_step.wait()  # bounded: the barrier's timeout
                run.results[step][r] = standin.peek(exchange.run(stages, bucket, flat, levels[r], average=True))
                compressors[r].state.commit()
        run.stats[r] = compressors[r].stats_table()

    run_ranks(rank, world, [levels[0].world.group.barrier, last_step])
    return run


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """What one rank's steady-state step of one bucket did on the device."""
    reads: int
    uploads: int
    allocations: int
    ops: int       # CuPy's own kernels: elementwise, fill, indexing
    launches: int  # ops/kernels.cu's
    chunks: int
    frames: tuple  # where each read happened: its package frames
    placed: frozenset  # (stream, device) of every op and launch

    @classmethod
    def of(cls, counts: standin.Counts, rank: int, chunks: int) -> "StepCounts":
        of = functools.partial(counts.of, rank=rank)
        return cls(len(of("read")), len(of("upload")), len(of("alloc")), len(of("op")), len(of("launch")), chunks,
                   tuple(e.where for e in of("read")), frozenset((e.stream, e.device) for e in of("op") + of("launch")))

    @property
    def launches_per_chunk(self) -> float:
        return self.launches / self.chunks


@functools.lru_cache(maxsize=None)
def steady_counts(case: Case) -> tuple:
    """The case on device arrays -> (its Run, each rank's StepCounts of the last step). Kept: the
    bit-exact and the counting tests share the runs. The stand-in must be installed."""
    run = run_exchange(case, standin.COUNTS)
    return run, [StepCounts.of(standin.COUNTS, r, case.chunks) for r in range(case.world)]


CASES = [Case(fmt, tensors, chunks, feedback=feedback) for fmt in ("e4m3", "e2m1fn") for tensors in TENSORS
         for chunks in CHUNKS for feedback in (False, True)] + [Case("e4m3", 10, 8, world=4, feedback=True)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_exchange_on_device_arrays_gives_the_host_engines_bits(counting_cupy, case):
    """exchange.run on device arrays: every step's results as the same exchange's on NumPy arrays
    with the host engine, alike on every rank, and the same stats."""
    want, (got, _) = run_exchange(case), steady_counts(case)
    for step in range(STEPS):
        for rank in range(case.world):
            assert got.results[step][rank].tobytes() == want.results[step][rank].tobytes(), (step, rank)
            assert got.results[step][rank].tobytes() == got.results[step][0].tobytes(), (step, rank)
    assert got.stats == want.stats


@dataclasses.dataclass(frozen=True)
class Bound:
    """At most `fixed` + `per_chunk` x chunks a step."""
    fixed: int
    per_chunk: int

    def __call__(self, chunks: int) -> int:
        return self.fixed + self.per_chunk * chunks


# What one rank's steady-state step of one bucket does on the device (e4m3, world 2, stats on,
# whatever the tensor count). Reads: the agreed metadata, the one a bucket makes; and the stats
# of the step before, every bucket's in one copy, once a step.
READS = {"hvd_aps/exchange.py": 1, "hvd_aps/_device.py": 1}  # the metadata (_read); the stats (copied_to_host)
UPLOADS = Bound(2, 0)       # the metadata vector and the agreed shifts (stochastic rounding: the seeds too)
LAUNCHES = Bound(1, 6)      # the maxima; per chunk: encode, stats, sum, the sums' APS shifts, re-encode, decode
OPS = Bound(9, 8)           # CuPy's own: the vector's maxima, the limits; per chunk gathers, casts, clears


def counts_table() -> dict:
    """{(format, feedback, tensors, chunks): rank 0's StepCounts}, printed as a table."""
    table = {(fmt, feedback, t, c): steady_counts(Case(fmt, t, c, feedback=feedback))[1][0]
             for fmt, feedback in (("e4m3", False), ("e2m1fn", True)) for t in TENSORS for c in CHUNKS}
    print("\nOne steady-state step of one bucket, per rank (world 2; ef-sr: error feedback, stochastic rounding)")
    print(f"{'format':>12} {'tensors':>7} {'chunks':>6} {'reads':>5} {'uploads':>7} {'allocs':>6} {'ops':>4} "
          f"{'launches':>8} {'per chunk':>9}")
    for (fmt, feedback, t, c), n in table.items():
        print(f"{fmt + '-ef-sr' * feedback:>12} {t:7d} {c:6d} {n.reads:5d} {n.uploads:7d} {n.allocations:6d} "
              f"{n.ops:4d} {n.launches:8d} {n.launches_per_chunk:9.2f}")
    print("reads of e4m3, 1000 tensors, 8 chunks:")
    for where, count in Counter(table["e4m3", False, 1000, 8].frames).most_common():
        print(f"  {count:3d} x {where}")
    return table


def test_launches_do_not_grow_with_the_tensor_count(counting_cupy):
    table = counts_table()
    for fmt, feedback, _, chunks in table:
        for kind in ("launches", "reads", "uploads"):  # ops: a sub-byte stream may have bits to clear, or not
            counts = {t: getattr(table[fmt, feedback, t, chunks], kind) for t in TENSORS}
            assert len(set(counts.values())) == 1, f"{fmt}, {chunks} chunks: {kind} by tensor count {counts}"


def reads_by_file(n: StepCounts) -> dict:
    """{package file whose call made the read (the first frame past the array helpers): reads}."""
    return dict(Counter(next(f for f in frames.split(" <- ") if not f.startswith("hvd_aps/_arrays.py")).split(":")[0]
                        for frames in n.frames))


def test_steady_state_reads_are_the_agreed_metadata_and_the_stats_a_step_later(counting_cupy):
    """Every rank: one read for the bucket (its agreed metadata), one for the step's stats, whatever
    the chunks; uploads fixed a step; launches and CuPy's operations within the bounds above."""
    for tensors in TENSORS:
        for chunks in CHUNKS:
            for n in steady_counts(Case("e4m3", tensors, chunks))[1]:
                frames = "\n".join(n.frames)
                assert reads_by_file(n) == READS, f"{tensors} tensors, {chunks} chunks: {n.reads} reads at\n{frames}"
                assert n.uploads <= UPLOADS(chunks), n
                assert n.launches <= LAUNCHES(chunks) and n.ops <= OPS(chunks), n


def test_every_launch_records_the_stream_and_device_it_ran_on(counting_cupy):
    """Each rank runs on a stream of its own: its kernels and CuPy operations land there, through
    CuPy's current stream (the entry points' tests below: the framework's). From a thread that
    chose none: CuPy's null stream, on device 0."""
    for case in (Case("e2m1fn", 10, 8), Case("e4m3", 10, 8, world=4, feedback=True)):
        run, counts = steady_counts(case)
        assert len(set(run.streams)) == case.world
        for stream, n in zip(run.streams, counts):
            assert n.launches and n.placed == {(stream, 0)}, (case, n.placed)
    counting_cupy.reset()
    hvd_aps.encode(cp.asarray(np.ones(10, np.float32)), "e4m3")
    assert [(e.name, e.stream, e.device, e.grid, e.block) for e in counting_cupy.launches] == [
        ("hvd_table_encode", 0, 0, (1,), (256,))]


def test_ranks_on_devices_of_their_own(counting_cupy):
    """Thread ranks each on a device of its own: every launch's arrays on the launch's device."""
    run_exchange(Case("e4m3", 10, 1), counting_cupy, spread=True)


# Device copies of host tables ------------------------------------------------------------------------
def test_a_tables_copy_made_on_one_stream_is_waited_for_on_another(counting_cupy):
    """Thread ranks on one device share a layout's tables: the copy is made on the stream that first
    needs it, and a kernel on another stream runs after it (an event waited for), not before."""
    blocks, peaks = _tables.run(5000, 2048), []
    for stream in (cp.cuda.Stream(), cp.cuda.Stream()):
        with stream:
            x = cp.asarray(np.arange(5000, dtype=np.float32))
            peaks.append(standin.peek(codec.engine_for(x).table_amax(x, blocks)))
    assert peaks[0].tobytes() == peaks[1].tobytes()
    assert sum(e.stack[0].endswith(" on_device") for e in counting_cupy.uploads) == 1  # the table's one copy


def test_the_stand_in_refuses_a_read_on_a_stream_not_ordered_after_the_upload(counting_cupy):
    with cp.cuda.Stream():
        index = cp.asarray(np.arange(3))
    values = cp.arange(5, dtype=np.float32)
    with cp.cuda.Stream() as other, pytest.raises(standin.StreamOrderError, match="neither waited for"):
        values[index]
    event = cp.cuda.Event()
    with cp.cuda.Stream() as first:
        later = cp.asarray(np.arange(2))
        event.record(first)
    other.wait_event(event)
    with other:
        assert values[later].shape == (2,)


def test_one_off_tables_leave_a_live_tables_copy_in_place(counting_cupy):
    """A bucket's table, copied once, is still on the device after thousands of one-off runs (the
    codec's public functions, a table of their own each): it uploads nothing when used again, and
    the one-off tables' copies went with them."""
    live, x = _tables.run(5000, 2048), cp.asarray(np.ones(5000, np.float32))
    engine = codec.engine_for(x)
    engine.table_amax(x, live)
    copies = len(_device._copies)
    for n in range(1, 4500):
        hvd_aps.encode(x[:n], "e4m3")
    counting_cupy.reset()
    engine.table_amax(x, live)
    assert not counting_cupy.uploads, counting_cupy.summary()
    assert len(_device._copies) <= copies + _tables.RUNS_KEPT  # the codec's run tables kept, no more


# The stand-in's own strictness --------------------------------------------------------------------
def test_the_stand_in_refuses_what_cupy_refuses(counting_cupy):
    """Implicit conversion to NumPy, host arrays as operands, a kernel the source lacks, arguments
    that do not fit a kernel's signature, reads inside cupyx.allow_synchronize(False)."""
    x = cp.arange(4, dtype=np.float32)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(4, np.float32)
    module = cp.RawModule(code=(importlib.resources.files("hvd_aps.ops") / "kernels.cu").read_text())
    with pytest.raises(LookupError):
        module.get_function("hvd_no_such_kernel")
    shifts = module.get_function("hvd_table_shifts")
    with pytest.raises(TypeError, match="shifts takes int32 on device 0, got float32"):
        shifts((1,), (256,), (x, np.int64(4), np.float64(1), cp.zeros(4, np.float32), cp.zeros(8, np.uint8)))
    with pytest.raises(TypeError, match="n takes int64"):
        shifts((1,), (256,), (x, 4, np.float64(1), cp.zeros(4, np.int32), cp.zeros(8, np.uint8)))
    with standin.cupyx.allow_synchronize(False), pytest.raises(standin.DeviceSynchronized):
        float(x[0])


def test_views_memory_pointers_and_dlpack_share_device_memory(counting_cupy):
    """Adjacent views of one allocation join without a copy (cupy.ndarray over a MemoryPointer, as
    hvd_aps._arrays.joined makes it); DLPack hands torch the memory itself, and back."""
    torch = pytest.importorskip("torch")
    whole = cp.arange(10, dtype=np.float32)
    counting_cupy.reset()
    joined = _arrays.concatenated([whole[:4], whole[4:]])
    assert joined.data.ptr == whole.data.ptr and not counting_cupy.allocations and not counting_cupy.ops
    tensor = torch.from_dlpack(whole)
    tensor[0] = 7
    assert cp.from_dlpack(tensor).data.ptr == whole.data.ptr
    assert float(joined[0]) == 7 and [e.name for e in counting_cupy.reads] == ["__float__"]


def test_installing_leaves_the_modules_as_they_were(monkeypatch):
    """A CuPy imported before (here a placeholder) is back afterwards, and so is the package's
    engine: the stand-in's is imported anew inside and gone outside."""
    placeholder, engine = types.ModuleType("cupy"), sys.modules.get("hvd_aps._cupy_engine")
    monkeypatch.setitem(sys.modules, "cupy", placeholder)
    with standin.installed():
        assert codec.engine_for(cp.zeros(1)).cupy is cp
    assert sys.modules["cupy"] is placeholder and sys.modules.get("hvd_aps._cupy_engine") is engine
    assert getattr(hvd_aps, "_cupy_engine", None) is engine


# Every torch entry point, in real processes -----------------------------------------------------------
@pytest.fixture(scope="module")
def entry_points(tmp_path_factory):
    """tests/workers/device_checks.py under torchrun, 2 ranks: each rank's JSON."""
    tmp = tmp_path_factory.mktemp("device")
    torchrun("device_checks.py", tmp, timeout=300)
    return [json.loads((tmp / f"device_rank{r}.json").read_text()) for r in range(2)]


def runs_of(ranks: list) -> list:
    return [key for key in ranks[0] if key != "place"]


def test_every_entry_point_gives_the_host_engines_bits_alike_on_every_rank(entry_points):
    """DDP's hook, FSDP2's reduce-scatter and HSDP's all-reduce hook, 1/10/1000 tensors, 1 and 8
    chunks: parameters after three steps bit for bit as with the host engine, and alike on both ranks."""
    for key in runs_of(entry_points):
        assert all(rank[key]["same_bits"] for rank in entry_points), key
        assert entry_points[0][key]["digest"] == entry_points[1][key]["digest"], key


def test_every_entry_point_reads_once_a_bucket_on_the_frameworks_stream_and_device(entry_points):
    """A steady-state step of one bucket: the agreed metadata read and the step's stats (a step
    later, in one copy); every kernel and CuPy operation on the stream the framework called on
    and the device of the bucket's tensors, in whichever thread ran it; launches the same whatever
    the tensor count."""
    for rank in entry_points:
        for key in runs_of(entry_points):
            assert rank[key]["reads"] == READS, (key, rank[key]["reads"])
            assert rank[key]["placed"] == [rank["place"]], (key, rank[key]["placed"])
            assert rank[key]["uploads"] <= UPLOADS(1), (key, rank[key]["uploads"])
        for key in runs_of(entry_points):
            entry, _, chunks = key.split("-")
            launches = {rank[f"{entry}-{t}t-{chunks}"]["launches"] for t in TENSORS}
            assert len(launches) == 1, (key, launches)


@pytest.fixture(scope="module")
def horovod_entry_points(tmp_path_factory):
    """tests/workers/device_horovod_checks.py under horovodrun, 2 ranks: each rank's JSON."""
    pytest.importorskip("horovod")
    tmp = tmp_path_factory.mktemp("device_horovod")
    horovodrun("device_horovod_checks.py", tmp, timeout=300)
    return [json.loads((tmp / f"device_horovod_rank{r}.json").read_text()) for r in range(2)]


def test_horovods_one_line_and_the_codes_optimizer_read_once_a_bucket_and_once_a_step(horovod_entry_points):
    """Horovod's DistributedOptimizer with an APSCompressor and hvd_aps.torch's, 1/10/1000 tensors,
    1 and 8 chunks: bit for bit the host engine's and alike on both ranks; a steady step reads the
    bucket's agreed metadata, the stats and (the one line) every reduced token in one read, not
    one a gradient; every launch on the stream and device the gradients were handed over on."""
    ranks = horovod_entry_points
    for key in runs_of(ranks):
        for rank in ranks:
            assert rank[key]["same_bits"], key
            assert rank[key]["reads"] == READS and rank[key]["tolists"] == key.startswith("horovod"), (key, rank[key])
            assert rank[key]["placed"] == [rank["place"]], (key, rank[key]["placed"])
        assert ranks[0][key]["digest"] == ranks[1][key]["digest"], key
