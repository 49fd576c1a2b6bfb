#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one Debian 12 host, for the tests and CI.
#
#   bash slurm/local_cluster.sh [start|stop|status]        (default: start; run as root)
#
# start   install missing packages (apt, --no-install-recommends), write the configs, start
#         munged, MariaDB (socket only), slurmdbd, slurmctld and two slurmd, and wait until both
#         nodes take jobs. Idempotent: daemons already up are left alone; a changed config restarts
#         only the Slurm daemons. Prints the bring-up time.
# stop    stop every daemon listed above (by its pid file). State and packages stay.
# status  the daemons' pids and `sinfo`; exit 0 when the cluster answers, 3 otherwise.
#
# The cluster: partition `debug` with nodes node1 and node2, both slurmd on this host (Debian's
# Slurm is built with MULTIPLE_SLURMD), each claiming all CPUs of the host and 2 fake GPUs
# (`gpu` GRES backed by /dev/null copies: Slurm accepts --gpus and sets CUDA_VISIBLE_DEVICES, but
# there is no GPU behind them). Two nodes because heterogeneous jobs never start on one node, and
# slurmdbd because submitit reads job states from `sacct`. MPI steps: `srun --mpi=pmi2` with the
# venv's mpich wheel (checked: 2 ranks on 2 nodes), `srun --mpi=pmix` with Debian's Open MPI.
# No systemd here: every daemon is started directly and daemonises itself.
# Recipe and every pitfall behind the settings: docs/slurm_local.md.
set -euo pipefail

ACTION=${1:-start}
CLUSTER=localcluster
NODES=(node1 node2)
GPUS=2
DB_USER=slurm
DB_PASS=slurmdbpass            # socket-only database on a test host
CONF=/etc/slurm
LOGDIR=/var/log/slurm
T0=$(date +%s%N)

elapsed() { awk -v ns=$(( $(date +%s%N) - T0 )) 'BEGIN { printf "%.1f", ns / 1e9 }'; }
log() { echo "[local_cluster $(elapsed)s] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# wait_for SECONDS CMD...: poll CMD every 0.2 s
wait_for() {
  local n=$(( $1 * 5 )); shift
  while (( n-- > 0 )); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}

# running PIDFILE: the pid in it is alive and is one of our daemons (a stale file may name a reused pid)
running() {
  local pid
  [ -s "$1" ] && pid=$(cat "$1") && kill -0 "$pid" 2>/dev/null || return 1
  case "$(cat "/proc/$pid/comm" 2>/dev/null)" in slurmd|slurmctld|slurmdbd|munged|mariadbd) return 0 ;; esac
  return 1
}

# stop_pidfiles FILE...: SIGTERM all at once (each daemon takes ~2 s), SIGKILL what is left after 10 s
stop_pidfiles() {
  local f pids=() left=()
  for f in "$@"; do
    [ -e "$f" ] || continue
    running "$f" && pids+=("$(cat "$f")")
    rm -f "$f"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 100); do
    left=()
    for f in "${pids[@]}"; do kill -0 "$f" 2>/dev/null && left+=("$f"); done
    [ ${#left[@]} -eq 0 ] && return 0
    sleep 0.1
  done
  kill -9 "${left[@]}" 2>/dev/null || true
}

install_packages() {
  # libpmix-dev ships the unversioned libpmix.so that Slurm's mpi_pmix plugin dlopens
  local pkgs=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server openmpi-bin libpmix-dev) missing=() p
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  log "packages installed"
}

CHANGED=0
# put FILE MODE < content: replace FILE only when the content differs, and remember that it did
put() {
  local tmp; tmp=$(mktemp)
  cat >"$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; CHANGED=1; log "wrote $1"; fi
  chmod "$2" "$1"
}

write_configs() {
  local host mem n i
  host=$(hostname -s)
  mkdir -p "$CONF" "$LOGDIR" /var/spool/slurmctld
  # Slurm hands out node names (SLURM_JOB_NODELIST -> torch's MASTER_ADDR): they must resolve
  getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >>/etc/hosts
  for n in "${NODES[@]}"; do
    getent hosts "$n" >/dev/null || echo "127.0.0.1 $n" >>/etc/hosts
    # per-node TmpFS: the pmix plugin of two slurmd on one host would collide in /tmp
    mkdir -p "/var/spool/slurmd/$n/tmp" && chmod 1777 "/var/spool/slurmd/$n/tmp"
  done
  for ((i = 0; i < GPUS; i++)); do
    [ -e "/dev/fakegpu$i" ] || mknod "/dev/fakegpu$i" c 1 3
  done
  # RealMemory must not exceed what slurmd detects; the two virtual nodes share the host's memory
  mem=$(( $(free -m | awk '/^Mem:/{print $2}') * 45 / 100 ))

  put "$CONF/slurm.conf" 0644 <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again only after the step credential lifetime (default 120 s)
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
MailProg=/bin/true
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd/%n
TmpFS=/var/spool/slurmd/%n/tmp
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
# het jobs are only scheduled by backfill: every second instead of every 30 s; the main loop (which
# starts a requeued job once its hold ends) every 2 s instead of 60 s
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGDIR/jobcomp.log
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
Waittime=0
NodeName=node[1-${#NODES[@]}] NodeHostname=$host NodeAddr=127.0.0.1 Port=[6821-$((6820 + ${#NODES[@]}))] CPUs=$(nproc) RealMemory=$mem Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
  put "$CONF/gres.conf" 0644 <<EOF
AutoDetect=off
Name=gpu File=/dev/fakegpu[0-$((GPUS - 1))]
EOF
  put "$CONF/slurmdbd.conf" 0600 <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
DebugLevel=info
LogFile=$LOGDIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
}

start_munge() {
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged </dev/null >>"$LOGDIR/munged.out" 2>&1
  wait_for 10 sh -c 'munge -n | unmunge' || die "munged did not start ($LOGDIR/munged.out)"
  log "munged up"
}

start_mariadb() {
  if ! mariadb-admin ping >/dev/null 2>&1; then
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >>"$LOGDIR/mariadb.out" 2>&1
    install -d -o mysql -g root -m 0755 /run/mysqld
    setsid -f /usr/sbin/mariadbd --user=mysql --skip-networking \
      --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid \
      --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 </dev/null >>"$LOGDIR/mariadb.out" 2>&1
    wait_for 60 mariadb-admin ping || die "MariaDB did not start ($LOGDIR/mariadb.out)"
    log "mariadb up"
  fi
  mariadb -e "CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
              GRANT ALL ON slurm_acct_db.* TO '$DB_USER'@'localhost';"
}

# start_daemon PIDFILE NAME CMD...: start CMD unless the daemon behind PIDFILE runs
start_daemon() {
  local pidfile=$1 name=$2; shift 2
  running "$pidfile" && return 0
  "$@" </dev/null >>"$LOGDIR/$name.out" 2>&1 || die "$name failed to start ($LOGDIR/$name.out, $LOGDIR/$name.log)"
}

# every node answers and takes jobs (busy counts: `start` on a cluster running jobs is a no-op)
nodes_up() {
  [ "$(sinfo -h -N -o '%N %t' | sort -u | grep -cE ' (idle|mix|alloc|comp)$')" = "${#NODES[@]}" ]
}

start_slurm() {
  start_daemon /run/slurmdbd.pid slurmdbd /usr/sbin/slurmdbd
  wait_for 60 sacctmgr -n list cluster || die "slurmdbd does not answer ($LOGDIR/slurmdbd.log)"
  sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
  log "slurmdbd up"
  start_daemon /run/slurmctld.pid slurmctld /usr/sbin/slurmctld
  wait_for 60 sh -c 'scontrol ping | grep -q "is UP"' || die "slurmctld does not answer ($LOGDIR/slurmctld.log)"
  log "slurmctld up"
  local n
  for n in "${NODES[@]}"; do start_daemon "/run/slurmd-$n.pid" "slurmd-$n" /usr/sbin/slurmd -N "$n"; done
  if ! wait_for 30 nodes_up; then
    # nodes left DOWN by an unclean stop come back with one resume
    scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume 2>/dev/null || true
    wait_for 30 nodes_up || { sinfo -N >&2; die "nodes not up ($LOGDIR/slurmd-*.log)"; }
  fi
}

slurm_pidfiles() { echo /run/slurmd-*.pid /run/slurmctld.pid /run/slurmdbd.pid; }

case "$ACTION" in
  start)
    [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts system daemons)"
    install_packages
    write_configs
    if [ "$CHANGED" = 1 ]; then
      # shellcheck disable=SC2046  # word splitting of the pid file list is wanted
      stop_pidfiles $(slurm_pidfiles)
    fi
    start_munge
    start_mariadb
    start_slurm
    log "cluster up in $(elapsed) s: $(sinfo -h -o '%P %a %D %T %N %G' | tr '\n' ' ')"
    ;;
  stop)
    # shellcheck disable=SC2046
    stop_pidfiles $(slurm_pidfiles)
    stop_pidfiles /run/mysqld/mysqld.pid /run/munge/munged.pid
    log "stopped in $(elapsed) s"
    ;;
  status)
    for f in /run/munge/munged.pid /run/mysqld/mysqld.pid $(slurm_pidfiles); do
      [ -e "$f" ] || continue
      if running "$f"; then echo "$f: running (pid $(cat "$f"))"; else echo "$f: stale"; fi
    done
    timeout 5 sinfo -N -o '%N %P %T %c %G' 2>/dev/null || exit 3
    ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
