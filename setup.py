"""Build hook for the optional C accelerator of the Layer-0 contract (pipeline.contract._fastscan).

All metadata lives in pyproject.toml; this file only declares the extension. It is optional:
without a C compiler the install still succeeds and the pure-Python scanner is used instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pipeline.contract._fastscan",
            sources=["pipeline/contract/_fastscan.c"],
            optional=True,
        )
    ]
)
