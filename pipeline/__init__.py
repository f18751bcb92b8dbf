"""critique-pipeline: the pure domain (no Celery here)."""

__version__ = "0.1.0"
