"""The --compression names the examples and benchmarks take:

    none, fp16      the framework's own (Horovod's Compression.none / .fp16; DDP: its default
                    allreduce / fp16_compress_hook)
    tokens          horovod.torch only, a floor and no training: Horovod's per-gradient path
                    alone, as APSCompressor drives it (Tokens)
    <recipe>        an hvd_aps recipe (hvd_aps.RECIPES: aps-e4m3, aps-e3m0-ef, aps-e4m3-auto, ...),
                    through the framework's own optimizer (horovod.torch.DistributedOptimizer)
    codes-<rest>    the recipe aps-<rest> through hvd_aps.torch.DistributedOptimizer
"""
import hvd_aps
from hvd_aps._tokens import token_values

STOCK = ("none", "fp16")
CODES_PREFIX = "codes-"
FLOOR = "tokens"
TOKEN_ELEMENTS = token_values(0).size  # what APSCompressor hands Horovod in place of a gradient


class Tokens:
    """A Horovod Compressor that hands Horovod's optimizer a two-element token in place of every
    gradient, as APSCompressor does, and gives the gradient back unreduced: Horovod's hook, its
    enqueueing, its negotiation and allreduce of the tokens and its synchronize(), with no
    exchange at all. Its step is the floor of any compressor that keeps Horovod's optimizer and
    hands it a token a gradient; its ranks do not train together (each keeps its own gradient)."""

    @staticmethod
    def compress(tensor):
        return tensor.new_ones(TOKEN_ELEMENTS, dtype=tensor.dtype), tensor

    @staticmethod
    def decompress(tensor, ctx):
        return ctx


def compression(name, stock=None, **options):
    """The compressor a --compression name stands for (`stock`: the framework's Compression
    namespace, for none and fp16); options: further APSCompressor keywords."""
    if name in STOCK:
        return getattr(stock, name) if stock is not None else name
    if name == FLOOR:
        return Tokens
    recipe = "aps-" + name[len(CODES_PREFIX):] if name.startswith(CODES_PREFIX) else name
    return hvd_aps.APSCompressor.from_recipe(recipe, **options)


def uses_codes_optimizer(name):
    return name.startswith(CODES_PREFIX)
