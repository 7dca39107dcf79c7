"""Synthetic data-parallel benchmark with horovod.tensorflow, twin of pytorch_synthetic_benchmark.py:
the same MLP (4 x hidden^2 parameters) or the same many small tensors (--profile tensors),
hvd.DistributedGradientTape inside tf.function.

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


def mlp(args):
    """(variables, loss): the MLP of 4 x hidden^2 parameters on random inputs."""
    h = args.hidden
    layers = [(tf.Variable(tf.random.normal([h, h], stddev=h ** -0.5)), tf.Variable(tf.zeros([h]))) for _ in range(4)]
    x, y = tf.random.normal([args.batch_size, h]), tf.random.normal([args.batch_size, h])

    def loss():
        out = x
        for w, b in layers:
            out = tf.nn.relu(out @ w + b)
        return tf.reduce_mean((out - y) ** 2)
    return [v for w, b in layers for v in (w, b)], loss


def tensors(args):
    """(variables, loss): --tensors vectors of --tensor-elements, the loss the sum of each one's
    product with a fixed vector (synthetic_models.Shaped's compute)."""
    shape = [args.tensor_elements]
    variables = [tf.Variable(tf.random.normal(shape, stddev=0.01)) for _ in range(args.tensors)]
    fixed = [tf.random.normal(shape) for _ in range(args.tensors)]
    scale = (args.tensors * args.tensor_elements) ** -0.5  # as synthetic_models.Shaped: stable under SGD
    return variables, lambda: scale * tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, fixed)])


PROFILES = {"mlp": mlp, "tensors": tensors}


def step_fn(variables, loss_of, compression, lr=1e-6):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_of()
        if compression is None:
            grads = tape.gradient(loss, variables)
        elif compression[0] == "codes":
            grads = hvd_aps.tensorflow.DistributedGradientTape(tape, compression[1]).gradient(loss, variables)
        else:
            # num_groups=1: Horovod compresses every gradient before it reduces any (else one at a time)
            tape = hvd.DistributedGradientTape(tape, compression=compression[1], num_groups=1)
            grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(lr * g)

    return lambda: step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    if args.profile not in PROFILES:
        parser.error(f"the TensorFlow benchmark has the profiles {sorted(PROFILES)}")
    hvd.init(process_sets="dynamic") if args.dynamic_process_sets else hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.random.set_seed(0)
    variables, loss = PROFILES[args.profile](args)
    params = sum(int(v.shape.num_elements()) for v in variables)
    compute = statistics.median(timed(step_fn(variables, loss, None), 3))  # no communication yet
    comp = recipes.compression(args.compression, hvd.Compression, **compressor_options(args))
    kind = "codes" if recipes.uses_codes_optimizer(args.compression) else "horovod"
    for v in variables:
        v.assign(hvd.broadcast(v, 0))
    measure(step_fn(variables, loss, (kind, comp)), args, {"step": compute}, params, hvd.allgather_object, hvd.rank(),
            hvd.size())


if __name__ == "__main__":
    main()
