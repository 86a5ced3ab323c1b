"""Same-host transfers over POSIX-FD mappings: the ``ipc`` transport and its export server.

Installs as ``kvconnect.connectors.ipc`` (the folder ``connectors/ipc/``).
"""
