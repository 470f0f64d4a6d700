"""The disk tier below the prefix store: entry files, their writer thread, the model's
content hash. Torch-free; the scheduler's `DiskIndex` decides, this package does the I/O."""
