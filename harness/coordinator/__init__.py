"""A local run's coordinator, in the ``kvconnect-validate`` process: :mod:`.event_loop` (the
event loop, failures, teardown; its parts :mod:`.startup`, spawning and admitting the workers,
and :mod:`.restarts`, on :mod:`.part`), :mod:`.launch` (starting, stopping and probing worker
processes), :mod:`.worker_records` (its worker records, teardown), :mod:`.watchdog` (who is to
blame for a silence), :mod:`.faultwatch` (time-to-report of injected faults), :mod:`.cleanup`
(the after-run leak check)."""
