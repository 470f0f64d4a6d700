"""Text handling that holds no torch: the tokenizer, chat templates and message starts, tool
definitions in prompts and tool calls in replies, and grammars for constrained output.

Dependencies run one way: daemon -> text and gpu -> text; nothing here imports gpu, daemon or torch.
"""
