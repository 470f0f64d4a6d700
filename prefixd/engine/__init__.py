"""The engine process: the runner, the scheduler Engine and the disk tier in one blocking loop."""
