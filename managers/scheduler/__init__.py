"""The scheduler: a loop (`Scheduler`, loop.py) over named parts: `Intake`, `PrefillPlanner`,
`DecodePlanner` and `Output`, sharing `Queues` and the `KVManager`, and telling clients
through one `Emitter`."""

from managers.scheduler.loop import Scheduler

__all__ = ["Scheduler"]
