"""critique-pipeline: the Celery side — app, thin tasks, routing, the manager client, the CLI."""
