"""The daemon: configuration, CLI, serve loop, connections, the engine thread, systemd glue."""
