"""A prefill or decode worker process (``python -m kvconnect.harness.worker``, or forked by the
coordinator): :mod:`.process` (joins the run, reports the outcome), :mod:`.scenario` (the steps
per worker: :mod:`.steps` shared, :mod:`.prefill`, :mod:`.decode`, the ``--sizes`` sweep in
:mod:`.sweep`), :mod:`.content` (block contents and digests), :mod:`.reference_copies` (same-run
reference copies; the transports are specs in :mod:`kvconnect.connectors.registry`)."""
