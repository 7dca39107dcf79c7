"""hvd_aps.perf_layouts: the pipeline, tensor-parallel and DiLoCo step models against their
arithmetic counted by hand, their bytes against the messages hvd_aps sends, and plan's rows."""
import dataclasses

import pytest

import hvd_aps
from hvd_aps import calibration, perf
from hvd_aps.diloco import Schedule
from hvd_aps.perf_layouts import (Collective, Pipeline, TensorParallel, diloco_step, exchange_bytes, pipeline_step,
                                  tensor_parallel_step)

CODEC = perf.Codec(1e-3, 2e-9)
FP32, HALF, CODES = perf.Path("float32", 32), perf.Path("16-bit", 16), perf.Path("codes e4m3", 8, CODEC)
FAST = perf.Link(1e15, 0.0)  # a link that costs nothing


def test_a_pipeline_takes_its_bubble_and_a_round_trip_over_the_stages_a_slot():
    """1F1B over M micro-batches of S stages: (M + S - 1) micro-batch times where the link costs
    nothing; each slot adds the round trip's hops (two a boundary) over the S micro-batches 1F1B
    keeps in flight; one micro-batch is one round trip."""
    p = Pipeline(stages=4, microbatches=8, activations=1 << 20, compute=0.8)
    step, sent = pipeline_step(p, FP32, perf.Cluster(4, FAST))
    assert step == pytest.approx((8 + 4 - 1) * 0.8 / 8)
    assert sent == 8 * 4 * (1 << 20)  # a boundary's messages each way
    for bandwidth in (1e9, 1e8, 1e7):
        hop = 1e-4 + 4 * (1 << 20) / bandwidth
        step, _ = pipeline_step(p, FP32, perf.Cluster(4, perf.Link(bandwidth, 1e-4)))
        assert step == pytest.approx(11 * (0.1 + 2 * 3 / 4 * hop))
    one = Pipeline(stages=3, microbatches=1, activations=1000, compute=0.3)
    c = perf.Cluster(3, perf.Link(1e6, 1e-3))
    assert pipeline_step(one, FP32, c)[0] == pytest.approx(3 * 0.3 + 2 * 2 * (1e-3 + 4000 / 1e6))


def test_a_pipelines_codes_cost_their_passes_and_send_block_codes_bytes():
    """An end stage encodes and decodes once a micro-batch each, a middle stage both ways."""
    p = Pipeline(stages=2, microbatches=4, activations=131072, compute=0.4)
    step, sent = pipeline_step(p, CODES, perf.Cluster(2, FAST))
    passes = 2 / (3 + 1 / 2) * CODEC.time(131072)
    assert step == pytest.approx((4 + 2 - 1) * (0.1 + passes))
    middle = dataclasses.replace(p, stages=3)
    assert pipeline_step(middle, CODES, perf.Cluster(3, FAST))[0] == pytest.approx(
        (4 + 3 - 1) * (0.1 + 4 / (3 + 1 / 3) * CODEC.time(131072)))
    message = hvd_aps.BlockCodes("e4m3").message_bytes(131072)
    assert sent == pytest.approx(4 * message, rel=1e-3)
    assert pipeline_step(p, HALF, perf.Cluster(2, FAST))[1] == 4 * 2 * 131072
    with pytest.raises(ValueError, match="one a host"):
        pipeline_step(p, FP32, perf.Cluster(3, FAST))
    with pytest.raises(ValueError, match="2 or more stages"):
        Pipeline(stages=1, microbatches=4, activations=1, compute=0.1)


def test_sequence_parallel_blocks_run_six_gathers_and_six_scatters_each():
    """q, k, v and up gather forward and reduce-scatter backward, out and down the other way:
    on Gloo a reduce-scatter moves an allreduce's bytes, 2(N-1)/N of the tensor, a gather (N-1)/N."""
    a, blocks = 1 << 18, 3
    t = TensorParallel.sequence_parallel(blocks, a, compute=0.5)
    assert sorted(k.value for k, _ in t.collectives) == sorted(["all-gather"] * 18 + ["reduce-scatter"] * 18)
    c = perf.Cluster(2, perf.Link(1e9, 1e-4))
    step, sent = tensor_parallel_step(t, FP32, c)
    assert sent == pytest.approx(blocks * (6 * 0.5 + 6 * 1.0) * 4 * a)
    gather, scatter = perf.allgather(4 * a / 2, c), perf.allreduce(4 * a, c)
    assert step == pytest.approx(0.5 + blocks * 6 * (gather + scatter))
    nccl_step, nccl_sent = tensor_parallel_step(t, FP32, c, gloo=False)
    assert nccl_sent == pytest.approx(blocks * 12 * 0.5 * 4 * a) and nccl_step < step
    charged = dataclasses.replace(t, per_collective=1e-3, float32=((Collective.ALL_GATHER, a),))
    step_charged, sent_charged = tensor_parallel_step(charged, FP32, c)
    assert step_charged == pytest.approx(step + 37e-3 + gather) and sent_charged == pytest.approx(sent + 2 * a)


def test_tensor_parallel_codes_send_their_codes_once_a_gather_or_scatter_and_pay_their_passes():
    a = 1 << 18
    t = TensorParallel(((Collective.ALL_GATHER, a), (Collective.REDUCE_SCATTER, a), (Collective.ALL_REDUCE, a)), 0.0)
    codes = perf.codes_bytes(a, 8)
    codec = (perf.gather_codec_share(2) + perf.SCATTER_CODEC_SHARE + 1) * CODEC.time(a)
    step, sent = tensor_parallel_step(t, CODES, perf.Cluster(2, FAST))
    assert sent == pytest.approx(0.5 * codes + 0.5 * codes + 1.0 * codes)
    assert step == pytest.approx(codec)
    c = perf.Cluster(2, perf.Link(1e8, 1e-4))
    wire = (perf.allgather(codes / 2, c) + perf.metadata_allreduce(c) + perf.alltoall(codes, c)
            + perf.metadata_allreduce(c) + perf.alltoall(codes, c) + perf.allgather(codes / 2, c))
    assert tensor_parallel_step(t, CODES, c)[0] == pytest.approx(codec + wire)
    with pytest.raises(ValueError, match="1 or more blocks"):
        TensorParallel.sequence_parallel(0, a, 0.1)
    with pytest.raises(ValueError, match="collectives of 1 or more values"):
        TensorParallel((), 0.1)


def test_diloco_amortizes_its_exchange_and_a_delay_hides_it():
    w = perf.Workload(10_000_000, 0.1, shared_processor=False)
    c = perf.Cluster(2, perf.Link(1.25e7, 1e-4))
    exchange = perf.exchange_time(10_000_000, CODES, c)
    step, sent = diloco_step(w, Schedule(50), CODES, c)
    assert step == pytest.approx(0.1 + exchange / 50)
    assert sent == pytest.approx(exchange_bytes(10_000_000, CODES, 2) / 50)
    assert exchange_bytes(10_000_000, FP32, 2) == 40_000_000  # the ring's 2(N-1)/N of float32
    fragment = perf.exchange_time(2_000_000, CODES, c)  # past one inner step, within two
    assert 0.1 < fragment < 0.2
    partly, _ = diloco_step(w, Schedule(50, fragments=5, delay=1), CODES, c)
    assert partly == pytest.approx(0.1 + 5 * (fragment - 0.1) / 50)
    hidden, _ = diloco_step(w, Schedule(50, fragments=5, delay=2), CODES, c)
    assert hidden == pytest.approx(0.1)
    shared = dataclasses.replace(w, shared_processor=True)
    busy = c.contention * perf.busy_time(2_000_000, 1, CODES, c)
    assert diloco_step(shared, Schedule(50, fragments=5, delay=2), CODES, c)[0] == pytest.approx(0.1 + 5 * busy / 50)
    with pytest.raises(ValueError, match="one fragment's exchange at a time"):
        Schedule(50, fragments=5, delay=10)  # the model plans what DiLoCo runs


def test_plan_prints_the_layouts_rows_and_refuses_what_they_cannot_plan(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    calibration.save({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(CODEC)}}, cal)
    from hvd_aps.__main__ import main
    common = ["--links", "100mbit", "--format", "e4m3", "--calibration", str(cal)]
    main(["plan", "--pipeline", "--hosts", "2", "--microbatches", "4", "--activations", "131072", "--compute-ms", "400",
          *common])
    printed = capsys.readouterr().out
    step, _ = pipeline_step(Pipeline(2, 4, 131072, 0.4), CODES, perf.Cluster(2, perf.Link.parse("100mbit")))
    assert f"codes e4m3  {step * 1e3:.1f}" in printed and "1F1B over 4 micro-batches" in printed
    main(["plan", "--tensor", "--hosts", "2", "--blocks", "2", "--activations", "256K", "--compute-ms", "300", *common])
    printed = capsys.readouterr().out
    step, sent = tensor_parallel_step(TensorParallel.sequence_parallel(2, 256_000, 0.3), CODES,
                                      perf.Cluster(2, perf.Link.parse("100mbit")))
    assert f"codes e4m3  {step * 1e3:.1f}" in printed and f"{sent / 1e6:.3f}" in printed
    main(["plan", "--diloco", "100", "--params", "5M", "--compute-ms", "50", "--hosts", "2", *common])
    printed = capsys.readouterr().out
    assert "data parallel codes e4m3" in printed and "DiLoCo codes e4m3" in printed
    assert "fastest DiLoCo" in printed
    for wrong, said in (
            (["--pipeline", "--hosts", "2", "--ranks-per-host", "2", "--activations", "1K", "--compute-ms", "1"],
             "one stage a host"),
            (["--pipeline", "--hosts", "2", "--compute-ms", "1"], "needs --activations"),
            (["--tensor", "--hosts", "1", "--activations", "1K", "--compute-ms", "1"], "2 or more ranks"),
            (["--tensor", "--diloco", "4", "--activations", "1K", "--params", "1M", "--compute-ms", "1"],
             "one layout at a time"),
            (["--diloco", "4", "--params", "1M", "--compute-ms", "1", "--pin", str(tmp_path / "pin")], "--pin"),
            (["--diloco", "0", "--params", "1M", "--compute-ms", "1"], "sync_every"),
            (["--diloco", "20", "--fragments", "3", "--params", "1M", "--compute-ms", "1"], "multiple of fragments")):
        with pytest.raises(SystemExit):
            main(["plan", *wrong, *common])
        assert said in capsys.readouterr().err, wrong
