"""Launch N = hosts x ranks-per-host real processes on loopback that believe they run on `hosts`
machines (Horovod: its rendezvous server with host assignments host0:K,host1:K..., and each
process's HOROVOD_HOSTNAME; torch.distributed: torchrun's GROUP_RANK and LOCAL_RANK), so the
two-level exchange makes its groups as on a cluster. Loads what each rank saved. Each rank writes
its output to files: with pipes read one rank after another, a rank whose output outgrew a pipe's
buffer would block in its write while the others wait for it in a collective. Ranks still running
at the timeout get SIGABRT, on which Python's faulthandler (PYTHONFAULTHANDLER, tests/conftest.py)
writes every thread's stack into their logs, and the failure shows them: where each rank waited."""
import pathlib
import signal
import subprocess
import sys
import time

from horovod_run import WORKERS, free_port, worker_env


def launch(script, tmp_path, hosts=2, per_host=2, horovod=True, timeout=300, args=()):
    server = None
    env = worker_env(HVD_APS_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
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
    procs, logs = [], []
    try:
        for h in range(hosts):
            for local in range(per_host):
                rank = h * per_host + local
                log = open(pathlib.Path(tmp_path) / f"rank{rank}.log", "w+")
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKERS / script), str(tmp_path), *args], stdout=log,
                    stderr=subprocess.STDOUT, text=True,
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=str(h), HOROVOD_RANK=str(rank),
                             HOROVOD_LOCAL_RANK=str(local), HOROVOD_CROSS_RANK=str(h), HOROVOD_HOSTNAME=f"host{h}")))
        stalled = _wait(procs, timeout)
        texts = [log.seek(0) or log.read() for log in logs]
        assert not stalled, f"{script}: ranks {stalled} still running after {timeout} s; their stacks:\n" + "\n".join(
            f"--- rank {r}\n{texts[r][-8000:]}" for r in stalled)
        for rank, (p, text) in enumerate(zip(procs, texts)):
            assert p.returncode == 0, f"{script} rank {rank} failed:\n{text[-6000:]}"
    finally:
        for p in procs:
            p.kill()
        for log in logs:
            log.close()
        if server is not None:
            server.stop()


STACKS_S = 10  # how long stalled ranks get to write their stacks


def _wait(procs, timeout) -> list:
    """Wait for every process until `timeout` seconds from now -> the ranks still running then,
    after SIGABRT made each write its threads' stacks."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    stalled = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in stalled:
        procs[r].send_signal(signal.SIGABRT)
    for r in stalled:
        try:
            procs[r].wait(timeout=STACKS_S)
        except subprocess.TimeoutExpired:
            pass
    return stalled
