#!/usr/bin/env bash
# OpenCode (`opencode run`) against prefixd's Chat Completions API through an
# OpenAI-compatible provider: two runs, then the tokens each step reported
# (tokens.cache.read is what prefixd's cache gave).
#
#   prefixd serve --http 127.0.0.1:8080 &
#   examples/agents/opencode.sh ["a prompt"]
#
# PREFIXD_URL (default http://127.0.0.1:8080) is the daemon's HTTP front; PREFIXD_TOKEN the
# content of its --http-token-file, if it has one. The runs happen in a fresh directory
# holding only opencode.json and a small file to look at.
set -euo pipefail

url="${PREFIXD_URL:-http://127.0.0.1:8080}"
prompt="${1:-Read notes.txt and say in one line what it asks for.}"
command -v opencode >/dev/null || { echo "opencode not found: npm install -g opencode-ai" >&2; exit 1; }
curl -sf "$url/health" >/dev/null || { echo "no prefixd HTTP front at $url" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
echo "Water the tomatoes at 06:00 local time, not UTC." > notes.txt
cat > opencode.json <<JSON
{
  "provider": {
    "prefixd": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "prefixd (local)",
      "options": {"baseURL": "$url/v1", "apiKey": "${PREFIXD_TOKEN:-unused}"},
      "models": {"prefixd": {"name": "prefixd"}}
    }
  },
  "model": "prefixd/prefixd"
}
JSON

show() {  # text, tool calls and each step's tokens from `opencode run --format json`
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        event = json.loads(line)
    except ValueError:
        continue
    part = event.get("part", {})
    if event.get("type") == "text":
        print("reply:", part.get("text", "")[:300])
    elif event.get("type") == "tool_use":
        print("tool:", part.get("tool"), json.dumps(part.get("state", {}).get("input"))[:200])
    elif event.get("type") == "step_finish":
        print("tokens:", json.dumps(part.get("tokens")))
    elif event.get("type") == "error":
        print("error:", json.dumps(event.get("error"))[:300])
'
}

echo "== run 1"
opencode run --format json "$prompt" </dev/null | show
echo "== run 2 (a new session: the same system prompt and tools are its cached prefix)"
opencode run --format json "$prompt" </dev/null | show
