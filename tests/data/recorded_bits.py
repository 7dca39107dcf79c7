"""The final parameters of the resume checks' straight runs (tests/test_resume.py: the DDP hook,
FSDP2, the one line and hvd_aps.torch's optimizer through Horovod, TensorFlow's tape and Keras 3's
fit) as a tree of hvd_aps gave them, kept as digests in bits_<commit>.json: this tree must give
the same bits. Recorded by running those tests with that tree's package first on the path:

    HVD_APS_RECORD_BITS=1 PYTHONPATH=<that tree> python -m pytest tests/test_resume.py -k "same_bits"

The bits also depend on the machine's float kernels (torch's and TensorFlow's matrix products
pick theirs by processor), so each framework's digests are kept beside a digest of a plain
computation of that framework on the recording machine: where it differs here, the check is
skipped, saying why."""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

TREE = "170dc6e"
FILE = Path(__file__).parent / f"bits_{TREE}.json"
RECORD = "HVD_APS_RECORD_BITS"
WIDTH, LAYERS, BATCH = 256, 6, 8


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def torch_kernels() -> str:
    """The digest of a few steps of the workers' MLP trained by torch alone, on one thread."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):
            x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        return digest(p.detach().numpy() for p in net.parameters())
    finally:
        torch.set_num_threads(threads)


def tensorflow_kernels() -> str:
    """The digest of the gradients of the TF workers' two dense layers on a fixed batch."""
    import tensorflow as tf
    gen = np.random.default_rng(0)
    x, y = (tf.constant(gen.normal(size=(2 * BATCH, WIDTH)).astype(np.float32)) for _ in range(2))
    w1, w2 = (tf.constant(gen.normal(size=(WIDTH, WIDTH)).astype(np.float32) / 16) for _ in range(2))
    with tf.GradientTape() as tape:
        tape.watch([w1, w2])
        loss = tf.reduce_mean((tf.tanh(x @ w1) @ w2 - y) ** 2)
    return digest(g.numpy() for g in tape.gradient(loss, [w1, w2]))


KERNELS = {"torch": torch_kernels, "tensorflow": tensorflow_kernels}


def same_bits(framework: str, runs: dict) -> None:
    """runs: {name: one rank's final parameters} -> each digest equal to the recorded tree's
    (with RECORD set: recorded, for this framework, beside its kernels' digest)."""
    kernels = KERNELS[framework]()
    got = {name: digest([a]) for name, a in runs.items()}
    if os.environ.get(RECORD):
        saved = json.loads(FILE.read_text()) if FILE.exists() else {}
        saved[framework] = {"kernels": kernels, "runs": {**saved.get(framework, {}).get("runs", {}), **got}}
        FILE.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
        return
    recorded = json.loads(FILE.read_text())[framework]
    if recorded["kernels"] != kernels:
        pytest.skip(f"{framework}'s float kernels give other bits on this machine than on the one that "
                    f"recorded {FILE.name}: its runs cannot be compared here")
    for name, value in got.items():
        assert value == recorded["runs"][name], f"{name}: not the bits of tree {TREE}"
