"""The block tables (hvd_aps._tables) and the engines' table functions: the compiled host engine,
cut into many threads' shares, gives the NumPy engine's bytes and bits on tables of a real layout
(segments of every size, sub-byte formats whose blocks start mid-byte, stochastic rounding,
residuals, the stats' sample)."""
import concurrent.futures

import numpy as np
import pytest

from hvd_aps import _host_engine, _numpy_engine, _tables
from kernel_cases import data, plan
from hvd_aps.formats import FloatFormat

pytestmark = pytest.mark.skipif(not _host_engine.available, reason="the compiled host engine is not built")
SIZES = [5, 3000, 1, 9001, 2048, 4097, 700, 33]  # tensors that start anywhere in a packed stream


THREADS = 7


class CountingPool:
    """A thread pool that counts the tables it is handed and the shares they are cut into."""

    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(THREADS)
        self.tables = self.shares = 0

    def map(self, fn, shares):
        shares = list(shares)
        self.tables, self.shares = self.tables + 1, self.shares + len(shares)
        return self.pool.map(fn, shares)


@pytest.fixture
def many_threads(monkeypatch):
    """The host engine cutting every table into seven shares, however small, on a pool of its own
    (one core or HVD_APS_THREADS=1 leave the engine none); the test fails unless the tables ran in
    shares on it."""
    pool = CountingPool()
    monkeypatch.setattr(_host_engine, "_MIN_CHUNK", 8)
    monkeypatch.setattr(_host_engine, "_width", lambda: THREADS)
    monkeypatch.setattr(_host_engine, "_pool", pool)
    yield
    pool.pool.shutdown()
    assert pool.tables and pool.shares > pool.tables, "the host engine ran no table in several threads' shares"


@pytest.mark.parametrize("name", ["e2m1fn", "e4m3", "e3m2", "e2m0", "e5m10"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_host_tables_give_the_numpy_engines_bytes(name, rounding, many_threads):
    fmt = FloatFormat.parse(name)
    held, chunks = plan(fmt)
    x = data(held.blocks.elements)
    rng = np.random.default_rng(1)
    for chunk in chunks:
        send = chunk.lanes[0].send
        shifts = rng.integers(-3, 8, send.count).astype(np.int32)
        seeds = rng.integers(0, 2 ** 63, send.count).astype(np.uint64)
        messages, residuals = [], []
        for engine in (_host_engine, _numpy_engine):
            message = rng.integers(0, 256, chunk.send_bytes).astype(np.uint8)  # last step's bytes
            message[chunk.clear_send] = 0
            residual = np.full(x.size, np.nan, np.float32)
            engine.table_encode(x, fmt, send, shifts, rounding, seeds, False, message, residual)
            messages.append(message)
            residuals.append(residual)
        assert messages[0].tobytes() == messages[1].tobytes()
        assert residuals[0].tobytes() == residuals[1].tobytes()
        first = rng.integers(0, 5, send.count)
        step = rng.integers(1, 6, send.count)
        limits = np.ldexp(np.float64(fmt.max), -shifts.astype(np.int64)).astype(np.float32)
        stats = [e.table_stats(x, messages[0], fmt, send, shifts, first, step, limits)
                 for e in (_host_engine, _numpy_engine)]
        np.testing.assert_array_equal(stats[0][:, :4], stats[1][:, :4])  # counts
        np.testing.assert_allclose(stats[0][:, 4:], stats[1][:, 4:], rtol=1e-12)  # sums of squares


@pytest.mark.parametrize("name", ["e2m1fn", "e4m3", "e3m2"])
def test_host_sum_decode_and_amax_tables_match_numpys(name, many_threads):
    fmt = FloatFormat.parse(name)
    world = 3
    held, chunks = plan(fmt, world)
    rng = np.random.default_rng(2)
    for chunk in chunks:
        lane = chunk.lanes[0]
        rows = rng.integers(0, 256, (world, chunk.row_bytes)).astype(np.uint8)
        shifts = rng.integers(-4, 6, lane.reduce.count).astype(np.int32)
        sums = [np.full(lane.range[1] - lane.range[0], np.nan, np.float32) for _ in range(2)]
        peaks = [e.table_sum(rows, fmt, lane.reduce, shifts, out) for e, out in zip((_host_engine, _numpy_engine), sums)]
        assert sums[0].tobytes() == sums[1].tobytes() and peaks[0].tobytes() == peaks[1].tobytes()
        gathered = rng.integers(0, 256, sum(chunk.owner_bytes)).astype(np.uint8)
        exponents = rng.integers(-6, 6, lane.finish.count).astype(np.int32)
        outs = [np.full(held.blocks.elements, np.nan, np.float32) for _ in range(2)]
        for engine, out in zip((_host_engine, _numpy_engine), outs):
            engine.table_decode(gathered, fmt, lane.finish, exponents, out, np.float32(3))
        assert outs[0].tobytes() == outs[1].tobytes()
    x = data(held.blocks.elements, seed=3)
    x[[7, 5000]] = [np.inf, np.nan]
    got, want = (e.table_amax(x, held.blocks) for e in (_host_engine, _numpy_engine))
    assert got.tobytes() == want.tobytes() and np.isinf(got).sum() == 2


@pytest.mark.parametrize("bits", [3, 4, 6, 8, 12])
def test_thread_shares_cover_every_element_once_and_start_on_a_byte(bits):
    exp_bits = min(5, bits - 2)
    fmt = FloatFormat(exp_bits, bits - 1 - exp_bits)
    _, chunks = plan(fmt)
    send = chunks[0].lanes[0].send
    period = 8 // np.gcd(8, fmt.bits)
    for parts in (1, 2, 5, 64):
        shares = send.cuts(parts, period)
        for (b0, o0), _ in shares:
            assert (send.rows[b0, _tables.POS] + o0) % period == 0 or o0 == 0 and send.rows[b0, _tables.POS] == 0
        # the shares tile the table's elements: each starts where the one before ends, none empty
        bounds = [(int(send.starts[b0]) + o0, int(send.starts[b1]) + o1 if b1 < send.count else send.elements)
                  for (b0, o0), (b1, o1) in shares]
        assert bounds[0][0] == 0 and bounds[-1][1] == send.elements
        assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert 1 < len(shares) <= parts or parts == 1


def test_every_engine_keeps_the_engine_contract(counting_cupy):
    """The host, NumPy and CuPy engines (the last on the counting stand-in) each have every table
    function of hvd_aps._engine.Engine, with its parameters in its order and its defaults."""
    import inspect
    from hvd_aps import _engine
    from hvd_aps import _cupy_engine
    assert _engine.CONTRACT == ("table_amax", "table_encode", "table_sum", "table_decode", "table_shifts",
                                "table_stats")
    for engine in (_host_engine, _numpy_engine, _cupy_engine):
        assert isinstance(engine, _engine.Engine), engine.__name__
        for name in _engine.CONTRACT:
            want = list(inspect.signature(getattr(_engine.Engine, name)).parameters.values())[1:]  # past self
            got = list(inspect.signature(getattr(engine, name)).parameters.values())
            assert [(p.name, p.default) for p in got] == [(p.name, p.default) for p in want], (engine.__name__, name)


# The modules whose every function and method is annotated (the codec, the formats, scaling, the
# engines and where the device's work runs)
ANNOTATED = ("codec", "formats", "scaling", "_numpy_engine", "_host_engine", "_cupy_engine", "_device")


def test_every_function_of_the_codec_and_the_engines_is_annotated():
    """Every function and method of ANNOTATED's modules, public or private, nested or decorated,
    annotates each of its parameters (but self and cls) and its return. Read from the sources, so
    the CuPy engine is held to it without CuPy."""
    import ast
    import pathlib
    import hvd_aps
    root = pathlib.Path(hvd_aps.__file__).parent
    offenders = []
    for module in ANNOTATED:
        path = root / f"{module}.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            params += [p for p in (a.vararg, a.kwarg) if p is not None]
            missing = [p.arg for p in params if p.annotation is None] + (["return"] if node.returns is None else [])
            if missing:
                offenders.append(f"hvd_aps/{module}.py:{node.lineno} {node.name}: {', '.join(missing)}")
    assert not offenders, f"{len(offenders)} functions not fully annotated:\n" + "\n".join(offenders)


def test_packed_codes_are_cut_into_threads_shares_only_where_rows_come_in_stream_order(monkeypatch):
    """Two threads' rows sharing a packed byte would each rewrite it (a lost code): rows out of
    stream order (a device's table may come in any order) are encoded by one thread; a layout's
    run, in order, still in shares."""
    from kernel_cases import LARGE, Table
    monkeypatch.setattr(_host_engine, "_width", lambda: 2)
    monkeypatch.setattr(_host_engine, "_pool", concurrent.futures.ThreadPoolExecutor(2))
    shuffled = Table.of(LARGE, FloatFormat.parse("e2m2"), np.random.default_rng(5)).blocks
    in_order = _tables.run(LARGE, LARGE)
    assert not shuffled.in_stream_order and in_order.in_stream_order

    def shares(blocks, period):
        return len(_host_engine._run_table(lambda *share: share, blocks, period))

    assert shares(shuffled, 8) == 1 and shares(shuffled, 1) == 2 and shares(in_order, 8) == 2
