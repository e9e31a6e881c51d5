#!/usr/bin/env bash
# Capture one agent client's requests: run it headless against relay.py in answer mode (or, with UPSTREAM set,
# forwarding to a server), in a fresh temporary folder holding three small files, with a fresh temporary home;
# the raw captures land in OUT.
#
#   bash benchmarks/agents/capture.sh CLIENT OUT [ANSWER_JSON]
#   UPSTREAM=http://127.0.0.1:8080 PROMPT="list the files here, read one, answer" bash benchmarks/agents/capture.sh codex OUT
#
# CLIENT: claude (nonessential traffic off), claude-full (on: adds the title request), codex,
#         agents-responses, agents-responses-stream, agents-chat, agents-chat-stream.
# CLAUDE_ARGS / CODEX_ARGS: extra flags (e.g. "--allowedTools Bash" / "--sandbox workspace-write").
# AGENTS_ARGS: extra flags of agents_sdk_task.py (e.g. "--read-tool").
# Binaries: CLAUDE=claude CODEX=codex AGENTS_PYTHON=python (one with openai-agents installed); PORT=9000, MODEL=demo-chat,
# PROMPT="list the files here".
# Then: python benchmarks/agents/make_fixtures.py OUT tests/fixtures/clients/<client>-<version> (see its doc).
set -euo pipefail
client=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
answer=${3:-$here/answer_ls.json}
port=${PORT:-9000}
model=${MODEL:-demo-chat}
prompt=${PROMPT:-list the files here}
relay_python=${RELAY_PYTHON:-python3}
tmp=$(mktemp -d)
mkdir -p "$tmp/task" "$tmp/home" "$out"
printf '# Demo\nA tiny project.\n' > "$tmp/task/README.md"
printf 'print("hello")\n' > "$tmp/task/main.py"
printf 'buy milk\n' > "$tmp/task/notes.txt"
echo "$tmp" > "$out/.tmpdir"   # make_fixtures.py replaces these paths with placeholders

mode=(--answer "$answer")
[ -n "${UPSTREAM:-}" ] && mode=(--upstream "$UPSTREAM")
"$relay_python" "$here/relay.py" --listen "127.0.0.1:$port" "${mode[@]}" --out "$out" > "$out/.relay.log" 2>&1 &
relay=$!
trap 'kill $relay 2>/dev/null || true' EXIT
sleep 1

base=(env -i PATH="$PATH" HOME="$tmp/home" SHELL=/bin/bash TERM=dumb LANG=C.UTF-8)
cd "$tmp/task"
set +e
case $client in
  claude|claude-full)
    quiet=(CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1)
    [ "$client" = claude-full ] && quiet=(DISABLE_TELEMETRY=1)
    "${base[@]}" "${quiet[@]}" ANTHROPIC_BASE_URL="http://127.0.0.1:$port" ANTHROPIC_API_KEY=x \
      timeout "${CLIENT_TIMEOUT:-300}" "${CLAUDE:-claude}" -p "$prompt" --model "$model" --output-format json ${CLAUDE_ARGS:-} </dev/null ;;
  codex)
    cat > "$tmp/home/config.toml" <<EOF
model = "$model"
model_provider = "local"

[model_providers.local]
name = "local"
base_url = "http://127.0.0.1:$port/v1"
env_key = "LOCAL_API_KEY"
wire_api = "responses"
EOF
    "${base[@]}" CODEX_HOME="$tmp/home" LOCAL_API_KEY=x \
      timeout "${CLIENT_TIMEOUT:-300}" "${CODEX:-codex}" exec --skip-git-repo-check ${CODEX_ARGS:-} "$prompt" </dev/null ;;
  agents-*)
    api=${client#agents-}; stream=()
    [[ $api == *-stream ]] && { api=${api%-stream}; stream=(--stream); }
    "${base[@]}" OPENAI_API_KEY=x timeout "${CLIENT_TIMEOUT:-300}" "${AGENTS_PYTHON:-python}" "$here/agents_sdk_task.py" \
      --base-url "http://127.0.0.1:$port/v1" --api "$api" --model "$model" --prompt "$prompt" "${stream[@]}" \
      ${AGENTS_ARGS:-} </dev/null ;;
  *) echo "unknown client $client" >&2; exit 2 ;;
esac
status=$?
sleep 0.5
cat "$out/.relay.log" >&2  # the client's own output stays alone on stdout
exit $status
