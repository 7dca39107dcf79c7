"""Which ranks share a host, and whether an exchange runs on two levels (float32 inside a host,
codes between hosts) or flat. Framework-neutral: the adapters gather each rank's (host, local
rank) and build their groups (Horovod process sets, torch.distributed groups) from this.

Per-host bytes across the slow link (D: a rank's float32 gradient bytes, L ranks per host, H
hosts, N = L * H): flat 8-bit codes about 2 * L * (D / 4) * (N - L) / N, a float32 ring
2 * D * (N - 1) / N, two levels 2 * (D / 4) * (H - 1) / H: with 8 ranks on each of 2 hosts,
2.0 D, 1.9 D and 0.25 D. Two levels also cut each rank's codec work by L.
"""
import dataclasses
import os
import socket
import warnings

# (host, local rank) from the launcher's environment, first found: torchrun's, then a Slurm
# step's (srun starts every rank itself, no torchrun); else the hostname and local rank 0
HOST_VARS, LOCAL_RANK_VARS = ("GROUP_RANK", "SLURM_NODEID"), ("LOCAL_RANK", "SLURM_LOCALID")


def launcher_place() -> tuple:
    """(host, local rank) of this process as its launcher numbered it (torch.distributed's entry
    points; Horovod has its own)."""
    host = next((os.environ[v] for v in HOST_VARS if os.environ.get(v)), None) or socket.gethostname()
    local = next((os.environ[v] for v in LOCAL_RANK_VARS if os.environ.get(v)), "0")
    return host, int(local)


@dataclasses.dataclass(frozen=True)
class Topology:
    """hosts[h]: the ranks (of the group the exchange spans, in its numbering) on host h, in
    local-rank order; hosts in order of their lowest rank."""
    hosts: tuple

    @classmethod
    def from_places(cls, places: list) -> "Topology":
        """places[r] = (host key, local rank) of rank r, as every rank gathered them alike."""
        keys = []
        for key, _ in places:
            if key not in keys:
                keys.append(key)
        return cls(tuple(tuple(r for _, r in sorted((local, r) for r, (k, local) in enumerate(places) if k == key))
                         for key in keys))

    @property
    def equal(self) -> bool:
        return len({len(h) for h in self.hosts}) == 1

    def local_group(self, rank: int) -> tuple:
        return next(h for h in self.hosts if rank in h)

    def cross_group(self, rank: int) -> tuple:
        local = self.local_group(rank).index(rank)
        return tuple(h[local] for h in self.hosts)

    def groups(self) -> list:
        """Every local group, then every cross group: the order every rank creates them in."""
        return list(self.hosts) + [tuple(h[l] for h in self.hosts) for l in range(len(self.hosts[0]))]

    def two_levels(self, hierarchical) -> bool:
        """hierarchical None: two levels where several hosts each hold several ranks (hosts with
        unequal rank counts stay flat, with a warning); True: two levels (equal hosts needed);
        False: flat."""
        several = len(self.hosts) > 1 and len(self.hosts[0]) > 1
        if hierarchical is False or (hierarchical is None and not several):
            return False
        if not self.equal:
            sizes = [len(h) for h in self.hosts]
            if hierarchical:
                raise ValueError(f"hierarchical=True needs the same number of ranks on every host, got {sizes}")
            warnings.warn(f"hvd_aps: hosts hold {sizes} ranks, unequal, so the exchange stays flat (codes between "
                          "every pair of ranks)", RuntimeWarning, stacklevel=3)
            return False
        return True
