"""The Celery app: Redis broker in production, kombu's filesystem transport when embedded."""

from __future__ import annotations

from celery import Celery

from storage.settings import get_settings


def make_celery() -> Celery:
    s = get_settings()
    app = Celery("backfill", broker=s.resolved_broker_url, include=["scheduler.tasks"])
    conf: dict[str, object] = {
        "task_acks_late": True,  # a task killed mid-way is redelivered, and every task is idempotent
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if s.resolved_broker_url.startswith("filesystem"):
        folder = s.broker_folder
        for sub in ("queue", "processed"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        conf["broker_transport_options"] = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "store_processed": False,
        }
    else:
        conf["broker_transport_options"] = {"visibility_timeout": 3600}
    app.conf.update(conf)
    return app


celery_app = make_celery()
