"""kvconnect.harness (the folder `harness/`, installed as ``kvconnect.harness`` by a setuptools
``package-dir`` mapping): the 1PnD validation harness behind ``kvconnect-validate``.

A sub-package per kind of process: :mod:`.worker` (a prefill or decode worker),
:mod:`.coordinator` (a local run's coordinator), :mod:`.multihost` (one member of a multi-host
run). What they share lives here, one concept per module: :mod:`.config` (the run config every
worker gets), :mod:`.control` (what a worker uses to talk to the run), :mod:`.faults`
(``--inject`` fault kinds, fired at a worker's phase boundary), :mod:`.report` (checks,
transfers, JSON / JUnit; where reports go: :mod:`.report_files`), :mod:`.display` (live
progress, final tables), :mod:`.environment` (versions, devices, boot id), :mod:`.footprint`
(fds, sockets and KV mappings a process holds), :mod:`.rundir` (a run's private directory);
and the command on top: :mod:`.cli` (exit codes), :mod:`.arguments` (its options),
:mod:`.resources` (memory, fds and mappings a run needs, checked before it starts),
:mod:`.std_streams` (a closed or broken stdout / stderr). :mod:`.conformance` is the other
command, ``kvconnect-conformance`` (the conformance kit for vLLM connectors, with its pytest
plugin); it uses none of the modules above.

Imports go down (tests/test_package_layers.py): the shared modules import no sub-package,
:mod:`.worker` imports them (display and rundir excepted), :mod:`.coordinator` and
:mod:`.multihost` import them and :mod:`.worker` but never each other, the command imports all.
Worker processes load nothing of the rest (tests/test_harness_layers.py); nothing below imports it.
"""
