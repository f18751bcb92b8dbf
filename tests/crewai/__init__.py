"""Tests that need the real ``crewai`` package, which cannot share our main environment (its
pins conflict with ours): tests/integration/test_adapter_crewai.py builds CrewAI's own
environment from constraints-crewai.txt and runs these there; in the main environment they are
skipped."""

OFFLINE = {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "CREWAI_DISABLE_VERSION_CHECK": "true",
    "OTEL_SDK_DISABLED": "true",
    "OTEL_TRACES_EXPORTER": "none",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
"""CrewAI's telemetry, tracing and version check off, and litellm's price list read from its
package (tests/crewai/conftest.py sets them before crewai is imported)."""
