#!/usr/bin/env bash
# The user's path, outside the checkout: build the wheel, install it WITHOUT extras into a fresh
# venv (plus the pinned CPU torch), then from / run `mindspec generate`, start `mindspec serve` on
# free ports, wait for /health on the business port, POST one /v1/completions, run the client
# libraries against it (scripts/client_smoke.py), stop the server.
# A runtime import that only an extra (or the dev environment) provides fails here, not for users.
#
#   scripts/fresh_install_check.sh            # exit 0: every step passed; else one FAIL line
#
# Env: PYTHON (the interpreter that builds and makes the venv; default python3), TORCH_SPEC
# (default torch==2.13.0), KEEP_WORK=1 keeps the temporary directory, SERVE_TIMEOUT (seconds to
# wait for /health, default 600), CLIENT_PYTHON (runs scripts/client_smoke.py; default PYTHON),
# SKIP_CLIENTS=1 skips the client libraries' checks.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SERVE_TIMEOUT="${SERVE_TIMEOUT:-600}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mindspec-fresh-install.XXXXXX")"
SERVER_PID=""

step() { echo "== fresh install: $*"; }
fail() { echo "FAIL fresh install: $*" >&2; exit 1; }

cleanup() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    if [[ "${KEEP_WORK:-0}" == 1 ]]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

step "building the wheel"
"$PYTHON" -m pip wheel "$ROOT" --no-deps -w "$WORK/wheel" >"$WORK/wheel.log" 2>&1 \
    || { tail -20 "$WORK/wheel.log" >&2; fail "pip wheel failed (log above)"; }
WHEEL="$(ls "$WORK"/wheel/mindspec-*.whl 2>/dev/null | head -1)"
[[ -n "$WHEEL" ]] || fail "pip wheel wrote no mindspec wheel into $WORK/wheel"

step "installing $(basename "$WHEEL") and $TORCH_SPEC into a fresh venv (no extras)"
"$PYTHON" -m venv "$WORK/venv" || fail "python -m venv failed"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q "$TORCH_SPEC" "$WHEEL" >"$WORK/install.log" 2>&1 \
    || { tail -20 "$WORK/install.log" >&2; fail "pip install $TORCH_SPEC $(basename "$WHEEL") failed (log above)"; }
MINDSPEC="$WORK/venv/bin/mindspec"
[[ -x "$MINDSPEC" ]] || fail "the wheel installed no mindspec console script"

cd /  # nothing of the checkout is importable from here
where="$("$VPY" -c 'import mindspec, os; print(os.path.dirname(mindspec.__file__))')"
[[ "$where" == "$WORK/venv/"* ]] || fail "mindspec imports from $where, not from the venv"

step "mindspec generate"
"$MINDSPEC" generate --prompt "def add(a, b):" --max-tokens 8 >"$WORK/generate.out" 2>"$WORK/generate.err" \
    || { cat "$WORK/generate.err" >&2; fail "mindspec generate exited with $? (stderr above)"; }
[[ -s "$WORK/generate.out" ]] || fail "mindspec generate printed nothing"
echo "generated: $(head -c 200 "$WORK/generate.out" | tr '\n' ' ')"

free_port() { "$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT="$(free_port)"; MGMT="$(free_port)"; METRICS="$(free_port)"
while [[ "$MGMT" == "$PORT" ]]; do MGMT="$(free_port)"; done
while [[ "$METRICS" == "$PORT" || "$METRICS" == "$MGMT" ]]; do METRICS="$(free_port)"; done

step "mindspec serve on 127.0.0.1:$PORT (management $MGMT, metrics $METRICS)"
"$MINDSPEC" serve --port "$PORT" --management-port "$MGMT" --metrics-port "$METRICS" >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!

# /health on the business port, where load balancers and benchmark tools probe it.
"$VPY" - "$PORT" "$SERVER_PID" "$SERVE_TIMEOUT" <<'EOF' || { tail -30 "$WORK/serve.log" >&2; fail "the server did not become healthy (server log above)"; }
import os, sys, time, urllib.error, urllib.request

port, pid, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"the server (pid {pid}) exited while starting")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            if r.status == 200:
                print(f"healthy: GET /health on the business port {port}")
                sys.exit(0)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        pass
    time.sleep(1)
sys.exit(f"no 200 from /health on port {port} within {timeout:g} s")
EOF

step "POST /v1/completions"
"$VPY" - "$PORT" <<'EOF' || { tail -30 "$WORK/serve.log" >&2; fail "/v1/completions failed (server log above)"; }
import json, sys, urllib.request

body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", data=body,
                             headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=300) as r:
        status, raw = r.status, r.read()
except urllib.error.HTTPError as exc:
    sys.exit(f"HTTP {exc.code}: {exc.read()[:500]!r}")
try:
    text = json.loads(raw)["choices"][0]["text"]
except (ValueError, KeyError, IndexError, TypeError) as exc:
    sys.exit(f"HTTP {status}, but the body has no choices[0].text ({type(exc).__name__}): {raw[:500]!r}")
if not isinstance(text, str):
    sys.exit(f"choices[0].text is {type(text).__name__}, not a string: {raw[:500]!r}")
print(f"completion: {text!r}")
EOF

# The client libraries are the user's, not the wheel's: they run from CLIENT_PYTHON (default: the
# interpreter that built the wheel, which in CI has the test extra) against the venv's server.
if [[ "${SKIP_CLIENTS:-0}" != 1 ]]; then
    step "openai, text_generation, huggingface_hub and MindIE requests (scripts/client_smoke.py)"
    "${CLIENT_PYTHON:-$PYTHON}" "$ROOT/scripts/client_smoke.py" "http://127.0.0.1:$PORT" \
        || { tail -30 "$WORK/serve.log" >&2; fail "a client check failed (server log above)"; }
fi

step "stopping the server (SIGTERM)"
kill -TERM "$SERVER_PID"
for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
if kill -0 "$SERVER_PID" 2>/dev/null; then tail -20 "$WORK/serve.log" >&2; fail "the server did not stop within 60 s of SIGTERM"; fi
rc=0; wait "$SERVER_PID" || rc=$?
SERVER_PID=""
[[ "$rc" == 0 ]] || { tail -20 "$WORK/serve.log" >&2; fail "the server exited with code $rc after SIGTERM"; }
echo "PASS fresh install: wheel without extras, generate, serve, /health, /v1/completions, clients, clean stop"
