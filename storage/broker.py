"""The broker: one Celery app, the task and queue names, and sending a task by name.

It sits in `storage` so that the API can enqueue work with a direct call without importing
the scheduler; the scheduler registers the task bodies on this same app (`scheduler.tasks`).
Redis in production, kombu's filesystem transport (no server) when embedded.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import uuid
from time import monotonic
from typing import Any

from celery import Celery
from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps

from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.broker")


class TaskName(enum.StrEnum):
    """Every Celery task name, in one place."""

    validate_batch = "backfill.validate_batch"
    drain = "backfill.drain"
    finalize_batch = "backfill.finalize_batch"


class QueueName(enum.StrEnum):
    """One queue per kind of work, so no kind starves another (a large upload's validation
    never waits behind drains, and drains never wait behind validations)."""

    validation = "validation"
    dispatch = "dispatch"
    finalization = "finalization"


# How often a worker looks for messages on the filesystem broker (the embedded mode).
FILESYSTEM_POLL_S = 0.02

QUEUE_OF: dict[TaskName, QueueName] = {
    TaskName.validate_batch: QueueName.validation,
    TaskName.drain: QueueName.dispatch,
    TaskName.finalize_batch: QueueName.finalization,
}


class _FilesystemChannel(filesystem.Channel):
    def _put(self, queue: Any, message: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """kombu's `_put` creates the message file, then locks and writes it, while its reader
        moves and reads a file without looking at the lock: polled often, a worker read a file
        still empty and died of it. Written under a name the reader skips, then renamed into place,
        a message is whole when it appears. (Same name scheme as kombu's: time-ordered.)"""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(dumps(message).encode())  # type: ignore[no-untyped-call]
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class FilesystemTransport(filesystem.Transport):
    """kombu's filesystem transport whose messages appear whole (`_FilesystemChannel`)."""

    Channel = _FilesystemChannel


def make_celery() -> Celery:
    s = get_settings()
    app = Celery("backfill", broker=s.resolved_broker_url)
    conf: dict[str, object] = {
        "task_acks_late": True,  # a task killed mid-way is redelivered, and every task is idempotent
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "task_default_queue": QueueName.dispatch.value,
        "task_routes": {name.value: {"queue": queue.value} for name, queue in QUEUE_OF.items()},
    }
    if s.resolved_broker_url.startswith("filesystem"):
        folder = s.broker_folder
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        conf["broker_transport"] = FilesystemTransport
        conf["broker_transport_options"] = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            # kombu's default is ./control, in whatever directory the process started.
            "control_folder": str(folder / "control"),
            "store_processed": False,
            # The transport has no way to wait for a message: it lists the folder, then sleeps this
            # long (kombu's default, 1 s, was most of a small batch's turnaround: each of its steps
            # waited for it). A listing of an empty folder costs microseconds.
            "polling_interval": FILESYSTEM_POLL_S,
        }
    else:
        conf["broker_transport_options"] = {"visibility_timeout": 3600}
    app.conf.update(conf)
    return app


@functools.cache
def get_celery_app() -> Celery:
    """The process's Celery app, built on first use from the settings of that moment and dropped
    with the rest of the process's adapters (`storage.process_state.reset`)."""
    return make_celery()


def __getattr__(name: str) -> Celery:
    """`celery_app`, the name the task bodies register on (`scheduler.tasks`), is the process's
    app (`get_celery_app`), built when first read rather than when this module is imported. The
    task bodies are shared tasks (Celery's default): an app built after a reset registers them too."""
    if name == "celery_app":
        return get_celery_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def send_task(name: TaskName, *args: str) -> None:
    """Enqueue a task by name on its queue. Raises if the broker cannot be reached: callers
    that can rely on the scheduler loop's re-nudge catch and log it."""
    get_celery_app().send_task(name.value, args=list(args), queue=QUEUE_OF[name].value)
