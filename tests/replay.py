"""The resume checks' straight runs replayed in the test's own process (tests/test_resume.py): the
reference bits a run through an entry point must end on, computed on the machine at hand.

torch: the workers' model trained on one replica per rank with the workers' batches, their SGD
and one thread, each step's gradients averaged by the in-process driver (hvd_aps.emulate: the
codes allreduce, or FSDP2's codes reduce-scatter per module) under the tensor names the entry
point gives them (stochastic rounding's seeds and the residuals are drawn from those names), and
where FSDP2 gathers the parameters as codes, each step computed with the NumPy model's codes of
them (tests/model.py).
TensorFlow: each step's gradients of every rank, as the worker computed them, averaged by the
in-process driver, against what the entry point handed the optimizer in that step.
"""
import numpy as np

import hvd_aps
import model
from hvd_aps import diloco_peers, emulate

STEPS, WIDTH, LAYERS, BATCH, LR, MOMENTUM = 8, 256, 6, 8, 0.05, 0.9


def _net():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _local_grads(net, step: int, rank: int, computed_with=None) -> list:
    """Rank `rank`'s gradients of step `step` (the workers' batch, common.straight_or_resumed),
    computed with the parameters' values computed_with gives."""
    import torch
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    net.zero_grad(set_to_none=True)
    masters = [p.detach().clone() for p in net.parameters()]
    if computed_with is not None:
        with torch.no_grad():
            for p, value in zip(net.parameters(), computed_with(masters)):
                p.copy_(torch.from_numpy(value).reshape(p.shape))
    torch.nn.functional.mse_loss(net(x), y).backward()
    with torch.no_grad():
        for p, master in zip(net.parameters(), masters):
            p.copy_(master)
    return [p.grad.detach().numpy().ravel().copy() for p in net.parameters()]


def _trained(ranks: int, average, computed_with=None) -> np.ndarray:
    """Rank 0's final parameters end to end, each step's gradients averaged by average(grads);
    computed_with(params) -> the values of the parameters each step computes with (default: the
    parameters themselves)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nets = [_net() for _ in range(ranks)]
        opts = [torch.optim.SGD(n.parameters(), lr=LR, momentum=MOMENTUM) for n in nets]
        for step in range(STEPS):
            averaged = average([_local_grads(net, step, r, computed_with) for r, net in enumerate(nets)])
            for net, opt in zip(nets, opts):
                for p, g in zip(net.parameters(), averaged):
                    p.grad = torch.from_numpy(g.reshape(p.shape).copy())
                opt.step()
        return torch.cat([p.detach().ravel() for p in nets[0].parameters()]).numpy()
    finally:
        torch.set_num_threads(threads)


def torch_allreduce(options: dict, keys, ranks: int = 2, ranks_per_host: int = 1) -> np.ndarray:
    """The final parameters of the workers' training with every gradient through the codes
    allreduce of APSCompressor("e3m0", **options), keys[i] naming parameter i."""
    compressors = [hvd_aps.APSCompressor("e3m0", **options) for _ in range(ranks)]
    return _trained(ranks, lambda grads: emulate.codes_allreduce(compressors, grads, "replay", ranks_per_host, keys))


def _shard_rows(grads: list, world: int) -> np.ndarray:
    """(world, n) rows of one module's gradients as FSDP2 lays them out for its reduce-scatter:
    row r holds rank r's dim-0 shard of each parameter, the parameters end to end."""
    return np.stack([np.concatenate([g[r * len(g) // world:(r + 1) * len(g) // world].ravel() for g in grads])
                     for r in range(world)])


def _gathered_as_codes(fmt: str, ranks: int):
    """computed_with for FSDP2's parameters gathered as codes: each rank's shard of a module (its
    dim-0 chunk of the weight, then of the bias) through the NumPy model of per-block codes."""
    def copy(params):
        values = []
        for u in range(LAYERS):
            weight, bias = (p.numpy() for p in params[2 * u:2 * u + 2])
            rows = [model.reencoded(row, fmt) for row in _shard_rows([weight, bias], ranks)]
            half = WIDTH * WIDTH // ranks
            values += [np.concatenate([r[:half] for r in rows]), np.concatenate([r[half:] for r in rows])]
        return values
    return copy


def torch_fsdp(options: dict, names, ranks: int = 2, params=None) -> np.ndarray:
    """The same training with each module's gradients through the codes reduce-scatter (one
    Linear a module, its weight and bias sharded on dim 0), names[u] naming module u; params: the
    format the parameters are gathered in (None: exactly)."""
    compressors = [hvd_aps.APSCompressor("e3m0", **options) for _ in range(ranks)]
    shapes = [(WIDTH, WIDTH), (WIDTH,)]

    def average(grads):
        modules = [[[g[2 * u].reshape(shapes[0]), g[2 * u + 1]] for u in range(LAYERS)] for g in grads]
        inputs = [[_shard_rows(m, ranks) for m in mine] for mine in modules]
        shards = emulate.codes_reduce_scatter(compressors, inputs, names)
        averaged = []
        for u in range(LAYERS):
            rows = np.stack([shards[r][u] for r in range(ranks)])  # (world, n): rank r's shard of the module
            half = WIDTH * WIDTH // ranks
            averaged.append(rows[:, :half].ravel())
            averaged.append(rows[:, half:].ravel())
        return averaged

    return _trained(ranks, average, None if params is None else _gathered_as_codes(params, ranks))


def steps_replayed(options: dict, keys, local: list, delivered: list, ranks_per_host: int = 1) -> list:
    """Each step's gradients of every rank (local[r][step] as the worker saved them, tensors end
    to end as one flat, sizes in delivered's split) averaged by the in-process driver ->
    [(step, tensor)] where it differs from delivered[step] bit for bit."""
    ranks, sizes = len(local), [a.size for a in delivered[0]]
    compressors = [hvd_aps.APSCompressor("e3m0", **options) for _ in range(ranks)]
    cuts = np.cumsum([0] + sizes)
    wrong = []
    for step, want in enumerate(delivered):
        grads = [[local[r][step][a:b] for a, b in zip(cuts[:-1], cuts[1:])] for r in range(ranks)]
        got = emulate.codes_allreduce(compressors, grads, "replay", ranks_per_host, keys)
        wrong += [(step, t) for t, (g, w) in enumerate(zip(got, want)) if g.tobytes() != w.ravel().tobytes()]
    return wrong


def diloco(options: dict, fragments: list) -> list:
    """DiLoCo written again from its description (hvd_aps/diloco.py's docstring): the workers'
    model, AdamW and batches (tests/workers/common.py) on one replica per rank; fragment f (its
    parameters' indices in fragments[f]) synced after the steps t with t = (f + 1) H / F (mod H),
    its pseudo-gradients (synced - now) averaged (float32: (a + b) / 2; codes: the in-process
    driver under DiLoCo's names; int8: INTELLECT-1's ring in one process) and applied `delay`
    steps later by Nesterov SGD (0.7, 0.9) on the synced values, the parameters set to
    lerp(synced, now, mix). -> per rank, the parameters after every step."""
    import torch
    from workers.common import DILOCO_STEPS, diloco_batch, diloco_compressor, diloco_model
    sync_every, delay, mix = options["sync_every"], options.get("delay", 0), options.get("mix", 0.0)
    every, ranks = sync_every // len(fragments), 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [diloco_model() for _ in range(ranks)]
        names = [f"diloco.{name}" for name, _ in models[0].named_parameters()]
        params = [list(m.parameters()) for m in models]
        inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        synced = [[[params[r][i].detach().clone() for i in part] for part in fragments] for r in range(ranks)]
        outers = [[torch.optim.SGD(s, lr=0.7, momentum=0.9, nesterov=True) for s in mine] for mine in synced]
        compressors = [None if options["compression"] == "int8" else diloco_compressor(options["compression"])
                       for _ in range(ranks)]
        pending, after = {}, [[] for _ in range(ranks)]

        def apply(f):
            averaged = pending.pop(f)[1]
            for r in range(ranks):
                for s, a in zip(synced[r][f], averaged):
                    s.grad = torch.from_numpy(a.reshape(s.shape).copy())
                outers[r][f].step()
                with torch.no_grad():
                    for s, i in zip(synced[r][f], fragments[f]):
                        params[r][i].copy_(torch.lerp(s, params[r][i], mix) if mix else s)

        for step in range(1, DILOCO_STEPS + 1):
            for r, (m, inner) in enumerate(zip(models, inners)):
                x, y = diloco_batch(step - 1, r)
                inner.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                inner.step()
            for f in [f for f, (started, _) in pending.items() if step - started == delay]:
                apply(f)
            if step % every == 0:
                f = (step // every - 1) % len(fragments)
                pseudo = [[(s - params[r][i]).detach().numpy().ravel().copy() for s, i in zip(synced[r][f], fragments[f])]
                          for r in range(ranks)]
                if options["compression"] == "int8":  # INTELLECT-1's ring over the fragment's flat vector
                    flat = diloco_peers.intellect1_int8_allreduce([np.concatenate(p) for p in pseudo])
                    averaged = np.split(flat, np.cumsum([a.size for a in pseudo[0]])[:-1])
                elif compressors[0] is None:  # a sum of two float32 is one rounding, in either order
                    averaged = [(a + b) / np.float32(2) for a, b in zip(*pseudo)]
                else:
                    averaged = emulate.codes_allreduce(compressors, pseudo, f"diloco.fragment{f}", 1,
                                                       [names[i] for i in fragments[f]])
                pending[f] = (step, averaged)
                if delay == 0:
                    apply(f)
            for r in range(ranks):
                after[r].append(torch.cat([p.detach().reshape(-1) for p in params[r]]).numpy().copy())
        return [np.stack(a) for a in after]
    finally:
        torch.set_num_threads(threads)
