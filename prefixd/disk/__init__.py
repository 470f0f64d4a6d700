"""The disk tier below the prefix store: entry files, their writer thread, the model's
content hash and the index of what the directory holds (`index.DiskIndex`). Torch-free; it
implements the scheduler's `LowerTier` (prefixd/scheduler/device.py) and the scheduler never
imports it."""
