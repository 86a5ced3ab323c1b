"""One process of a multi-host run: a worker that meets its peers through a
``torch.distributed.TCPStore`` (:mod:`.rendezvous`), proving a shared token (:mod:`.store_auth`)."""
