"""Launch N = hosts x ranks-per-host real processes on loopback that believe they run on `hosts`
machines (Horovod: its rendezvous server with host assignments host0:K,host1:K..., and each
process's HOROVOD_HOSTNAME; torch.distributed: torchrun's GROUP_RANK and LOCAL_RANK), so the
two-level exchange makes its groups as on a cluster. Loads what each rank saved."""
import os
import subprocess
import sys

from horovod_run import WORKERS, free_port


def launch(script, tmp_path, hosts=2, per_host=2, horovod=True, timeout=300, args=()):
    server = None
    env = dict(os.environ, PYTHONPATH=str(WORKERS), OMP_NUM_THREADS="1", HVD_APS_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(hosts * per_host), LOCAL_WORLD_SIZE=str(per_host))
    if horovod:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
        server = RendezvousServer(False)
        port = server.start()
        server.init(get_host_assignments(parse_hosts(",".join(f"host{h}:{per_host}" for h in range(hosts))),
                                         hosts * per_host))
        env.update(HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                   HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="lo",
                   HOROVOD_SIZE=str(hosts * per_host), HOROVOD_LOCAL_SIZE=str(per_host), HOROVOD_CROSS_SIZE=str(hosts))
    procs = []
    try:
        for h in range(hosts):
            for local in range(per_host):
                rank = h * per_host + local
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKERS / script), str(tmp_path), *args], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True,
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=str(h), HOROVOD_RANK=str(rank),
                             HOROVOD_LOCAL_RANK=str(local), HOROVOD_CROSS_RANK=str(h), HOROVOD_HOSTNAME=f"host{h}")))
        outs = [p.communicate(timeout=timeout) for p in procs]
        for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"{script} rank {rank} failed:\n{out[-2000:]}\n{err[-4000:]}"
    finally:
        for p in procs:
            p.kill()
        if server is not None:
            server.stop()
