"""Data-parallel Keras 3 training of a small CNN on scikit-learn's digits with horovod.tensorflow
and APSCompressor, through hvd_aps.keras.DistributedOptimizer (which averages under Keras 3).

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2_keras_digits.py --compression aps-e4m3

--compression: none | fp16 | aps-<format> | naive-<format>. Nothing is downloaded.
"""
import argparse

import horovod.tensorflow as hvd
import keras
import numpy as np
from sklearn.datasets import load_digits

import hvd_aps
import hvd_aps.keras
import recipes


def digits(rank, size, test_fraction=0.2, seed=0):
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1), y[order]
    n_test = int(len(x) * test_fraction)
    return (x[n_test:][rank::size], y[n_test:][rank::size]), (x[:n_test], y[:n_test])


def cnn():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="aps-e4m3")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(args.seed)
    (x, y), (x_test, y_test) = digits(hvd.rank(), hvd.size())
    compression = recipes.compression(args.compression, hvd.Compression)
    model = cnn()
    opt = hvd_aps.keras.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9),
                                             compression=compression)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {len(x)} training images per rank, compression={args.compression}")
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              validation_data=(x_test, y_test) if hvd.rank() == 0 else None,
              callbacks=[hvd_aps.keras.BroadcastInitialState()], verbose=2 if hvd.rank() == 0 else 0)
    loss, acc = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"final test accuracy {acc:.4f}")
        if isinstance(compression, hvd_aps.APSCompressor):
            t = compression.totals()
            print(f"per rank, all {args.epochs} epochs: {t}")


if __name__ == "__main__":
    main()
