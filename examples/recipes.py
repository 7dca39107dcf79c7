"""The --compression names the examples and benchmarks take:

    none, fp16      the framework's own (Horovod's Compression.none / .fp16; DDP: its default
                    allreduce / fp16_compress_hook)
    <recipe>        an hvd_aps recipe (hvd_aps.RECIPES: aps-e4m3, aps-e3m0-ef, aps-e4m3-auto, ...),
                    through the framework's own optimizer (horovod.torch.DistributedOptimizer)
    codes-<rest>    the recipe aps-<rest> through hvd_aps.torch.DistributedOptimizer
"""
import hvd_aps

STOCK = ("none", "fp16")
CODES_PREFIX = "codes-"


def compression(name, stock=None, **options):
    """The compressor a --compression name stands for (`stock`: the framework's Compression
    namespace, for none and fp16); options: further APSCompressor keywords."""
    if name in STOCK:
        return getattr(stock, name) if stock is not None else name
    recipe = "aps-" + name[len(CODES_PREFIX):] if name.startswith(CODES_PREFIX) else name
    return hvd_aps.APSCompressor.from_recipe(recipe, **options)


def uses_codes_optimizer(name):
    return name.startswith(CODES_PREFIX)
