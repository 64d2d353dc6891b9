"""The batch domain: models, status machine, validation, execution records, output assembly."""
