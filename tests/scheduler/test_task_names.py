"""Every task name in `storage.broker` has a body in `backfill.scheduler.tasks` and a queue of its own."""

from __future__ import annotations

import backfill.scheduler.tasks  # noqa: F401  (registers the bodies, as `backfill worker` does)
from backfill.storage.broker import QUEUE_OF, QueueName, TaskName, celery_app


def test_every_task_name_has_a_body_on_its_queue() -> None:
    assert set(QUEUE_OF) == set(TaskName) and set(QUEUE_OF.values()) == set(QueueName)
    registered = {name for name in celery_app.tasks if not name.startswith("celery.")}
    assert registered == {name.value for name in TaskName}
    for name, queue in QUEUE_OF.items():
        assert celery_app.amqp.router.route({}, name.value)["queue"].name == queue.value
