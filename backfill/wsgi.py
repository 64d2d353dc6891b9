"""The ASGI app as a process serves it: validation goes to the Celery queue."""

from __future__ import annotations

from api.app import create_app, install_configured_keys


def _enqueue_validation(batch_id: str) -> None:
    from scheduler.celery_app import celery_app

    celery_app.send_task("backfill.validate_batch", args=[batch_id])


install_configured_keys()
app = create_app(enqueue_validation=_enqueue_validation)
