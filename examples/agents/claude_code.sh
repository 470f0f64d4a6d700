#!/usr/bin/env bash
# Claude Code (`claude -p`) against prefixd's Messages API: two one-shot turns, then what each
# reported as read from the cache.
#
#   prefixd serve --http 127.0.0.1:8080 &
#   examples/agents/claude_code.sh ["a prompt"]
#
# PREFIXD_URL (default http://127.0.0.1:8080) is the daemon's HTTP front; PREFIXD_TOKEN the
# content of its --http-token-file, if it has one (any value does on loopback without one).
# The config directory is a fresh temporary one, so your own ~/.claude is not read or changed.
#
# Claude Code's own first prompt (its system prompt and 12-22 tool definitions) is about 20,000
# tokens: more than the default model's 8,192-token context. With a model whose context holds
# it, run as is; with the default model, narrow it (CLAUDE_ARGS, passed to every `claude -p`):
#
#   CLAUDE_ARGS='--tools Bash,Read --system-prompt "You are a coding agent. Use the tools."' \
#     examples/agents/claude_code.sh
set -euo pipefail

url="${PREFIXD_URL:-http://127.0.0.1:8080}"
prompt="${1:-List the files in this directory with your tools, then say which one is largest.}"
command -v claude >/dev/null || { echo "claude not found: npm install -g @anthropic-ai/claude-code" >&2; exit 1; }
curl -sf "$url/health" >/dev/null || { echo "no prefixd HTTP front at $url" >&2; exit 1; }

config_dir="$(mktemp -d)"
trap 'rm -rf "$config_dir"' EXIT

export ANTHROPIC_BASE_URL="$url"
export ANTHROPIC_AUTH_TOKEN="${PREFIXD_TOKEN:-unused}"
# Claude Code names Claude models for its main and background requests; prefixd serves one
# model, reachable as "prefixd" (or "default", or its own name).
# ANTHROPIC_MODEL is left unset: Claude Code checks that name against its catalogue itself
export ANTHROPIC_DEFAULT_OPUS_MODEL=prefixd
export ANTHROPIC_DEFAULT_SONNET_MODEL=prefixd
export ANTHROPIC_DEFAULT_HAIKU_MODEL=prefixd
export ANTHROPIC_SMALL_FAST_MODEL=prefixd
# Claude Code's metadata.user_id carries its session id, and prefixd takes that field as the
# cache namespace; one fixed namespace lets every session reuse the others' system prompt.
export ANTHROPIC_CUSTOM_HEADERS="X-Prefixd-Namespace: claude-code"
export CLAUDE_CONFIG_DIR="$config_dir"
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
export DISABLE_AUTOUPDATER=1

for turn in 1 2; do
  echo "== turn $turn"
  if [ "$turn" = 1 ]; then
    eval "claude -p --output-format json --max-turns 3 ${CLAUDE_ARGS:-} \"\$prompt\"" > "$config_dir/turn.json" || true
  else
    eval "claude -p --output-format json --max-turns 3 --continue ${CLAUDE_ARGS:-} \"Say in one line what you found.\"" \
      > "$config_dir/turn.json" || true
  fi
  python3 - "$config_dir/turn.json" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
usage = result.get("usage", {})
print("reply:", str(result.get("result", ""))[:300])  # an API error's message lands here too
print("is_error:", result.get("is_error"), " turns:", result.get("num_turns"))
print("usage: input_tokens", usage.get("input_tokens"), " cache_read_input_tokens",
      usage.get("cache_read_input_tokens"), " output_tokens", usage.get("output_tokens"))
PY
done
