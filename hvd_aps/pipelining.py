"""hvd_aps.pipelining: torch.distributed.pipelining's PipelineStage sending each stage's activations
forward and their gradients backward as APS codes, for the schedules users run (GPipe, 1F1B,
interleaved, zero bubble)::

    stage = hvd_aps.pipelining.CodesPipelineStage(stage_module, stage_index, num_stages, device,
                                                  forward="e4m3", backward="e5m2")
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)

Each float32, bfloat16 or float16 tensor a stage sends travels as one uint8 message: codes in the
direction's format, every block of 2048 values at the power of two its own max gives, the blocks'
exponents after them (hvd_aps.BlockCodes: a point-to-point send has no Max-allreduce to agree a
scale). The receiver decodes where the stage reads it (_retrieve_recv_activations,
_retrieve_recv_grads), rounding to nearest. Other dtypes (positions, masks), and two stages on one
rank, go as torch sends them. `bytes_sent`: what this stage sent.
"""
import enum
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from . import _arrays, _device
from ._codes_collectives import CODED_DTYPES
from ._owned import BlockCodes
from .formats import FloatFormat

_Format = Union[BlockCodes, FloatFormat, str]


class Direction(enum.Enum):
    """Which way a message goes: a micro-batch's activations, or their gradients."""
    FORWARD = "forward"
    BACKWARD = "backward"
_READS = ("_retrieve_recv_activations", "_retrieve_recv_grads")  # where torch's stage reads what it received
if not all(hasattr(PipelineStage, name) for name in _READS):
    raise ImportError(f"hvd_aps.pipelining decodes where PipelineStage reads its received tensors ({', '.join(_READS)}"
                      f"), which this torch {torch.__version__} does not have (torch 2.13 does)")


class CodesPipelineStage(PipelineStage):
    """PipelineStage whose sends are codes: `forward` the activations' (a BlockCodes or a format),
    `backward` their gradients' (default: forward's); the other arguments are PipelineStage's."""

    def __init__(self, *args, forward: _Format = "e4m3", backward: _Format = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.codes = {Direction.FORWARD: BlockCodes.parse(forward),
                      Direction.BACKWARD: BlockCodes.parse(backward if backward is not None else forward)}
        self._received = {d: {} for d in Direction}  # chunk -> [(message, buffer)] to decode
        self._sending = {}  # (direction, chunk) -> messages in flight: kept until the chunk's next send
        self.bytes_sent = 0

    # sends ----------------------------------------------------------------------------------------
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self._encoded(super().get_fwd_send_ops(fwd_chunk_id), Direction.FORWARD, fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return self._encoded(super().get_bwd_send_ops(bwd_chunk_id), Direction.BACKWARD, bwd_chunk_id)

    def _encoded(self, ops: list, direction: Direction, chunk: int) -> list:
        codes = self.codes[direction]
        messages = [self._encode(op.tensor, codes) if op.tensor.dtype in CODED_DTYPES else op.tensor for op in ops]
        self._sending[direction, chunk] = messages
        self.bytes_sent += sum(m.numel() * m.element_size() for m in messages)
        return [dist.P2POp(dist.isend, m, op.peer, op.group, op.tag) for op, m in zip(ops, messages)]

    @staticmethod
    def _encode(tensor: torch.Tensor, codes: BlockCodes) -> torch.Tensor:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        message = torch.empty(codes.message_bytes(flat.numel()), dtype=torch.uint8, device=tensor.device)
        with _device.entered(_device.place_of(flat)):
            codes.encode(_arrays.as_array(flat), _arrays.as_array(message))
        return message

    # receives ------------------------------------------------------------------------------------
    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        return self._receiving(super().get_fwd_recv_ops(fwd_chunk_id), Direction.FORWARD, fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        return self._receiving(super().get_bwd_recv_ops(bwd_chunk_id), Direction.BACKWARD, bwd_chunk_id)

    def _receiving(self, ops: list, direction: Direction, chunk: int) -> list:
        """Each receive of a coded dtype into a message of the buffer's codes, the buffer decoded
        into before use; any other as it was."""
        codes, pending, received = self.codes[direction], [], []
        for op in ops:
            if op.tensor.dtype not in CODED_DTYPES:
                received.append(op)
                continue
            message = torch.empty(codes.message_bytes(op.tensor.numel()), dtype=torch.uint8, device=op.tensor.device)
            pending.append((message, op.tensor))
            received.append(dist.P2POp(dist.irecv, message, op.peer, op.group, op.tag))
        if pending:
            self._received[direction][chunk] = pending
        return received

    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        self._decode(self._received[Direction.FORWARD].pop(fwd_chunk_id, ()), self.codes[Direction.FORWARD])
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        self._decode(self._received[Direction.BACKWARD].pop(bwd_chunk_id, ()), self.codes[Direction.BACKWARD])
        return super()._retrieve_recv_grads(bwd_chunk_id)

    @staticmethod
    def _decode(pending, codes: BlockCodes) -> None:
        """Each received message into its buffer (a leaf that may require grad: written in place)."""
        for message, buffer in pending:
            values = torch.empty(buffer.numel(), dtype=torch.float32, device=buffer.device)
            with _device.entered(_device.place_of(values)):
                codes.decode(_arrays.as_array(message), buffer.numel(), _arrays.as_array(values))
            with torch.no_grad():
                buffer.copy_(values.view(buffer.shape))
