#!/usr/bin/env bash
# Capture one agent client's requests: run it headless against relay.py in answer mode, in a fresh temporary
# folder holding three small files, with a fresh temporary home; the raw captures land in OUT.
#
#   bash benchmarks/agents/capture.sh CLIENT OUT [ANSWER_JSON]
#
# CLIENT: claude (nonessential traffic off), claude-full (on: adds the title request), codex,
#         agents-responses, agents-responses-stream, agents-chat, agents-chat-stream.
# CLAUDE_ARGS / CODEX_ARGS: extra flags (e.g. "--allowedTools Bash" / "--sandbox workspace-write").
# Binaries: CLAUDE=claude CODEX=codex AGENTS_PYTHON=python (one with openai-agents installed); PORT=9000, MODEL=demo-chat.
# Then: python benchmarks/agents/make_fixtures.py OUT tests/fixtures/clients/<client>-<version> (see its doc).
set -euo pipefail
client=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
answer=${3:-$here/answer_ls.json}
port=${PORT:-9000}
model=${MODEL:-demo-chat}
relay_python=${RELAY_PYTHON:-python3}
tmp=$(mktemp -d)
mkdir -p "$tmp/task" "$tmp/home" "$out"
printf '# Demo\nA tiny project.\n' > "$tmp/task/README.md"
printf 'print("hello")\n' > "$tmp/task/main.py"
printf 'buy milk\n' > "$tmp/task/notes.txt"
echo "$tmp" > "$out/.tmpdir"   # make_fixtures.py replaces these paths with placeholders

"$relay_python" "$here/relay.py" --listen "127.0.0.1:$port" --answer "$answer" --out "$out" > "$out/.relay.log" 2>&1 &
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
      timeout 300 "${CLAUDE:-claude}" -p "list the files here" --model "$model" --output-format json ${CLAUDE_ARGS:-} </dev/null ;;
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
      timeout 300 "${CODEX:-codex}" exec --skip-git-repo-check ${CODEX_ARGS:-} "list the files here" </dev/null ;;
  agents-*)
    api=${client#agents-}; stream=()
    [[ $api == *-stream ]] && { api=${api%-stream}; stream=(--stream); }
    "${base[@]}" OPENAI_API_KEY=x timeout 300 "${AGENTS_PYTHON:-python}" "$here/agents_sdk_task.py" \
      --base-url "http://127.0.0.1:$port/v1" --api "$api" --model "$model" "${stream[@]}" </dev/null ;;
  *) echo "unknown client $client" >&2; exit 2 ;;
esac
status=$?
sleep 0.5
cat "$out/.relay.log"
exit $status
