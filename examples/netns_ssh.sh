#!/bin/sh
# ssh for MPICH's Hydra inside examples/netns_hosts.py's cluster: `netns_ssh.sh [-x] HOST COMMAND...`
# runs COMMAND in the network namespace of HOST (an address 10.77.0.N: namespace
# ${HVD_APS_NETNS_PREFIX}N-1) under a hostname of its own (a UTS namespace), as ssh would on a
# machine of the cluster. Hydra passes the command as words that ssh would join for a shell.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
ns="${HVD_APS_NETNS_PREFIX:?set by netns_hosts.py}$(( ${host##*.} - 1 ))"
exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && exec $*"
