#!/usr/bin/env bash
# Start a world of N ranks of a command on this machine, one process per rank, as
# torchrun would (RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT),
# each rank its own NCCL "node" (NCCL_HOSTID=simnode$RANK), so that several NCCL ranks
# share one GPU and NCCL links them over sockets:
#
#   bash scripts/nccl-world.sh [options] -- COMMAND [ARG...]
#
#   -n N            ranks (default 2)
#   -d DIR          the world's folder (default: a new one under ${TMPDIR:-/tmp}); each
#                   rank's output goes to DIR/rank$R.log, its process id to
#                   DIR/rank$R.pid (the rank's own process: signal that one)
#   -t SECONDS      bound on the whole world (default 300); past it every rank is
#                   killed and the script exits 124
#   -p PORT         MASTER_PORT (default: a free one)
#   --same-node     do not set NCCL_HOSTID (one node, as NCCL sees it)
#   --fault SIG:R   inject a fault: once a rank creates DIR/fault-point, write the time
#                   (seconds since the epoch) to DIR/fault-at, then send SIG (KILL,
#                   STOP, ...) to rank R's own process. The ranks see the fault in
#                   SYMMPOOL_WORLD_FAULT=SIG:R. Rank R is then expected to die (KILL) or
#                   stay stopped (STOP: killed once the others are done)
#   --dies R        rank R is expected to end by SIGKILL on its own (a rank that kills
#                   itself on purpose, e.g. `fsdp_step --survive`)
#   --replace       once the victim (of --fault or --dies) is gone, start its
#                   replacement as a scheduler would: the same command as rank R with
#                   SYMMPOOL_JOIN=1 (DIR/rankR-replacement.log), expected to exit 0
#
# Every rank also gets SYMMPOOL_WORLD_DIR=DIR and SYMMPOOL_JOB_ID (a fresh one, so that
# a stray rank of another world on the same port is refused). The script waits for the
# ranks; on exit, timeout or interrupt it kills every rank still running (trap). It
# prints one line per rank and exits 0 when every rank exited 0 (the victim of a fault:
# when it was signalled and the others exited 0), 1 when some did not, 124 on timeout,
# 2 on bad usage.
set -uo pipefail

ranks=2 dir="" bound=300 port="" hostid=1 fault="" dies="" replace=0
usage() { sed -n '2,34p' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    -n) ranks="${2:?}"; shift 2 ;;
    -d) dir="${2:?}"; shift 2 ;;
    -t) bound="${2:?}"; shift 2 ;;
    -p) port="${2:?}"; shift 2 ;;
    --same-node) hostid=0; shift ;;
    --fault) fault="${2:?}"; shift 2 ;;
    --dies) dies="${2:?}"; shift 2 ;;
    --replace) replace=1; shift ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "nccl-world: unknown option $1" >&2; usage ;;
  esac
done
[ $# -gt 0 ] || usage
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "nccl-world: -n wants a positive number" >&2; exit 2; }
[[ "$bound" =~ ^[1-9][0-9]*$ ]] || { echo "nccl-world: -t wants whole seconds" >&2; exit 2; }
victim="" sig=""
if [ -n "$fault" ]; then
  sig="${fault%%:*}" victim="${fault#*:}"
  sig="${sig#SIG}"
  if ! [[ "$victim" =~ ^[0-9]+$ ]] || [ "$victim" -ge "$ranks" ] || ! kill -l "$sig" >/dev/null 2>&1; then
    echo "nccl-world: --fault wants SIG:RANK with a signal name and a rank below $ranks" >&2
    exit 2
  fi
fi
if [ -z "$dir" ]; then
  dir="$(mktemp -d "${TMPDIR:-/tmp}/nccl-world.XXXXXX")"
else
  mkdir -p "$dir" && rm -f "$dir"/rank*.log "$dir"/rank*.pid "$dir"/fault-point "$dir"/fault-at
fi
# A free port: one nothing listens on (bash's /dev/tcp connects, or fails), below
# Linux's ephemeral range (32768 and up), where an outgoing connection may hold it.
if [ -z "$port" ]; then
  for _ in $(seq 1 100); do
    p=$((10000 + RANDOM % 22000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then port=$p; break; fi
  done
  [ -n "$port" ] || { echo "nccl-world: no free port found" >&2; exit 1; }
fi

pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

job="nccl-world-$$-$RANDOM"
# Start rank $1, logging to $2, with more variables after them; the command follows --.
start_rank() {
  local r="$1" log="$2" extra=()
  shift 2
  while [ "$1" != -- ]; do extra+=("$1"); shift; done
  shift
  [ "$hostid" = 1 ] && extra+=(NCCL_HOSTID="simnode$r")
  [ -n "$fault" ] && extra+=(SYMMPOOL_WORLD_FAULT="$sig:$victim")
  # `env` execs the command: $! is the rank's own process.
  env RANK="$r" WORLD_SIZE="$ranks" LOCAL_RANK="$r" LOCAL_WORLD_SIZE="$ranks" \
    MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" SYMMPOOL_JOB_ID="$job" \
    SYMMPOOL_WORLD_DIR="$dir" "${extra[@]}" "$@" >"$log" 2>&1 </dev/null &
  pids+=($!)
}
for ((r = 0; r < ranks; r++)); do
  start_rank "$r" "$dir/rank$r.log" -- "$@"
  echo "$!" >"$dir/rank$r.pid"
done
echo "nccl-world: $ranks ranks of '$*' on port $port, logs in $dir"

start=$SECONDS
expired() { [ $((SECONDS - start)) -ge "$bound" ]; }
alive() { kill -0 "$1" 2>/dev/null; }
signalled=0
status=0
if [ -n "$dies" ]; then
  [[ "$dies" =~ ^[0-9]+$ ]] && [ "$dies" -lt "$ranks" ] && [ -z "$fault" ] ||
    { echo "nccl-world: --dies wants a rank below $ranks, and no --fault" >&2; exit 2; }
  victim="$dies" signalled=1
fi
if [ -n "$fault" ]; then
  while [ ! -e "$dir/fault-point" ] && ! expired && alive "${pids[$victim]}"; do sleep 0.05; done
  if [ -e "$dir/fault-point" ] && alive "${pids[$victim]}"; then
    date +%s.%N >"$dir/fault-at"
    kill -s "$sig" "${pids[$victim]}" && signalled=1
    echo "nccl-world: SIG$sig sent to rank $victim (pid ${pids[$victim]}) at $(cat "$dir/fault-at")"
  else
    echo "nccl-world: the world never reached the fault's point (or rank $victim ended first)"
    status=1
  fi
fi
# Wait for every rank but a stopped victim; with --replace, start the victim's
# replacement once it is gone, as a scheduler would.
replaced=0
while ! expired; do
  if [ "$replace" = 1 ] && [ "$replaced" = 0 ] && [ "$signalled" = 1 ] && ! alive "${pids[$victim]}"; then
    start_rank "$victim" "$dir/rank$victim-replacement.log" SYMMPOOL_JOIN=1 -- "$@"
    replaced=1
    echo "nccl-world: rank $victim's replacement started (pid $!, SYMMPOOL_JOIN=1)"
  fi
  running=0
  for r in "${!pids[@]}"; do
    [ "$signalled" = 1 ] && [ "$r" = "$victim" ] && continue
    alive "${pids[$r]}" && running=1
  done
  [ "$running" = 0 ] && break
  sleep 0.05
done
timed_out=0
expired && timed_out=1
for r in "${!pids[@]}"; do
  p="${pids[$r]}"
  if alive "$p"; then
    if [ "$signalled" = 1 ] && [ "$r" = "$victim" ] && [ -z "$dies" ]; then
      what="still stopped once the others were done; killed"
    else
      what="still running after ${bound} s; killed"
      status=1
    fi
    kill -9 "$p" 2>/dev/null
  fi
  wait "$p" 2>/dev/null
  code=$?
  [ -n "${what:-}" ] || what="exit $code"
  if [ "$code" -gt 128 ] && [ -z "${what##exit*}" ]; then what="killed by SIG$(kill -l $((code - 128)))"; fi
  if [ "$signalled" = 1 ] && [ "$r" = "$victim" ]; then
    case "$what" in "killed by SIGKILL"|"still stopped"*) ;; *) status=1; what="$what (expected SIGKILL)" ;; esac
  elif [ "$code" != 0 ]; then
    status=1
  fi
  echo "nccl-world: rank $r$([ "$r" -ge "$ranks" ] && echo " (rank $victim's replacement)") (pid $p): $what"
  what=""
done
pids=()
[ "$timed_out" = 1 ] && exit 124
exit "$status"
