#!/usr/bin/env bash
# Run a command as if on a slower host: everything it starts shares CPUS of one core.
#   .ci/slow_host.sh 0.6 -- make test        (0.6 core: ~3x slower than 2 free cores; `make test-slow-host`)
# Needs root and the cgroup cpu controller (v1 at /sys/fs/cgroup/cpu, or v2). The group is
# removed afterwards, also when the command fails or is interrupted. Exit status: the command's.
set -u
[ $# -ge 3 ] && [ "$2" = "--" ] || { echo "usage: $0 CPUS -- COMMAND [ARG...]   (CPUS e.g. 0.6)" >&2; exit 2; }
cpus=$1; shift 2
period=100000
quota=$(awk -v c="$cpus" -v p="$period" 'BEGIN { q = int(c * p); if (q < 1000) exit 1; print q }') \
  || { echo "CPUS must be a number >= 0.01, got '$cpus'" >&2; exit 2; }
name="slow_host_$$"
if [ -d /sys/fs/cgroup/cpu ] && [ -w /sys/fs/cgroup/cpu ]; then         # cgroup v1
  cg=/sys/fs/cgroup/cpu/$name
  mkdir "$cg" && echo "$period" > "$cg/cpu.cfs_period_us" && echo "$quota" > "$cg/cpu.cfs_quota_us" \
    || { echo "cannot create a CPU quota at $cg" >&2; exit 2; }
  parent=/sys/fs/cgroup/cpu
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then                     # cgroup v2
  cg=/sys/fs/cgroup/$name
  mkdir "$cg" && echo "$quota $period" > "$cg/cpu.max" \
    || { echo "cannot create a CPU quota at $cg" >&2; exit 2; }
  parent=/sys/fs/cgroup
else
  echo "no writable cgroup cpu controller here" >&2; exit 2
fi
cleanup() {
  # Move whatever is left back to the parent so the group can go (processes of the command
  # that outlived it are left running; kill them by PID if they are yours).
  for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do echo "$p" > "$parent/cgroup.procs" 2>/dev/null; done
  rmdir "$cg" 2>/dev/null
}
trap cleanup EXIT INT TERM
echo "slow_host: $cpus of one core (quota $quota/$period us) for: $*" >&2
bash -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' _ "$cg" "$@"
