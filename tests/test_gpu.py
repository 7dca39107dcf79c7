"""The CuPy engine against the CPU engines, bit for bit: its table kernels (the only kernels it has)
directly and under every codec function; and the codes exchange on a GPU (threads as ranks; the
DDP hook over NCCL with one rank). Skipped where there is no CUDA device."""
import os

import numpy as np
import pytest

import hvd_aps
from kernel_cases import Table, data, device, plan, same, tree_sums
from support import assert_bit_exact, assert_low_precision, launch_ddp_checks, rank_grads, same_format, simulate

cupy = pytest.importorskip("cupy", reason="no CuPy: scripts/install.sh installs it where there is a CUDA device")
try:
    cupy.cuda.runtime.getDeviceCount()
except cupy.cuda.runtime.CUDARuntimeError:
    pytest.skip("no CUDA device", allow_module_level=True)

SIZES = [1, 3, 1023, 1_000_003]


def cpu(fn, *args, **kwargs):
    os.environ["HVD_APS_ENGINE"] = "numpy"
    try:
        return fn(*args, **kwargs)
    finally:
        del os.environ["HVD_APS_ENGINE"]


def inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(n) * np.exp2(rng.uniform(-150, 129, n))).astype(np.float32)
    x[: min(n, 6)] = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45])[: min(n, 6)]
    return x


@pytest.mark.parametrize("name", sorted(hvd_aps.PRESETS) + ["e5m3", "e4m0"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("n", SIZES)
def test_encode_decode_match_the_cpu(name, rounding, n):
    x = inputs(n)
    want = cpu(hvd_aps.encode, x, name, rounding, seed=9, shift=5)
    got = hvd_aps.encode(cupy.asarray(x), name, rounding, seed=9, shift=5)
    assert isinstance(got, cupy.ndarray) and (cupy.asnumpy(got) == want).all()
    decoded = cupy.asnumpy(hvd_aps.decode(got, name, shift=5))
    assert (decoded.view(np.uint32) == cpu(hvd_aps.decode, want, name, shift=5).view(np.uint32)).all()


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1fn", "e3m0"])
@pytest.mark.parametrize("world", [1, 8])
def test_table_shifts_match_the_cpu(name, world):
    """The re-encode's APS shifts and their exponents in the message (hvd_table_shifts) against
    scaling.shifts_for, over maxima of every float32 binade, subnormals, 0 and Inf."""
    from hvd_aps import _cupy_engine, _numpy_engine, scaling
    fmt = hvd_aps.FloatFormat.parse(name)
    with np.errstate(over="ignore"):
        peaks = np.abs(inputs(100_003, seed=4))
    peaks[np.isnan(peaks)] = np.inf
    limit = scaling.limit_for(world, fmt)
    want_bytes = np.zeros(2 * peaks.size + 3, np.uint8)
    want = _numpy_engine.table_shifts(peaks, limit, want_bytes[1:-2])
    assert (want == scaling.shifts_for(peaks, world, fmt)).all()
    got_bytes = cupy.zeros(want_bytes.size, cupy.uint8)
    got = _cupy_engine.table_shifts(cupy.asarray(peaks), limit, got_bytes[1:-2])
    assert (cupy.asnumpy(got) == want).all() and (cupy.asnumpy(got_bytes) == want_bytes).all()


def test_non_contiguous_and_sums():
    x = inputs(4001).reshape(4001, 1)[::3]
    assert (cupy.asnumpy(hvd_aps.encode(cupy.asarray(inputs(4001).reshape(4001, 1))[::3], "e4m3")) ==
            cpu(hvd_aps.encode, x, "e4m3")).all()
    codes = np.random.default_rng(1).integers(0, 255, (4, 10_001)).astype(np.uint8)
    got = cupy.asnumpy(hvd_aps.decode_sum(cupy.asarray(codes), "e4m3", shift=2))
    want = cpu(hvd_aps.decode_sum, codes, "e4m3", shift=2)
    # Inf + -Inf: IEEE leaves the NaN's sign and payload to the hardware (x86 and CUDA differ)
    nan = np.isnan(want)
    assert nan.any() and (np.isnan(got) == nan).all()
    assert (got.view(np.uint32) == want.view(np.uint32))[~nan].all()


@pytest.mark.parametrize("name", ["e4m3", "e2m1fn", "e3m2fn"])
def test_float16_values_and_sums_into_out_match_the_cpu(name):
    """float16 values (fp16's codes, encoded from the float32 ones) and decode_sum adding to what
    `out` holds (a decode a rank) on the GPU give the CPU's bits."""
    fmt = hvd_aps.FloatFormat.parse(name)
    x = inputs(30_011)
    for shift in (0, 9):
        want = cpu(hvd_aps.quantize, x, fmt, shift=shift, unscale=False, dtype=np.float16)
        got = hvd_aps.quantize(cupy.asarray(x), fmt, shift=shift, unscale=False, dtype=np.float16)
        assert got.dtype == np.float16 and cupy.asnumpy(got).tobytes() == want.tobytes()
        codes = cpu(hvd_aps.encode, x, fmt)
        want = cpu(hvd_aps.decode, codes, fmt, shift=shift, dtype=np.float16)
        assert cupy.asnumpy(hvd_aps.decode(cupy.asarray(codes), fmt, shift=shift, dtype=np.float16)).tobytes() == \
            want.tobytes()
    rng = np.random.default_rng(6)  # finite sums: a NaN's sign from Inf + -Inf is the hardware's
    stacked = np.stack([cpu(hvd_aps.encode, rng.standard_normal(4001).astype(np.float32), fmt) for _ in range(3)])
    start = rng.standard_normal(stacked.shape[1]).astype(np.float32)
    want = cpu(hvd_aps.decode_sum, stacked, fmt, shift=3, out=start.copy())
    got = hvd_aps.decode_sum(cupy.asarray(stacked), fmt, shift=3, out=cupy.asarray(start))
    assert (cupy.asnumpy(got).view(np.uint32) == want.view(np.uint32)).all()


@pytest.mark.parametrize("name", ["e2m1fn", "e3m2fn", "e4m3", "e5m10", "e1m2fn"])
def test_pack_unpack_and_amax(name):
    fmt = hvd_aps.FloatFormat.parse(name)
    codes = np.random.default_rng(2).integers(0, 1 << fmt.bits, 10_007).astype(fmt.code_dtype)
    packed = hvd_aps.pack(cupy.asarray(codes), fmt)
    assert (cupy.asnumpy(packed) == cpu(hvd_aps.pack, codes, fmt)).all()
    assert (cupy.asnumpy(hvd_aps.unpack(packed, fmt, codes.size)) == codes).all()
    x = inputs(100_000)[6:]
    assert hvd_aps.amax(cupy.asarray(x)) == cpu(hvd_aps.amax, x)
    assert hvd_aps.amax(cupy.asarray(inputs(100))) == float("inf")


@pytest.mark.parametrize("name", ["e2m1fn", "e3m2fn", "e4m3", "e5m10"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_packed_row_stages_match_the_cpu(name, rounding):
    """encode_into (pieces at odd code positions), decode_sum_rows (rows lying apart) and
    decode_row on the GPU give the CPU engine's bytes and bits."""
    fmt, n, ranks = hvd_aps.FloatFormat.parse(name), 100_003, 3
    rng = np.random.default_rng(3)
    xs = [(rng.standard_normal(n) * rng.choice([0, 1e-3, 1, 3], n)).astype(np.float32) for _ in range(ranks)]
    size = hvd_aps.packed_size(n, fmt)
    rows = {"cpu": np.zeros((ranks, size + 5), np.uint8), "gpu": cupy.zeros((ranks, size + 5), cupy.uint8)}
    for r, x in enumerate(xs):
        for a, b in [(0, 5), (5, 50_001), (50_001, n)]:
            options = dict(seed=r, shift=4, index=a)
            cpu(hvd_aps.codec.encode_into, x[a:b], fmt, rows["cpu"][r, 2:2 + size], a, rounding, **options)
            hvd_aps.codec.encode_into(cupy.asarray(x[a:b]), fmt, rows["gpu"][r, 2:2 + size], a, rounding, **options)
    assert (cupy.asnumpy(rows["gpu"]) == rows["cpu"]).all()
    want, want_peak = cpu(hvd_aps.codec.decode_sum_rows, rows["cpu"][:, 2:2 + size], fmt, 7, n - 3, shift=4)
    got, peak = hvd_aps.codec.decode_sum_rows(rows["gpu"][:, 2:2 + size], fmt, 7, n - 3, shift=4)
    assert (cupy.asnumpy(got).view(np.uint32) == want.view(np.uint32)).all() and peak == want_peak
    want = cpu(hvd_aps.codec.decode_row, rows["cpu"][1, 2:2 + size], fmt, 7, n - 3, shift=4, divisor=3)
    got = hvd_aps.codec.decode_row(rows["gpu"][1, 2:2 + size], fmt, 7, n - 3, shift=4, divisor=3)
    assert (cupy.asnumpy(got).view(np.uint32) == want.view(np.uint32)).all()


@pytest.mark.parametrize("name", ["e2m1fn", "e4m3", "e5m10"])
def test_blocked_runs_match_the_cpu(name):
    """encode_into and decode_row with one exponent per block, decode_sum_rows' per-block maxima
    and amax_blocks: the CuPy kernels against the CPU engine."""
    fmt, n, block = hvd_aps.FloatFormat.parse(name), 50_003, 2048
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(n) * rng.choice([0, 1e-3, 1, 3], n)).astype(np.float32)
    shifts = rng.integers(-3, 6, -(-n // block))
    size = hvd_aps.packed_size(n + 3, fmt)
    rows = {"cpu": np.zeros((2, size), np.uint8), "gpu": cupy.zeros((2, size), cupy.uint8)}
    for r in range(2):
        cpu(hvd_aps.codec.encode_into, x, fmt, rows["cpu"][r], 3, shift=shifts, block=block)
        hvd_aps.codec.encode_into(cupy.asarray(x), fmt, rows["gpu"][r], 3, shift=shifts, block=block)
    assert (cupy.asnumpy(rows["gpu"]) == rows["cpu"]).all()
    want, want_peaks = cpu(hvd_aps.codec.decode_sum_rows, rows["cpu"], fmt, 3, n + 3, shift=1, block=block)
    got, peaks = hvd_aps.codec.decode_sum_rows(rows["gpu"], fmt, 3, n + 3, shift=1, block=block)
    assert (cupy.asnumpy(got).view(np.uint32) == want.view(np.uint32)).all() and (peaks == want_peaks).all()
    want = cpu(hvd_aps.codec.decode_row, rows["cpu"][0], fmt, 3, n + 3, shift=shifts, block=block, divisor=3)
    got = hvd_aps.codec.decode_row(rows["gpu"][0], fmt, 3, n + 3, shift=shifts, block=block, divisor=3)
    assert (cupy.asnumpy(got).view(np.uint32) == want.view(np.uint32)).all()
    assert (hvd_aps.codec.amax_blocks(cupy.asarray(x), block) == cpu(hvd_aps.codec.amax_blocks, x, block)).all()


def test_torch_inputs_stay_on_the_device():
    torch = pytest.importorskip("torch")
    x = inputs(10_000)
    got = hvd_aps.encode(torch.from_numpy(x).cuda(), "e4m3")
    assert isinstance(got, cupy.ndarray) and (cupy.asnumpy(got) == cpu(hvd_aps.encode, x, "e4m3")).all()


def test_tensorflow_inputs_stay_on_the_device():
    tf = pytest.importorskip("tensorflow")
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees no GPU (a CPU build of TensorFlow, or CUDA libraries it cannot load)")
    x = inputs(10_000)
    with tf.device("GPU:0"):
        t = tf.constant(x)
    got = hvd_aps.encode(t, "e4m3")
    assert isinstance(got, cupy.ndarray) and (cupy.asnumpy(got) == cpu(hvd_aps.encode, x, "e4m3")).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1fn"])
def test_codes_exchange_on_the_gpu_equals_the_cpu(fmt):
    """The results, the bytes sent and every tensor's stats (sampled on the device, measured on
    the host) as the CPU's."""
    grads = rank_grads(3, [1000, 24, 9001])
    compressors = {"cpu": same_format(fmt, 3), "gpu": same_format(fmt, 3)}
    on_cpu, sent_cpu = simulate(grads, compressors["cpu"])
    on_gpu, sent_gpu = simulate([[cupy.asarray(g) for g in r] for r in grads], compressors["gpu"])
    assert sent_cpu == sent_gpu
    assert [c.stats_table() for c in compressors["cpu"]] == [c.stats_table() for c in compressors["gpu"]]
    for cpu_rank, gpu_rank in zip(on_cpu, on_gpu):
        for c, g in zip(cpu_rank, gpu_rank):
            assert isinstance(g, cupy.ndarray) and cupy.asnumpy(g).tobytes() == c.tobytes()


def test_ddp_hook_over_nccl_on_one_gpu(tmp_path):
    """One rank: NCCL's all_reduce, all_to_all_single and all_gather on CUDA tensors, the CuPy
    stages, and the bucket written back on the device."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_aps.ddp
    import model as numpy_model

    from workers.torch_models import Given
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        grads = rank_grads(1, [5000, 300])[0]
        model = DDP(Given([g.size for g in grads]).cuda(), device_ids=[0])
        model.register_comm_hook(hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e4m3")), hvd_aps.ddp.aps_hook)
        model([torch.from_numpy(g).cuda() for g in grads]).backward()
        want = numpy_model.flat([grads[::-1]], "e4m3")[::-1]  # one bucket, parameters in reverse order
        for p, w in zip(model.module.ps, want):
            assert p.grad.is_cuda and p.grad.cpu().numpy().tobytes() == w.tobytes()
    finally:
        dist.destroy_process_group()


def test_ddp_hook_over_gloo_with_two_ranks_on_one_gpu(tmp_path):
    """Two torchrun ranks share the one GPU over Gloo (NCCL takes one rank a device): the hook's
    CuPy stages on CUDA tensors and Gloo's all_reduce, all_to_all_single and all_gather on them;
    several buckets, DDP's rebuilt buckets, a bucket view, a process group, chunks, float16 and
    bfloat16 models, bit for bit as the NumPy model on every rank, the gradients left on the GPU."""
    pytest.importorskip("torch")
    ranks = launch_ddp_checks(tmp_path, 2, HVD_APS_CHECK_DEVICE="cuda")
    for key, steps in [("plain", 2), ("view", 1), ("group", 1), ("chunked", 1)]:
        assert_bit_exact(ranks, key, steps)
        assert all(bool(r[f"{key}_0_dtype_ok"]) for r in ranks)
    for dtype in ("float16", "bfloat16"):
        assert_low_precision(ranks, dtype)


def test_calibration_times_the_gpu_engine_on_mirrored_ranks():
    """`calibrate --device cuda`: the mirrored ranks take CuPy messages, rank 0's share of the
    results holds the CPU's bits, and the fitted codec is a device one."""
    from hvd_aps import _layout, calibration, exchange
    from hvd_aps._stages import Bucket
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(5000).astype(np.float32), rng.standard_normal(700).astype(np.float32) * 1e-3]
    bucket = Bucket.whole("mirrored", ["a", "b"], ["a", "b"], [g.size for g in grads])

    def rank0(flat):
        comp = hvd_aps.APSCompressor("e4m3", chunk_bytes=0)
        got = exchange.run(comp.exchanger.stages(4, 0), bucket, flat, exchange.Levels.flat(calibration.Mirror(4)),
                           average=True)
        return cupy.asnumpy(got)

    share = int(_layout.Layout(bucket.segments, 4).shards[1])
    want, got = cpu(rank0, np.concatenate(grads)), rank0(cupy.asarray(np.concatenate(grads)))
    assert (got[:share].view(np.uint32) == want[:share].view(np.uint32)).all()
    saved = calibration.calibrate(["e4m3"], 8, ((1 << 14, 1), (1 << 20, 1), (1 << 20, 8)), repeats=1, device="cuda")
    assert saved["engine"] == "cupy" and saved["device"] != "cpu" and saved["codecs"]["e4m3"]["device"]


@pytest.mark.parametrize("name", ["e2m1fn", "e4m3", "e3m2", "e5m10"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_table_stages_match_the_host_engine(name, rounding):
    """The CuPy engine's table functions (one launch a stage, neighbouring blocks sharing the
    bytes of a packed stream) give the host engine's bytes and bits on a real layout's tables."""
    from hvd_aps import _cupy_engine, _host_engine
    fmt = hvd_aps.FloatFormat.parse(name)
    held, chunks = plan(fmt)
    x = data(held.blocks.elements)
    rng = np.random.default_rng(5)
    for chunk in chunks:
        lane = chunk.lanes[0]
        shifts = rng.integers(-3, 8, lane.send.count).astype(np.int32)
        seeds = rng.integers(0, 2 ** 63, lane.send.count).astype(np.uint64)
        stale = rng.integers(0, 256, chunk.send_bytes).astype(np.uint8)
        stale[chunk.clear_send] = 0
        want, got = stale.copy(), cupy.asarray(stale)
        want_res, got_res = np.zeros_like(x), cupy.zeros(x.size, cupy.float32)
        _host_engine.table_encode(x, fmt, lane.send, shifts, rounding, seeds, False, want, want_res)
        _cupy_engine.table_encode(cupy.asarray(x), fmt, lane.send, shifts, rounding, seeds, False, got, got_res)
        assert (cupy.asnumpy(got) == want).all() and (cupy.asnumpy(got_res).view(np.uint32) == want_res.view(np.uint32)).all()
        first, step = rng.integers(0, 4, lane.send.count), rng.integers(1, 5, lane.send.count)
        limits = np.ldexp(np.float64(fmt.max), -shifts.astype(np.int64)).astype(np.float32)
        host = _host_engine.table_stats(x, want, fmt, lane.send, shifts, first, step, limits)
        device = cupy.asnumpy(_cupy_engine.table_stats(cupy.asarray(x), got, fmt, lane.send, shifts, first, step, limits))
        assert (device[:, :4] == host[:, :4]).all() and np.allclose(device[:, 4:], host[:, 4:], rtol=1e-12)
        rows = rng.integers(0, 256, (3, chunk.row_bytes)).astype(np.uint8)
        dec = rng.integers(-4, 6, lane.reduce.count).astype(np.int32)
        want_sum, got_sum = np.zeros(lane.range[1] - lane.range[0], np.float32), cupy.zeros(lane.range[1] - lane.range[0], cupy.float32)
        want_peaks = _host_engine.table_sum(rows, fmt, lane.reduce, dec, want_sum)
        got_peaks = _cupy_engine.table_sum(cupy.asarray(rows), fmt, lane.reduce, dec, got_sum)
        assert same(cupy.asnumpy(got_sum), want_sum, nan=True)  # random codes: NaNs meet in the sums
        assert got_peaks.tobytes() == want_peaks.tobytes()
        gathered = rng.integers(0, 256, sum(chunk.owner_bytes)).astype(np.uint8)
        exps = rng.integers(-6, 6, lane.finish.count).astype(np.int32)
        want_out, got_out = np.zeros_like(x), cupy.zeros(x.size, cupy.float32)
        _host_engine.table_decode(gathered, fmt, lane.finish, exps, want_out, np.float32(3))
        _cupy_engine.table_decode(cupy.asarray(gathered), fmt, lane.finish, exps, got_out, np.float32(3))
        assert (cupy.asnumpy(got_out).view(np.uint32) == want_out.view(np.uint32)).all()
    peaks = _cupy_engine.table_amax(cupy.asarray(x), held.blocks)
    assert peaks.tobytes() == _host_engine.table_amax(x, held.blocks).tobytes()


@pytest.mark.parametrize("name", ["e4m3", "e2m1fn", "e5m10"])
def test_stats_sums_are_the_emulations_bit_for_bit(name):
    """Where the CPU emulation of the kernels (tests/simt) cannot speak for a device: the stats'
    float64 sums (products that meet an add, __dmul_rn so that nvcc fuses none) on this GPU are
    the emulation's bit for bit, and NumPy's in the kernel's order."""
    from hvd_aps import _cupy_engine, _host_engine
    fmt, rng = hvd_aps.FloatFormat.parse(name), np.random.default_rng(8)
    table = Table.of(20_000, fmt, rng)
    x = (rng.standard_normal(20_000) * np.exp2(rng.uniform(-30, 10, 20_000))).astype(np.float32)
    shifts = rng.integers(-3, 8, table.blocks.count).astype(np.int32)
    message = np.zeros(table.size, np.uint8)
    _host_engine.table_encode(x, fmt, table.blocks, shifts, "nearest", None, False, message)
    first, step = rng.integers(0, 4, table.blocks.count), rng.integers(1, 5, table.blocks.count)
    limits = np.ldexp(np.float64(fmt.max), -shifts.astype(np.int64)).astype(np.float32)
    got = cupy.asnumpy(_cupy_engine.table_stats(cupy.asarray(x), cupy.asarray(message), fmt, table.blocks, shifts,
                                                first, step, limits))
    with device() as emulated:
        import counting_cupy
        want = counting_cupy.peek(emulated.table_stats(counting_cupy.cupy.asarray(x), counting_cupy.cupy.asarray(message),
                                                       fmt, table.blocks, shifts, first, step, limits))
    sent = np.zeros(x.size, np.float32)
    _host_engine.table_decode(message, fmt, table.blocks, shifts, sent)
    assert got.tobytes() == want.tobytes() == tree_sums(x, sent, table.blocks, first, step, limits).tobytes()
