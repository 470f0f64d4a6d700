"""Text handling that holds no torch: tool definitions in prompts and tool calls in replies."""
