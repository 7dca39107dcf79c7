"""Synthetic data-parallel benchmark with horovod.tensorflow, twin of pytorch_synthetic_benchmark.py:
the same MLP (4 x hidden^2 parameters), hvd.DistributedGradientTape inside tf.function.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2_synthetic_benchmark.py --compression aps-e4m3

--compression (examples/recipes.py): none | fp16 | an hvd_aps recipe such as aps-e4m3 (APSCompressor
in Horovod's own tape, codes on the wire) or aps-e4m3-values | codes-<rest> (hvd_aps.tensorflow's tape).
Rank 0 prints one JSON line, as the PyTorch benchmark does.
"""
import argparse
import statistics

import horovod.tensorflow as hvd
import tensorflow as tf

import hvd_aps
import hvd_aps.tensorflow
from benchmark_common import add_arguments, compressor_options, measure, timed
import recipes


def step_fn(layers, x, y, compression, lr=1e-6):
    variables = [v for w, b in layers for v in (w, b)]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for w, b in layers:
                h = tf.nn.relu(h @ w + b)
            loss = tf.reduce_mean((h - y) ** 2)
        if compression is None:
            grads = tape.gradient(loss, variables)
        elif compression[0] == "codes":
            grads = hvd_aps.tensorflow.DistributedGradientTape(tape, compression[1]).gradient(loss, variables)
        else:
            grads = hvd.DistributedGradientTape(tape, compression=compression[1]).gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(lr * g)

    return lambda: step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    if args.profile != "mlp":
        parser.error("the TensorFlow benchmark has the mlp profile only")
    hvd.init(process_sets="dynamic") if args.dynamic_process_sets else hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.random.set_seed(0)
    h = args.hidden
    layers = [(tf.Variable(tf.random.normal([h, h], stddev=h ** -0.5)), tf.Variable(tf.zeros([h]))) for _ in range(4)]
    params = 4 * (h * h + h)
    x, y = tf.random.normal([args.batch_size, h]), tf.random.normal([args.batch_size, h])
    compute = statistics.median(timed(step_fn(layers, x, y, None), 3))  # no communication yet
    comp = recipes.compression(args.compression, hvd.Compression, **compressor_options(args))
    kind = "codes" if recipes.uses_codes_optimizer(args.compression) else "horovod"
    for w, b in layers:
        w.assign(hvd.broadcast(w, 0))
    measure(step_fn(layers, x, y, (kind, comp)), args, {"step": compute}, params, hvd.allgather_object, hvd.rank(),
            hvd.size())


if __name__ == "__main__":
    main()
