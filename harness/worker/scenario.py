"""What one worker does: the issue's steps 1-6 for a prefill or a decode worker.

Prefill ``p`` (:mod:`.prefill`): build the extensible KV cache (1 block, warm-up prefix, final
size, single-handle recommit) and check it; register it with every transport that registers
memory (NIXL) after the final commit; fill every committed block with position-dependent
contents; digest the blocks each decode will fetch; (``--corrupt``: flip one byte
afterwards); publish its offers and serve round 1; check the decodes' completion notices (of
transports that send them: NIXL READs); CPU offload round trip; sleep / wake (release,
recommit zeroed, refill, re-register); serve round 2.

Decode ``d`` (:mod:`.decode`): the same cache build and registration; fill its blocks with its
own "poison" contents; for each round and each prefill: load the prefill's offers
(handshake), fetch a random non-contiguous block set over every transport (re-poisoning the
destination first), digest what arrived and compare; tell the prefills the round is done;
between the rounds, sleep / wake its own cache and re-register.

Transports are known only through their specs (:mod:`kvconnect.connectors.registry`): before
the steps, a worker imports the run's ``transport_modules`` (``--transport-module``), which
register theirs. The steps both share live in :mod:`.steps`. Each step reports checks through
:class:`~.control.Control` and enters its phase there; a peer problem raises
:class:`~.control.PeerFailure`, which ends the worker (the coordinator reports it).
"""

from __future__ import annotations

from ..config import PREFILL
from ..control import Control


def run_worker(ctl: Control, role: str, rank: int, socket_dir: str) -> None:
    """Run ``role`` ``rank``'s scenario (raises on a fatal problem); ``socket_dir``: a
    private directory for serving sockets ("" where none is needed)."""
    from kvconnect.connectors.registry import load_transport_modules

    load_transport_modules(ctl.config.transport_modules)
    if role == PREFILL:
        from .prefill import PrefillWorker as Worker
    else:
        from .decode import DecodeWorker as Worker  # type: ignore[assignment]
    Worker(ctl, rank, socket_dir).run()
