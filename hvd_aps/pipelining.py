"""hvd_aps.pipelining: torch.distributed.pipelining's PipelineStage sending each stage's activations
forward and their gradients backward as APS codes, for the schedules users run (GPipe, 1F1B,
interleaved, zero bubble)::

    stage = hvd_aps.pipelining.CodesPipelineStage(stage_module, stage_index, num_stages, device,
                                                  forward="e4m3", backward="e5m2")
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)

Every tensor a stage sends (get_fwd_send_ops, get_bwd_send_ops: one micro-batch's) travels as one
uint8 message: its codes in the direction's format, every block of 2048 values at the power of two
its own max gives, the blocks' exponents after them (hvd_aps.BlockCodes: a point-to-point send has
no Max-allreduce to agree on a scale, so the sender's own travels with the codes). The receiving
stage receives the message (get_fwd_recv_ops, get_bwd_recv_ops) and decodes it into the buffer the
stage computes from where it reads it (torch 2.13's _retrieve_recv_activations and
_retrieve_recv_grads: the schedules have waited for the receive by then). Rounding to nearest.
Two stages on one rank (a V schedule's turn) hand their tensors over in memory, exactly, as torch
does. `bytes_sent`: what this stage sent.
"""
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from . import _arrays, _device
from ._owned import BlockCodes
from .formats import FloatFormat

_Codes = Union[BlockCodes, FloatFormat, str]
_READS = ("_retrieve_recv_activations", "_retrieve_recv_grads")  # where torch's stage reads what it received
if not all(hasattr(PipelineStage, name) for name in _READS):
    raise ImportError(f"hvd_aps.pipelining decodes where PipelineStage reads its received tensors ({', '.join(_READS)}"
                      f"), which this torch {torch.__version__} does not have (torch 2.13 does)")


class CodesPipelineStage(PipelineStage):
    """PipelineStage whose sends are codes: `forward` the activations' (a BlockCodes or a format),
    `backward` their gradients' (default: forward's); the other arguments are PipelineStage's."""

    def __init__(self, *args, forward: _Codes = "e4m3", backward: _Codes = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.forward_codes = BlockCodes.parse(forward)
        self.backward_codes = BlockCodes.parse(backward if backward is not None else forward)
        self._received = {"forward": {}, "backward": {}}  # chunk -> [(message, buffer)] to decode
        self._sending = {}  # (direction, chunk) -> messages in flight: kept until the chunk's next send
        self.bytes_sent = 0

    # sends ----------------------------------------------------------------------------------------
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self._encoded(super().get_fwd_send_ops(fwd_chunk_id), self.forward_codes, ("forward", fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return self._encoded(super().get_bwd_send_ops(bwd_chunk_id), self.backward_codes, ("backward", bwd_chunk_id))

    def _encoded(self, ops: list, codes: BlockCodes, key: tuple) -> list:
        messages = [self._encode(op.tensor, codes) for op in ops]
        self._sending[key] = messages
        self.bytes_sent += sum(m.numel() for m in messages)
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
        return self._receiving(super().get_fwd_recv_ops(fwd_chunk_id), self.forward_codes, "forward", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        return self._receiving(super().get_bwd_recv_ops(bwd_chunk_id), self.backward_codes, "backward", bwd_chunk_id)

    def _receiving(self, ops: list, codes: BlockCodes, direction: str, chunk: int) -> list:
        """Each receive into a message of the buffer's codes; the buffer decoded into before use."""
        pending = [(torch.empty(codes.message_bytes(op.tensor.numel()), dtype=torch.uint8, device=op.tensor.device),
                    op.tensor) for op in ops]
        if pending:
            self._received[direction][chunk] = pending
        return [dist.P2POp(dist.irecv, m, op.peer, op.group, op.tag) for op, (m, _) in zip(ops, pending)]

    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        self._decode(self._received["forward"].pop(fwd_chunk_id, ()), self.forward_codes)
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        self._decode(self._received["backward"].pop(bwd_chunk_id, ()), self.backward_codes)
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
