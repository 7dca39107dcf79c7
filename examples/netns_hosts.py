"""Run a command as the ranks of a cluster of network namespaces (examples/netns_cluster.py's
hosts: one namespace per host, 10.77.0.1, 10.77.0.2, ...), started the way a cluster starts them:

    sudo .venv/bin/python examples/netns_hosts.py --launcher mpirun [--hosts 2] [--per-host 2] -- python train.py
    sudo .venv/bin/python examples/netns_hosts.py --launcher slurm-mpirun -- python train.py
    sudo .venv/bin/python examples/netns_hosts.py --launcher srun -- python train.py

mpirun: MPICH's mpirun (Hydra) from the switch namespace with the hosts' addresses (-hosts), its
ssh replaced by examples/netns_ssh.sh, which starts each host's proxy in that host's namespace under
a hostname of its own. slurm-mpirun: the same mpirun inside a faked Slurm allocation (SLURM_JOB_ID,
SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE, ...): Hydra reads the hosts from the allocation, as in an
sbatch script. srun: every rank started as `srun` starts them (SLURM_PROCID, SLURM_LOCALID,
SLURM_NODEID, SLURM_NTASKS, ...), plus what docs/integrations.md's sbatch recipe exports for
torch.distributed (MASTER_ADDR: the first node, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK); every
namespace keeps this machine's hostname, so only Slurm's variables tell the hosts apart. Links are
uncapped unless --rate. Needs root (ip netns, unshare); removes what it made. Exits with the
command's status (the first failing rank's under srun).
"""
import argparse
import os
import pathlib
import subprocess
import sys
import time

from netns_cluster import RUN, SUBNET, SWITCH, cluster

EXAMPLES = pathlib.Path(__file__).resolve().parent
BIN = pathlib.Path(sys.executable).parent  # mpirun of the PyPI MPICH wheel, where scripts/install.sh put it
MASTER_PORT = 29511


def named_hosts(names):
    """Each host's own name resolves to its address inside its namespace (MPICH, Gloo)."""
    for i, ns in enumerate(names):
        with open(pathlib.Path("/etc/netns") / ns / "hosts", "a") as hosts:
            hosts.write(f"{SUBNET}.{i + 1} {ns}\n")


def addresses(hosts):
    return [f"{SUBNET}.{i + 1}" for i in range(hosts)]


def mpirun(args, allocation: dict) -> int:
    """mpirun from the switch namespace; `allocation`: Slurm's variables (the hosts come from
    them), else -hosts."""
    env = dict(os.environ, **allocation, HVD_APS_NETNS_PREFIX=f"{RUN}-h",
               PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    hosts = [] if allocation else ["-hosts", ",".join(addresses(args.hosts))]
    cmd = ["ip", "netns", "exec", SWITCH, str(BIN / "mpirun"), "-np", str(args.hosts * args.per_host),
           "-ppn", str(args.per_host), *hosts, "-iface", "br0", "-launcher", "ssh",
           "-launcher-exec", str(EXAMPLES / "netns_ssh.sh"), *args.command]
    return subprocess.run(cmd, env=env, timeout=args.timeout).returncode


def slurm_allocation(hosts, per_host) -> dict:
    """What sbatch gives the batch script of `hosts` nodes with `per_host` tasks each."""
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(hosts), "SLURM_NNODES": str(hosts),
            "SLURM_JOB_NODELIST": f"{SUBNET}.[1-{hosts}]", "SLURM_NODELIST": f"{SUBNET}.[1-{hosts}]",
            "SLURM_NTASKS": str(hosts * per_host), "SLURM_NTASKS_PER_NODE": str(per_host),
            "SLURM_TASKS_PER_NODE": f"{per_host}(x{hosts})", "SLURM_JOB_CPUS_PER_NODE": f"{per_host}(x{hosts})"}


def srun(args, names) -> int:
    """Every task as srun starts it in its node's namespace, with the recipe's exports."""
    allocation = slurm_allocation(args.hosts, args.per_host)
    procs = []
    for node, ns in enumerate(names):
        for local in range(args.per_host):
            rank = node * args.per_host + local
            env = dict(os.environ, **allocation, SLURM_PROCID=str(rank), SLURM_LOCALID=str(local),
                       SLURM_NODEID=str(node), SLURMD_NODENAME=ns, SLURM_STEP_NODELIST=allocation["SLURM_NODELIST"],
                       SLURM_STEP_NUM_TASKS=allocation["SLURM_NTASKS"],
                       # the sbatch recipe's exports (docs/integrations.md)
                       MASTER_ADDR=addresses(1)[0], MASTER_PORT=str(MASTER_PORT), RANK=str(rank),
                       WORLD_SIZE=allocation["SLURM_NTASKS"], LOCAL_RANK=str(local))
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *args.command], env=env))
    try:
        deadline = time.monotonic() + args.timeout  # one bound for the job, not one a task in turn
        codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return next((c for c in codes if c), 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=["mpirun", "slurm-mpirun", "srun"], required=True)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--rate", default=None, help="cap every host's link (tc tbf), e.g. 1gbit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every rank runs")
    args = parser.parse_args()
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("give the command after --")
    with cluster(args.hosts, args.rate) as names:
        named_hosts(names)
        if args.launcher == "srun":
            code = srun(args, names)
        else:
            allocation = slurm_allocation(args.hosts, args.per_host) if args.launcher == "slurm-mpirun" else {}
            code = mpirun(args, allocation)
    sys.exit(code)


if __name__ == "__main__":
    main()
