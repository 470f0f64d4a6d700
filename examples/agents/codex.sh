#!/usr/bin/env bash
# Codex (`codex exec`) against prefixd's Responses API: two turns of one session, then the
# usage each reported (cached_input_tokens is what prefixd's cache gave).
#
#   prefixd serve --http 127.0.0.1:8080 &
#   examples/agents/codex.sh ["a prompt"]
#
# PREFIXD_URL (default http://127.0.0.1:8080) is the daemon's HTTP front. The provider is
# written to a fresh CODEX_HOME, so your own ~/.codex is not read or changed; README.md
# shows the same lines for ~/.codex/config.toml.
set -euo pipefail

url="${PREFIXD_URL:-http://127.0.0.1:8080}"
prompt="${1:-List the files in this directory with your shell tool, then say which one is largest.}"
command -v codex >/dev/null || { echo "codex not found: npm install -g @openai/codex" >&2; exit 1; }
curl -sf "$url/health" >/dev/null || { echo "no prefixd HTTP front at $url" >&2; exit 1; }

export CODEX_HOME="$(mktemp -d -p "$HOME" .codex-prefixd.XXXXXX)"  # Codex refuses helper links under /tmp
trap 'rm -rf "$CODEX_HOME"' EXIT
cat > "$CODEX_HOME/config.toml" <<TOML
model = "prefixd"
model_provider = "prefixd"

[model_providers.prefixd]
name = "prefixd"
base_url = "$url/v1"
wire_api = "responses"
TOML
if [ -n "${PREFIXD_TOKEN:-}" ]; then  # the daemon's --http-token-file content, when it has one
  echo 'env_key = "PREFIXD_TOKEN"' >> "$CODEX_HOME/config.toml"
fi

show() {  # the agent's messages, tool runs and the turn's usage from `codex exec --json`
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        event = json.loads(line)
    except ValueError:
        continue
    item = event.get("item", {})
    if item.get("type") == "agent_message":
        print("reply:", item["text"][:300])
    elif item.get("type") == "command_execution":
        print("ran:", item.get("command"), "exit", item.get("exit_code"))
    elif event.get("type") == "turn.completed":
        print("usage:", json.dumps(event["usage"]))
    elif event.get("type") in ("turn.failed", "error"):
        print("error:", json.dumps(event)[:300])
'
}

echo "== turn 1"
codex exec --json --skip-git-repo-check "$prompt" </dev/null | show || true  # a failed turn still has a session to resume
echo "== turn 2 (resumes the session: the whole first turn is its cached prefix)"
codex exec --json --skip-git-repo-check resume --last "Say in one line what you found." </dev/null | show
