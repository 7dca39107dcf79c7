"""The outer exchanges other DiLoCo implementations run, in one process: N float32 pseudo-gradients
-> the float32 average every worker applies, rounding for rounding as each source describes it.
hvd_aps's own: emulate.codes_allreduce; bf16 DiLoCo: peers.nccl_ring_allreduce(..., "bfloat16", "avg").
Intellect1Int8Ring runs INTELLECT-1's on real ranks (torch.distributed), its bytes on the wire.

- INTELLECT-1 (PrimeIntellect-ai/prime at 5cc57a0f, src/zeroband/diloco.py, C/csrc/): divided by
  N, then a ring of uint8 codes over N x 2 chunks: each hop quantizes its running fp32 sum afresh,
  q = clamp(round(x / scale) + 128, 0, 255) (halves away from zero), scale = 6 sigma / 256, sigma =
  norm2(x) / sqrt(n - 1), with a codebook of each bin's mean (0 if empty; here in float64), and the
  next rank adds codebook[q]; the chunk's last rank keeps codebook[q] of its total for the allgather.
- torchft (meta-pytorch/torchft at 7eb7087, quantization.py, collectives.py): per row (1-D: n rows
  of 1) q = e4m3fn(row * 448 / max abs(row)); an alltoall of ceil(rows / N) rows, each owner sums
  q / scale in float32 from its own rank on and requantizes, an allgather; then divided by N.
- Streaming DiLoCo (arXiv 2501.18512): 4-bit outer gradients summed in float32; e3m0 at each
  worker's own max is this module's reading, not the paper's stated arithmetic.
"""
from typing import Sequence

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from . import codec, scaling
from .diloco import OuterAverage

INT8_BINS, INT8_ZERO, INT8_SPAN = 256, 128, 6.0  # INTELLECT-1's uniform 8-bit: +-3 sigma in 256 bins
RING_BUFFERS = 2  # INTELLECT-1's ring: N x 2 chunks
FP8_MAX = 448.0   # e4m3fn's largest value: torchft's scale puts every row's max there


def float32_average(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The float32 mean (DiLoCo's and OpenDiLoCo's outer allreduce): summed in rank order, / N."""
    total = np.zeros_like(np.asarray(arrays[0], np.float32))
    for a in arrays:
        total = total + np.asarray(a, np.float32)
    return total / np.float32(len(arrays))


def _int8_quantize(x: np.ndarray) -> tuple:
    """(codes, codebook) of uniform_8bit_quantize."""
    n = x.size
    sigma = np.sqrt(np.sum(x.astype(np.float64) ** 2) / max(n - 1, 1))
    scale = np.float32(INT8_SPAN * sigma / INT8_BINS)
    if scale == 0:
        return np.full(n, INT8_ZERO, np.uint8), np.zeros(INT8_BINS, np.float32)
    codes = np.clip(std_round(x.astype(np.float32) / scale) + INT8_ZERO, 0, INT8_BINS - 1).astype(np.uint8)
    counts = np.bincount(codes, minlength=INT8_BINS)
    sums = np.bincount(codes, weights=x.astype(np.float64), minlength=INT8_BINS)
    book = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)
    return codes, book


def std_round(v: np.ndarray) -> np.ndarray:
    """C++'s std::round of float32 values: to nearest, halves away from zero (the fraction left
    by trunc is exact in float32)."""
    whole = np.trunc(v)
    return whole + np.sign(v) * (np.abs(v - whole) >= np.float32(0.5))


def _int8_round_trip(x: np.ndarray) -> np.ndarray:
    codes, book = _int8_quantize(x)
    return book[codes]


def intellect1_int8_allreduce(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """INTELLECT-1's outer allreduce (module docstring): the pre-divided pseudo-gradients through
    its uint8 ring -> the average every worker applies. Chunk c of each pass of N goes round the
    ring from rank c + 1 to its owner c, the usual ring's order (the source's offset unchecked)."""
    n, shape = len(arrays), np.shape(arrays[0])
    held = np.stack([np.asarray(a, np.float32).ravel() / np.float32(n) for a in arrays])
    out = np.empty(held.shape[1], np.float32)
    for c, span in enumerate(_ring_chunks(held.shape[1], n)):
        chunk = held[:, span]
        total = chunk[(c + 1) % n]
        for hop in range(2, n + 1):  # what arrives is the sender's running sum, quantized afresh
            total = chunk[(c + hop) % n] + _int8_round_trip(total)
        out[span] = _int8_round_trip(total)  # the owner's own total, as the allgather carries it
    return out.reshape(shape)


def _ring_chunks(elements: int, n: int) -> list:
    """The ring's chunks of a vector over n ranks: N x RING_BUFFERS slices of equal size (the last shorter)."""
    size = max(1, -(-elements // (n * RING_BUFFERS)))
    return [slice(lo, min(lo + size, elements)) for lo in range(0, elements, size)]


class Intellect1Int8Ring(OuterAverage):
    """INTELLECT-1's outer allreduce over torch.distributed: the bits of intellect1_int8_allreduce,
    each hop's uint8 codes and float32 codebook sent point to point, then every owner's chunks
    allgathered. Synchronous: start() returns once it is done. `group`: DiLoCo's process_group
    (every rank by default), one that carries CPU tensors (Gloo): the messages are on the CPU."""

    def __init__(self, group=None):
        self.group = group

    def start(self, flat, bucket):
        n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        held = flat.detach().cpu().numpy().astype(np.float32) / np.float32(n)
        chunks = _ring_chunks(held.size, n)
        world = self.group or dist.group.WORLD
        after, before = (dist.get_global_rank(world, (rank + step) % n) for step in (1, -1))
        running = {c: held[s] for c, s in enumerate(chunks) if (c + 1) % n == rank}
        for hop in range(1, n):  # chunk c is at rank (c + hop) % n and goes on to the next rank
            sent = {c: _int8_message(running.pop(c)) for c in list(running)}
            got = {c: torch.empty(_message_bytes(s.stop - s.start), dtype=torch.uint8)
                   for c, s in enumerate(chunks) if (c + hop + 1) % n == rank}
            ops = [dist.P2POp(dist.isend, m, after, self.group, tag=c) for c, m in sent.items()]
            ops += [dist.P2POp(dist.irecv, m, before, self.group, tag=c) for c, m in got.items()]
            for work in dist.batch_isend_irecv(ops) if ops else ():
                work.wait()
            running = {c: held[chunks[c]] + _int8_decoded(m) for c, m in got.items()}
        flat.copy_(torch.from_numpy(self._gathered(running, chunks, n)).reshape(flat.shape))
        return flat

    def _gathered(self, owned: dict, chunks: list, n: int) -> np.ndarray:
        """Every owner's totals (chunk c's at rank c % n, slot c // n of its message) allgathered
        as codes -> the whole vector every rank decodes alike, the owner's own chunks too."""
        slot = _message_bytes(chunks[0].stop - chunks[0].start) if chunks else 0
        mine = torch.zeros(RING_BUFFERS * slot, dtype=torch.uint8)
        for c, total in owned.items():
            message = _int8_message(total)
            mine[(c // n) * slot:(c // n) * slot + message.numel()] = message
        every = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(every, mine, group=self.group)
        out = np.empty(chunks[-1].stop if chunks else 0, np.float32)
        for c, s in enumerate(chunks):
            out[s] = _int8_decoded(every[c % n][(c // n) * slot:(c // n) * slot + _message_bytes(s.stop - s.start)])
        return out

    def wait(self, handle):
        return handle


def _message_bytes(elements: int) -> int:
    """A chunk's message: its uint8 codes, then its float32 codebook."""
    return elements + 4 * INT8_BINS


def _int8_message(x: np.ndarray) -> torch.Tensor:
    codes, book = _int8_quantize(x)
    return torch.from_numpy(np.concatenate([codes, book.view(np.uint8)]))


def _int8_decoded(message: torch.Tensor) -> np.ndarray:
    raw = message.numpy()
    return raw[-4 * INT8_BINS:].view(np.float32)[raw[:-4 * INT8_BINS]]


def torchft_fp8_allreduce(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """torchft's quantized outer allreduce (module docstring) -> the average every worker applies."""
    n, shape = len(arrays), np.shape(arrays[0])
    if len(shape) not in (1, 2):
        raise ValueError(f"torchft quantizes 1-D and 2-D tensors only, got shape {shape}")
    rows = [np.asarray(a, np.float32).reshape(shape if len(shape) == 2 else (-1, 1)) for a in arrays]
    sent = [_fp8_rows(r) for r in rows]
    per = -(-rows[0].shape[0] // n)
    total = np.empty_like(rows[0])
    for owner in range(n):
        lo, hi = owner * per, min((owner + 1) * per, rows[0].shape[0])
        if lo >= hi:
            continue
        acc = np.zeros((hi - lo, rows[0].shape[1]), np.float32)
        for k in range(n):  # from the owner's own rank on
            q, scale = sent[(owner + k) % n]
            acc = acc + q[lo:hi].astype(np.float32) / scale[lo:hi]
        q, scale = _fp8_rows(acc)
        total[lo:hi] = q.astype(np.float32) / scale
    return (total / np.float32(n)).reshape(shape)


def _fp8_rows(rows: np.ndarray) -> tuple:
    """(e4m3fn codes, per-row float32 scales) of torchft's fused_quantize_into_fp8."""
    amax = np.abs(rows).max(axis=1, keepdims=True).astype(np.float32)
    with np.errstate(divide="ignore"):
        scale = np.where(amax > 0, np.float32(FP8_MAX) / amax, np.float32(1)).astype(np.float32)
    return (rows * scale).astype(ml_dtypes.float8_e4m3fn), scale


def fp4_average(arrays: Sequence[np.ndarray], fmt: str = "e3m0") -> np.ndarray:
    """Streaming DiLoCo's 4-bit outer gradients as read here (module docstring): each worker's
    rounded onto `fmt` at the power of two its own max gives, gathered, summed in float32 in rank
    order, divided by N."""
    total = np.zeros_like(np.asarray(arrays[0], np.float32))
    for a in arrays:
        a = np.asarray(a, np.float32)
        shift = scaling.shift_for(codec.amax(a), 1, fmt)
        total = total + codec.quantize(a, fmt, shift=shift)
    return total / np.float32(len(arrays))
