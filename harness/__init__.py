"""kvconnect.harness (the folder `harness/`, installed as ``kvconnect.harness`` by a setuptools
``package-dir`` mapping): the 1PnD validation harness behind ``kvconnect-validate``.

Modules, one concept each: :mod:`.cli` (arguments, exit codes), :mod:`.config` (the run
config every worker gets), :mod:`.report` (checks, transfers, JSON / JUnit), :mod:`.display`
(live progress, final tables), :mod:`.environment` (versions, devices, boot id),
:mod:`.resources` (memory, fds and mappings a run needs, checked before it starts),
:mod:`.orchestrator` (local runs: the coordinator's event loop, failures, teardown; its
parts :mod:`.startup`, spawning and admitting the workers, and :mod:`.restarts`, on
:mod:`.coordinator_part`),
:mod:`.launch` (starting, stopping and probing local worker processes), :mod:`.rundir` (a
run's private directory), :mod:`.rendezvous` (multi-host runs over a TCPStore),
:mod:`.control` (what a worker uses to talk to the run), :mod:`.worker` (worker process
entry), :mod:`.scenario` (the steps per worker: :mod:`.steps` shared, :mod:`.prefill`,
:mod:`.decode`), :mod:`.content` (block contents and digests), :mod:`.transports` (same-run
reference copies; the transports themselves are specs in :mod:`kvconnect.connectors.registry`,
never named here), :mod:`.faults` (``--inject`` fault kinds, fired at a worker's phase
boundary), :mod:`.footprint` (fds, sockets and KV mappings a process holds),
:mod:`.faultwatch` (time-to-report of injected faults), :mod:`.workerset` (the coordinator's
worker records, teardown), :mod:`.cleanup` (the after-run leak check), :mod:`.store_auth`
(the rendezvous token check).

Worker processes import nothing of the coordinator side (cli, resources, orchestrator,
launch, rundir, rendezvous, display, faultwatch, cleanup, workerset). Nothing below the
harness imports it.
"""
