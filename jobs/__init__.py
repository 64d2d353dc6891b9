"""The batch domain: models, status machine, validation, execution records, output assembly."""

# Registers the usage-ledger hook on `jobs.execution.record_outcome`. Here, because every process
# that can record a result has imported this package first: the hook cannot be missing anywhere.
from jobs import billing as _billing  # noqa: F401
