"""The daemon: options, configuration, CLI, the front process's serve loop, systemd glue."""
