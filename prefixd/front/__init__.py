"""The front process: listeners, the socket and HTTP fronts, the admission gate, output."""
