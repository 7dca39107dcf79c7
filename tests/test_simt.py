"""ops/kernels.cu's own text on the CPU (tests/simt/): the SIMT layer held to CUDA's semantics; every
kernel bit for bit with the compiled host engine (the stats and shifts with NumPy's arithmetic) on
every kind of format, both roundings, saturation, sizes that end mid-byte and mid-row, rows sharing
packed bytes, 1 to 8 ranks and every special value; and the kernels' launches replayed under
ThreadSanitizer and AddressSanitizer."""
import numpy as np
import pytest

import counting_cupy as standin
import hvd_aps
import simt
from counting_cupy import cupy as cp
from hvd_aps import _host_engine, _numpy_engine, scaling
from kernel_cases import LARGE, SIZES, Table, device, inputs, same, shifts_for, tree_sums

pytestmark = pytest.mark.skipif(not _host_engine.available, reason="the compiled host engine is not built")

SELF = simt.Module(simt.HERE / "selftest.cu")
Span = simt.Span.of
# 8-bit (IEEE, fn), 16-bit, the 4-bit packings, 6-bit, and codes that straddle bytes (5 and 7 bits)
FORMATS = ["e4m3", "e5m2", "e4m3fn", "e5m10", "e8m7", "e3m0", "e2m1fn", "e3m2fn", "e2m2", "e4m2"]


# The SIMT layer --------------------------------------------------------------------------------------
def test_indices_cover_grid_and_block_in_three_dimensions():
    grid, block = (3, 2, 4), (5, 3, 2)
    out = np.zeros(int(np.prod(grid) * np.prod(block)) * 8, np.uint32)
    SELF.launch("simt_indices", grid, block, [Span(out)])
    got = out.reshape(-1, 8)
    b = np.arange(int(np.prod(grid))).repeat(int(np.prod(block)))
    t = np.tile(np.arange(int(np.prod(block))), int(np.prod(grid)))
    want = np.stack([t % 5, t // 5 % 3, t // 15, b % 3, b // 3 % 2, b // 6, np.full_like(t, 30), np.full_like(t, 24)], 1)
    assert (got == want).all()


def test_shared_memory_is_a_blocks_own_and_syncthreads_a_barrier():
    """Blocks run at once on the pool: each reverses its run through shared memory of its own."""
    x = np.random.default_rng(0).standard_normal(64 * 1024).astype(np.float32)
    y = np.zeros_like(x)
    SELF.launch("simt_reverse", (64,), (1024,), [Span(x), Span(y)])
    assert (y.reshape(64, 1024) == x.reshape(64, 1024)[:, ::-1]).all()


@pytest.mark.parametrize("delta, width", [(1, 32), (3, 16), (16, 32), (5, 8)])
def test_shuffle_down_is_cudas(delta, width):
    """Lanes take their partner's value of the same shuffle (twice in a row), a lane whose partner
    lies past its width segment keeps its own."""
    x = np.random.default_rng(delta).integers(0, 2 ** 32, 512, dtype=np.uint32)
    out = np.zeros_like(x)
    SELF.launch("simt_shuffle", (2,), (256,), [Span(x), Span(out), np.uint32(delta), np.int32(width)])
    lane = np.arange(512) % 32
    want = x
    for _ in range(2):
        source = np.where(lane % width + delta < width, np.arange(512) + delta, np.arange(512))
        want = want[source]
    assert (out == want).all()


def test_atomics_of_every_block_land_on_the_same_words():
    x = np.random.default_rng(1).integers(0, 2 ** 32, 64 * 256, dtype=np.uint32)
    top, bits, clear = np.zeros(1, np.uint32), np.zeros(x.size // 32, np.uint32), np.full(x.size // 32, ~np.uint32(0))
    SELF.launch("simt_atomics", (64,), (256,), [Span(x), Span(top), Span(bits), Span(clear)])
    assert top[0] == x.max() and (bits == ~np.uint32(0)).all() and not clear.any()


@pytest.mark.parametrize("kernel, why", [
    ("simt_divergent_barrier", "32 of 64 threads wait at __syncthreads[(][)], which 32 exited without reaching"),
    ("simt_missing_lane", "thread 0 shuffles with lane 5 of its warp, which exited")])
def test_what_would_hang_a_device_fails_the_launch_with_its_reason(kernel, why):
    with pytest.raises(RuntimeError, match=why):
        SELF.launch(kernel, (1,), (64,), [Span(np.zeros(64, np.uint32))])


# kernels.cu against the host engine -----------------------------------------------------------------
def runs(fmt: str):
    """(size, rounding, saturate) for one format: every small size both ways, LARGE once."""
    cases = [(n, r, s) for n in SIZES for r in ("nearest", "stochastic") for s in (False, True)]
    return cases + [(LARGE, "stochastic" if len(fmt) % 2 else "nearest", len(fmt) % 3 == 0)]


@pytest.mark.parametrize("name", FORMATS)
def test_encode_gives_the_host_engines_bytes_and_residuals(name):
    fmt = hvd_aps.FloatFormat.parse(name)
    rng = np.random.default_rng(len(name))
    with device() as engine:
        for n, rounding, saturate in runs(name):
            table = Table.of(n, fmt, rng)
            x, shifts = inputs(n, fmt, rng), shifts_for(table.blocks.count, rng)
            seeds = rng.integers(0, 2 ** 63, table.blocks.count).astype(np.uint64)
            stale = rng.integers(0, 256, table.size).astype(np.uint8)  # bits no row owns are kept
            want, want_res = stale.copy(), np.zeros(n, np.float32)
            _host_engine.table_encode(x, fmt, table.blocks, shifts, rounding, seeds, saturate, want, want_res)
            got, got_res = cp.asarray(stale), cp.zeros(n, np.float32)
            engine.table_encode(cp.asarray(x), fmt, table.blocks, shifts, rounding, seeds, saturate, got, got_res)
            assert same(standin.peek(got), want), (n, rounding, saturate)
            assert same(standin.peek(got_res), want_res), (n, rounding, saturate)


@pytest.mark.parametrize("name", FORMATS)
def test_decode_and_the_ranks_sum_give_the_host_engines_bits(name):
    """Every code (NaN and Inf codes included) of 1 to 8 ranks' rows lying apart in memory, at
    each row's exponent; decode divided by N as the average's is."""
    fmt = hvd_aps.FloatFormat.parse(name)
    rng = np.random.default_rng(len(name) + 1)
    with device() as engine:
        for k, (n, _, _) in enumerate(runs(name)[::4]):
            table = Table.of(n, fmt, rng)
            shifts = shifts_for(table.blocks.count, rng)
            ranks = 1 + (k + len(name)) % 8 if n < LARGE else 3
            rows = rng.integers(0, 256, (ranks, table.size + 5)).astype(np.uint8)
            want_out = np.zeros(n, np.float32)
            want_peaks = _host_engine.table_sum(rows[:, 2:-3], fmt, table.blocks, shifts, want_out)
            got_out = cp.zeros(n, np.float32)
            got_peaks = engine.table_sum(cp.asarray(rows)[:, 2:-3], fmt, table.blocks, shifts, got_out)
            assert same(standin.peek(got_out), want_out, nan=True), (n, ranks)
            assert same(standin.peek(got_peaks), want_peaks), (n, ranks)
            for divisor in (np.float32(1), np.float32(ranks)):
                want = _host_engine.table_decode(rows[0], fmt, table.blocks, shifts, np.zeros(n, np.float32), divisor)
                got = engine.table_decode(cp.asarray(rows[0]), fmt, table.blocks, shifts, cp.zeros(n, np.float32),
                                          divisor)
                assert same(standin.peek(got), want), (n, divisor)


@pytest.mark.parametrize("n", SIZES + [LARGE])
def test_amax_gives_the_host_engines_peaks(n):
    """Each row's max |x| (+Inf for any NaN or Inf), wherever in the row it lies."""
    rng = np.random.default_rng(n)
    with device() as engine:
        for _ in range(3):
            table = Table.of(n, hvd_aps.e4m3, rng)
            x = inputs(n, hvd_aps.e4m3, rng)
            got = engine.table_amax(cp.asarray(x), table.blocks)
            assert same(standin.peek(got), _host_engine.table_amax(x, table.blocks))


@pytest.mark.parametrize("name", ["e4m3", "e2m1fn", "e3m2fn", "e5m10"])
def test_stats_count_as_the_host_engine_and_sum_as_the_kernels_tree(name):
    """Counts exactly the host engine's; the float64 sums exactly NumPy's of the kernel's own order
    (and within rounding of the host engine's, which sums in another)."""
    fmt = hvd_aps.FloatFormat.parse(name)
    rng = np.random.default_rng(7)
    with device() as engine:
        for n in (31, 4097, 20_000):
            table = Table.of(n, fmt, rng)
            with np.errstate(over="ignore"):
                x = (rng.standard_normal(n) * np.exp2(rng.uniform(-30, 10, n))).astype(np.float32)
            shifts = rng.integers(-3, 8, table.blocks.count).astype(np.int32)
            message = np.zeros(table.size, np.uint8)
            _host_engine.table_encode(x, fmt, table.blocks, shifts, "nearest", None, False, message)
            first, step = rng.integers(0, 4, table.blocks.count), rng.integers(1, 5, table.blocks.count)
            limits = np.ldexp(np.float64(fmt.max), -shifts.astype(np.int64)).astype(np.float32)
            host = _host_engine.table_stats(x, message, fmt, table.blocks, shifts, first, step, limits)
            got = standin.peek(engine.table_stats(cp.asarray(x), cp.asarray(message), fmt, table.blocks, shifts,
                                                  first, step, limits))
            sent = np.zeros(n, np.float32)
            _host_engine.table_decode(message, fmt, table.blocks, shifts, sent)
            assert (got[:, :4] == host[:, :4]).all()
            assert got.tobytes() == tree_sums(x, sent, table.blocks, first, step, limits).tobytes()
            assert np.allclose(got[:, 4:], host[:, 4:], rtol=1e-12, atol=0)


def test_shifts_are_numpys_float64_arithmetic_with_the_exponents_in_the_message():
    """Maxima of every float32 binade, subnormals, 0 and Inf, against scaling.shifts_under; at the
    limits APS uses (every format, 1 to 1024 ranks) and at limits so small that limit / peak is a
    subnormal double, where the division's rounding takes the two correction steps."""
    rng = np.random.default_rng(3)
    with np.errstate(over="ignore"):
        peaks = np.abs((rng.standard_normal(70_003) * np.exp2(rng.uniform(-150, 129, 70_003))).astype(np.float32))
    peaks[np.isnan(peaks)] = np.inf
    peaks[:4] = [0.0, 1e-45, np.inf, 3.4e38]
    limits = [scaling.limit_for(world, hvd_aps.FloatFormat.parse(name)) for name in ("e4m3", "e2m1fn", "e5m10")
              for world in (1, 3, 1024)] + [np.ldexp(1.37, -1060), np.ldexp(1.0, -1070), 5e-324]
    with device() as engine:
        for limit in limits:
            want_bytes = np.zeros(2 * peaks.size + 3, np.uint8)
            want = _numpy_engine.table_shifts(peaks, limit, want_bytes[1:-2])
            got_bytes = cp.zeros(2 * peaks.size + 3, np.uint8)
            got = engine.table_shifts(cp.asarray(peaks), limit, got_bytes[1:-2])
            assert same(standin.peek(got), want) and same(standin.peek(got_bytes), want_bytes), limit


# The kernels under the sanitizers ---------------------------------------------------------------------
def record_kernels(path) -> int:
    """Each kernel's launches over formats of every packing, rows sharing packed bytes in both
    roundings and 3 ranks, kept for replay: how many launches."""
    rng = np.random.default_rng(11)
    with device() as engine, simt.Recording() as recording:
        for name in ("e4m3", "e3m0", "e2m2", "e5m10"):
            fmt = hvd_aps.FloatFormat.parse(name)
            n = 1500
            table = Table.of(n, fmt, rng)
            count = table.blocks.count
            x, shifts = cp.asarray(inputs(n, fmt, rng)), shifts_for(count, rng)
            seeds = rng.integers(0, 2 ** 63, count).astype(np.uint64)
            peaks = engine.table_amax(x, table.blocks)
            engine.table_shifts(peaks, 224.0, cp.zeros(2 * count, np.uint8))
            for rounding in ("nearest", "stochastic"):
                message = cp.zeros(table.size, np.uint8)
                engine.table_encode(x, fmt, table.blocks, shifts, rounding, seeds, name == "e3m0", message,
                                    cp.zeros(n, np.float32))
            engine.table_stats(x, message, fmt, table.blocks, shifts, np.zeros(count, np.int64),
                               np.ones(count, np.int64), np.full(count, 1.0, np.float32))
            rows = cp.asarray(rng.integers(0, 256, (3, table.size + 4)).astype(np.uint8))[:, 1:-3]
            engine.table_sum(rows, fmt, table.blocks, shifts, cp.zeros(n, np.float32))
            engine.table_decode(message, fmt, table.blocks, shifts, cp.zeros(n, np.float32), np.float32(3))
        recording.write(path)
        return len(recording.launches)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("simt") / "kernels.rec"
    return path, record_kernels(path)


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_the_kernels_replay_clean_under_the_sanitizers(recorded, sanitizer):
    """No race between blocks or between a block's threads (ThreadSanitizer), no access outside the
    arrays a launch was handed (AddressSanitizer, exact-size heap copies; a packed stream's array
    in whole words), and every array as the in-process run left it."""
    path, launches = recorded
    run = simt.KERNELS.replay(path, sanitizer, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-6000:]
    assert f"replay: {launches} launches as recorded" in run.stdout


@pytest.mark.parametrize("kernel, grid, size, sanitizer, report", [
    ("simt_race_between_blocks", 8, 4, "thread", "data race .*simt_race_between_blocks"),
    ("simt_race_in_block", 1, 256, "thread", "data race .*simt_race_in_block"),
    ("simt_plain_beside_atomic", 2, 4, "thread", "data race"),
    ("simt_overrun", 1, 160, "address", "heap-buffer-overflow")])
def test_the_sanitized_replay_reports_races_and_overruns(tmp_path, kernel, grid, size, sanitizer, report):
    """What the checked builds are for: a race between blocks, between a block's threads with no
    barrier between, a plain store beside another block's atomic, a write past an array."""
    memory = np.zeros(size + 64, np.uint8)
    arguments = [Span(memory[:size])] + ([np.int64(size // 4)] if kernel == "simt_overrun" else [])
    with simt.Recording() as recording:
        SELF.launch(kernel, (grid,), (64,), arguments)
    recording.write(tmp_path / "k.rec")
    run = SELF.replay(tmp_path / "k.rec", sanitizer, timeout=120)
    assert run.returncode == simt.SANITIZER_FAILED, run.stdout + run.stderr[-3000:]
    assert pytest.importorskip("re").search(report, run.stderr.replace("\n", " ")), run.stderr[-3000:]


# The GPU projection, from the kernels' counted work ---------------------------------------------------
def test_the_shipped_gpu_projection_is_what_the_kernels_count_now(tmp_path, capsys):
    """hvd_aps/gpu_projection.json (plan --device cuda's codec) holds what one exchange launches, reads,
    uploads and moves as the kernels and the exchange stand now: rerun examples/gpu_projection.py
    when this fails. And a device's measured file prints beside it."""
    import json
    import sys
    sys.path.insert(0, str(simt.HERE.parent.parent / "examples"))
    import gpu_projection
    from hvd_aps import calibration
    shipped = json.loads(calibration.GPU_PROJECTION.read_text())
    assert shipped["kind"] == "projected" and calibration.load(calibration.GPU_PROJECTION).kind.value == "projected"
    row = next(r for r in shipped["counted"]["e4m3"] if (r["elements"], r["tensors"]) == (1 << 18, 16))
    counted = gpu_projection.count("e4m3", 1 << 18, 16)
    assert (counted.launches, counted.operations, counted.reads, counted.uploads) == (
        row["launches"], row["operations"], row["reads"], row["uploads"])
    assert sum(b for _, b in counted.kernel_bytes) == row["kernel_bytes"]
    assert counted.seconds == pytest.approx(row["projected_seconds"], rel=1e-12)
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"format": calibration.FORMAT, "device": "a GPU", "date": "today", "measured": {
        "e4m3": [{"elements": 1 << 18, "tensors": 16, "seconds": 2 * row["projected_seconds"]}]}}))
    gpu_projection.against(measured)
    assert "262144      16" in capsys.readouterr().out
