"""The performance model (hvd_aps.perf) against its alpha-beta terms worked out by hand, and the
calibration's stand-in ranks (hvd_aps.calibration.Mirror) against the emulated exchange of real
workers, bit for bit."""
import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest

import hvd_aps
from hvd_aps import calibration, emulate, exchange, perf
from hvd_aps import _layout
from hvd_aps._stages import Bucket

from horovod_run import bounded, free_port

ALPHA, BW = 1e-4, 1e8
SLOW = perf.Link(BW, ALPHA)
FREE = perf.Codec(0.0, 0.0)
CLI_S = 120  # a plan or calibrate run of the CLI
JOB_S = 600  # a calibrate --links --entry-points job of 2 ranks


def test_link_rates_parse_as_tc_and_nics_name_them():
    assert perf.Link.parse("1gbit").bandwidth == 125e6
    assert perf.Link.parse("10Gbit/s").bandwidth == 1.25e9
    assert perf.Link.parse("400Gbit").bandwidth == 50e9
    assert perf.Link.parse("12.5GB/s").bandwidth == 12.5e9
    for bad in ("fast", "10gbps", "10g"):  # bps is bytes to tc and bits to a data sheet
        with pytest.raises(ValueError, match="link rate"):
            perf.Link.parse(bad)


def test_collectives_are_alpha_beta_with_a_host_link_shared_by_its_ranks():
    two = perf.Cluster(2, SLOW)
    assert perf.allreduce(1e6, two) == pytest.approx(2 * ALPHA + 1e6 / BW)
    four = perf.Cluster(4, SLOW)
    assert perf.allreduce(1e6, four) == pytest.approx(6 * ALPHA + 1.5e6 / BW)
    # 2 hosts x 2 ranks: each host sends 2 ranks x half of each message across
    assert perf.alltoall(1e6, perf.Cluster(2, SLOW, 2)) == pytest.approx(3 * ALPHA + 1e6 / BW)
    assert perf.allgather(1e6, two) == perf.alltoall(2e6, two)
    assert perf.allreduce(1e6, perf.Cluster(1, SLOW)) == 0.0
    # NCCL's tree: 2 log2 N latency steps where that beats the ring's 2 (N - 1), same bytes
    big = perf.Cluster(128, SLOW, 8, tree=True)
    assert perf.allreduce(1e6, big) == pytest.approx(20 * ALPHA + 2 * 1023 / 1024 * 1e6 / BW)
    assert perf.allreduce(1e6, perf.Cluster(2, SLOW, tree=True)) == perf.allreduce(1e6, two)


def test_codes_exchange_is_metadata_alltoall_and_allgather():
    n = 1 << 20
    codes = n * (1 + 2 / 2048)  # 8-bit codes and the sums' block exponents
    e4m3 = perf.Path("e4m3", 8, FREE)
    assert perf.exchange_time(n, e4m3, perf.Cluster(2, SLOW)) == pytest.approx(4 * ALPHA + codes / BW)
    codec = perf.Codec(1e-3, 1e-9, 1e-4)
    slow = perf.Path("e4m3", 8, codec)
    # unchunked: codec and wire add up (the wire is shorter than any chunking would hide)
    assert perf.exchange_time(1000, slow, perf.Cluster(2, SLOW), tensors=3) == pytest.approx(
        1e-3 + 3e-4 + 1e-6 + 4 * ALPHA + 1000 * (1 + 2 / 2048) / BW)


def test_chunks_overlap_codec_and_wire_only_where_pipelined(tmp_path, capsys):
    """A bucket of 64 MiB float32 on 1 Gbit/s: pipelined (torch.distributed's collectives) the
    best chunking hides most of the shorter of codec and wire; not pipelined (Horovod's) they
    add up, whatever the chunking, with each collective's own cost; plan --entry-point horovod
    prints the steps of the latter."""
    n, c, codec = 1 << 24, perf.Cluster(2, perf.Link.parse("1gbit")), perf.Codec(1e-4, 5e-9)
    wire = perf.wire_time(n, perf.Path("e4m3", 8, codec), c)
    serial = perf.exchange_time(n, perf.Path("e4m3", 8, codec, pipelined=False), c)
    assert serial == pytest.approx(codec.time(n) + wire)
    overlapped = perf.exchange_time(n, perf.Path("e4m3", 8, codec), c)
    assert max(wire, codec.time(n)) < overlapped < serial - 0.5 * min(wire, codec.time(n))
    # each collective's own cost (Horovod's negotiation): three an unchunked exchange, two more a chunk
    horovod = perf.Path("e4m3", 8, codec, pipelined=False, collective=2e-3)
    assert perf.exchange_time(n, horovod, c) == pytest.approx(serial + 3 * 2e-3)
    # pipelined over a link that costs nothing, in 16 chunks of 4 MiB: the codec, 15 more exchange
    # costs, and a 16th of the 33 collectives' cost (1 MiB chunks: 63 more exchange costs, slower)
    free_link = perf.Cluster(2, perf.Link(1e18, 0.0))
    assert perf.exchange_time(n, dataclasses.replace(horovod, pipelined=True), free_link) == pytest.approx(
        codec.time(n) + 15 * 1e-4 + 33 * 2e-3 / 16)
    cal = tmp_path / "cal.json"
    calibration.save({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(codec)}}, cal)
    from hvd_aps.__main__ import main
    for entry, pipelined, collective in ((perf.EntryPoint.DDP, True, 0.0),
                                         (perf.EntryPoint.HOROVOD, False, perf.HOROVOD_COLLECTIVE_S)):
        extra = ["--entry-point", entry.value]
        main(["plan", "--params", str(n), "--tensors", "1", "--compute-ms", "50", "--links", "1gbit",
              "--format", "e4m3", "--calibration", str(cal)] + extra)
        # in the entry point's buckets: DDP's, or APSCompressor's 16 MiB through Horovod
        work = perf.Workload(n, 0.05, buckets=perf.entry_buckets(n, entry), tensors=1, shared_processor=True)
        step = perf.step_time(work, perf.Path("codes e4m3", 8, codec, pipelined=pipelined, collective=collective), c)
        assert capsys.readouterr().out.split("\ncodes e4m3 ")[1].split()[0] == f"{step * 1e3:.1f}", extra


def test_two_levels_send_a_slice_of_codes_between_hosts():
    n, inside = 1 << 20, perf.Link(1e10, 1e-6)
    c = perf.Cluster(2, SLOW, 2, inside)
    host = 2 * (1e-6 + 0.5 * 4 * n / 1e10)          # float32 scatter and gather inside the host
    cross = 2 * (ALPHA + 0.5 * n * (1 + 2 / 2048) / BW)  # both local ranks' slices share the link
    assert perf.exchange_time(n, perf.Path("e4m3", 8, FREE), c) == pytest.approx(host + 6 * ALPHA + cross)


def test_host_level_through_memory_and_a_16_bit_sum_take_the_processor():
    """On the CPU two levels copy float32 through host memory (HOST_COPIES per element of the
    bucket, plus the own slice's result) and a framework's 16-bit allreduce sums on the
    processor ((N-1)/N of the bucket): both scale with the ranks sharing it, both come out of the
    backward where it computes, and neither counts where the model says it does not apply."""
    n, inside, copy = 1 << 20, perf.Link(1e10, 1e-6), 1e-9
    memory = perf.Cluster(2, SLOW, 2, inside, sharing=4, copy=copy)
    passes = (3 + 1 / 2) * n * copy * 4  # write the box, sum from the boxes, read the results
    cross = 2 * (ALPHA + 0.5 * n * (1 + 2 / 2048) / BW)
    e4m3 = perf.Path("e4m3", 8, FREE)
    assert perf.exchange_time(n, e4m3, memory) == pytest.approx(2 * 1e-6 + passes + 6 * ALPHA + cross)
    assert perf.processor_time(n, e4m3, dataclasses.replace(memory, ranks_per_host=1)) == 0.0  # flat: no host level
    # an earlier tree's host level, of 6 passes: what the check counts for the rows it recorded
    assert perf.processor_time(n, e4m3, dataclasses.replace(memory, host_copies=6)) == pytest.approx(
        (6 + 1 / 2) * n * copy * 4)
    half = perf.Path("fp16", 16, processor=3e-9)
    four = perf.Cluster(4, SLOW, sharing=2)
    summed = 3e-9 * 0.75 * n * 2
    # Gloo's ring sums its reduce-scatter half's segments (2 MiB of float16: 8, two a rank) while
    # the next travel: the slower of sums and that half shows, an eighth of the other, then the allgather half
    wire = perf.allreduce(2 * n, four)
    assert summed < wire / 2
    assert perf.exchange_time(n, half, four) == pytest.approx(wire + summed / 8)
    fast = perf.Cluster(4, perf.Link(1e30, 0.0), sharing=2)
    assert perf.exchange_time(n, half, fast) == pytest.approx(summed)
    assert perf.exchange_time(n, dataclasses.replace(half, processor=0.0), four) == pytest.approx(wire)
    shared = perf.Workload(2 * n, compute=1.0, backward=1.0, buckets=[n, n])
    assert perf.step_time(shared, half, fast) == pytest.approx(1.0 + 2 * summed)
    assert perf.step_time(dataclasses.replace(shared, shared_processor=False), half, fast) == pytest.approx(1.0 + summed)
    assert perf.breakdown(shared, half, fast)[1] == pytest.approx(2 * summed)
    # a codes path's cost in the job: per element its codec handles (a rank's slice on two levels)
    in_job = perf.Path("e4m3", 8, FREE, processor=2e-9)
    assert perf.processor_time(n, in_job, memory) == pytest.approx(passes + 2e-9 * n / 2 * 4)
    assert perf.processor_time(n, in_job, four) == pytest.approx(2e-9 * n * 2)
    for bad in ({"copy": -1.0}, {"host_copies": -1}, {"contention": -0.5}, {"wire_contention": -0.1}):
        with pytest.raises(ValueError, match="copy, host_copies and contentions >= 0"):
            perf.Cluster(2, SLOW, 2, **bad)


def test_link_fit_recovers_the_alpha_and_beta_the_allreduce_times_came_from():
    shape = perf.Cluster(2, perf.Link(1.0), 2)
    truth = perf.Link(3e8, 7e-5)
    rows = [(n, perf.allreduce(4 * n, dataclasses.replace(shape, between=truth))) for n in calibration.LINK_ELEMENTS]
    link = calibration.fit_link(rows, shape)
    assert link.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    assert link.latency == pytest.approx(truth.latency, rel=1e-6)
    with pytest.raises(ValueError, match="do not grow"):
        calibration.fit_link([(1 << 6, 2e-3), (1 << 20, 1e-3)], shape)


def test_step_overlaps_exchanges_with_backward_and_adds_a_shared_codec():
    n = 1 << 20
    fp32 = perf.Path("float32", 32)
    wire = perf.allreduce(4 * n, perf.Cluster(2, SLOW))
    long_backward = perf.Workload(n, compute=3 * wire, buckets=[n])
    assert perf.step_time(long_backward, fp32, perf.Cluster(2, SLOW)) == pytest.approx(3 * wire + wire)
    two = perf.Workload(2 * n, compute=0.3, backward=1.0, buckets=[n, n])  # ready at 0.15 and 0.3
    first = perf.exchange_time(n, fp32, perf.Cluster(2, SLOW))
    assert perf.step_time(two, fp32, perf.Cluster(2, SLOW)) == pytest.approx(max(0.15 + first, 0.3) + first)
    # a wire that costs nothing: the first bucket's codec (ready halfway) delays backward only
    # where they share the processor; the last one's delays the step either way
    fast, codes = perf.Cluster(2, perf.Link(1e30, 0.0)), perf.Path("e4m3", 8, perf.Codec(0.01, 0.0))
    shared = perf.Workload(2 * n, compute=1.0, backward=1.0, buckets=[n, n])
    apart = dataclasses.replace(shared, shared_processor=False)
    assert perf.step_time(shared, codes, fast) == pytest.approx(1.02)
    assert perf.step_time(apart, codes, fast) == pytest.approx(1.01)
    # a GPU's codec: its passes take the device from backward (the gradients after them come that much
    # later), its driver's cost per exchange does not
    gpu = perf.Path("e4m3", 8, perf.Codec(0.01, 1e-9, device=True))
    assert perf.step_time(shared, gpu, fast) == pytest.approx(1.0 + n * 1e-9 + 0.01 + n * 1e-9)
    host = dataclasses.replace(gpu, codec=perf.Codec(0.01, 1e-9))
    assert perf.step_time(shared, host, fast) - perf.step_time(shared, gpu, fast) == pytest.approx(0.01)


def test_a_measured_timeline_decides_when_each_bucket_can_start():
    n = 1 << 20
    c, fp32 = perf.Cluster(2, SLOW), perf.Path("float32", 32)
    one, two = perf.exchange_time(n, fp32, c), perf.exchange_time(2 * n, fp32, c)  # about 42 and 84 ms
    # three gradients, the first two ready early in a 0.1 s backward (a CNN's last layers), the third at its end
    timeline = [(n, 0.1), (n, 0.2), (n, 1.0)]
    w = perf.Workload(3 * n, compute=0.1, backward=1.0, buckets=[2 * n, n], timeline=timeline)
    assert w.ready(n) == 0.1 and w.ready(n + 1) == 0.2 and w.ready(3 * n) == 1.0
    # the first bucket is ready when its last gradient is (0.02 s), not at two thirds of the backward
    assert perf.step_time(w, fp32, c) == pytest.approx(max(0.02 + two, 0.1) + one)
    proportional = dataclasses.replace(w, timeline=None)
    assert perf.step_time(proportional, fp32, c) == pytest.approx(max(0.1 * 2 / 3 + two, 0.1) + one)
    for wrong in ([(n, 0.5), (n, 0.2)], [(n, 0.5), (n - 1, 1.0)], [(n, 0.5), (n, 1.5)]):
        with pytest.raises(ValueError, match="timeline"):
            perf.Workload(2 * n, 0.1, timeline=wrong)


def test_horovod_fuses_the_gradients_ready_when_its_allreduce_before_ends():
    """Horovod's own allreduce (tensor fusion): each allreduce takes every gradient ready when
    the one before ended, up to the fusion threshold, so it runs during the backward; DDP's
    buckets, fixed in advance, wait for their last gradient."""
    n, second = 1 << 20, perf.Link(4 * (1 << 20) / 0.3, 0.01)  # 0.3 s a gradient's bytes, 10 ms a message step
    one = perf.allreduce(4 * n, perf.Cluster(2, second))
    assert one == pytest.approx(0.32)
    c = perf.Cluster(2, second)
    w = perf.Workload(4 * n, compute=1.0, backward=1.0, buckets=[4 * n], timeline=[(n, 0.1), (n, 0.2), (n, 0.3),
                                                                                   (n, 1.0)], shared_processor=False)
    fused = perf.entry_path(perf.FLOAT32_PATH, 32, entry=perf.EntryPoint.HOROVOD)
    assert fused.fusion_bytes == perf.HOROVOD_FUSION_BYTES and fused.collective == 0.0
    # the first alone (0.1-0.42), the next two fused (to 1.04), the last once it is ready and the wire free
    assert perf.step_time(w, fused, c) == pytest.approx(0.42 + 0.62 + 0.32)
    assert perf.breakdown(w, fused, c)[0] == pytest.approx(3 * 0.02 + 4 * 0.3)  # three allreduces' latencies
    one_each = dataclasses.replace(fused, fusion_bytes=4 * n)  # a threshold of one gradient: four allreduces
    assert perf.step_time(w, one_each, c) == pytest.approx(1.06 + 0.32)
    bucketed = perf.entry_path(perf.FLOAT32_PATH, 32, entry=perf.EntryPoint.DDP)
    assert perf.step_time(w, bucketed, c) == pytest.approx(1.0 + perf.allreduce(16 * n, c))
    # without a measured timeline, `tensors` equal gradients ready in proportion to their elements
    even = perf.Workload(10, 1.0, tensors=4)
    assert even.gradients() == [(3, 0.3), (3, 0.6), (2, 0.8), (2, 1.0)] and even.tensor_count == 4


def test_an_entry_points_costs_a_gradient_and_the_contention_slow_the_step():
    """What `calibrate --links --entry-points` measures in a job: a cost a gradient, which delays
    each hand-over and (sharing the processor) the backward; a cost per element beyond the
    codec; and the contentions, the share of the processor an exchange running beside the
    backward takes from it (its codec's work, its time on the links)."""
    n, fast = 1 << 20, perf.Cluster(2, perf.Link(1e30, 0.0), sharing=2)
    codec = perf.Codec(0.01, 0.0)
    w = perf.Workload(n, compute=1.0, backward=1.0, buckets=[n], tensors=100)
    plain = perf.entry_path("codes e4m3", 8, codec, perf.EntryPoint.DDP)
    costly = perf.entry_path("codes e4m3", 8, codec, perf.EntryPoint.DDP, perf.EntryCost(1e-4, 1e-9))
    assert costly.per_gradient == 1e-4 and costly.processor == 1e-9 and costly.pipelined
    per_element = n * 1e-9 * 2  # every element, at the cluster's sharing of 2
    assert perf.exchange_time(n, costly, fast, 100) == pytest.approx(perf.exchange_time(n, plain, fast, 100)
                                                                      + per_element)
    # the bucket is handed over after its 100 gradients' costs (1.01 s), then its exchange runs
    assert perf.step_time(w, plain, fast) == pytest.approx(1.0 + 0.02)
    assert perf.step_time(w, costly, fast) == pytest.approx(1.01 + 0.02 + per_element)
    # compute on an accelerator: the costs a gradient still delay the hand-over, not the backward
    apart = dataclasses.replace(w, shared_processor=False)
    assert perf.step_time(apart, costly, fast) == pytest.approx(1.01 + 0.02 + per_element)
    assert perf.step_time(apart, plain, fast) == pytest.approx(1.02)
    assert perf.breakdown(w, costly, fast)[1] == pytest.approx(0.02 + per_element + 100 * 1e-4)
    # an allreduce of 0.1 s on the links from halfway through a 1 s backward, then one element at its
    # end: where the bytes cost the cores 40 % of their time while they travel, the backward ends
    # 40 ms later
    link = perf.Link(4 * (n - 1) / 0.1, 0.0)
    half = perf.Workload(n, compute=1.0, backward=1.0, buckets=[n - 1, 1], timeline=[(n - 1, 0.5), (1, 1.0)])
    fp32 = perf.entry_path(perf.FLOAT32_PATH, 32, entry=perf.EntryPoint.DDP)
    assert perf.step_time(half, fp32, perf.Cluster(2, link)) == pytest.approx(1.0 + 4 / link.bandwidth)
    assert perf.step_time(half, fp32, perf.Cluster(2, link, wire_contention=0.4)) == pytest.approx(1.04)
    # _slowed: compute left beside an exchange: slowed while they overlap, then at full speed
    assert perf._slowed(1.0, 0.1, 0.04) == pytest.approx(1.04)
    assert perf._slowed(0.03, 0.1, 0.04) == pytest.approx(0.05)  # done during it, at 60 % speed
    assert perf._slowed(1.0, 0.1, 0.5) == pytest.approx(1.1)  # at most all of the processor while it runs
    # through Horovod: codes one collective at a time at its negotiation's cost, its own allreduce fused
    codes = perf.entry_path("codes e4m3", 8, codec, perf.EntryPoint.CODES)
    assert not codes.pipelined and codes.collective == perf.HOROVOD_COLLECTIVE_S and codes.fusion_bytes == 0
    assert perf.entry_buckets(10 << 20, perf.EntryPoint.HOROVOD) == [4 << 20, 4 << 20, 2 << 20]
    assert perf.entry_buckets(10 << 20, perf.EntryPoint.DDP) == perf.ddp_buckets(10 << 20)


def test_entry_costs_solve_the_cost_per_element_the_job_measured():
    from hvd_aps import entry_costs
    low, high = -entry_costs.MAX_PROCESSOR, entry_costs.MAX_PROCESSOR
    assert entry_costs.solve(lambda cost: 0.2 + 1e6 * cost, 0.25, low, high) == pytest.approx(5e-8, rel=1e-6)
    assert entry_costs.solve(lambda cost: 0.2 + 1e6 * cost, 0.19, low, high) == pytest.approx(-1e-8, rel=1e-6)
    assert entry_costs.entry_paths(perf.EntryPoint.CODES, ["e4m3"]) == [("codes e4m3", "e4m3")]
    assert entry_costs.entry_paths(perf.EntryPoint.DDP, ["e4m3", "e3m0"]) == [
        ("float32", None), ("16-bit", None), ("codes e4m3", "e4m3"), ("codes e3m0", "e3m0")]
    model = entry_costs.Vectors(3, 10)
    assert [p.numel() for p in model.parameters()] == [4, 3, 3]
    model().backward()
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("path, bits", [(perf.FLOAT32_PATH, 32), (perf.HALF_PATH, 16)])
def test_entry_costs_are_solved_so_the_model_gives_back_the_steps_they_came_from(path, bits):
    """Horovod's fused allreduce runs its hand-overs beside the exchanges, so the steps' growth
    from FEW to MANY tensors is not the cost a gradient times the tensors added: the costs are
    solved through the model, which then gives back both measured steps (and the costs behind them),
    and the cost a gradient stays at zero where the model alone already grows past the steps."""
    from hvd_aps import entry_costs
    cluster = perf.Cluster(2, perf.Link(1e8, 1e-3), sharing=2, contention=0.5, wire_contention=0.4)
    work = {n: perf.Workload(1 << 22, 0.004, 0.5, 0.002, perf.entry_buckets(1 << 22, perf.EntryPoint.HOROVOD), n)
            for n in (entry_costs.FEW, entry_costs.MANY)}

    def model(tensors, cost):
        return perf.step_time(work[tensors], perf.entry_path(path, bits, None, perf.EntryPoint.HOROVOD, cost), cluster)
    truth = perf.EntryCost(1.5e-4, 0.0 if path == perf.FLOAT32_PATH else 1.5e-8)
    steps = {n: model(n, truth) for n in work}
    few, many = entry_costs.FEW, entry_costs.MANY
    difference = (steps[many] - model(many, perf.EntryCost()) - steps[few] + model(few, perf.EntryCost())) / (many - few)
    assert difference < 0.9 * truth.per_gradient  # the hand-overs partly hidden: a difference undercounts them
    solved = entry_costs.solve_costs(model, steps, per_element=path != perf.FLOAT32_PATH)
    assert solved.per_gradient == pytest.approx(truth.per_gradient, rel=1e-3)
    assert solved.processor == pytest.approx(truth.processor, rel=1e-3, abs=1e-13)
    assert all(model(n, solved) == pytest.approx(steps[n], rel=1e-4) for n in work)
    flat = {few: steps[few], many: steps[few]}
    assert 0 <= entry_costs.solve_costs(model, flat, per_element=path != perf.FLOAT32_PATH).per_gradient < 1e-12


class OneRank:
    """A job of one rank for time_contention: its collectives hand back what this rank gives."""

    def allgather_object(self, obj):
        return [obj]


def test_a_failing_exchange_beside_the_compute_ends_the_contention_with_its_error():
    """An exchange that fails on the thread beside the compute is raised on the caller's, not
    left to leave a contention measured beside nothing."""
    from hvd_aps import entry_costs
    calls = []

    def work():
        calls.append(None)
        if len(calls) > entry_costs.REPEATS:  # timed alone, then fails beside the compute
            raise ConnectionError("a peer left")
    with pytest.raises(RuntimeError, match="beside the compute failed") as raised:
        entry_costs.time_contention(work, OneRank(), products=2)
    assert isinstance(raised.value.__cause__, ConnectionError)


def test_a_calibration_file_keeps_the_costs_measured_in_a_job(tmp_path):
    """links_entry with the entry points' costs and the contention, read back by load, and the
    paths plan builds from them."""
    out = tmp_path / "cal.json"
    calibration.save({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(perf.Codec(1e-4, 2e-9))}},
                     out)
    costs = {"entry_points": {perf.EntryPoint.HOROVOD: {"float32": perf.EntryCost(6.7e-5, 0.0),
                                                        "codes e4m3": perf.EntryCost(8e-5, 1e-9)}},
             "steps": {perf.EntryPoint.HOROVOD: {"float32": {4: 0.1, 512: 0.13}}}, "contention": 0.6,
             "wire_contention": 0.3}
    cluster = perf.Cluster(2, perf.Link(1e8, 1e-4), sharing=2)
    calibration.add_links(out, calibration.links_entry(perf.Link(1e8, 1e-4), cluster, [(64, 1e-3, [1e-3])], costs))
    loaded = calibration.load(out)
    assert loaded.contentions() == {"contention": 0.6, "wire_contention": 0.3} and loaded.sharing == 2
    assert loaded.link == perf.Link(1e8, 1e-4)
    assert json.loads(out.read_text())["links"]["entry_steps"] == {"horovod": {"float32": {"4": 0.1, "512": 0.13}}}
    assert loaded.entry_cost(perf.EntryPoint.HOROVOD, "codes e4m3") == perf.EntryCost(8e-5, 1e-9)
    assert loaded.entry_cost(perf.EntryPoint.DDP, "codes e4m3") == perf.EntryCost()  # not measured: none
    fp32, half, codes = loaded.paths(perf.EntryPoint.CODES, ["e4m3"])  # the codes optimizer against Horovod's own
    assert fp32.per_gradient == 6.7e-5 and fp32.fusion_bytes and half.per_gradient == 0.0
    assert codes.codec == loaded.codecs["e4m3"] and codes.per_gradient == 0.0 and not codes.pipelined
    horovod = loaded.paths(perf.EntryPoint.HOROVOD, ["e4m3"])[2]
    assert (horovod.per_gradient, horovod.processor) == (8e-5, 1e-9)


def test_break_even_solves_where_the_saved_bytes_pay_for_the_extra_latencies():
    n = 1 << 16
    w = perf.Workload(n, compute=0.0, buckets=[n])
    codes, fp32 = perf.Path("e4m3", 8, FREE), perf.Path("float32", 32)
    # codes 4 alpha + C / bw against 2 alpha + 4n / bw: codes win while bw < (4n - C) / (2 alpha)
    expected = (4 * n - n * (1 + 2 / 2048)) / (2 * ALPHA)
    assert perf.break_even(w, codes, fp32, perf.Cluster(2, SLOW)) == pytest.approx(expected, rel=1e-6)
    costly = perf.Path("e4m3", 8, perf.Codec(10.0, 0.0))
    assert perf.break_even(w, costly, fp32, perf.Cluster(2, SLOW)) is None


def test_ddp_buckets_follow_ddp_caps():
    assert perf.ddp_buckets(7_000_000) == [262144, 6553600, 184256]
    with pytest.raises(ValueError, match="buckets hold"):
        perf.Workload(10, 1.0, buckets=[4, 4])


def test_mirror_stands_for_rank_zero_of_ranks_holding_the_same_gradients():
    """Rank 0's share of the results from the mirrored collectives holds the bits two emulated
    workers get, the other share zeros."""
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(5000).astype(np.float32), rng.standard_normal(700).astype(np.float32) * 1e-3]
    expected = emulate.codes_allreduce([hvd_aps.APSCompressor("e4m3", chunk_bytes=0) for _ in range(2)],
                                       [grads, grads])
    comp = hvd_aps.APSCompressor("e4m3", chunk_bytes=0)
    bucket = Bucket.whole("emulated", [f"emulated[{i}]" for i in range(2)], ["a", "b"], [g.size for g in grads])
    got = exchange.run(comp.exchanger.stages(2, 0), bucket, np.concatenate(grads),
                       exchange.Levels.flat(calibration.Mirror(2)), average=True)
    share = int(_layout.Layout(bucket.segments, 2).shards[1])
    expected = np.concatenate(expected)
    np.testing.assert_array_equal(got[:share].view(np.uint32), expected[:share].view(np.uint32))
    assert np.count_nonzero(expected[:share]) > 0.9 * share and not np.any(got[share:])


def test_calibrate_and_plan_from_the_command_line(tmp_path):
    out = tmp_path / "cal.json"
    buckets = ((1 << 10, 1), (1 << 14, 1), (1 << 14, 4))
    saved = calibration.calibrate(["e4m3"], 2, buckets, repeats=1)
    assert saved["device"] == "cpu" and not saved["codecs"]["e4m3"]["device"] and saved["date"].startswith("20")
    with pytest.raises(ValueError, match="device is one of"):
        calibration.time_exchange("e4m3", 2, 1 << 10, 1, device="tpu")
    if importlib.util.find_spec("cupy") is None:  # the CPU machines: a clear error, not an ImportError
        with pytest.raises(ValueError, match="needs CuPy and a CUDA device"):
            calibration.calibrate(["e4m3"], 2, buckets, repeats=1, device="cuda")
    calibration.save(saved, out)
    assert [r["elements"] for r in json.loads(out.read_text())["measured"]["e4m3"]] == [1 << 10, 1 << 14, 1 << 14]
    loaded = calibration.load(out)
    codec = loaded.codecs["e4m3"]
    assert codec.fixed >= 0 and codec.per_tensor >= 0 and codec.per_element >= 0
    assert 1e-12 < loaded.copy < 1e-7  # seconds per float32 element: between 40 TB/s and 40 MB/s
    run = bounded([sys.executable, "-m", "hvd_aps", "plan", "--params", "4.3M", "--compute-ms", "40",
                   "--links", "1gbit,100gbit", "--format", "e4m3", "--calibration", out], CLI_S, dict(os.environ))
    assert "1gbit between hosts" in run.stdout and "100gbit between hosts" in run.stdout
    assert "codes e4m3" in run.stdout and ("faster than both below" in run.stdout or "faster than neither" in run.stdout)
    assert "range ms" in run.stdout and f"fits of the calibration's own timings" in run.stdout  # its repeats kept


SPREAD_CODEC = perf.Codec(2e-4, 3e-9, 5e-6)
APART = (0.7, 0.9, 1.0, 1.1, 1.6)  # each bucket's repeats, as factors of its median


def _with_repeats(factors, link_factors=None) -> calibration.Calibration:
    """A calibration whose buckets' (and link sizes') repeats spread by `factors` around times
    SPREAD_CODEC (and a 1 Gbit/s link of 50 us) gives exactly."""
    rows = [{"elements": n, "tensors": t, "seconds": SPREAD_CODEC.time(n, t),
             "repeats": [f * SPREAD_CODEC.time(n, t) for f in factors]} for n, t in calibration.BUCKETS]
    data = {"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(SPREAD_CODEC)},
            "measured": {"e4m3": rows}}
    if link_factors:
        link, cluster = perf.Link(1.25e8, 5e-5), perf.Cluster(2, perf.Link(1.25e8, 5e-5), 1)
        times = [(n, perf.allreduce(4 * n, cluster)) for n in calibration.LINK_ELEMENTS]
        data["links"] = calibration.links_entry(link, cluster, [(n, s, [f * s for f in link_factors])
                                                                 for n, s in times])
    return calibration.parse(data)


def test_a_plans_range_comes_from_the_calibrations_own_repeats():
    """draws() fits the codec (and the link) again from each timing's repeats drawn again:
    repeats alike give the point fit itself, repeats apart a range around it; the same draws on
    every call; no draws from a file that kept no repeats."""
    def spread(drawn):
        return calibration.spread([d.codecs["e4m3"].time(1 << 22, 16) for d in drawn])

    alike = calibration.draws(_with_repeats((1.0,) * 5))
    assert len(alike) == calibration.DRAWS
    low, high = spread(alike)
    assert low == pytest.approx(SPREAD_CODEC.time(1 << 22, 16), rel=1e-9) == pytest.approx(high, rel=1e-9)
    apart = _with_repeats(APART, link_factors=APART)
    drawn = calibration.draws(apart)
    low, high = spread(drawn)
    assert low < 0.97 * SPREAD_CODEC.time(1 << 22, 16) and high > 1.03 * SPREAD_CODEC.time(1 << 22, 16)
    assert low >= 0.7 * SPREAD_CODEC.time(1 << 22, 16) and high <= 1.6 * SPREAD_CODEC.time(1 << 22, 16)
    bandwidths = calibration.spread([d.link.bandwidth for d in drawn])
    assert bandwidths[0] < apart.link.bandwidth < bandwidths[1]
    assert [d.codecs for d in calibration.draws(apart)] == [d.codecs for d in drawn]
    older = calibration.parse({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(SPREAD_CODEC)},
                               "measured": {"e4m3": [{"elements": 1, "tensors": 1, "seconds": 1e-3}]}})
    assert calibration.draws(older) == []


def test_links_measured_inside_a_torchrun_job_feed_the_plan(tmp_path):
    """calibrate --links --entry-points under torchrun (2 ranks, Gloo on loopback) adds the link
    its allreduce got, DDP's paths' costs and the contention to a calibration file, keeping the
    codec's; plan --links measured plans on them."""
    out = tmp_path / "cal.json"
    calibration.save(calibration.calibrate(["e4m3"], 2, ((1 << 10, 1), (1 << 14, 1), (1 << 14, 4)), repeats=1), out)
    refused = bounded([sys.executable, "-m", "hvd_aps", "calibrate", "--links", "--out", out], CLI_S,
                      dict(os.environ), check=False)
    assert refused.returncode != 0 and "horovodrun" in refused.stderr and "torchrun" in refused.stderr
    job = bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", free_port(), "-m", "hvd_aps", "calibrate", "--links", "--entry-points",
                   "--format", "e4m3", "--out", out], JOB_S, dict(os.environ, OMP_NUM_THREADS="1"))
    assert "contention" in job.stdout and "us a gradient" in job.stdout
    saved = json.loads(out.read_text())
    assert saved["links"]["hosts"] == 1 and saved["links"]["ranks_per_host"] == 2 and saved["links"]["sharing"] == 2
    assert set(saved["links"]["entry_points"]) == {"ddp"}
    assert set(saved["links"]["entry_points"]["ddp"]) == {"float32", "16-bit", "codes e4m3"}
    assert saved["links"]["contention"] >= 0
    assert [r["elements"] for r in saved["links"]["measured"]] == list(calibration.LINK_ELEMENTS)
    loaded = calibration.load(out)
    assert "e4m3" in loaded.codecs and loaded.link.bandwidth > 0 and loaded.link_shape == (1, 2)
    run = bounded([sys.executable, "-m", "hvd_aps", "plan", "--params", "4.3M", "--compute-ms", "40",
                   "--hosts", "1", "--ranks-per-host", "2", "--links", "measured", "--format", "e4m3",
                   "--calibration", out], CLI_S, dict(os.environ))
    assert "measured between hosts" in run.stdout and "codes e4m3" in run.stdout
    assert "no cost a gradient measured" not in run.stderr and "measured in a job: float32" in run.stdout
    bad = bounded([sys.executable, "-m", "hvd_aps", "plan", "--params", "4.3M", "--compute-ms", "40",
                   "--format", "e3m0", "--calibration", out], CLI_S, dict(os.environ), check=False)
    assert bad.returncode != 0 and "no calibration for e3m0" in bad.stderr


def test_links_measured_inside_a_horovodrun_job(tmp_path):
    """calibrate --links --entry-points under horovodrun (2 ranks, Gloo on loopback) times
    Horovod's own float32 allreduce at every size and writes the link it gets, with the job's
    shape, and the costs of Horovod's optimizer's paths and hvd_aps.torch's; without the
    codec's calibration it says what to run first."""
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    out = tmp_path / "cal.json"
    command = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "hvd_aps", "calibrate",
               "--links", "--entry-points", "--format", "e4m3", "--out", out]
    refused = bounded(command, JOB_S, dict(os.environ, OMP_NUM_THREADS="1"), check=False)
    assert refused.returncode != 0 and "needs the codec's calibration" in refused.stdout + refused.stderr
    calibration.save(calibration.calibrate(["e4m3"], 2, ((1 << 10, 1), (1 << 14, 1), (1 << 14, 4)), repeats=1), out)
    job = bounded(command, JOB_S, dict(os.environ, OMP_NUM_THREADS="1"))
    assert "Horovod's float32 allreduce gets" in job.stdout
    links = json.loads(out.read_text())["links"]
    assert links["entry_points"].keys() == {"horovod", "codes"}
    assert set(links["entry_points"]["horovod"]) == {"float32", "16-bit", "codes e4m3"}
    assert set(links["entry_points"]["codes"]) == {"codes e4m3"}
    assert all(cost["per_gradient"] >= 0 for paths in links["entry_points"].values() for cost in paths.values())
    assert links["hosts"] == 1 and links["ranks_per_host"] == 2
    measured = links["measured"]
    assert [r["elements"] for r in measured] == list(calibration.LINK_ELEMENTS)
    assert measured[-1]["seconds"] > measured[0]["seconds"]  # the largest allreduce takes longer: really timed
    assert calibration.load(out).link.bandwidth == links["bandwidth"] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and waits in /proc are Linux's")
def test_an_idle_horovod_rank_shows_its_loops_cycling():
    """examples/horovod_idle_cpu.py under 2 real ranks (docs/benchmarks.md's bound on the one
    line): with nothing queued, each rank's CPU is Horovod's background loop and Gloo's event
    loop cycling, each found by its wait (benchmark_common.learn_kinds)."""
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    assert horovodrun, "horovodrun is not installed next to this Python: run scripts/install.sh"
    script = pathlib.Path(__file__).parent.parent / "examples" / "horovod_idle_cpu.py"
    job = bounded([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, script, "--seconds", "1"],
                  120, dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [json.loads(line[line.index("{"):]) for line in job.stdout.splitlines() if "cpu_ms_per_s" in line]
    assert sorted(line["rank"] for line in lines) == [0, 1], job.stdout
    for line in lines:
        cpu = line["cpu_ms_per_s"]
        assert cpu.get("horovod", 0.0) > 0 and cpu.get("gloo", 0.0) > 0, line
        assert cpu["horovod"] + cpu["gloo"] > cpu.get("main", 0.0), line  # the loops, not the reads


@pytest.mark.parametrize("params, link, codec, policy", [
    ("100M", "100mbit", perf.Codec(1e-3, 1e-9), "codes"),   # the wire is the step: codes clearly shorter
    ("100M", "100gbit", perf.Codec(1.0, 1e-9), "native"),   # a codec of a second an exchange
    ("1M", "10gbit", perf.Codec(1e-4, 1e-9), None),         # both hide behind the compute: the trials decide
])
def test_plan_pins_policy_only_where_the_prediction_is_clear(tmp_path, params, link, codec, policy):
    cal, pin = tmp_path / "cal.json", tmp_path / "pin.json"
    calibration.save({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(codec)}}, cal)
    from hvd_aps.__main__ import main
    main(["plan", "--params", params, "--compute-ms", "200", "--links", link, "--format", "e4m3",
          "--calibration", str(cal), "--pin", str(pin)])
    decisions = json.loads(pin.read_text())
    assert decisions.get("policy") == policy
    comp = hvd_aps.APSCompressor("e4m3", policy="auto", stats=False)
    comp.pin(decisions)
    assert comp.decisions()["policy"] == policy
    with pytest.raises(SystemExit):  # one decision holds for one link speed
        main(["plan", "--params", params, "--compute-ms", "200", "--links", "1gbit,10gbit", "--format", "e4m3",
              "--calibration", str(cal), "--pin", str(pin)])


def test_plan_fsdp_prints_the_fsdp_step_model(tmp_path, capsys):
    """plan --fsdp: the table's steps are perf.fsdp_step_time's for units of equal size (Gloo's
    reduce-scatter on the CPU, resharding unless --no-reshard, every path's parameters gathered in
    its precision with --gather), not the bucket allreduce's."""
    cal = tmp_path / "cal.json"
    codec = perf.Codec(2e-3, 1e-9)
    calibration.save({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(codec)}}, cal)
    from hvd_aps.__main__ import main
    assert perf.fsdp_units(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="FSDP units"):
        perf.fsdp_units(3, 4)
    for extra, reshard, gather in (([], True, False), (["--no-reshard"], False, False), (["--gather"], True, True)):
        main(["plan", "--params", "20M", "--compute-ms", "100", "--hosts", "4", "--links", "1gbit", "--format", "e4m3",
              "--calibration", str(cal), "--fsdp", "6"] + extra)
        printed = capsys.readouterr().out
        work = perf.Workload(20_000_000, 0.1, buckets=perf.fsdp_units(20_000_000, 6))
        cluster = perf.Cluster(4, perf.Link.parse("1gbit"))
        for path in (perf.Path("float32", 32), perf.Path("codes e4m3", 8, codec)):
            fsdp = perf.fsdp_step_time(work, path, cluster, reshard=reshard, gloo=True, gather=path if gather else None)
            assert f"{fsdp * 1e3:.1f}" in printed.split(f"\n{path.name} ")[1].split()[0:1], path.name
            assert abs(fsdp - perf.step_time(work, path, cluster)) > 1e-3  # another model than the buckets'
        assert "FSDP2 in 6 units" in printed and ("no resharding" in printed) != reshard
        assert ("the parameters gathered in each path's precision" in printed) == gather
    with pytest.raises(SystemExit):  # --gather plans FSDP2's gathers
        main(["plan", "--params", "20M", "--compute-ms", "100", "--gather"])


def test_a_step_profile_measures_when_gradients_are_ready_and_plans_from_it(tmp_path, capsys):
    """hvd_aps.step_profile on a real torch model: a wide last layer's gradients are ready
    early (its backward is a fraction of the whole), the first layer's last; saved, loaded and
    planned from with `plan --profile`, whose float32 step is perf.step_time's on that timeline."""
    import torch
    from hvd_aps import step_profile
    torch.manual_seed(0)
    deep = [torch.nn.Linear(256, 256) for _ in range(6)]
    model = torch.nn.Sequential(*deep, torch.nn.Linear(256, 4096))  # the last layer: 1M of its 1.4M parameters
    x = torch.randn(64, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    profile = step_profile.measure(model, lambda: model(x).square().mean(), opt)
    assert profile.parameters == sum(p.numel() for p in model.parameters())
    assert len(profile.timeline) == len(list(model.parameters()))
    fractions = [at for _, at in profile.timeline]
    assert fractions == sorted(fractions) and 0 <= fractions[0] and fractions[-1] <= 1
    by_size = {n: at for n, at in profile.timeline}
    assert by_size[256 * 4096] < fractions[-1]  # the wide last layer before the first layer's weight
    assert profile.timeline[-1][0] in (256, 256 * 256)  # the first layer's bias or weight, last
    assert profile.forward > 0 and profile.backward > 0 and profile.optimizer > 0
    saved = tmp_path / "step.json"
    step_profile.save(profile, saved)
    assert step_profile.load(saved) == profile
    cal = tmp_path / "cal.json"
    calibration.save({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(perf.Codec(1e-3, 1e-9))}}, cal)
    from hvd_aps.__main__ import main
    main(["plan", "--profile", str(saved), "--links", "1gbit", "--format", "e4m3", "--calibration", str(cal)])
    expected = perf.step_time(profile.workload(), perf.Path("float32", 32), perf.Cluster(2, perf.Link.parse("1gbit")))
    assert f"{expected * 1e3:.1f}" in capsys.readouterr().out.split("\nfloat32 ")[1].split()[0:1]
    for wrong in (["--profile", str(saved), "--params", "1M"], ["--params", "1M"]):
        with pytest.raises(SystemExit):
            main(["plan", *wrong, "--calibration", str(cal)])
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="none of the model's parameters"):
        step_profile.measure(torch.nn.Sequential(frozen, torch.nn.Linear(4, 4)), lambda: x[:, :4].sum().requires_grad_())
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(tmp_path / "other.json"), "--calibration", str(cal)])


def test_at_scale_tables_and_the_dettmers_shape():
    """examples/perf_at_scale.py: the link found for 32-bit's 23x on 96 GPUs really gives 23x,
    and fewer bits scale further there; on NVLink alone nothing is worth compressing."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    import perf_at_scale
    shape = perf_at_scale.dettmers()
    assert shape["float32"] == pytest.approx(perf_at_scale.DETTMERS_FP32_SPEEDUP, rel=1e-3)
    assert shape["float32"] < shape["bf16"] < shape["NCCL fp8"] < shape["e3m0"] <= perf_at_scale.DETTMERS_GPUS
    assert perf_at_scale.GPU.kind is calibration.Kind.PROJECTED  # the GPU codec: projected, and says so
    assert all(c.device for c in perf_at_scale.GPU.codecs.values())
    rows = perf_at_scale.rows()
    assert len(rows) == len(perf_at_scale.WORKLOADS) * (1 + (len(perf_at_scale.GPU_COUNTS) - 1) * len(perf_at_scale.HOST_LINKS))
    for r in rows:
        assert min(r["step_ms"].values()) >= r["compute_ms"] - 1e-9  # no path beats its own compute
        if r["link"] == "NVLink only":
            assert r["step_ms"]["e4m3"] >= r["step_ms"]["NCCL fp8"]


def test_fsdp_step_is_serial_gathers_and_reduce_scatters_per_unit():
    """FSDP2 on the CPU: every unit's all-gathers (two with resharding, one for the root) and its
    reduce-scatter (float32, or the codes' metadata and alltoall plus half a bucket's codec)."""
    n, two = 1 << 20, perf.Cluster(2, SLOW)
    w = perf.Workload(2 * n, compute=0.2, optimizer=0.01, buckets=[n, n])
    gather, scatter = perf.allgather(4 * n / 2, two), perf.alltoall(4 * n, two)
    fp32 = perf.Path("float32", 32)
    assert perf.fsdp_step_time(w, fp32, two) == pytest.approx(0.21 + 3 * gather + 2 * scatter)
    assert perf.fsdp_step_time(w, fp32, two, reshard=False) == pytest.approx(0.21 + 2 * gather + 2 * scatter)
    codec = perf.Codec(1e-3, 1e-9)
    codes = perf.fsdp_step_time(w, perf.Path("e4m3", 8, codec), two)
    per_unit = perf.metadata_allreduce(two) + perf.alltoall(perf.codes_bytes(n, 8), two) + 0.5 * codec.time(n)
    assert codes == pytest.approx(0.21 + 3 * gather + 2 * per_unit)  # sharing=1: the codec's own time
    assert codes < perf.fsdp_step_time(w, fp32, two)
    # Gloo's reduce-scatter moves what an allreduce moves
    gloo = perf.fsdp_step_time(w, fp32, two, gloo=True)
    assert gloo == pytest.approx(0.21 + 3 * gather + 2 * perf.allreduce(4 * n, two))


def test_fsdp_gathers_in_each_precision_the_model_counts():
    """The parameters' all-gathers in float32, in bfloat16 (a 16-bit path) and as codes: their
    bytes at 4, 2 and 1 byte (plus the exponents) an element, the codes' codec at the share of a
    bucket exchange's passes a gather makes (encode 1/N, decode all)."""
    n, two = 1 << 20, perf.Cluster(2, SLOW)
    w = perf.Workload(2 * n, compute=0.2, optimizer=0.01, buckets=[n, n])
    fp32, codec = perf.Path("float32", 32), perf.Codec(1e-3, 1e-9)
    codes = perf.Path("e4m3", 8, codec)
    base = perf.fsdp_step_time(w, fp32, two) - 3 * perf.allgather(4 * n / 2, two)  # three gathers of a unit each
    assert perf.fsdp_step_time(w, fp32, two, gather=fp32) == pytest.approx(perf.fsdp_step_time(w, fp32, two))
    assert perf.fsdp_step_time(w, fp32, two, gather=perf.Path("16-bit", 16)) == pytest.approx(
        base + 3 * perf.allgather(2 * n / 2, two))
    assert perf.gather_codec_share(2) == pytest.approx(1.5 / 3.5)
    assert perf.fsdp_step_time(w, fp32, two, gather=codes) == pytest.approx(
        base + 3 * (perf.allgather(perf.codes_bytes(n, 8) / 2, two) + perf.gather_codec_share(2) * codec.time(n)))
    both = perf.fsdp_breakdown(w, codes, two, gather=codes)
    assert both[0] < perf.fsdp_breakdown(w, codes, two)[0] and both[1] > perf.fsdp_breakdown(w, codes, two)[1]


def test_hsdp_gathers_and_scatters_inside_the_host_and_averages_shards_across_hosts():
    """HSDP (2 hosts x 2 ranks): the all-gathers and float32 reduce-scatter among a host's ranks,
    then each rank's half of a unit across hosts, both ranks of a host through its link at once:
    the framework's allreduce, or the codes' bucket exchange of the shard with its whole codec."""
    n, c = 1 << 20, perf.Cluster(2, SLOW, 2)
    host, cross = perf.Cluster(1, c.inside, 2), perf.Cluster(2, SLOW)
    w = perf.Workload(2 * n, compute=0.2, optimizer=0.01, buckets=[n, n])
    gather, scatter = perf.allgather(4 * n / 2, host), perf.allreduce(4 * n, host)  # Gloo: an allreduce's bytes
    fp32 = perf.fsdp_step_time(w, perf.Path("float32", 32), c, gloo=True, hsdp=True)
    assert fp32 == pytest.approx(0.21 + 3 * gather + 2 * (scatter + perf.allreduce(4 * n, cross)))
    codec = perf.Codec(1e-3, 1e-9)
    codes = perf.fsdp_step_time(w, perf.Path("e4m3", 8, codec), c, gloo=True, hsdp=True)
    across = (perf.metadata_allreduce(cross) + perf.alltoall(perf.codes_bytes(n, 8), cross)
              + perf.allgather(perf.codes_bytes(n, 8) / 2, cross))
    assert codes == pytest.approx(0.21 + 3 * gather + 2 * (scatter + across + codec.time(n / 2)))
    # the link between hosts carries the shards only: much less than flat FSDP over all four ranks
    fp32_path = perf.Path("float32", 32)
    assert perf.hsdp_breakdown(w, fp32_path, c)[0] < perf.fsdp_breakdown(w, fp32_path, c)[0]
    # torch's HSDP with a 16-bit reduce dtype: the host's reduce-scatter and the allreduce across hosts in 16 bits
    fp16 = perf.fsdp_step_time(w, perf.Path("16-bit", 16), c, gloo=True, hsdp=True)
    assert fp16 == pytest.approx(0.21 + 3 * gather + 2 * (perf.allreduce(2 * n, host) + perf.allreduce(2 * n, cross)))
    with pytest.raises(ValueError, match="several hosts of several ranks"):
        perf.fsdp_step_time(w, perf.Path("float32", 32), perf.Cluster(2, SLOW), hsdp=True)


def test_plan_hsdp_prints_the_hsdp_step_model(tmp_path, capsys):
    """plan --fsdp N --hsdp: the table's steps are the HSDP model's; --hsdp alone, or on one rank a
    host, is refused with the reason."""
    cal = tmp_path / "cal.json"
    codec = perf.Codec(2e-3, 1e-9)
    calibration.save({"format": calibration.FORMAT, "codecs": {"e4m3": dataclasses.asdict(codec)}, "copy": 1e-10}, cal)
    from hvd_aps.__main__ import main
    base = ["plan", "--params", "20M", "--compute-ms", "100", "--hosts", "2", "--links", "1gbit", "--format", "e4m3",
            "--calibration", str(cal)]
    main(base + ["--ranks-per-host", "4", "--fsdp", "6", "--hsdp"])
    printed = capsys.readouterr().out
    work = perf.Workload(20_000_000, 0.1, buckets=perf.fsdp_units(20_000_000, 6))
    # the host's 4 ranks share its cores: the codec takes 4 times its calibrated time (plan's --sharing default)
    cluster = perf.Cluster(2, perf.Link.parse("1gbit"), 4, copy=1e-10, sharing=4)
    for path in (perf.Path("float32", 32), perf.Path("codes e4m3", 8, codec)):
        hsdp = perf.fsdp_step_time(work, path, cluster, gloo=True, hsdp=True)
        assert f"{hsdp * 1e3:.1f}" == printed.split(f"\n{path.name} ")[1].split()[0], path.name
    assert "HSDP in 6 units" in printed and "allreduce of each shard across hosts" in printed
    for refused, reason in ((["--ranks-per-host", "4", "--hsdp"], "give --fsdp UNITS"),
                            (["--fsdp", "6", "--hsdp"], "several hosts of several ranks")):
        with pytest.raises(SystemExit):
            main(base + refused)
        assert reason in capsys.readouterr().err


def test_plan_on_a_gpu_says_its_codec_is_projected_and_takes_a_measured_one(tmp_path, capsys):
    """plan --device cuda plans with the GPU codec projected from the kernels' counted work (and
    says so), or with a device's measured calibration file given instead (and names the device)."""
    from hvd_aps.__main__ import main
    args = ["plan", "--device", "cuda", "--params", "25M", "--compute-ms", "90", "--hosts", "8", "--links", "25gbit"]
    main(args)
    assert "projected for an NVIDIA H200, not measured" in capsys.readouterr().out
    measured = json.loads(calibration.GPU_PROJECTION.read_text())
    measured.update(kind="measured", device="a lent GPU", date="2026-11-28")
    (tmp_path / "gpu.json").write_text(json.dumps(measured))
    main(args + ["--calibration", str(tmp_path / "gpu.json")])
    assert "the codec measured on a lent GPU on 2026-11-28" in capsys.readouterr().out


def test_plan_prints_each_paths_measured_error_at_the_nearest_world(tmp_path, capsys):
    """plan's error column: the packaged hvd_aps/fidelity.json is the medians of the measurement
    docs/accuracy.md shows (docs/fidelity_at_scale.json), read at the measured world nearest the
    job's; a path not measured prints none."""
    from hvd_aps import fidelity
    from hvd_aps.__main__ import main
    docs = pathlib.Path(__file__).parent.parent / "docs"
    measured = json.loads((docs / "fidelity_at_scale.json").read_text())["records"]
    assert fidelity.summary(measured) == json.loads(fidelity.FILE.read_text())
    e4m3 = [r["relative_error"] for r in measured if r["path"] == "hvd_aps e4m3" and r["workers"] == 64]
    assert fidelity.error("codes e4m3", 64) == float(np.median(e4m3))
    assert [fidelity.nearest_world(n) for n in (1, 8, 22, 23, 100, 5000)] == [8, 8, 8, 64, 64, 1024]
    cal = tmp_path / "cal.json"
    calibration.save({"format": calibration.FORMAT, "codecs": {f: dataclasses.asdict(perf.Codec(2e-3, 1e-9))
                                                               for f in ("e4m3", "e2m1fn")}}, cal)
    main(["plan", "--params", "20M", "--compute-ms", "100", "--hosts", "16", "--ranks-per-host", "4", "--links",
          "1gbit", "--format", "e4m3", "--format", "e2m1fn", "--calibration", str(cal)])
    printed = capsys.readouterr().out
    assert "as measured at 64 workers" in printed
    rows = {line.split("  ")[0]: line.rsplit("  ", 1)[1].strip() for line in printed.splitlines()[4:8]}
    assert rows == {"float32": "-", "16-bit": f"{100 * fidelity.error('16-bit', 64):.1f} %",
                    "codes e4m3": f"{100 * fidelity.error('codes e4m3', 64):.1f} %", "codes e2m1fn": "-"}


def test_the_recorded_plan_check_is_what_this_tree_predicts(capsys, monkeypatch):
    """docs/performance-model.md quotes examples/plan_check.py on the rows and calibrations kept in
    docs/cluster/plan_check: this tree, run on them, prints those figures (one calibration, and the
    four side by side at 1 Gbit/s)."""
    root = pathlib.Path(__file__).parent.parent
    recorded = root / "docs" / "cluster" / "plan_check"
    monkeypatch.syspath_prepend(str(root / "examples"))  # undone after the test
    import plan_check
    rows = [f"--rows={recorded / 'rows' / name}" for name in ("t400_hvd.json:400", "t400_ddp.json:400",
                                                               "t300_hvd.json:300", "t300_ddp.json:300",
                                                               "r18_hvd.json", "r18_ddp.json")]
    calibrations = ["cal", "calB", "repeat1", "repeat2"]
    for args, printed in ((["--calibration", str(recorded / "cal.json")], "check.txt"),
                          ([f"--calibration={recorded / c}.json" for c in calibrations] + ["--rates", "1gbit"],
                           "repeats.txt")):
        monkeypatch.setattr(sys, "argv", ["plan_check.py", *args, *rows])
        plan_check.main()
        assert capsys.readouterr().out == (recorded / printed).read_text()
