#!/bin/bash
# A one-node Slurm on this machine, for the tests of scripts/slurm_grpo.sh (tests/test_slurm.py): installs Debian's
# slurmctld, slurmd, slurm-client and munge if they are missing, writes a slurm.conf for this host (its short name,
# all its CPUs, no GPUs, jobs requeueable), and starts munged, slurmctld and slurmd. Needs root. Idempotent: a
# Slurm already answering is left as it is.
#
#   sudo bash tests/tools/start_slurm.sh && sinfo
set -euo pipefail

if sinfo --noheader >/dev/null 2>&1 && [ "$(sinfo --noheader --format=%t | head -1)" = idle ] \
        && grep -q cred_expire=10 /etc/slurm/slurm.conf 2>/dev/null; then
    echo "slurm: already running"; exit 0
fi
if [ "$(id -u)" != 0 ]; then echo "slurm: needs root (packages, daemons)" >&2; exit 1; fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
fi

HOST=$(hostname -s)
# munge: the key every Slurm daemon and client signs with; munged runs as its own user.
mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
chmod 755 /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=nanorl
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
# A requeued job waits for its credential to expire before it may start again (120 s by default): 10 s here.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobRequeue=1
ReturnToService=2
KillWait=60
MinJobAge=600
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
    if [ "$(sinfo --noheader --format=%t 2>/dev/null | head -1)" = idle ]; then
        echo "slurm: one node ($HOST, $(nproc) CPUs) idle"; exit 0
    fi
    sleep 1
done
echo "slurm: the node did not come up; see /var/log/slurm/" >&2
sinfo >&2 || true
exit 1
