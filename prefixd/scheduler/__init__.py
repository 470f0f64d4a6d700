"""Pure-Python scheduling: streams, lanes, admission, rounds, chunk planner, prefix store.

Never imports torch or cupy; talks to the model only through `prefixd.scheduler.device.Device`.
"""
