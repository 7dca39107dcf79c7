"""The model-parallel step models (hvd_aps.perf_layouts) against the netns cluster's pipeline and
tensor-parallel rows (examples/model_parallel_benchmark.py under examples/netns_cluster.py,
docs/cluster/model_parallel_transformer.json).

Protocol, as examples/perf_model_check.py's: the codec's time from `python -m hvd_aps calibrate`
(--calibration; e4m3's codec stands for e8m7, the rows' bf16: the codec's passes do not depend
on the format's split), each row's compute the one its benchmark measured, each link its nominal
rate at the efficiency examples/perf_model_check.py fits for 1 Gbit/s (LINK_EFFICIENCY); one
figure fitted, on the tensor-parallel float32 rows: the cost a collective adds beyond its link
(TensorParallel.per_collective). Every other row is predicted, bytes too.

    .venv/bin/python examples/model_parallel_check.py [--rows docs/cluster/model_parallel_transformer.json] \
        [--calibration docs/perf_model_calibration.json]
"""
import argparse
import dataclasses
import json
import pathlib
import statistics

from hvd_aps import calibration, perf
from hvd_aps.perf_layouts import Collective, Pipeline, TensorParallel, pipeline_step, tensor_parallel_step

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
VOCAB = 256  # the study's byte-level vocabulary
BITS = {"none": 32, "bf16": 16, "e4m3": 8}
CODEC_OF = {"bf16": "e4m3", "e4m3": "e4m3"}  # the codec calibrated for each codes setting
# what a tc-capped link delivers to Gloo over TCP, x its nominal rate: examples/perf_model_check.py's fit
# of 1 Gbit/s on the data-parallel float32 rows (0.94 Gbit/s), taken for every rate
LINK_EFFICIENCY = 0.94
PER_COLLECTIVE = [0.25e-3 * k for k in range(81)]  # seconds a collective adds, to fit


def path_of(setting: str, codecs: dict) -> perf.Path:
    if setting == "none":
        return perf.Path(perf.FLOAT32_PATH, 32)
    return perf.Path(perf.codes_path(setting), BITS[setting], codecs[CODEC_OF[setting]])


def sharing(row) -> float:
    """Ranks sharing the cores the codec was calibrated on: every rank of the netns cluster."""
    return float(row["hosts"] * row["ranks_per_host"])


def tensor_layout(row, per_collective: float) -> TensorParallel:
    """The study's tensor_plan: the blocks' sequence parallelism (q, k and v apart), the head
    gathering the sequence and its logits, the embedding output's gradient gathered in float32."""
    activations = row["batch_size"] * row["sequence"] * row["hidden"]
    blocks = TensorParallel.sequence_parallel(row["blocks"], activations, row["compute"])
    head = ((Collective.ALL_GATHER, activations), (Collective.REDUCE_SCATTER, activations),
            (Collective.ALL_GATHER, row["batch_size"] * row["sequence"] * VOCAB))
    return dataclasses.replace(blocks, collectives=blocks.collectives + head,
                               float32=((Collective.ALL_GATHER, activations),), per_collective=per_collective)


def predict(row, codecs: dict, link: perf.Link, per_collective: float) -> tuple:
    layout, setting = row["compression"].split(":")
    c = perf.Cluster(row["hosts"], link, row["ranks_per_host"], sharing=sharing(row))
    path = path_of(setting, codecs)
    if layout == "pp":
        pipeline = Pipeline(row["hosts"], row["microbatches"],
                            row["batch_size"] // row["microbatches"] * row["sequence"] * row["hidden"], row["compute"])
        return pipeline_step(pipeline, path, c)
    return tensor_parallel_step(tensor_layout(row, per_collective), path, c)


def links_of(rows) -> dict:
    """Each rate's link: its nominal rate at LINK_EFFICIENCY, the model's default latency."""
    return {rate: perf.Link(LINK_EFFICIENCY * perf.Link.parse(rate).bandwidth) for rate in {r["rate"] for r in rows}}


def fit_per_collective(rows, codecs, links) -> float:
    """The cost a tensor-parallel collective adds that predicts the float32 rows best."""
    fp32 = [r for r in rows if r["compression"] == "tp:none"]
    return min(PER_COLLECTIVE, key=lambda cost: sum(
        abs(predict(r, codecs, links[r["rate"]], cost)[0] / r["step_median"] - 1) for r in fp32))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=str(DOCS / "cluster" / "model_parallel_transformer.json"))
    parser.add_argument("--calibration", default=str(DOCS / "perf_model_calibration.json"))
    args = parser.parse_args()
    rows = json.loads(pathlib.Path(args.rows).read_text())
    for row in rows:  # the benchmark's arguments, as netns_cluster ran it
        row.setdefault("batch_size", 8)
    codecs = calibration.load(args.calibration).codecs
    links = links_of(rows)
    per_collective = fit_per_collective(rows, codecs, links)
    for rate, link in sorted(links.items()):
        print(f"link {rate}: {link.bandwidth * 8 / 1e9:.3f} Gbit/s, {link.latency * 1e6:.0f} us")
    print(f"fitted on the tensor-parallel float32 rows: {per_collective * 1e3:.2f} ms a collective beyond its link")
    print(f"{'rate':>8} {'row':>8} {'measured s':>10} {'predicted s':>11} {'error':>7} {'MB measured':>11} "
          f"{'MB predicted':>12}")
    errors = []
    for row in rows:
        seconds, sent = predict(row, codecs, links[row["rate"]], per_collective)
        error = seconds / row["step_median"] - 1
        fitted = row["compression"] == "tp:none"
        if not fitted:
            errors.append(abs(error))
        print(f"{row['rate']:>8} {row['compression']:>8} {row['step_median']:>10.3f} {seconds:>11.3f} "
              f"{100 * error:>+6.1f}% {row['tx_bytes_per_step'] / 1e6:>11.2f} {sent / 1e6:>12.2f}"
              + (" (fitted)" if fitted else ""))
    print(f"predicted rows: median absolute error {100 * statistics.median(errors):.1f} %, "
          f"worst {100 * max(errors):.1f} %, {sum(e <= 0.2 for e in errors)} of {len(errors)} within 20 %")


if __name__ == "__main__":
    main()
