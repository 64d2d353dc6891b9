"""Every task name in `storage.broker` has a body in `backfill.scheduler.tasks` and a queue of its own."""

from __future__ import annotations

import subprocess
import sys

import backfill.scheduler.tasks  # noqa: F401  (registers the bodies, as `backfill worker` does)
from backfill.storage.broker import QUEUE_OF, QueueName, TaskName, get_celery_app
from backfill.storage.process_state import reset as reset_process_state


def test_every_task_name_has_a_body_on_its_queue() -> None:
    celery_app = get_celery_app()
    assert set(QUEUE_OF) == set(TaskName) and set(QUEUE_OF.values()) == set(QueueName)
    registered = {name for name in celery_app.tasks if not name.startswith("celery.")}
    assert registered == {name.value for name in TaskName}
    for name, queue in QUEUE_OF.items():
        assert celery_app.amqp.router.route({}, name.value)["queue"].name == queue.value


def test_an_app_built_after_a_reset_has_every_task_body() -> None:
    """A reset of the process's state drops its Celery app; the next one, built from the settings
    of then, still runs every task (the bodies are shared tasks, registered on each new app)."""
    before = get_celery_app()
    reset_process_state()
    after = get_celery_app()
    assert after is not before
    assert {name for name in after.tasks if not name.startswith("celery.")} == {name.value for name in TaskName}


def test_importing_the_broker_builds_no_app() -> None:
    """The app is built from the settings when first used, not from those of the import's moment."""
    probe = (
        "import backfill.storage.broker as broker\n"
        "assert broker.get_celery_app.cache_info().currsize == 0\n"
        "assert broker.celery_app is broker.get_celery_app()\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)
