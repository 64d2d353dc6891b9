"""The stack launcher moved to `backfill.devfleet.stack` (and its services to
`backfill.devfleet.services`); this name stays for the test modules that still import it."""

from backfill.devfleet.services import PostgresCluster, RedisServer, create_database, drop_database
from backfill.devfleet.stack import Stack, launch_stack, service_env

__all__ = [
    "PostgresCluster",
    "RedisServer",
    "Stack",
    "create_database",
    "drop_database",
    "launch_stack",
    "service_env",
]
