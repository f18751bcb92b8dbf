"""Build hook for the optional C accelerator (pipeline.text._fastscan: the Layer-0 scan and
simhash).

All metadata lives in pyproject.toml; this file only declares the extension. It is optional:
without a C compiler the install still succeeds and the pure-Python scanner is used instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pipeline.text._fastscan",
            sources=["pipeline/text/_fastscan.c"],
            optional=True,
        )
    ]
)
