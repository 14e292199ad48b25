#!/usr/bin/env bash
# The real agent CLIs end to end against `specprefill-engine serve`: each gets a one-line
# task with the settings docs/server.md gives (its own config in a fresh home, nothing
# else), and must exit 0. Then a three-turn Claude Code session (tools on), whose turns 2
# and 3 must read >= 90% of the previous turn's prompt from the prefix cache.
#
#   bash tests/clients/clients.sh [claude codex opencode aider llm agents claude-turns]
#
# Install the CLIs first (not project dependencies):
#   npm install -g @anthropic-ai/claude-code @openai/codex opencode-ai
#   python3 -m venv ../clients-venv && ../clients-venv/bin/pip install aider-chat
#   python3 -m venv ../clients-venv2 && ../clients-venv2/bin/pip install llm openai-agents
#
# MODEL (default: a tiny random-weight llama with a 64K window, tests/models.py's
# save_long_context_model: Claude Code's ~28K-token prompt does not fit the demo pair's
# 16K, and on a 2-core CPU a real model's prefill of it takes minutes), DRAFT, PORT,
# PYTHON (the project's venv), AIDER_VENV, PY_CLIENTS_VENV, CAPTURE=DIR (each request
# body saved through tests/clients/capture.py, as tests/fixtures/clients/ were).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=/work/main/.venv/bin/python
AIDER_VENV=${AIDER_VENV:-$ROOT/../clients-venv}
PY_CLIENTS_VENV=${PY_CLIENTS_VENV:-$ROOT/../clients-venv2}
PORT=${PORT:-8321}
KEY=sk-local
WORK=$(mktemp -d /tmp/specprefill-clients.XXXXXX)
export PYTHONPATH=$ROOT:$ROOT/integrations:$ROOT/tests
CLIENTS=("$@")
[ ${#CLIENTS[@]} -gt 0 ] || CLIENTS=(claude codex opencode aider llm agents claude-turns)

if [ -z "${MODEL:-}" ]; then
  MODEL=$WORK/model
  "$PYTHON" -c "from pathlib import Path; from models import save_long_context_model; \
save_long_context_model(Path('$MODEL'))"
fi
SERVE=("$PYTHON" -m specprefill_engine.cli serve --model "$MODEL" --port "$PORT"
       --api-key "$KEY" --served-model-name local --log-level info)
[ -n "${DRAFT:-}" ] && SERVE+=(--draft "$DRAFT")
"${SERVE[@]}" > "$WORK/serve.log" 2>&1 &
SERVER=$!
URL=http://127.0.0.1:$PORT
if [ -n "${CAPTURE:-}" ]; then
  "$PYTHON" tests/clients/capture.py --upstream "$URL" --port $((PORT + 1)) --out "$CAPTURE" \
    > "$WORK/capture.log" 2>&1 &
  PROXY=$!
  URL=http://127.0.0.1:$((PORT + 1))
fi
cleanup() { kill "$SERVER" ${PROXY:+"$PROXY"} 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq 600); do
  curl -sf "$URL/health" > /dev/null && break
  sleep 0.5
done
curl -sf "$URL/health" > /dev/null || { echo "serve did not start"; cat "$WORK/serve.log"; exit 1; }
echo "model: $MODEL ($(curl -s -H "x-api-key: $KEY" "$URL/v1/models" | \
  "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["context_length"])') tokens)"

TASK="Say hi in one short sentence."
FAILED=0
run() {  # name version-command command...: one CLI's task, its exit code and time
  local name=$1 version=$2; shift 2
  local start=$SECONDS
  ( cd "$WORK/project" && timeout 900 "$@" ) > "$WORK/$name.out" 2>&1
  local code=$?
  [ $code -eq 0 ] || FAILED=1
  printf '%-13s %-34s exit %-3s %4ss  %s\n' "$name" "$(eval "$version" 2>/dev/null | head -1)" \
    "$code" $((SECONDS - start)) "$(tr '\n' ' ' < "$WORK/$name.out" | cut -c1-60)"
}
mkdir -p "$WORK/project" && git -C "$WORK/project" init -q

CLAUDE=(env HOME="$WORK/home-claude" ANTHROPIC_BASE_URL="$URL" ANTHROPIC_AUTH_TOKEN="$KEY"
        ANTHROPIC_MODEL=local ANTHROPIC_DEFAULT_HAIKU_MODEL=local
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 claude)  # Claude Code: the Anthropic endpoint

for client in "${CLIENTS[@]}"; do
  case $client in
  claude)
    run claude "claude --version" "${CLAUDE[@]}" -p "$TASK" ;;
  codex)  # the Responses endpoint, through a model provider in config.toml
    mkdir -p "$WORK/codex"
    cat > "$WORK/codex/config.toml" <<EOF
model = "local"
model_provider = "specprefill"

[model_providers.specprefill]
name = "specprefill-engine"
base_url = "$URL/v1"
wire_api = "responses"
env_key = "SPECPREFILL_API_KEY"
EOF
    run codex "codex --version" env CODEX_HOME="$WORK/codex" SPECPREFILL_API_KEY=$KEY \
      codex exec --skip-git-repo-check "$TASK"
    run codex-resume "codex --version" env CODEX_HOME="$WORK/codex" SPECPREFILL_API_KEY=$KEY \
      codex exec --skip-git-repo-check resume --last "And once more." ;;
  opencode)  # chat completions, through an OpenAI-compatible provider in opencode.json
    cat > "$WORK/opencode.json" <<EOF
{
  "\$schema": "https://opencode.ai/config.json",
  "provider": {
    "specprefill": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "specprefill-engine",
      "options": {"baseURL": "$URL/v1", "apiKey": "$KEY"},
      "models": {"local": {"name": "local", "limit": {"context": 65536, "output": 4096}}}
    }
  },
  "model": "specprefill/local"
}
EOF
    run opencode "opencode --version" env HOME="$WORK/home-opencode" \
      OPENCODE_CONFIG="$WORK/opencode.json" opencode run "$TASK" ;;
  aider)  # chat completions, through litellm's openai/ prefix
    run aider "$AIDER_VENV/bin/aider --version" env HOME="$WORK/home-aider" \
      "$AIDER_VENV/bin/aider" --model openai/local --openai-api-base "$URL/v1" \
      --openai-api-key $KEY --no-git --yes-always --no-check-update \
      --no-show-model-warnings --analytics-disable --message "$TASK" ;;
  llm)  # chat completions, as an extra OpenAI model
    mkdir -p "$WORK/llm"
    printf -- '- model_id: local\n  model_name: local\n  api_base: "%s/v1"\n  api_key_name: specprefill\n' \
      "$URL" > "$WORK/llm/extra-openai-models.yaml"
    echo "{\"specprefill\": \"$KEY\"}" > "$WORK/llm/keys.json"
    run llm "$PY_CLIENTS_VENV/bin/llm --version" env LLM_USER_PATH="$WORK/llm" \
      "$PY_CLIENTS_VENV/bin/llm" -m local "$TASK" ;;
  agents)  # the OpenAI Agents SDK: a tool call through chat completions, then Responses
    run agents "$PY_CLIENTS_VENV/bin/python -c 'import agents; print(\"openai-agents\", agents.__version__)'" \
      "$PY_CLIENTS_VENV/bin/python" "$ROOT/tests/clients/agents_sdk.py" "$URL/v1" $KEY ;;
  claude-turns)  # three turns, tools on; usage from --output-format json
    for turn in 1 2 3; do
      more=(); [ $turn -gt 1 ] && more=(--continue)
      run "claude-turn$turn" "claude --version" "${CLAUDE[@]}" -p "${more[@]}" \
        --output-format json "Turn $turn: $TASK"
    done
    "$PYTHON" - "$WORK" <<'EOF' || FAILED=1
import json, sys
def result(path):  # the JSON line (Claude Code may print a notice line before it)
    lines = [line for line in open(path) if line.startswith("{")]
    return json.loads(lines[-1])


turns = [result(f"{sys.argv[1]}/claude-turn{t}.out") for t in (1, 2, 3)]
prompts = [u["input_tokens"] + u["cache_read_input_tokens"] for u in (t["usage"] for t in turns)]
ok = True
for t in (1, 2):
    cached = turns[t]["usage"]["cache_read_input_tokens"]
    share = cached / prompts[t - 1]
    ok &= share >= 0.9
    print(f"claude turn {t + 1}: prompt {prompts[t]} tokens, {cached} from the prefix cache "
          f"= {share:.1%} of turn {t}'s {prompts[t - 1]}")
sys.exit(0 if ok else 1)
EOF
    ;;
  *) echo "unknown client $client"; FAILED=1 ;;
  esac
done
grep -c "ignored the field" "$WORK/serve.log" | xargs printf 'server log: %s ignored-field warnings, ' 
grep -c -i "traceback" "$WORK/serve.log" | xargs printf '%s tracebacks\n'
echo "outputs and the server log: $WORK"
exit $FAILED
